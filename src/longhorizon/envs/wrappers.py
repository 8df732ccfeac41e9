"""Environment wrappers: step limits, fault injection, tool costs and loop detection.

Each wrapper is an `Environment` around another one; they compose in any order and stay jittable
and vmappable. A wrapper keeps its own state in `state.extras[<wrapper name>]` and, like every
environment, leaves a finished row unchanged.

* `TimeLimit(env, max_steps)`: truncates (not terminates) after `max_steps` actions.
* `FaultInjection(env, rates, env_error_kinds)`: a well-formed tool call fails with a tool timeout,
  an empty result, a permission error or unavailability at set rates (one set for every tool, or
  a tool's own: `{"timeout": 0.05, "lookup": {"unavailable": 0.2}}`). The call is not executed and
  the policy sees an error observation. Kinds in `env_error_kinds` are infrastructure failures: the
  episode stops with `env_error=True` and `truncated=True` (not the policy's fault; learners mask
  it). The others are recoverable: the episode goes on and the policy may retry.
* `ToolCost(env, costs)`: adds a per-tool cost to `timestep.cost` for every executed or attempted
  well-formed call.
* `LoopDetector(env, k)`: the same canonical action in the same anchor state for the k-th time
  truncates the episode with `loop=True` (calls that failed with an injected fault do not count).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.envs.base import Environment, finish_guard
from longhorizon.envs.types import Action, EnvState, ErrorCode, TimeStep, hash_tree, select

__all__ = ["Wrapper", "TimeLimit", "FaultInjection", "ToolCost", "LoopDetector", "FAULT_KINDS",
           "tool_fault_rates"]

FAULT_KINDS = {"timeout": ErrorCode.TIMEOUT, "empty_result": ErrorCode.EMPTY_RESULT,
               "permission_denied": ErrorCode.PERMISSION_DENIED,
               "unavailable": ErrorCode.UNAVAILABLE}


class Wrapper(Environment):
  """Delegates everything to `env`; subclasses override `reset`/`step` (and name their extras)."""

  def __init__(self, env: Environment):
    # No super().__init__: the reward spec, tools and text are the wrapped environment's.
    self.env = env

  def __getattr__(self, name):
    if name == "env":  # not set yet (e.g. during unpickling)
      raise AttributeError(name)
    return getattr(self.env, name)

  name = property(lambda self: self.env.name)
  version = property(lambda self: self.env.version)
  milestone_names = property(lambda self: self.env.milestone_names)
  reward_spec = property(lambda self: self.env.reward_spec)
  tools = property(lambda self: self.env.tools)
  unwrapped = property(lambda self: self.env.unwrapped)

  def generate_task(self, key, split="train"):
    return self.env.generate_task(key, split)

  def init(self, task, key):
    return self.env.init(task, key)

  def transition(self, task, inner, action, key):
    return self.env.transition(task, inner, action, key)

  def error_observation(self, task, inner, error):
    return self.env.error_observation(task, inner, error)

  def canonical_state(self, task, inner):
    return self.env.canonical_state(task, inner)

  def verify(self, task, inner):
    return self.env.verify(task, inner)

  def oracle(self, state):
    return self.env.oracle(state)

  def system_text(self, style):
    return self.env.system_text(style)

  def task_text(self, task, style):
    return self.env.task_text(task, style)

  def observation_text(self, observation, style):
    return self.env.observation_text(observation, style)

  def vocabulary(self):
    return self.env.vocabulary()

  def task_difficulty(self, task):
    return self.env.task_difficulty(task)

  def milestones_at_reset(self, task, inner):
    return self.env.milestones_at_reset(task, inner)

  def episode_info(self, task, inner):
    return self.env.episode_info(task, inner)

  def state_text(self, task, inner, style):
    return self.env.state_text(task, inner, style)

  def split_params(self, split):
    return self.env.split_params(split)

  def codec(self, tokenizer=None, style="compact"):
    return self.env.codec(tokenizer, style)

  def reset(self, key, task=None):
    return self.env.reset(key, task)

  def step(self, state, action):
    return self.env.step(state, action)

  def __repr__(self):
    return f"{type(self).__name__}({self.env!r})"


def _finish(old: EnvState, state: EnvState, timestep: TimeStep, stop: jax.Array,
            **flags) -> tuple[EnvState, TimeStep]:
  """Marks `timestep` truncated where `stop` (plus extra flags) and re-applies the finished-row
  guard of `old`."""
  updates = {"truncated": timestep.truncated | stop}
  for name, value in flags.items():
    updates[name] = getattr(timestep, name) | value
  timestep = timestep.replace(**updates)
  state = state.replace(done=state.done | stop, last=timestep)
  return finish_guard(old, state, timestep)


class TimeLimit(Wrapper):
  """Truncates an episode after `max_steps` actions (unless it terminated on that step)."""

  def __init__(self, env: Environment, max_steps: int):
    super().__init__(env)
    if max_steps < 1:
      raise ValueError(f"TimeLimit: max_steps must be >= 1, got {max_steps}.")
    self.max_steps = int(max_steps)

  def step(self, state, action):
    new_state, timestep = self.env.step(state, action)
    stop = ~timestep.terminated & (timestep.step >= self.max_steps)
    return _finish(state, new_state, timestep, stop)


def tool_fault_rates(rates: Mapping, tool_names: Sequence[str]) -> dict[str, dict[str, float]]:
  """Each tool's fault rates from `FaultInjection`'s `rates`: a kind's rate applies to every tool
  without an entry of its own; a tool's entry (a mapping of kinds to rates) replaces them for that
  tool. Raises ValueError naming an unknown kind or tool, a negative rate, or a tool whose rates
  sum past 1 (one fault at most per call)."""
  shared = {k: v for k, v in rates.items() if not isinstance(v, Mapping)}
  own = {k: dict(v) for k, v in rates.items() if isinstance(v, Mapping)}
  unknown_tools = sorted(set(own) - set(tool_names))
  if unknown_tools:
    raise ValueError(f"FaultInjection: {unknown_tools} in the rates is neither a fault kind "
                     f"({sorted(FAULT_KINDS)}) nor a tool ({list(tool_names)}).")
  out = {name: own.get(name, shared) for name in tool_names}
  for label, table in [("every tool", shared)] + [(f"tool {n!r}", t) for n, t in own.items()]:
    unknown = sorted(set(table) - set(FAULT_KINDS))
    if unknown:
      raise ValueError(f"FaultInjection: unknown fault kind(s) {unknown} for {label}; known: "
                       f"{sorted(FAULT_KINDS)}.")
    if any(float(r) < 0 for r in table.values()) or sum(map(float, table.values())) > 1 + 1e-9:
      raise ValueError(f"FaultInjection: rates for {label} must be >= 0 and sum to <= 1, got "
                       f"{dict(table)}.")
  return {name: {k: float(r) for k, r in table.items()} for name, table in out.items()}


class FaultInjection(Wrapper):
  """Injects tool faults (see the module docstring).

  Args:
    env: the environment.
    rates: fault kind -> probability per well-formed call, kinds from `FAULT_KINDS`, for every tool;
      and/or tool name -> {kind: probability}, that tool's own rates instead (`tool_fault_rates`).
      Each tool's rates must sum to <= 1.
    env_error_kinds: kinds that are infrastructure failures (episode stops, `env_error`); the rest
      are recoverable error observations.
    tools: names of the tools that can fail (default: all).
  """

  def __init__(self, env: Environment, rates: Mapping[str, float | Mapping[str, float]],
               env_error_kinds: Sequence[str] = ("unavailable",), tools: Sequence[str] | None = None):
    super().__init__(env)
    unknown = sorted(set(env_error_kinds) - set(FAULT_KINDS))
    if unknown:
      raise ValueError(f"FaultInjection: unknown fault kind(s) {unknown}; known: {sorted(FAULT_KINDS)}.")
    names = [t.name for t in env.tools]
    if tools is not None and set(tools) - set(names):
      raise ValueError(f"FaultInjection: unknown tool(s) {sorted(set(tools) - set(names))}; "
                       f"tools are {names}.")
    self.rates = tool_fault_rates(rates, names)  # tool name -> {kind: rate}
    self.env_error_kinds = tuple(env_error_kinds)
    self.tool_can_fail = np.array([tools is None or n in tools for n in names])
    kinds = sorted({k for table in self.rates.values() for k in table},
                   key=lambda k: FAULT_KINDS[k])
    self._codes = np.array([0] + [int(FAULT_KINDS[k]) for k in kinds], np.int32)
    # [tools, kinds + 1]: the cumulative rate of each tool's kinds (a kind it lacks has width 0)
    self._edges = np.cumsum([[0.0] + [self.rates[n].get(k, 0.0) for k in kinds] for n in names],
                            axis=-1) if names else np.zeros((1, 1))
    self._is_env_error = np.array([False] + [k in self.env_error_kinds for k in kinds])

  def step(self, state, action):
    key = jax.random.fold_in(jax.random.fold_in(state.key, state.step), 0xFA17)
    u = jax.random.uniform(key)
    tool = jnp.clip(jnp.asarray(action.tool, jnp.int32), 0, max(len(self.tools) - 1, 0))
    slot = jnp.sum(u >= jnp.asarray(self._edges)[tool, 1:]) + 1  # 1..len(kinds)+1
    slot = jnp.where(slot > len(self._codes) - 1, 0, slot)
    eligible = (jnp.asarray(action.error) == 0) & jnp.asarray(self.tool_can_fail)[tool] & (
        (action.tool >= 0) & (action.tool < len(self.tools)))
    slot = jnp.where(eligible, slot, 0)
    code = jnp.asarray(self._codes)[slot]
    faulted = code != 0
    is_env_error = jnp.asarray(self._is_env_error)[slot]

    normal_state, normal_ts = self.env.step(state, action)
    # The faulted call: nothing executes; the policy sees the error; the step counts.
    step = state.step + 1
    obs = self.env.error_observation(state.task, state.inner, code)
    fault_ts = state.last.replace(
        observation=obs, reward=jnp.zeros((), jnp.float32), terminated=jnp.zeros((), bool),
        truncated=is_env_error, success=jnp.zeros((), bool),
        milestones=jnp.zeros_like(state.milestones), cost=jnp.zeros((), jnp.float32),
        violation=jnp.zeros((), bool), env_error=is_env_error, step=step,
        invalid_action=jnp.zeros((), bool), loop=jnp.zeros((), bool), fault=code)
    fault_state = state.replace(step=step, done=is_env_error, last=fault_ts)
    new_state = select(faulted, fault_state, normal_state)
    timestep = select(faulted, fault_ts, normal_ts)
    return finish_guard(state, new_state, timestep)


class ToolCost(Wrapper):
  """Adds `costs[tool name]` (default `default`) to the cost of each well-formed call, and
  `reward_spec.cost` times it to the step's penalty (the reward stays `RewardSpec`'s)."""

  def __init__(self, env: Environment, costs: Mapping[str, float], default: float = 0.0):
    super().__init__(env)
    names = [t.name for t in env.tools]
    if set(costs) - set(names):
      raise ValueError(f"ToolCost: unknown tool(s) {sorted(set(costs) - set(names))}; tools are {names}.")
    self.costs = np.array([float(costs.get(n, default)) for n in names], np.float32)

  def step(self, state, action):
    new_state, timestep = self.env.step(state, action)
    tool = jnp.clip(jnp.asarray(action.tool, jnp.int32), 0, len(self.costs) - 1)
    well_formed = (jnp.asarray(action.error) == 0) & (action.tool >= 0) & (action.tool < len(self.costs))
    cost = jnp.where(well_formed & ~state.done, jnp.asarray(self.costs)[tool], 0.0)
    timestep = timestep.replace(cost=timestep.cost + cost,
                                reward=timestep.reward - self.reward_spec.cost * cost)
    return finish_guard(state, new_state.replace(last=timestep), timestep)


class LoopDetector(Wrapper):
  """Truncates with `loop=True` when the same action is taken in the same anchor state for the
  `k`-th time within the last `window` steps. The action is canonical: tool, arguments and parse
  error code (two texts that parse to the same action are the same action)."""

  def __init__(self, env: Environment, k: int = 3, window: int = 32):
    super().__init__(env)
    if k < 2 or window < k - 1:
      raise ValueError(f"LoopDetector: need k >= 2 and window >= k - 1, got k={k}, window={window}.")
    self.k, self.window = int(k), int(window)

  def reset(self, key, task=None):
    state, timestep = self.env.reset(key, task)
    history = {"signatures": jnp.zeros((self.window,), jnp.uint32),
               "filled": jnp.zeros((self.window,), bool)}
    return state.replace(extras={**state.extras, "loop_detector": history}), timestep

  def step(self, state, action):
    history = state.extras["loop_detector"]
    signature = hash_tree((state.last.anchor, jnp.asarray(action.tool, jnp.int32),
                           jnp.asarray(action.args, jnp.int32), jnp.asarray(action.error, jnp.int32)))
    seen = jnp.sum(history["filled"] & (history["signatures"] == signature))
    new_state, timestep = self.env.step(state, action)
    stop = (seen + 1 >= self.k) & ~timestep.terminated & ~timestep.truncated
    # A call that failed with an injected fault did not act; retrying it is not a loop.
    record = timestep.fault == 0
    slot = state.step % self.window
    history = {"signatures": history["signatures"].at[slot].set(
                   jnp.where(record, signature, history["signatures"][slot])),
               "filled": history["filled"].at[slot].set(record | history["filled"][slot])}
    new_state = new_state.replace(extras={**new_state.extras, "loop_detector": history})
    return _finish(state, new_state, timestep, stop, loop=stop)
