"""The environment and reward versions recorded on every episode (`EpisodeBatch.env_version`,
`reward_version`): stable 31-bit fingerprints of what produced the episode, so batches collected
under different environments or reward weights are told apart (in a replay buffer, in an
off-policy correction, in a comparison of runs).

Both are `crc32(json) & 0x7FFFFFFF` (non-negative, fits `int32`) of a plain description:

* `env_version(env)`: for each layer of the wrapper chain, outermost first, its class name, `name`,
  `version` and public constructor parameters (the instance's attributes not starting with `_`;
  environments store only their parameters on `self`), the wrapped environment nested under `env`.
  Changing a parameter (`horizon`, a fault rate, a tool cost), a wrapper or the class's `version`
  string changes it; rebuilding the same environment does not. A host environment's checks
  (`envs.host_wrappers.guard`: faults, tool costs, loop detection) enter it as `guards`.
* `reward_version(spec)`: the field values of the `RewardSpec` (envs/rewards.py).

NumPy arrays enter as their dtype and values; a value with no plain form (e.g. a callable) enters as
its type's qualified name only.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from typing import Any

import numpy as np

from longhorizon.envs import Environment, HostEnvironment
from longhorizon.envs.host_wrappers import guards_of
from longhorizon.envs.rewards import RewardSpec

__all__ = ["env_version", "reward_version"]


def env_version(env: Environment) -> int:
  """The 31-bit fingerprint of `env` and its wrappers (see the module docstring)."""
  return _fingerprint(_describe(env))


def reward_version(spec: RewardSpec) -> int:
  """The 31-bit fingerprint of `spec`'s field values."""
  return _fingerprint(_describe(spec))


def _fingerprint(description) -> int:
  return zlib.crc32(json.dumps(description, sort_keys=True).encode()) & 0x7FFFFFFF


def _describe(value: Any):
  """A JSON-able description of `value` (see the module docstring)."""
  if isinstance(value, HostEnvironment):
    out = {"class": type(value).__qualname__, "name": value.name, "version": value.version,
           "params": {k: _describe(v) for k, v in value.params().items()}}
    guards = guards_of(value)
    if guards is not None:  # faults, tool costs, loop detection (envs/host_wrappers.py)
      out["guards"] = _describe(guards)
    return out
  if isinstance(value, Environment):
    params = {k: _describe(v) for k, v in vars(value).items() if not k.startswith("_")}
    return {"class": type(value).__qualname__, "name": value.name, "version": value.version,
            "params": params}
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    fields = {f.name: _describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return {"class": type(value).__qualname__, "fields": fields}
  if isinstance(value, np.ndarray):
    return {"dtype": str(value.dtype), "values": value.tolist()}
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, dict):
    return {str(k): _describe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_describe(v) for v in value]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  return {"type": f"{type(value).__module__}.{type(value).__qualname__}"}
