"""Recovery tasks: episodes that start just after a failed episode's first error.

A long episode that goes wrong early gives the policy little practice at getting back on track:
most of its later states are ones a good policy never reaches. A recovery task restarts from the
state right after a failed episode's first error (ScalingInter-RL's and the essay's "first-turn
errors"): `collect` with `RolloutConfig.recovery_from` set keeps, for each failed root episode whose
first error did not end it, its saved environment state before the next step and its token prefix
up to that step (`RecoveryStarts`); a later update (`collect_recovery`) samples `G` continuations
of each kept start with the then current policy, as one group, prefilling the prefix afresh (the
old KV cache was computed by old parameters). The continuations hold the prefix as copies with
loss_mask 0 and `parent = RECOVERY`, `branch_step` = the step they start at.

The first error is, by `recovery_from`:
  * `first_divergence`: the first action that differs from the oracle's (needs an oracle);
  * `after_error`: the first invalid or forbidden action (any environment).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.rollout.buffer import EpisodeBuffer

__all__ = ["RECOVERY_FROM", "RecoveryPool", "RecoveryStarts", "first_error_steps",
           "recovery_starts"]

RECOVERY_FROM = ("first_divergence", "after_error")


@dataclasses.dataclass
class RecoveryStarts:
  """`M` saved starts: where `M` failed episodes stood just after their first error."""
  buffer: EpisodeBuffer  # [M]: each episode's tokens and step records before `steps`
  steps: np.ndarray  # [M] int64 the step each start takes next
  states: Any  # JAX environments: the state pytree ([M, ...] leaves); host: pool sources
  milestones: np.ndarray  # [M, num_milestones] bool reached before `steps`
  env_seed: np.ndarray  # [M] uint32 the source episodes' environment seeds
  source_group: np.ndarray  # [M] int32 the source episodes' groups
  source_version: np.ndarray  # [M] int32 the policy versions that sampled the source episodes
  source_row: np.ndarray  # [M] int64 the source episodes' rows in their collect's root batch

  def __len__(self) -> int:
    return len(self.steps)

  def take(self, rows) -> "RecoveryStarts":
    """The starts `rows` (indices; repeats allowed)."""
    rows = np.asarray(rows, np.int64)
    if isinstance(self.states, list):
      states = [self.states[r] for r in rows]
    else:
      states = jax.tree.map(lambda x: x[jnp.asarray(rows)], self.states)
    return RecoveryStarts(buffer=self.buffer.take(rows), steps=self.steps[rows], states=states,
                          milestones=self.milestones[rows], env_seed=self.env_seed[rows],
                          source_group=self.source_group[rows],
                          source_version=self.source_version[rows],
                          source_row=self.source_row[rows])

  @staticmethod
  def concat(parts: list["RecoveryStarts"]) -> "RecoveryStarts":
    """One `RecoveryStarts` of the non-empty `parts` in order (at least one); a single non-empty
    part is returned as is. The buffers are joined by `EpisodeBuffer.concat`, which raises a
    ValueError if they are not compatible (context length, step slots, milestones, ...)."""
    parts = [p for p in parts if len(p)]
    if not parts:
      raise ValueError("RecoveryStarts.concat needs at least one non-empty part.")
    if len(parts) == 1:
      return parts[0]
    cat = lambda *xs: np.concatenate([np.asarray(x) for x in xs])
    first = parts[0]
    if isinstance(first.states, list):
      states = [s for p in parts for s in p.states]
    else:
      states = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[p.states for p in parts])
    buffer = EpisodeBuffer.concat([p.buffer for p in parts])
    return RecoveryStarts(buffer=buffer, steps=cat(*[p.steps for p in parts]), states=states,
                          milestones=cat(*[p.milestones for p in parts]),
                          env_seed=cat(*[p.env_seed for p in parts]),
                          source_group=cat(*[p.source_group for p in parts]),
                          source_version=cat(*[p.source_version for p in parts]),
                          source_row=cat(*[p.source_row for p in parts]))


def first_error_steps(batch, buffer, how: str) -> np.ndarray:
  """`[B]` int64 each row's first error step by `how` (`RECOVERY_FROM`), -1 for a row without."""
  if how == "first_divergence":
    error = np.asarray(batch.oracle_match) == 0
  elif how == "after_error":
    error = buffer.invalid | buffer.unauthorized
  else:
    raise ValueError(f"recovery_from must be one of {RECOVERY_FROM}, got {how!r}.")
  return np.where(error.any(-1), np.argmax(error, -1), -1).astype(np.int64)


def recovery_starts(batch, buffer, rows, how: str, reached) -> RecoveryStarts:
  """The starts of `batch`'s failed episodes (not environment errors) whose first error (by `how`)
  was not their last step: each one's state and prefix before the step after that error.
  `buffer` and `rows` are the collect's (rows saving their states); `reached(buffer)` gives the
  `[B, M]` milestones a buffer's rows hold."""
  first = first_error_steps(batch, buffer, how)
  failed = ~np.asarray(batch.success) & ~np.asarray(batch.env_error).any(-1)
  ok = failed & (first >= 0) & (first + 1 < np.asarray(batch.num_steps))
  parents = np.flatnonzero(ok)
  steps = first[parents] + 1
  prefix = buffer.fork(parents, steps)
  states = rows.saved(parents, steps) if len(parents) else []
  return RecoveryStarts(buffer=prefix, steps=steps, states=states, milestones=reached(prefix),
                        env_seed=np.asarray(batch.env_seed)[parents],
                        source_group=np.asarray(batch.group)[parents],
                        source_version=np.asarray(batch.policy_version)[parents],
                        source_row=parents)


class RecoveryPool:
  """The newest `capacity` recovery starts, handed out newest first, each once."""

  def __init__(self, capacity: int):
    self.capacity, self.starts = int(capacity), None

  def __len__(self) -> int:
    return 0 if self.starts is None else len(self.starts)

  def add(self, starts: RecoveryStarts | None) -> None:
    """Keeps `starts` (the oldest kept ones are dropped past `capacity`)."""
    if starts is None or not len(starts):
      return
    both = starts if self.starts is None else RecoveryStarts.concat([self.starts, starts])
    self.starts = both.take(np.arange(max(len(both) - self.capacity, 0), len(both)))

  def pop(self, n: int) -> RecoveryStarts | None:
    """The newest `min(n, len(self))` starts, newest first (None if there are none)."""
    n, m = min(int(n), len(self)), len(self)
    if n <= 0:
      return None
    out = self.starts.take(np.arange(m - 1, m - n - 1, -1))
    self.starts = self.starts.take(np.arange(m - n)) if m > n else None
    return out
