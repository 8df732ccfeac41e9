"""A user's own environment, as a new user writes it outside the library (the notebook
`custom_environment.ipynb`'s keypad). Tests copy this file into a temporary folder under another
module name and put that folder on `sys.path` / `PYTHONPATH`; nothing registers it.

With `length=2` there are only 100 distinct codes: a task space far smaller than the default suite
sizes (2,048 train tasks).
"""

import jax
import jax.numpy as jnp

from longhorizon import envs
from longhorizon.envs import Action, Arg, ErrorCode, Tool, Transition

READ, PRESS, ENTER = 0, 1, 2  # tool indices
NOTE, DISPLAY, VERDICT = 0, 1, 2  # observation kinds


class Keypad(envs.Environment):
  """Open a keypad whose code is on a note: `read` a digit, `press` it, ..., then `enter`."""

  name = "keypad"
  version = "1"
  milestone_names = ("half_code", "full_code")

  def __init__(self, length: int = 2, **reward):
    super().__init__(**reward)
    self.length = int(length)

  @property
  def tools(self):
    digit = Arg("digit", "int", 0, 9, description="the digit to press")
    return (Tool("read", "Read the next digit of the code."),
            Tool("press", "Press one digit.", (digit,)),
            Tool("enter", "Submit the display and end the task."))

  def generate_task(self, key, split="train"):
    del split
    return {"code": jax.random.randint(key, (self.length,), 0, 10, jnp.int32)}

  def init(self, task, key):
    del key
    inner = {"display": jnp.full((self.length,), -1, jnp.int32), "typed": jnp.zeros((), jnp.int32),
             "read": jnp.zeros((), jnp.int32), "entered": jnp.zeros((), bool)}
    return inner, self._observation(NOTE, -1, inner)

  def _observation(self, kind, digit, inner, ok=False, error=ErrorCode.NONE):
    return {"kind": jnp.asarray(kind, jnp.int32), "digit": jnp.asarray(digit, jnp.int32),
            "display": inner["display"], "typed": inner["typed"], "ok": jnp.asarray(ok, bool),
            "error": jnp.asarray(error, jnp.int32)}

  def transition(self, task, inner, action, key):
    del key
    tool, digit = action.tool, action.args[0]
    can_read = (tool == READ) & (inner["read"] < self.length)
    can_press = (tool == PRESS) & (inner["typed"] < self.length)
    rejected = ((tool == READ) & ~can_read) | ((tool == PRESS) & ~can_press)
    slot = jnp.where(can_press, inner["typed"], self.length)
    new = {"display": inner["display"].at[slot].set(digit, mode="drop"),
           "typed": inner["typed"] + can_press.astype(jnp.int32),
           "read": inner["read"] + can_read.astype(jnp.int32),
           "entered": inner["entered"] | (tool == ENTER)}
    right = self._correct_prefix(task, new)
    note = task["code"][jnp.minimum(inner["read"], self.length - 1)]
    kind = jnp.where(tool == READ, NOTE, jnp.where(tool == PRESS, DISPLAY, VERDICT))
    error = jnp.where(rejected, ErrorCode.INVALID_ARGUMENT, ErrorCode.NONE)
    observation = self._observation(kind, note, new, self.verify(task, new), error)
    return Transition(inner=new, observation=observation, terminated=tool == ENTER, rejected=rejected,
                      milestones=jnp.stack([2 * right >= self.length, right == self.length]))

  def _correct_prefix(self, task, inner):
    match = (inner["display"] == task["code"]) & (jnp.arange(self.length) < inner["typed"])
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32)))

  def error_observation(self, task, inner, error):
    return self._observation(-1, -1, inner, error=error)

  def canonical_state(self, task, inner):
    return (task["code"], inner["display"], inner["typed"], inner["read"], inner["entered"])

  def verify(self, task, inner):
    return inner["entered"] & (self._correct_prefix(task, inner) == self.length)

  def oracle(self, state):
    inner, code = state.inner, state.task["code"]
    tool = jnp.where(inner["typed"] >= self.length, ENTER,
                     jnp.where(inner["read"] > inner["typed"], PRESS, READ))
    digit = code[jnp.minimum(inner["typed"], self.length - 1)]
    return Action(tool=tool.astype(jnp.int32), args=digit[None].astype(jnp.int32),
                  error=jnp.zeros((), jnp.int32))

  def system_text(self, style):
    return "read the code from the note , press each digit , then enter ."

  def task_text(self, task, style):
    return f"code of {len(task['code'])} digits"

  def observation_text(self, observation, style):
    kind, error = int(observation["kind"]), int(observation["error"])
    if error == ErrorCode.INVALID_ARGUMENT:
      return "note empty" if kind == NOTE else "display full"
    if kind == NOTE:
      return f"note {int(observation['digit'])}"
    if kind == DISPLAY:
      return "display " + " ".join(str(int(d)) for d in observation["display"][:int(observation["typed"])])
    return "accepted" if bool(observation["ok"]) else "rejected"

  def vocabulary(self):
    words = set(self.system_text("compact").split()) | {"code", "of", "digits", str(self.length)}
    words |= {"note", "display", "empty", "full", "accepted", "rejected"}
    return sorted(words | {str(d) for d in range(10)})


class NotAnEnvironment:
  """A class that is not an `Environment` (for the registry's error)."""
