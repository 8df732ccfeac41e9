"""Fault injection, tool costs and loop detection for host (plain-Python) environments.

The JAX wrappers (`envs/wrappers.py`) are environments around environments, jitted with them. A
host environment's instances live in the pool's workers (threads, processes, Ray actors), so the
same three checks run instead in the learner's process, around each row's call, with the JAX
wrappers' semantics:

* faults (`FaultInjection`'s rates): a well-formed tool call (for an environment without tool
  schemas, any non-empty action) fails with a timeout, an empty result, a permission error or
  unavailability. The call never reaches the environment; the policy sees the error and the step
  counts. Kinds in `env_error_kinds` stop the episode as an environment error (masked by the
  learners); the others are recoverable. The draw of row `r` at its step `t` is a function of the
  row's seed and `t` alone, so a rerun injects the same faults.
* tool costs (`ToolCost`): each well-formed call adds its tool's cost to the step's cost, which
  the run's `RewardSpec` weighs (`reward.cost`) like any cost the environment reports.
* loop detection (`LoopDetector`): the same canonical action (tool and arguments, or parse error
  code, or for free text the whitespace-normalised text) in the same anchor state for the `k`-th
  time within the last `window` steps truncates the episode with `loop=True`; calls that failed
  with an injected fault do not count.

`guard(env, ...)` attaches the settings to a host environment (they enter its fingerprint,
`rollout.versions.env_version`); the rollout loop (`rollout/collect.py`) makes one `GuardedRows`
per batch. A faulted step's `StepResult.info` holds `fault` (the `ErrorCode`), a looping one
`loop: True`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Mapping, Sequence

import numpy as np

from longhorizon.envs.host import HostEnvironment, StepResult, parse_call
from longhorizon.envs.types import ERROR_MESSAGES, ErrorCode
from longhorizon.envs.wrappers import FAULT_KINDS, tool_fault_rates

__all__ = ["HostGuards", "guard", "guards_of", "GuardedRows"]

_ANY = ""  # the one "tool" of an environment without tool schemas: every action


@dataclasses.dataclass(frozen=True)
class HostGuards:
  """The settings of the three checks (see the module docstring); all off by default."""
  faults: tuple = ()  # ((tool or "", ((kind, rate), ...)), ...): `tool_fault_rates`' table
  env_error_kinds: tuple = ("unavailable",)
  tool_costs: tuple = ()  # ((tool, cost), ...)
  loop_k: int = 0  # 0 = no loop detection
  loop_window: int = 32

  @property
  def active(self) -> bool:
    return bool(self.faults or self.tool_costs or self.loop_k)


def _tool_names(env: HostEnvironment) -> list[str]:
  return [t.get("function", t)["name"] for t in env.tools] if env.tools else [_ANY]


def guard(env: HostEnvironment, faults: Mapping | None = None,
          env_error_kinds: Sequence[str] = ("unavailable",), tool_costs: Mapping | None = None,
          loop_k: int = 0, loop_window: int = 32) -> HostEnvironment:
  """Attaches the checks to `env` (returns it). `faults` as `FaultInjection`'s rates (kind ->
  rate for every tool, or tool -> {kind: rate}; an environment without tool schemas takes the
  shared rates only), `tool_costs` tool -> cost, `loop_k` as `LoopDetector`'s `k` (0 = off).
  Raises ValueError naming an unknown kind or tool, a negative rate or rates summing past 1."""
  names = _tool_names(env)
  faults = {k: v for k, v in dict(faults or {}).items()
            if isinstance(v, Mapping) or float(v) > 0}
  unknown = sorted(set(env_error_kinds) - set(FAULT_KINDS))
  if unknown:
    raise ValueError(f"env_error_kinds: unknown fault kind(s) {unknown}; known: "
                     f"{sorted(FAULT_KINDS)}.")
  table = tool_fault_rates(faults, names) if faults else {}
  costs = dict(tool_costs or {})
  if env.tools is None and costs:
    raise ValueError(f"tool_costs: {type(env).__name__} has no tools (free-text actions).")
  if set(costs) - set(names):
    raise ValueError(f"tool_costs: unknown tool(s) {sorted(set(costs) - set(names))}; tools are "
                     f"{names}.")
  if loop_k and (loop_k < 2 or loop_window < loop_k - 1):
    raise ValueError(f"loop detection needs k >= 2 and window >= k - 1, got k={loop_k}, "
                     f"window={loop_window}.")
  env._guards = HostGuards(
      faults=tuple((n, tuple(sorted(t.items()))) for n, t in table.items() if t),
      env_error_kinds=tuple(env_error_kinds), tool_costs=tuple(sorted(costs.items())),
      loop_k=int(loop_k), loop_window=int(loop_window))
  return env


def guards_of(env: HostEnvironment) -> HostGuards | None:
  """The settings `guard` attached to `env`, or None when none is on."""
  guards = getattr(env, "_guards", None)
  return guards if guards is not None and guards.active else None


class GuardedRows:
  """The checks for one batch of rows: `before` answers a faulted call in the environment's
  place, `after` adds the tool cost and the loop stop to the environment's answer. `steps`: each
  row's steps so far (a row forked from a saved state; its loop check starts afresh)."""

  def __init__(self, env: HostEnvironment, guards: HostGuards, seeds: Sequence[int],
               style: str = "tool_call", steps: Sequence[int] | None = None):
    self.env, self.guards, self.style = env, guards, style
    self.seeds = [int(s) for s in seeds]
    self.steps = [0] * len(self.seeds) if steps is None else [int(t) for t in steps]
    self.rates = {tool: dict(kinds) for tool, kinds in guards.faults}
    self.costs = dict(guards.tool_costs)
    self.seen = [collections.deque(maxlen=guards.loop_window) for _ in self.seeds]
    self.calls: dict[int, tuple[str | None, str]] = {}  # row -> its current call, parsed once

  def _call(self, text: str) -> tuple[str | None, str]:
    """`(tool name or None when not well-formed, canonical action)`."""
    if self.env.tools is None:
      words = " ".join(str(text).split())
      return (_ANY if words else None), words
    call = parse_call(text, self.env.tools, self.style)
    if not call.ok:
      return None, f"error {call.error}"
    return call.name, json.dumps([call.name, call.arguments], sort_keys=True, default=str)

  def before(self, r: int, text: str) -> StepResult | None:
    """Row `r`'s answer when its call `text` faults (the call is not made), else None."""
    step, self.steps[r] = self.steps[r], self.steps[r] + 1
    tool, _ = self.calls[r] = self._call(text)
    rates = self.rates.get(tool) if tool is not None else None
    if not rates:
      return None
    u = np.random.default_rng([self.seeds[r], step, 0xFA17]).random()
    edge = 0.0
    for kind, rate in sorted(rates.items(), key=lambda kv: FAULT_KINDS[kv[0]]):
      edge += rate
      if u < edge:
        code = FAULT_KINDS[kind]
        stop = kind in self.guards.env_error_kinds
        return StepResult(f"error : {ERROR_MESSAGES[ErrorCode(code)]}", truncated=stop,
                          env_error=stop, info={"fault": int(code)})
    return None

  def after(self, r: int, text: str, anchor: int, result: StepResult) -> StepResult:
    """The answer `result` to row `r`'s call `text` made in the state of anchor `anchor`, with the
    call's tool cost and, on the `loop_k`-th repeat, the loop stop."""
    faulted = bool(result.info.get("fault"))
    tool, canonical = self.calls.pop(r, None) or self._call(text)
    if tool is not None and not faulted and not result.env_error and self.costs.get(tool):
      result = dataclasses.replace(result, cost=result.cost + float(self.costs[tool]))
    if self.guards.loop_k and not faulted:
      signature = (int(anchor), canonical)
      repeats = sum(s == signature for s in self.seen[r]) + 1
      self.seen[r].append(signature)
      ended = result.terminated or result.truncated or result.violation or result.env_error
      if repeats >= self.guards.loop_k and not ended:
        result = dataclasses.replace(result, truncated=True, info={**result.info, "loop": True})
    return result
