"""JAX-batched multi-turn environments, their text codecs, wrappers and task suites.

`make(name, **params)` builds a registered environment; `registered()` lists the names. Wrappers
(`TimeLimit`, `FaultInjection`, `ToolCost`, `LoopDetector`) compose around any environment and
stay jittable. See `base.py` for the API every environment shares.
"""

from __future__ import annotations

import importlib
from typing import Callable

from longhorizon.envs.base import Environment, RewardSpec, Transition, batch_reset, batch_step, stack_actions
from longhorizon.envs.codec import Codec, default_tokenizer
from longhorizon.envs.wrappers import FAULT_KINDS, FaultInjection, LoopDetector, TimeLimit, ToolCost, Wrapper
from longhorizon.envs.types import (ERROR_MESSAGES, Action, Arg, EnvState, ErrorCode, TimeStep, Tool,
                                    hash_tree, row, to_numpy)

__all__ = ["make", "register", "registered", "Environment", "RewardSpec", "Transition", "Codec",
           "default_tokenizer", "Action", "Arg", "Tool", "EnvState", "ErrorCode", "ERROR_MESSAGES",
           "TimeStep", "hash_tree", "row", "to_numpy", "batch_reset", "batch_step", "stack_actions", "Wrapper",
           "TimeLimit", "FaultInjection", "ToolCost", "LoopDetector", "FAULT_KINDS"]

# name -> "module:Class" (imported on first use) or a factory.
_REGISTRY: dict[str, str | Callable[..., Environment]] = {
    "pointer_chain": "longhorizon.envs.pointer_chain:PointerChain",
    "gridworld": "longhorizon.envs.gridworld:GridWorld",
    "calculator": "longhorizon.envs.calculator:Calculator",
    "retail": "longhorizon.envs.retail:Retail",
}


def register(name: str, factory: Callable[..., Environment], overwrite: bool = False) -> None:
  """Registers `factory(**params) -> Environment` under `name` (e.g. from a notebook)."""
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"environment {name!r} is already registered; pass overwrite=True to replace it.")
  _REGISTRY[name] = factory


def registered() -> list[str]:
  """The registered environment names."""
  return sorted(_REGISTRY)


def make(name: str, **params) -> Environment:
  """Builds the environment `name` with constructor `params`."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; registered: {registered()}.")
  factory = _REGISTRY[name]
  if isinstance(factory, str):
    module, cls = factory.split(":")
    factory = getattr(importlib.import_module(module), cls)
  return factory(**params)
