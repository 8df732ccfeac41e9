"""`Notebook`: the `offload` context mode for host environments (long outputs kept out of the prompt).

`config.context.mode = "offload"` wraps the run's host environment in a `Notebook`. A tool output
longer than `max_words` words does not enter the context: the policy reads its first
`preview_words` words and where the rest went,

    order 1042 status shipped items mug , lamp ... saved to note 0 , read_note 0 to read it

and the output itself is kept in the episode's notebook. Two tools are added to the environment's:
`read_note K` answers with note K's text exactly as the environment wrote it (read back into the
context only when the policy asks), and `write_note TEXT` keeps the policy's own text as a new
note (answered `saved to note K`), so a long plan or intermediate result need not stay in later
turns. Both calls are parsed like the environment's own (`<tool_call>{"name": "read_note",
"arguments": {"note": 0}}</tool_call>` in tool_call style, `read_note 0` in compact style); any
other action goes to the environment unchanged, and a note that does not exist, or a write to a
notebook that is full (`max_notes`), is an invalid action (BAD_ARGUMENT), never a crash; once
the notebook is full, long outputs stay in the context whole.

Nothing in the context is rewritten: the row of an episode is exactly the text the policy saw,
stubs and read-back notes included, so it stays one training row per episode, token-exact by
construction, with every learner feature that one row per episode allows (`full` mode's
truncation when even the offloaded context overflows). Oracle actions are the environment's own
(they depend on its state, not on what the policy read), so demonstrations never read notes;
the policy learns when to read from RL.

JAX environments render their observations from arrays through their codec, so `offload` is a
host-environment mode (`train/config.py` refuses it for a JAX environment with that reason).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from longhorizon import envs as envs_lib
from longhorizon.envs.host import HostEnvironment, Observation, StepResult, invalid_action, \
    parse_call, tool
from longhorizon.envs.types import ErrorCode

__all__ = ["Notebook", "NOTE_TOOLS"]

NOTE_TOOLS = (
    tool("read_note", "Show a saved note (a long tool output or your own text).", note="integer"),
    tool("write_note", "Save text as a note, to read it back later.", text="string"),
)
_NAMES = tuple(t["function"]["name"] for t in NOTE_TOOLS)
_WORDS = ("...", "saved", "to", "note", ",", "read_note", "write_note", "read", "it", "text",
          "notes", "long", "outputs", "are", "shows", "saves", "as", "a", ".", "K", "TEXT", ":", "no",
          "the", "notebook", "is", "full", "error")


class Notebook(HostEnvironment):
  """Offloads long outputs of the host environment `inner` to notes (see the module docstring).

  Args:
    inner: the environment's registered name or import path (`envs.make`).
    inner_params: its constructor parameters.
    max_words: outputs of more words than this are saved as a note.
    preview_words: the words of an offloaded output shown before its stub.
    max_notes: notes an episode may hold (note ids are 0..max_notes-1).
    reward: the run's `RewardSpec` (also given to `inner`).
  """

  def __init__(self, inner: str, inner_params: dict | None = None, max_words: int = 32,
               preview_words: int = 8, max_notes: int = 16, reward=None, **reward_kwargs):
    super().__init__(reward, **reward_kwargs)
    if max_words < 1 or preview_words < 0 or preview_words > max_words or max_notes < 1:
      raise ValueError(f"Notebook: need max_words >= 1, 0 <= preview_words <= max_words and "
                       f"max_notes >= 1; got max_words={max_words}, "
                       f"preview_words={preview_words}, max_notes={max_notes}.")
    self.inner, self.inner_params = inner, dict(inner_params or {})
    self.max_words, self.preview_words, self.max_notes = max_words, preview_words, max_notes
    self._env = envs_lib.make(inner, reward=self.reward_spec, **self.inner_params)
    if not isinstance(self._env, HostEnvironment):
      raise ValueError(f"Notebook: {inner!r} is a JAX environment; offload wraps host "
                       "environments only (their outputs are text).")
    self.name = f"{self._env.name}+notebook"
    self.version = f"{self._env.version}+notebook1"
    self.milestone_names = self._env.milestone_names
    self.tools = None if self._env.tools is None else tuple(self._env.tools) + NOTE_TOOLS
    self.default_backend = self._env.default_backend
    self._notes: list[str] = []

  def params(self) -> dict:
    """The constructor parameters (`name`, `tools`, ... are derived from `inner`)."""
    return {"inner": self.inner, "inner_params": self.inner_params, "max_words": self.max_words,
            "preview_words": self.preview_words, "max_notes": self.max_notes}

  # ------------------------------------------------------------------------------ episode
  def tasks(self, split: str, num: int, seed: int) -> list[dict]:
    return self._env.tasks(split, num, seed)

  def reset(self, task: dict, seed: int) -> Observation:
    self._notes = []
    return self._env.reset(task, seed)

  def step(self, action: str) -> StepResult:
    style = "tool_call" if isinstance(action, str) and "<tool_call>" in action else "compact"
    call = parse_call(action, NOTE_TOOLS, style)
    if call.ok:
      return self._note_call(call.name, call.arguments)
    if call.error != ErrorCode.UNKNOWN_TOOL and _names_a_note_tool(action):
      return invalid_action(call.error, call.message)
    result = self._env.step(action)
    words = result.observation.split()
    if len(words) <= self.max_words or len(self._notes) >= self.max_notes:
      return result
    self._notes.append(result.observation)
    preview = " ".join(words[:self.preview_words] + ["..."])
    k = len(self._notes) - 1
    stub = f"{preview} saved to note {k} , read_note {k} to read it"
    return dataclasses.replace(result, observation=stub,
                               info={**result.info, "offloaded_note": k})

  def _note_call(self, name: str, arguments: dict) -> StepResult:
    if name == "read_note":
      k = arguments["note"]
      if not 0 <= k < len(self._notes):
        return invalid_action(ErrorCode.BAD_ARGUMENT, f"no note {k}")
      return StepResult(self._notes[k], info={"read_note": k})
    if len(self._notes) >= self.max_notes:
      return invalid_action(ErrorCode.BAD_ARGUMENT, "the notebook is full")
    self._notes.append(arguments["text"])
    return StepResult(f"saved to note {len(self._notes) - 1}",
                      info={"wrote_note": len(self._notes) - 1})

  # ------------------------------------------------------------------------------ optional
  def oracle(self) -> str | None:
    return self._env.oracle()

  def random_action(self, seed: int) -> str | None:
    return self._env.random_action(seed)

  def state_text(self) -> str:
    return self._env.state_text()

  def snapshot(self) -> Any:
    return {"env": self._env.snapshot(), "notes": list(self._notes)}

  def restore(self, snapshot: Any) -> None:
    self._env.restore(snapshot["env"])
    self._notes = list(snapshot["notes"])

  @property
  def can_snapshot(self) -> bool:
    return self._env.can_snapshot

  def close(self) -> None:
    self._env.close()

  def system_text(self, style: str) -> str:
    guide = ("long outputs are saved to notes : read_note K shows note K , write_note TEXT saves "
             "TEXT as a note .")
    own = self._env.system_text(style)
    return f"{own} {guide}" if own else guide

  def vocabulary(self) -> list[str] | None:
    words = self._env.vocabulary()
    if words is None:
      return None
    extra = list(_WORDS) + [str(k) for k in range(self.max_notes)]
    return list(dict.fromkeys(list(words) + extra))

  def anchor(self, observation: str) -> int:
    return self._env.anchor(observation)

  def task_difficulty(self, task: dict) -> int:
    return self._env.task_difficulty(task)

  @property
  def notes(self) -> tuple[str, ...]:
    """The episode's notes so far (offloaded outputs and written texts, in order)."""
    return tuple(self._notes)


def _names_a_note_tool(action: str) -> bool:
  """Whether a call that failed to parse names read_note / write_note (a malformed note call is
  answered as one, not passed to the environment)."""
  text = action.strip() if isinstance(action, str) else ""
  return text.split(" ", 1)[0] in _NAMES or any(f'"{n}"' in text for n in _NAMES)
