"""`calculator`: multi-step arithmetic word problems solved with a calculator tool, then answered.

A task is a chain: a start value x_0 and N steps (op_i, b_i), op_i one of add, sub, mul, div, with
x_{i+1} = x_i op_i b_i; the answer is x_N. The problem is stated as a word problem (tool_call style:
"Ann has 12 apples. She gets 21 more apples. ...", one of a few stories) or as a bare list
(compact style: `start 12 , add 21 , mul 3 .`). The policy calls `calc(a, op, b)`, which returns
`a op b`, and ends the episode with `answer(value)`. The horizon is N + 1 actions for a policy that
does every step with the calculator.

Numbers: every operand, intermediate and answer is a whole number in [0, max_value]. The
calculator rejects a call whose result falls outside that range, a division that is not exact (or
by zero) and hand-built arguments out of range (`Transition.rejected`, observation error
INVALID_ARGUMENT, state unchanged); `answer` with a value out of range is rejected the same way.
The generator draws x_0 uniformly from [1, max_value], then at each step an operation uniformly
among those with a valid operand for the running value x (add: x < max_value; sub: x >= 1; mul:
2x <= max_value; div: x has a divisor in [2, x - 1]) and the operand uniformly among the valid
ones (add/sub: b >= 1, mul: b >= 2, div: 2 <= b < x and exact; the result in range), so no
intermediate ever leaves the range.

State: `progress` (how many steps of the chain were computed with the calculator, in order) and
the answer. A calc call advances `progress` only when it is exactly the next step: the current
value x_p, the step's operation and operand (either order for add and mul). Any other calc is
allowed (the result is shown) but changes nothing, so the canonical state and the anchor stay the
same and repeated visits group together for GiGPO.

The verifier checks the final answer only: `answered and answer == x_N`. A correct answer given
without (all of) the calculator calls counts as a success (mental arithmetic is a legitimate way
to solve the task); how much of the chain was done with the tool is recorded by the milestones.

Splits: `train`/`test` draw tasks with `num_ops` steps (different seeds); `ood` uses `ood_num_ops`
steps (default 2N): longer chains than any seen in training. Every task pads its steps to
`max(num_ops, ood_num_ops)` (fixed shapes) and carries its own `num_ops`.

Milestones: `first_step` (step 1 computed with the calculator) and `all_steps` (all N steps).
`all_steps` holds at reset in a 0-step task (a hand-made one: "answer the start value"; generated
tasks have N >= 1) and is then marked reached at reset (`milestones_at_reset`): it never fires.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.envs.base import SPLITS, Environment, Transition
from longhorizon.envs.types import Action, Arg, ErrorCode, Tool

__all__ = ["Calculator", "OPS", "STORIES"]

_CALC, _ANSWER = 0, 1
OPS = ("add", "sub", "mul", "div")
_ADD, _SUB, _MUL, _DIV = range(4)
_SYMBOLS = ("+", "-", "*", "/")
# (name, subject pronoun, possessive pronoun, items) of the tool_call word problems.
STORIES = (("Ann", "She", "her", "apples"), ("Ben", "He", "his", "marbles"),
           ("Cleo", "She", "her", "stickers"), ("Dev", "He", "his", "coins"))
# Observation kinds.
_START, _RESULT, _ANSWERED, _ERROR = 0, 1, 2, 3


class Calculator(Environment):
  """Args:
    num_ops: steps N of train/test tasks (>= 1).
    ood_num_ops: steps of `ood` tasks (default 2N).
    max_value: the largest number (operands, intermediates, answers lie in [0, max_value]).
    **reward: `RewardSpec` fields (success, milestone, cost, invalid, violation; envs/rewards.py).
  """

  name = "calculator"
  version = "1"
  milestone_names = ("first_step", "all_steps")

  def __init__(self, num_ops: int = 3, max_value: int = 999, ood_num_ops: int | None = None,
               **reward):
    super().__init__(**reward)
    if num_ops < 1:
      raise ValueError(f"calculator: num_ops must be >= 1, got {num_ops}.")
    self.num_ops = int(num_ops)
    self.ood_num_ops = int(ood_num_ops if ood_num_ops is not None else 2 * num_ops)
    if self.ood_num_ops < 1:
      raise ValueError(f"calculator: ood_num_ops must be >= 1, got {self.ood_num_ops}.")
    # Every number is a word of the compact vocabulary, which the codec caps at 100_000 values.
    if not 2 <= max_value < 100_000:
      raise ValueError(f"calculator: max_value must be in [2, 99999], got {max_value}.")
    self.max_value = int(max_value)

  @property
  def max_ops(self) -> int:
    """Padded number of steps of every task (the longest split)."""
    return max(self.num_ops, self.ood_num_ops)

  @property
  def tools(self):
    m = self.max_value
    a = Arg("a", "int", 0, m, description="the first number")
    op = Arg("op", "enum", choices=OPS, description="the operation: a + b, a - b, a * b or a / b")
    b = Arg("b", "int", 0, m, description="the second number")
    value = Arg("value", "int", 0, m, description="the final result of the problem")
    return (Tool("calc", f"Compute a op b on whole numbers in [0, {m}] (division must be exact).",
                 (a, op, b)),
            Tool("answer", "Give the final result of the problem and end the task.", (value,)))

  # ------------------------------------------------------------------------------- tasks
  def generate_task(self, key, split: str = "train"):
    if split not in SPLITS:
      raise ValueError(f"calculator: split must be one of {SPLITS}, got {split!r}.")
    steps = self.ood_num_ops if split == "ood" else self.num_ops
    k_start, k_story, k_steps = jax.random.split(key, 3)
    start = jax.random.randint(k_start, (), 1, self.max_value + 1, jnp.int32)

    def body(x, inputs):
      i, u = inputs
      masks = _operand_masks(x, self.max_value)  # [4, max_value + 1]
      op = _uniform_index(u[0], masks.any(axis=1))
      b = _uniform_index(u[1], masks[op])
      active = i < steps
      y = jnp.where(active, _apply(x, op, b), x)
      return y, (jnp.where(active, op, 0), jnp.where(active, b, 0), jnp.where(active, y, -1))

    inputs = (jnp.arange(self.max_ops), jax.random.uniform(k_steps, (self.max_ops, 2)))
    answer, (ops, operands, after) = jax.lax.scan(body, start, inputs)
    return {"start": start,  # [] int32 x_0
            "ops": ops,  # [K] int32 op_i (0 past num_ops)
            "operands": operands,  # [K] int32 b_i (0 past num_ops)
            "values": jnp.concatenate([start[None], after]),  # [K + 1] int32 x_i (-1 past num_ops)
            "answer": answer,  # [] int32 x_N
            "num_ops": jnp.asarray(steps, jnp.int32),  # [] int32 N
            # [] int32 index into STORIES (tool_call text only)
            "story": jax.random.randint(k_story, (), 0, len(STORIES), jnp.int32)}

  def task_difficulty(self, task):
    return task["num_ops"]

  def split_params(self, split):
    return {}

  # ------------------------------------------------------------------------------- dynamics
  def init(self, task, key):
    del key
    inner = {"progress": jnp.zeros((), jnp.int32), "answered": jnp.zeros((), bool),
             "answer": jnp.full((), -1, jnp.int32)}
    return inner, self._observation(_START, task["start"], -1, task["num_ops"], -1)

  def _observation(self, kind, a, op, b, result, error=ErrorCode.NONE):
    # kind: 0 = task start (a = x_0, b = N), 1 = calc result (result -1 when rejected),
    # 2 = answer received (a = value), 3 = error answering a malformed action.
    return {"kind": jnp.asarray(kind, jnp.int32), "a": jnp.asarray(a, jnp.int32),
            "op": jnp.asarray(op, jnp.int32), "b": jnp.asarray(b, jnp.int32),
            "result": jnp.asarray(result, jnp.int32), "error": jnp.asarray(error, jnp.int32)}

  def transition(self, task, inner, action: Action, key):
    del key
    a, op, b = action.args[0], action.args[1], action.args[2]
    is_calc = action.tool == _CALC
    result, valid = _calc(a, op, b, self.max_value)
    p = inner["progress"]
    i = jnp.clip(p, 0, self.max_ops - 1)
    x, want_op, want_b = task["values"][i], task["ops"][i], task["operands"][i]
    commutes = (want_op == _ADD) | (want_op == _MUL)
    operands_match = ((a == x) & (b == want_b)) | (commutes & (a == want_b) & (b == x))
    follows = is_calc & valid & (op == want_op) & operands_match & (p < task["num_ops"])
    answers = ~is_calc & (a >= 0) & (a <= self.max_value)
    progress = p + follows.astype(jnp.int32)
    new_inner = {"progress": progress, "answered": inner["answered"] | answers,
                 "answer": jnp.where(answers, a, inner["answer"])}
    rejected = jnp.where(is_calc, ~valid, ~answers)
    observation = self._observation(
        jnp.where(is_calc, _RESULT, _ANSWERED), a, jnp.where(is_calc, op, -1),
        jnp.where(is_calc, b, -1), jnp.where(is_calc & valid, result, -1),
        jnp.where(rejected, ErrorCode.INVALID_ARGUMENT, ErrorCode.NONE))
    return Transition(inner=new_inner, observation=observation, terminated=answers,
                      milestones=self._milestones(task, new_inner), rejected=rejected)

  def milestones_at_reset(self, task, inner):
    return self._milestones(task, inner)

  def _milestones(self, task, inner):
    return jnp.stack([inner["progress"] >= 1, inner["progress"] >= task["num_ops"]])

  def error_observation(self, task, inner, error):
    return self._observation(_ERROR, -1, -1, -1, -1, error)

  def canonical_state(self, task, inner):
    return (task["start"], task["ops"], task["operands"], task["num_ops"], task["story"],
            inner["progress"], inner["answered"], inner["answer"])

  def verify(self, task, inner):
    return inner["answered"] & (inner["answer"] == task["answer"])

  def oracle(self, state):
    task, p = state.task, state.inner["progress"]
    i = jnp.clip(p, 0, self.max_ops - 1)
    calc = p < task["num_ops"]
    step = jnp.stack([task["values"][i], task["ops"][i], task["operands"][i]])
    final = jnp.stack([task["answer"], 0, 0])
    return Action(tool=jnp.where(calc, _CALC, _ANSWER).astype(jnp.int32),
                  args=jnp.where(calc, step, final).astype(jnp.int32),
                  error=jnp.zeros((), jnp.int32))

  # ------------------------------------------------------------------------------- text
  def system_text(self, style):
    if style == "compact":
      return ("solve the problem : calc each step , starting from the start value and using each "
              "result in the next step , then answer the last result .")
    return ("You solve arithmetic word problems with a calculator. Work through the problem one "
            "step at a time: call calc with the current number, the step's operation and its "
            "number, then use the result in the next step. When every step is done, call answer "
            f"with the final number. The calculator works on whole numbers from 0 to "
            f"{self.max_value}; a result outside that range or an inexact division is rejected. "
            "One tool call per turn.")

  def task_text(self, task, style):
    start, n = int(task["start"]), int(task["num_ops"])
    steps = [(int(o), int(b)) for o, b in zip(np.asarray(task["ops"])[:n],
                                              np.asarray(task["operands"])[:n])]
    if style == "compact":
      return " , ".join([f"start {start}"] + [f"{_op_word(o)} {b}" for o, b in steps]) + " ."
    name, she, her, items = STORIES[int(task["story"]) % len(STORIES)]
    sentences = [f"{name} has {start} {items}."]
    for o, b in steps:
      sentences.append({
          _ADD: f"{she} gets {b} more {items}.",
          _SUB: f"{she} gives away {b} {items}.",
          _MUL: f"{she} ends up with {b} times as many {items} as before.",
          _DIV: f"{she} splits {her} {items} into {b} equal piles and keeps one pile.",
      }.get(o, f"{she} does something unknown with {b} {items}."))
    sentences.append(f"How many {items} does {name} have at the end?")
    return " ".join(sentences)

  def observation_text(self, observation, style):
    kind, a, op, b, result, error = (int(observation[k])
                                     for k in ("kind", "a", "op", "b", "result", "error"))
    compact = style == "compact"
    if kind == _START:
      return f"start {a} steps {b}" if compact else f"Start value: {a}. Steps: {b}."
    if kind == _RESULT:
      shown = f"{a} {_op_word(op)} {b}" if compact else f"{a} {_op_symbol(op)} {b}"
      if not error:
        return f"{shown} = {result}"
      if op == _DIV and 0 <= a <= self.max_value and 0 <= b <= self.max_value:
        reason = "not exact" if b else "division by zero"
        if compact:
          return f"{shown} = error : {reason}"
        return f"Error: {shown} is not a whole number." if b else f"Error: {shown} divides by zero."
      if compact:
        return f"{shown} = error : out of range"
      return f"Error: {shown} is outside the range 0 to {self.max_value}."
    if kind == _ANSWERED:
      if error:
        return "answer error : out of range" if compact else (
            f"Error: the answer must be in the range 0 to {self.max_value}.")
      return f"answer {a}" if compact else f"Answer {a} received."
    return "error" if compact else f"Error {error}."

  def vocabulary(self):
    words = set(self.system_text("compact").split())
    words |= {"start", "steps", ",", ".", "=", "?", "answer", "error", ":", "not", "exact",
              "division", "by", "zero", "out", "of", "range"}
    words |= set(OPS)
    words |= {str(i) for i in range(max(self.max_value, self.max_ops) + 1)}
    return sorted(words)


def _op_word(op: int) -> str:
  return OPS[op] if 0 <= op < len(OPS) else "?"


def _op_symbol(op: int) -> str:
  return _SYMBOLS[op] if 0 <= op < len(_SYMBOLS) else "?"


def _operand_masks(x, max_value: int):
  """[4, max_value + 1] bool: the operands b each operation may take from the running value x
  (add/sub: b >= 1, mul: b >= 2, div: 2 <= b < x and exact; the result in [0, max_value])."""
  b = jnp.arange(max_value + 1, dtype=jnp.int32)
  add = (b >= 1) & (b <= max_value - x)
  sub = (b >= 1) & (b <= x)
  mul = (b >= 2) & (x >= 1) & (b <= max_value // jnp.maximum(x, 1))
  div = (b >= 2) & (b < x) & (x % jnp.maximum(b, 1) == 0)
  return jnp.stack([add, sub, mul, div])


def _uniform_index(u, mask):
  """The index of the `floor(u * count)`-th True entry of `mask` ([n] bool, not all False), for
  `u` uniform in [0, 1): a uniformly random True index. (A `randint` with a traced bound instead
  compiles several times slower.)"""
  count = mask.sum(dtype=jnp.int32)
  r = jnp.minimum(jnp.floor(u * count).astype(jnp.int32), count - 1)
  return jnp.argmax(jnp.cumsum(mask, dtype=jnp.int32) > r).astype(jnp.int32)


def _apply(x, op, b):
  """x op b for operands the generator chose (valid by construction)."""
  return jnp.stack([x + b, x - b, x * b, x // jnp.maximum(b, 1)])[op]


def _calc(a, op, b, max_value: int):
  """`(result, valid)` of the calculator on `a op b`; valid when the arguments and the result lie in
  [0, max_value] and a division is exact. Overflow-free (mul is checked by division)."""
  args_ok = (a >= 0) & (a <= max_value) & (b >= 0) & (b <= max_value) & (op >= 0) & (op < len(OPS))
  a, b = jnp.clip(a, 0, max_value), jnp.clip(b, 0, max_value)
  safe_b = jnp.maximum(b, 1)
  results = jnp.stack([a + b, a - b, a * b, a // safe_b])
  ok = jnp.stack([a + b <= max_value, a >= b, (a == 0) | (b <= max_value // jnp.maximum(a, 1)),
                  (b > 0) & (a % safe_b == 0)])
  i = jnp.clip(op, 0, len(OPS) - 1)
  valid = args_ok & ok[i]
  return jnp.where(valid, results[i], -1), valid

