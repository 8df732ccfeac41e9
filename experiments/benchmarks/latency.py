"""Simulated tool latency and mode parsing of `async_vs_sync.py`, in a module without absl flags
so tests can import them beside other benchmark scripts (flags are process-global)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Latency:
  """Simulated tool latency of a batched env step: the slowest of the rows' calls."""
  kind: str = "lognormal"
  ms: float = 40.0
  shape: float = 1.0
  seed: int = 0

  def draw(self, index: int, step: int, calls: int) -> float:
    """Seconds the batch `index` waits at env step `step` with `calls` rows calling."""
    if self.kind == "none" or calls == 0:
      return 0.0
    rng = np.random.default_rng([self.seed, index, step])
    if self.kind == "lognormal":
      per_call = rng.lognormal(np.log(self.ms), self.shape, calls)
    else:
      per_call = self.ms * (1.0 + rng.pareto(self.shape, calls))
    return float(per_call.max()) / 1000.0

  def hook(self, index: int):
    """Batch `index`'s `on_env_step` for `rollout.collect`: sleeps its draw."""
    return lambda t, active: time.sleep(self.draw(index, t, int(np.sum(active))))


def parse_mode(mode: str) -> tuple[str, int, int]:
  """`'sync'` -> ('sync', 1, 0); `'async:A:S'` -> ('async', A, S); `'partial:A:S'` and
  `'partial-reprefill:A:S'`: async with partial rollouts across updates (the KV cache kept, or
  recomputed at a version switch) -> ('partial', A, S) / ('partial-reprefill', A, S)."""
  parts = mode.split(":")
  if parts == ["sync"]:
    return "sync", 1, 0
  kinds = ("async", "partial", "partial-reprefill")
  if len(parts) == 3 and parts[0] in kinds and parts[1].isdigit() and parts[2].isdigit():
    if int(parts[1]) < 1:
      raise ValueError(f"--modes: {mode!r} needs at least one actor.")
    return parts[0], int(parts[1]), int(parts[2])
  raise ValueError(f"--modes: {mode!r} is neither 'sync' nor 'KIND:ACTORS:MAX_STALENESS' with KIND "
                   f"one of {kinds}.")
