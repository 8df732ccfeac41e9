"""Online RL that replays whole task groups from the run's trajectory store.

With `config.store.replay_groups = n > 0` (and `config.store.enabled`), every synchronous RL update
trains on its freshly sampled batch plus `n` task groups drawn from the episodes the run stored at
earlier updates (`<workdir>/trajectories/`, `rollout/store.py`):

- **Whole groups.** Group estimators (GRPO, RLOO, ...) score an episode against the other rollouts
  of its task, so a replayed episode comes with its group: the rows of one stored file sharing a
  `group` label. A group is eligible when it is complete (`rollout.group_size` rows: `store.keep`
  may have dropped some at append), its scores differ (a group of equal scores has advantage 0 and
  would teach nothing) and it was stored at an earlier update (`stored update <= update`; the
  store numbers the batch of loop update `u` as `u + 1`). Where one update was stored twice (a run
  killed after its append and before its checkpoint computes it again on resume), the newest file
  is the one replayed, so a resumed run replays what an uninterrupted one would.
- **Priority.** A group's weight is the mean of its episodes' `store.Priority` weights (failure,
  recency with `now` = the update, rarest milestone), and `n` groups are drawn without replacement
  with probability proportional to it, from `np.random.default_rng([seed, update, REPLAY_STREAM])`
  (deterministic, independent of the rollout's streams).
- **Off-policy correction.** A replayed token was sampled by an older policy; its stored behaviour
  log-prob is what the loss corrects against: the truncated importance weight
  `min(pi_proximal / mu, C)` of a proximal loss (`loss.tis_threshold > 0`) or the `tis` loss's
  own. The config refuses replay without one (`train/config.py`).
- **One update shape.** When fewer than `n` groups are eligible (the first updates), the missing
  groups are copies of the fresh batch's first group, in groups of their own, with row weight 0
  (the loss's mask is weighted by it, so they count in no sum and no mean), and the update
  compiles once.

Replayed rows get group labels above the fresh batch's, so the two never share group statistics.
Metrics (`replay/*`): groups drawn, eligible groups, replayed episodes' success and age in updates.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from longhorizon.core.episode import EpisodeBatch
from longhorizon.rollout.store import Priority, Rows, TrajectoryStore, priority_weights

__all__ = ["REPLAY_STREAM", "StoreReplay", "eligible_groups", "draw_groups"]

REPLAY_STREAM = 0x5E9  # the third word of the replay draw's seed (see the module docstring)


def eligible_groups(rows: Rows, group_size: int, update: int) -> list[np.ndarray]:
  """The replayable groups of `rows` (the module docstring's rule), each as its indices into
  `rows`, in store order of their first row."""
  if not len(rows):
    return []
  newest = {}  # stored update -> its newest file (files come in store order)
  for path, u in zip(rows.path, rows.update):
    newest[int(u)] = path
  keep = np.array([newest[int(u)] == p and u <= update for p, u in zip(rows.path, rows.update)])
  index = np.flatnonzero(keep)
  groups = {}
  for i in index:
    groups.setdefault((rows.path[i], int(rows.group[i])), []).append(i)
  out = []
  for members in groups.values():
    members = np.asarray(members, np.int64)
    scores = rows.score[members]
    if len(members) == group_size and scores.max() > scores.min():
      out.append(members)
  return out


def draw_groups(rows: Rows, n: int, rng: np.random.Generator, *, group_size: int, update: int,
                priority: Priority = Priority()) -> tuple[list[np.ndarray], int]:
  """Up to `n` eligible groups drawn without replacement with probability proportional to the mean
  priority weight of their episodes: `(groups, eligible count)`."""
  groups = eligible_groups(rows, group_size, update)
  if not groups:
    return [], 0
  w = priority_weights(rows, priority, now=update)
  group_w = np.array([w[g].mean() for g in groups])
  k = min(n, int((group_w > 0).sum()))
  if not k:
    return [], len(groups)
  drawn = rng.choice(len(groups), size=k, replace=False, p=group_w / group_w.sum())
  return [groups[i] for i in drawn], len(groups)


@dataclasses.dataclass
class StoreReplay:
  """Draws the replayed groups of each update from the store at `path` (module docstring)."""
  path: str
  groups: int
  group_size: int
  context_length: int
  max_steps: int
  seed: int
  priority: Priority = Priority()

  def __post_init__(self):
    self.store = TrajectoryStore(self.path)

  def extend(self, batch: EpisodeBatch, update: int):
    """`(rows, scale, metrics)`: the replayed rows for loop update `update` (`groups x group_size`
    rows, padding included), their `[R]` row scales (1 replayed, 0 padding) and the `replay/*`
    metrics. `batch` is the fresh batch (host arrays), whose first group pads."""
    rng = np.random.default_rng([self.seed, update, REPLAY_STREAM])
    rows = self.store.rows()  # empty before the first append
    drawn, eligible = draw_groups(rows, self.groups, rng, group_size=self.group_size,
                                  update=update, priority=self.priority)
    top = int(np.max(batch.group)) + 1
    host = jax.tree.map(np.asarray, batch)
    pad = jax.tree.map(lambda x: x[:self.group_size], host)  # the fresh batch's first group
    parts, scale, ages, success = [], [], [], []
    for i in range(self.groups):
      if i < len(drawn):
        part = self.store.load(rows.take(drawn[i]), context_length=self.context_length,
                               max_steps=self.max_steps)
        part = _like(part, host)
        ages.append(update + 1 - rows.update[drawn[i]])  # stored as update + 1
        success.append(np.asarray(part.success))
        scale.append(np.ones((self.group_size,), np.float32))
      else:
        part = pad
        scale.append(np.zeros((self.group_size,), np.float32))
      parts.append(part.replace(group=np.full((self.group_size,), top + i, np.int32)))
    rows_out = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
    metrics = {"replay/groups": float(len(drawn)), "replay/eligible_groups": float(eligible),
               "replay/success_rate": float(np.mean(np.concatenate(success))) if success else 0.0,
               "replay/age_mean": float(np.mean(np.concatenate(ages))) if ages else 0.0}
    return rows_out, np.concatenate(scale), metrics


def _like(part: EpisodeBatch, fresh: EpisodeBatch) -> EpisodeBatch:
  """`part` (read from the store) with the fresh batch's reward components and dtypes, so the two
  concatenate into one batch of the update's layout."""
  components = {n: np.asarray(part.reward_components.get(
      n, np.zeros((part.batch_size,), np.float32)), np.float32) for n in fresh.reward_components}
  part = part.replace(reward_components=components)
  return jax.tree.map(lambda x, f: np.asarray(x).astype(np.asarray(f).dtype, copy=False), part,
                      fresh)
