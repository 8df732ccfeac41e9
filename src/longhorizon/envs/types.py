"""Shared environment types: actions, time steps, states, tool specs and error codes.

Every environment speaks the same structured action (`Action`: a tool index, a fixed-width vector
of integer arguments and a parse-error code), returns the same `TimeStep`, and keeps its own
dynamic state inside the common `EnvState`. Text never enters the jitted part: codecs
(`longhorizon.envs.codec`) turn text into `Action`s and observations into token ids on the host.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np


class ErrorCode(enum.IntEnum):
  """What went wrong with an action, as shown to the policy in `observation["error"]`.

  1-15 are the policy's fault (malformed or illegal actions); 16+ are infrastructure faults (from
  `FaultInjection`), which are not.
  """
  NONE = 0
  GARBAGE = 1  # no action could be found in the text
  BAD_JSON = 2  # a tool call whose JSON does not parse or has the wrong structure
  UNKNOWN_TOOL = 3  # the named tool does not exist
  BAD_ARGUMENT = 4  # a missing argument, a wrong type or a value out of range
  EXTRA_TEXT = 5  # text after the action
  INVALID_ARGUMENT = 6  # well-formed, but the environment rejects it (no such key, wall, ...)
  NOT_ALLOWED = 7  # a policy rule forbids the call (the safety gate decides whether it is a violation)
  TIMEOUT = 16  # injected faults
  EMPTY_RESULT = 17
  PERMISSION_DENIED = 18
  UNAVAILABLE = 19

  @property
  def is_parse_error(self) -> bool:
    return 1 <= self <= 5

  @property
  def is_fault(self) -> bool:
    return self >= 16


ERROR_MESSAGES = {
    ErrorCode.NONE: "",
    ErrorCode.GARBAGE: "no action found",
    ErrorCode.BAD_JSON: "the tool call is not valid JSON",
    ErrorCode.UNKNOWN_TOOL: "unknown tool",
    ErrorCode.BAD_ARGUMENT: "bad argument",
    ErrorCode.EXTRA_TEXT: "unexpected text after the action",
    ErrorCode.INVALID_ARGUMENT: "invalid argument",
    ErrorCode.NOT_ALLOWED: "not allowed",
    ErrorCode.TIMEOUT: "tool timed out",
    ErrorCode.EMPTY_RESULT: "tool returned nothing",
    ErrorCode.PERMISSION_DENIED: "permission denied",
    ErrorCode.UNAVAILABLE: "tool unavailable",
}


@dataclasses.dataclass(frozen=True)
class Arg:
  """One integer-coded tool argument.

  `kind="int"`: an integer in `[low, high]`, written as a decimal number. `kind="enum"`: one of
  `choices` (strings), coded as its index. In tool-call JSON an int argument must be a JSON integer
  and an enum argument a JSON string.
  """
  name: str
  kind: str = "int"
  low: int = 0
  high: int = 0
  choices: tuple[str, ...] = ()
  description: str = ""

  def __post_init__(self):
    if self.kind not in ("int", "enum"):
      raise ValueError(f"Arg {self.name!r}: kind must be 'int' or 'enum', got {self.kind!r}.")
    if self.kind == "enum" and not self.choices:
      raise ValueError(f"Arg {self.name!r}: an enum argument needs choices.")
    if self.kind == "int" and self.high < self.low:
      raise ValueError(f"Arg {self.name!r}: high={self.high} < low={self.low}.")

  def json_schema(self) -> dict:
    if self.kind == "enum":
      return {"type": "string", "enum": list(self.choices), "description": self.description}
    return {"type": "integer", "minimum": self.low, "maximum": self.high,
            "description": self.description}


@dataclasses.dataclass(frozen=True)
class Tool:
  """A tool (or action) the policy may call: its name, what it does and its arguments."""
  name: str
  description: str
  args: tuple[Arg, ...] = ()

  def json_schema(self) -> dict:
    """The OpenAI-style function schema shown to chat models."""
    return {"type": "function", "function": {
        "name": self.name, "description": self.description,
        "parameters": {"type": "object",
                       "properties": {a.name: a.json_schema() for a in self.args},
                       "required": [a.name for a in self.args]}}}


@flax.struct.dataclass
class Action:
  """A parsed action. Batched actions carry a leading `[B]` on every field."""
  tool: jax.Array  # [] int32 index into `env.tools` (-1 when the text did not parse)
  args: jax.Array  # [A] int32 arguments (int value or enum index), zero-padded to `env.num_args`
  error: jax.Array  # [] int32 ErrorCode of parsing; NONE for a well-formed action

  @classmethod
  def make(cls, tool: int, args: Sequence[int] = (), num_args: int = 1,
           error: int = ErrorCode.NONE) -> "Action":
    """A host-side (NumPy) action; `args` are zero-padded to `num_args`."""
    if len(args) > num_args:
      raise ValueError(f"{len(args)} arguments given but the environment takes at most {num_args}.")
    padded = np.zeros((num_args,), np.int32)
    padded[:len(args)] = args
    return cls(tool=np.int32(tool), args=padded, error=np.int32(error))

  @classmethod
  def invalid(cls, error: int, num_args: int = 1) -> "Action":
    return cls.make(-1, (), num_args, error)


@flax.struct.dataclass
class TimeStep:
  """What the environment answers after `reset` and after every `step` (one row; batched: `[B]`).

  `reward` is the environment's default scalarisation (success bonus, first-time milestone
  rewards, penalties for invalid actions and violations); the components are reported separately
  so learners can compose their own.
  """
  observation: dict  # env-specific structured arrays; always has "error": [] int32 ErrorCode
  reward: jax.Array  # [] float32
  terminated: jax.Array  # [] bool: the episode ended inside the task (answer given, goal, hole, stop)
  truncated: jax.Array  # [] bool: cut from outside (step limit, loop detector)
  success: jax.Array  # [] bool: the verifier accepts the final state (only at termination)
  milestones: jax.Array  # [M] bool: milestones reached for the first time at this step
  cost: jax.Array  # [] float32 cost of this step (tool costs)
  violation: jax.Array  # [] bool: the safety gate was hit; the episode stops, never a success
  env_error: jax.Array  # [] bool: infrastructure failure (not the policy's fault)
  anchor: jax.Array  # [] uint32 hash of the state the next action is taken in
  step: jax.Array  # [] int32 actions taken so far
  invalid_action: jax.Array  # [] bool: the action was malformed or rejected
  loop: jax.Array  # [] bool: stopped by the loop detector
  fault: jax.Array  # [] int32 ErrorCode of an injected fault this step (NONE if none)

  @property
  def done(self) -> jax.Array:
    return self.terminated | self.truncated


@flax.struct.dataclass
class EnvState:
  """The full state of one episode (batched: `[B]` leading axis everywhere)."""
  task: Any  # the env's task pytree (fixed-shape arrays), constant over the episode
  inner: Any  # the env's dynamic state pytree
  key: jax.Array  # PRNG key of the environment's own randomness (not the task's, not the policy's)
  step: jax.Array  # [] int32 actions taken
  done: jax.Array  # [] bool: finished; further steps are no-ops
  milestones: jax.Array  # [M] bool: milestones reached so far (those holding at reset included)
  last: TimeStep  # the latest time step (returned again, with zero reward, once done)
  extras: dict  # wrapper states by wrapper name


def select(pred, on_true, on_false):
  """`where(pred, a, b)` over matching pytrees, `pred` a scalar (per row under vmap)."""
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def to_numpy(tree):
  """A host copy of a pytree; typed PRNG keys become their uint32 key data."""
  def leaf(a):
    if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      return np.asarray(jax.random.key_data(a))
    return np.asarray(a)
  return jax.tree.map(leaf, tree)


def num_tasks(tasks) -> int:
  """The number of tasks in a batch of tasks: a pytree with a leading axis (JAX environments), or
  a list of task dicts (host environments; a leaf's `len` would count a dict's characters)."""
  if isinstance(tasks, (list, tuple)):
    return len(tasks)
  return int(jax.tree.leaves(tasks)[0].shape[0])


def row(tree, i: int):
  """Row `i` of a batched pytree, as NumPy (for host-side codecs; keys as key data)."""
  return jax.tree.map(lambda a: a[i], to_numpy(tree))


# ------------------------------------------------------------------------------------- hashing

_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def _fmix32(h):
  h = h ^ (h >> 16)
  h = h * _M1
  h = h ^ (h >> 13)
  h = h * _M2
  return h ^ (h >> 16)


def hash_tree(tree) -> jax.Array:
  """A uint32 hash of the integer/bool leaves of `tree` (shapes and order fixed by the pytree).

  Each 32-bit word is mixed with a salt from its position (MurmurHash3's finaliser), the mixed words
  are summed mod 2**32 and the sum is mixed again. Equal trees give equal hashes; unequal trees
  collide with probability about 2**-32 per pair. Vectorised (no loop over words); hashes one row
  (vmap it for a batch). Floats are not accepted: canonical states are integers.
  """
  words = []
  for leaf in jax.tree.leaves(tree):
    leaf = jnp.asarray(leaf)
    if not (jnp.issubdtype(leaf.dtype, jnp.integer) or leaf.dtype == jnp.bool_):
      raise TypeError(f"hash_tree hashes integer and bool leaves only, got {leaf.dtype}.")
    words.append(leaf.astype(jnp.uint32).reshape(-1))
  words = jnp.concatenate(words) if words else jnp.zeros((0,), jnp.uint32)
  salt = _fmix32(np.arange(1, words.shape[0] + 1, dtype=np.uint32) * np.uint32(0x9E3779B9))
  mixed = _fmix32((words ^ salt) * np.uint32(0xCC9E2D51))
  total = jnp.sum(mixed, dtype=jnp.uint32) + jnp.uint32(words.shape[0])
  return _fmix32(total)
