"""Host environments: plain-Python environments stepped outside jit, beside the JAX ones.

A `HostEnvironment` is one episode slot: an object with state, reset and stepped with text on the
host (a game, a database, a sandbox, a web service client). The rollout loop (`rollout.collect`)
runs `B` of them through an `EnvPool` (`envs/pool.py`: threads or processes, timeouts, retries,
rate limits, a circuit breaker, record and replay) and writes the same `EpisodeBatch` as for a JAX
environment, so learners, curriculum, async rollouts and evaluation are shared.

    class Echo(HostEnvironment):
      name, milestone_names = "echo", ("half",)
      def tasks(self, split, num, seed): return [{"word": f"w{seed}_{i}"} for i in range(num)]
      def reset(self, task, seed): self.word = task["word"]; return Observation(f"say {self.word}")
      def step(self, action):
        ok = action.strip() == self.word
        return StepResult("yes" if ok else "no", terminated=True, success=ok)

What the loop does with a step (one definition for both kinds, `envs/rewards.py`): the training
reward is composed from `success`, first-time `milestones` (names from `milestone_names`), `cost`,
`violation` and invalid actions by the run's `RewardSpec`, plus `StepResult.reward` as one more
component (`reward/env`, 0 unless the environment reports its own reward). `env_error=True` ends
the episode as `ENV_ERROR`: kept in the batch, excluded from training and from group baselines. An
action is invalid when `info["error"]` holds an `ErrorCode` (parse errors 1-5, INVALID_ARGUMENT,
NOT_ALLOWED): `invalid_action` builds that answer, and `parse_call` parses tool calls with the same
coded errors as the JAX codecs.

Text: the policy's prompt is the codec's framing of `system_text(style)` and the reset
observation's text; each observation is framed as the next turn (`envs/host_codec.py`). With
`vocabulary()` (the words its text uses) the default tokenizer is word-level (compact style, for
the small default policy), otherwise byte-level.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import zlib
from typing import Any, Sequence

from longhorizon.envs.codec import tool_call_error
from longhorizon.envs.host_codec import HostCodec
from longhorizon.envs.rewards import RewardSpec, reward_spec_of
from longhorizon.envs.types import ERROR_MESSAGES, ErrorCode
from longhorizon.text import parse_tool_call

__all__ = ["HostEnvironment", "Observation", "StepResult", "Call", "parse_call", "invalid_action",
           "tool", "is_host"]


@dataclasses.dataclass(frozen=True)
class Observation:
  """What `reset` returns: the first observation's text (the task as the policy reads it)."""
  text: str
  info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What `step` returns (see the module docstring for how the loop reads each field)."""
  observation: str
  reward: float = 0.0
  terminated: bool = False
  truncated: bool = False
  success: bool = False
  milestones: tuple[str, ...] = ()
  cost: float = 0.0
  violation: bool = False
  env_error: bool = False
  info: dict = dataclasses.field(default_factory=dict)

  @property
  def error(self) -> int:
    """The `ErrorCode` of an invalid action (0 if the action was valid)."""
    return int(self.info.get("error", 0))


class HostEnvironment:
  """Base class of plain-Python environments: one instance per episode slot (see module doc).

  Subclasses set `name`, `version`, `milestone_names` and `tools` (JSON schemas in the function
  format chat templates take, or None for free-text actions) and implement `tasks`, `reset` and
  `step`; `oracle`, `snapshot`/`restore`, `close`, `system_text`, `vocabulary`, `anchor` and
  `task_difficulty` are optional. Constructor parameters are stored as public attributes (they
  enter the environment's fingerprint, `rollout.versions.env_version`); the episode's state lives
  in attributes that start with `_` or are set by `reset`.
  """

  name: str = ""
  version: str = "1"
  milestone_names: tuple[str, ...] = ()
  tools: tuple[dict, ...] | None = None
  # Backend the pool uses unless the config names one: "thread" (I/O-bound: services, databases)
  # or "process" (isolation, CPU-bound Python).
  default_backend: str = "thread"

  def __init__(self, reward: RewardSpec | None = None, **reward_kwargs):
    self._reward_spec = reward_spec_of(type(self).__name__, reward, reward_kwargs)

  @property
  def reward_spec(self) -> RewardSpec:
    return self._reward_spec

  # ------------------------------------------------------------------ what a subclass provides
  def tasks(self, split: str, num: int, seed: int) -> list[dict]:
    """`num` JSON-serialisable task specs of `split` ("train", "test" or "ood"), a function of
    `(split, num, seed)` only; test and ood tasks are unseen in train."""
    raise NotImplementedError(f"{type(self).__name__} must implement tasks(split, num, seed).")

  def reset(self, task: dict, seed: int) -> Observation:
    """Starts `task`; `seed` is the episode's own randomness (equal seeds, equal episodes)."""
    raise NotImplementedError(f"{type(self).__name__} must implement reset(task, seed).")

  def step(self, action: str) -> StepResult:
    """Applies the policy's raw text (end-of-turn token removed). Malformed text is an invalid
    action (`invalid_action`), never an exception; an exception is an environment error."""
    raise NotImplementedError(f"{type(self).__name__} must implement step(action).")

  # ------------------------------------------------------------------------------ optional
  def oracle(self) -> str | None:
    """The next expert action as the policy would write it (None: no expert here)."""
    return None

  def random_action(self, seed: int) -> str | None:
    """A random well-formed action from the current state, a function of `seed` (for noisy
    demonstrations, `sft.demo_epsilon`). Default: a random tool of `tools` with random argument
    values (the environment may refuse them); free-text environments override it."""
    if not self.tools:
      raise NotImplementedError(f"{type(self).__name__} has free-text actions and no "
                                "random_action(seed); define one for noisy demonstrations.")
    rng = random.Random(seed)
    schema = _schema(rng.choice(list(self.tools)))
    arguments = {}
    for key, spec in schema.get("parameters", {}).get("properties", {}).items():
      if "enum" in spec:
        arguments[key] = rng.choice(spec["enum"])
      else:
        arguments[key] = {"integer": rng.randint(0, 9), "number": float(rng.randint(0, 9)),
                          "boolean": rng.random() < 0.5}.get(spec.get("type"), "x")
    return "<tool_call>" + json.dumps({"name": schema["name"], "arguments": arguments}) + \
        "</tool_call>"

  def state_text(self) -> str:
    """A summary of the episode's current state, written in the task's place when
    `context.mode='summary'` rewrites the context (`rollout/context.py`): what the policy needs to
    go on from here as from a fresh task, in the words of `vocabulary()`. Environments without
    one raise (summary mode is then refused by the config)."""
    raise NotImplementedError(
        f"{type(self).__name__} has no state summary (state_text), which context.mode='summary' "
        f"needs; use context.mode='window' or implement it.")

  def snapshot(self) -> Any:
    """A picklable copy of the episode's state, independent of this instance: `restore` on a
    fresh instance (after `reset` of the same task and seed) continues the episode exactly."""
    raise NotImplementedError(f"{type(self).__name__} has no snapshot().")

  def restore(self, snapshot: Any) -> None:
    raise NotImplementedError(f"{type(self).__name__} has no restore().")

  @property
  def can_snapshot(self) -> bool:
    return type(self).snapshot is not HostEnvironment.snapshot

  def close(self) -> None:
    """Releases what the episode holds (files, connections, processes)."""

  def system_text(self, style: str) -> str:
    """What the policy is told before the first observation (the codec adds the tool schemas
    in tool_call style)."""
    del style
    return ""

  def vocabulary(self) -> list[str] | None:
    """Every word the environment's text uses (space-separated, punctuation as its own word), for
    a word-level tokenizer; None (default) for a byte-level one."""
    return None

  def anchor(self, observation: str) -> int:
    """31-bit id of the state the next action is taken in (GiGPO's anchor). Default: a hash of
    the observation text; override with a canonical state when the text does not identify it."""
    return zlib.crc32(observation.encode()) & 0x7FFFFFFF

  def task_difficulty(self, task: dict) -> int:
    return int(task.get("difficulty", 0))

  def episode_info(self, task: dict, infos: list) -> dict:
    """Facts about a finished episode that evaluation reports, as `Environment.episode_info`
    (`collateral_damage`, `attacked`, `attack_success`; bool or int), from its task and the `info`
    dicts of its steps, oldest first (steps answered with an environment error left out; a row
    forked from a saved state has only its own steps'). Every episode must give the same keys.
    Called in the learner's process, on an instance that never stepped: read nothing but the
    arguments. Default none."""
    del task, infos
    return {}

  def codec(self, tokenizer=None, style: str = "compact"):
    return HostCodec(self, tokenizer, style)

  @property
  def num_milestones(self) -> int:
    return len(self.milestone_names)

  @property
  def unwrapped(self):
    return self

  def params(self) -> dict:
    """The constructor parameters (public attributes), for fingerprints and process workers."""
    return {k: v for k, v in vars(self).items() if not k.startswith("_")}

  def __repr__(self):
    return f"{type(self).__name__}({self.name!r})"


def is_host(env) -> bool:
  """True for a host environment (or a factory class of one)."""
  if isinstance(env, type):
    return issubclass(env, HostEnvironment)
  return isinstance(getattr(env, "unwrapped", env), HostEnvironment)


# ------------------------------------------------------------------------------ tools and parsing
_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool}


def tool(name: str, description: str, **params: Any) -> dict:
  """A tool schema: `tool("run_tests", "Run the visible tests.")`, `tool("write_file", "...",
  path="string", content="string")`; a parameter is a JSON type name, a list of allowed strings
  (an enum), or a full JSON-schema dict. Every parameter is required."""
  properties = {}
  for key, spec in params.items():
    if isinstance(spec, str):
      spec = {"type": spec}
    elif isinstance(spec, (list, tuple)):
      spec = {"type": "string", "enum": list(spec)}
    if spec.get("type") not in _TYPES:
      raise ValueError(f"tool {name!r}: parameter {key!r} has type {spec.get('type')!r}; one of "
                       f"{sorted(_TYPES)}.")
    properties[key] = dict(spec)
  return {"type": "function", "function": {
      "name": name, "description": description,
      "parameters": {"type": "object", "properties": properties, "required": list(params)}}}


@dataclasses.dataclass(frozen=True)
class Call:
  """A parsed tool call, or a parse error (`error != 0`, `message` says what is wrong)."""
  name: str = ""
  arguments: dict = dataclasses.field(default_factory=dict)
  error: int = 0
  message: str = ""

  @property
  def ok(self) -> bool:
    return self.error == 0


def _schema(t: dict) -> dict:
  return t.get("function", t)


def _fail(code: ErrorCode, message: str) -> Call:
  return Call(error=int(code), message=f"{ERROR_MESSAGES[code]}: {message}")


def parse_call(text: str, tools: Sequence[dict], style: str = "tool_call") -> Call:
  """Parses the policy's text against `tools` (schemas from `tool`), with the JAX codecs' error
  codes: GARBAGE (no action), BAD_JSON, UNKNOWN_TOOL, BAD_ARGUMENT (missing, extra, wrong type or
  not among an enum's values), EXTRA_TEXT. Never raises.

  Styles: `tool_call` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and `compact`
  (`name value value ...`: space-separated words; the last string parameter takes the rest of the
  line, so `write notes.txt some text` works)."""
  try:
    if not isinstance(text, str):
      return _fail(ErrorCode.GARBAGE, f"expected text, got {type(text).__name__}")
    by_name = {_schema(t)["name"]: _schema(t) for t in tools}
    if style == "compact":
      return _parse_compact(text.strip(), by_name)
    return _parse_json_call(text, by_name)
  except Exception as e:  # a guarantee, not a code path we expect
    return _fail(ErrorCode.GARBAGE, f"could not parse the action ({type(e).__name__})")


def _parse_json_call(text: str, by_name: dict) -> Call:
  call, message = parse_tool_call(text)
  if call is None:
    return Call(error=int(tool_call_error(message)), message=message)
  name, arguments = call["name"], call["arguments"]
  if name not in by_name:
    return _fail(ErrorCode.UNKNOWN_TOOL, f"{_snip(name)}; available tools: {sorted(by_name)}")
  return _check_arguments(name, dict(arguments), by_name[name])


def _parse_compact(text: str, by_name: dict) -> Call:
  words = text.split(" ")
  words = [w for w in words if w]
  if not words:
    return _fail(ErrorCode.GARBAGE, f"empty action; tools: {sorted(by_name)}")
  name = words[0]
  if name not in by_name:
    return _fail(ErrorCode.UNKNOWN_TOOL, f"{_snip(name)}; tools: {sorted(by_name)}")
  properties = by_name[name].get("parameters", {}).get("properties", {})
  keys, given = list(properties), words[1:]
  if len(given) > len(keys) and keys and properties[keys[-1]].get("type") == "string":
    given = given[:len(keys) - 1] + [" ".join(given[len(keys) - 1:])]
  if len(given) > len(keys):
    return _fail(ErrorCode.EXTRA_TEXT, _snip(" ".join(given[len(keys):])))
  arguments = {}
  for key, word in zip(keys, given):
    kind = properties[key].get("type")
    if kind == "integer":
      if not re.fullmatch(r"0|-?[1-9][0-9]{0,17}", word):
        return _fail(ErrorCode.BAD_ARGUMENT, f"{key} must be an integer, got {_snip(word)}")
      arguments[key] = int(word)
    elif kind == "number":
      try:
        arguments[key] = float(word)
      except ValueError:
        return _fail(ErrorCode.BAD_ARGUMENT, f"{key} must be a number, got {_snip(word)}")
    elif kind == "boolean":
      if word not in ("true", "false"):
        return _fail(ErrorCode.BAD_ARGUMENT, f"{key} must be true or false, got {_snip(word)}")
      arguments[key] = word == "true"
    else:
      arguments[key] = word
  return _check_arguments(name, arguments, by_name[name])


def _check_arguments(name: str, arguments: dict, schema: dict) -> Call:
  parameters = schema.get("parameters", {})
  properties = parameters.get("properties", {})
  extra = sorted(set(arguments) - set(properties))
  if extra:
    return _fail(ErrorCode.BAD_ARGUMENT, f"{name} takes no argument(s) {extra}")
  for key in parameters.get("required", list(properties)):
    if key not in arguments:
      return _fail(ErrorCode.BAD_ARGUMENT, f"{name} is missing argument {key!r}")
  for key, value in arguments.items():
    spec = properties[key]
    kind = _TYPES.get(spec.get("type"), object)
    bad_bool = isinstance(value, bool) and spec.get("type") != "boolean"
    if bad_bool or not isinstance(value, kind) or (isinstance(value, float)
                                                   and not math.isfinite(value)):
      return _fail(ErrorCode.BAD_ARGUMENT,
                   f"{key} must be a JSON {spec.get('type')}, got {_snip(json.dumps(value))}")
    if "enum" in spec and value not in spec["enum"]:
      return _fail(ErrorCode.BAD_ARGUMENT, f"{key} must be one of {spec['enum'][:8]}, got "
                                           f"{_snip(json.dumps(value))}")
  return Call(name=name, arguments=arguments)


def invalid_action(code: int, message: str = "", observation: str | None = None) -> StepResult:
  """The answer to an invalid action: `info["error"] = code` (counted as invalid, penalised by
  `RewardSpec.invalid`), the episode goes on. The observation is `observation` or the message
  (for a `Call` from `parse_call`, pass `call.error, call.message`)."""
  code = ErrorCode(int(code))
  if observation is None:
    observation = f"error : {message or ERROR_MESSAGES[code]}"
  return StepResult(observation=observation, info={"error": int(code)})


def _snip(text: str, limit: int = 40) -> str:
  text = str(text)
  return repr(text if len(text) <= limit else text[:limit] + "...")
