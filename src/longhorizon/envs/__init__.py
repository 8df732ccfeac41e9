"""Multi-turn environments: JAX-batched ones, plain-Python host ones (`host.py`), codecs, wrappers.

`make(name, **params)` builds an environment named by its registered name (`registered()` lists
them) or by import path, `"package.module:Class"` (a user's environment outside the library: its
folder on `PYTHONPATH`, nothing to register). Wrappers
(`TimeLimit`, `FaultInjection`, `ToolCost`, `LoopDetector`) compose around any environment and
stay jittable. See `base.py` for the API every environment shares.
"""

from __future__ import annotations

import importlib
from typing import Callable

from longhorizon.envs.base import Environment, Transition, batch_reset, batch_step, stack_actions
from longhorizon.envs.rewards import RewardSpec, compose_rewards
from longhorizon.envs.codec import Codec, default_tokenizer
from longhorizon.envs.host import HostEnvironment, Observation, StepResult, is_host
from longhorizon.envs.wrappers import (FAULT_KINDS, FaultInjection, LoopDetector, TimeLimit, ToolCost,
                                      Wrapper, tool_fault_rates)
from longhorizon.envs.types import (ERROR_MESSAGES, Action, Arg, EnvState, ErrorCode, TimeStep, Tool,
                                    hash_tree, row, to_numpy)

__all__ = ["make", "register", "registered", "resolve", "Environment", "HostEnvironment",
           "Observation", "StepResult", "is_host", "RewardSpec", "compose_rewards", "Transition",
           "Codec", "default_tokenizer", "Action", "Arg", "Tool", "EnvState", "ErrorCode",
           "ERROR_MESSAGES", "TimeStep", "hash_tree", "row", "to_numpy", "batch_reset",
           "batch_step", "stack_actions", "Wrapper", "TimeLimit", "FaultInjection", "ToolCost",
           "LoopDetector", "FAULT_KINDS", "tool_fault_rates"]

# name -> "module:Class" (imported on first use) or a factory.
_REGISTRY: dict[str, str | Callable[..., Environment]] = {
    "pointer_chain": "longhorizon.envs.pointer_chain:PointerChain",
    "gridworld": "longhorizon.envs.gridworld:GridWorld",
    "calculator": "longhorizon.envs.calculator:Calculator",
    "retail": "longhorizon.envs.retail:Retail",
    # Host (plain-Python) environments (`envs/host.py`), stepped by `envs/pool.py`.
    "textworld": "longhorizon.envs.textworld_games:TextWorldGames",
    "back_office": "longhorizon.envs.back_office:BackOffice",
    "code_sandbox": "longhorizon.envs.code_sandbox:CodeSandbox",
}


def register(name: str, factory: Callable[..., Environment], overwrite: bool = False) -> None:
  """Registers `factory(**params) -> Environment` under `name` (e.g. from a notebook)."""
  if ":" in name:
    raise ValueError(f"environment name {name!r} contains ':', which marks an import path "
                     "('package.module:Class'); register it under a plain name.")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"environment {name!r} is already registered; pass overwrite=True to replace it.")
  _REGISTRY[name] = factory


def registered(kind: str | None = None) -> list[str]:
  """The registered environment names (import paths are accepted by `make` besides these); with
  `kind` "jax" or "host", only the JAX-batched or the plain-Python ones (their classes are
  imported to tell)."""
  if kind is None:
    return sorted(_REGISTRY)
  if kind not in ("jax", "host"):
    raise ValueError(f"kind must be None, 'jax' or 'host', got {kind!r}.")
  return sorted(n for n in _REGISTRY if is_host(resolve(n)) == (kind == "host"))


def _import(path: str, name: str) -> Callable[..., Environment]:
  """The attribute `Class` (dots allowed: `Outer.Inner`) of `package.module:Class`."""
  module_name, _, attribute = path.partition(":")
  if not module_name or not attribute:
    raise ValueError(f"environment {name!r}: an import path is 'package.module:Class', with both "
                     "parts non-empty.")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name is not None and module_name.startswith(e.name):
      raise ValueError(
          f"environment {name!r}: cannot import module {module_name!r} ({e}); put the folder that "
          f"holds it on PYTHONPATH (or sys.path), or use a registered name: {registered()}.") from e
    raise ValueError(f"environment {name!r}: importing module {module_name!r} failed: {e}") from e
  obj = module
  for part in attribute.split("."):
    if not hasattr(obj, part):
      found = sorted(k for k, v in vars(module).items()
                     if isinstance(v, type) and issubclass(v, (Environment, HostEnvironment))
                     and v not in (Environment, HostEnvironment))
      raise ValueError(f"environment {name!r}: module {module_name!r} ({module.__file__}) has no "
                       f"attribute {attribute!r}; Environment classes in it: {found}.")
    obj = getattr(obj, part)
  if isinstance(obj, type) and not issubclass(obj, (Environment, HostEnvironment)):
    raise ValueError(f"environment {name!r}: {obj.__module__}.{obj.__qualname__} is not a subclass "
                     "of longhorizon.envs.Environment or longhorizon.envs.host.HostEnvironment; "
                     "name the environment class.")
  if not callable(obj):
    raise ValueError(f"environment {name!r}: {attribute!r} is a {type(obj).__name__}, not an "
                     "Environment class or a factory returning one.")
  return obj


def resolve(name: str) -> Callable[..., Environment]:
  """The factory (usually the class) of `name`: a registered name, or an import path
  `"package.module:Class"`; raises `ValueError` saying what is missing (module, attribute, or an
  object that is not an Environment class or a callable)."""
  if not isinstance(name, str):
    raise ValueError(f"environment name must be a string, got {name!r}.")
  if name in _REGISTRY:
    factory = _REGISTRY[name]
    return _import(factory, name) if isinstance(factory, str) else factory
  if ":" in name:
    return _import(name, name)
  raise ValueError(f"unknown environment {name!r}; registered: {registered()}; an environment "
                   "outside the library is named by import path, 'package.module:Class'.")


def make(name: str, **params) -> Environment | HostEnvironment:
  """Builds the environment `name` (registered, or `"package.module:Class"`) with constructor
  `params`: a JAX `Environment` or a plain-Python `HostEnvironment` (`envs/host.py`); raises
  `ValueError` if the factory returns neither."""
  env = resolve(name)(**params)
  if not isinstance(env, (Environment, HostEnvironment)):
    raise ValueError(f"environment {name!r}: the factory returned a {type(env).__name__}, not a "
                     "longhorizon.envs.Environment or longhorizon.envs.host.HostEnvironment.")
  return env
