"""Preference optimisation on multi-turn trajectories: the policy-token mask, preference pairs from
groups and branch points, and the DPO loss.

DPO (Rafailov et al. 2023) on whole trajectories: for a pair `tau+ > tau-` of episodes of one task,

    loss = -log sigmoid(beta * ((log pi(tau+) - log ref(tau+)) - (log pi(tau-) - log ref(tau-))))

where `log pi(tau)` sums the log-probs of the policy's own sampled tokens only (`policy_mask`: the
actions; prompt and observation tokens are the environment's and are masked). With
`label_smoothing = eps` the loss is conservative DPO's
`-(1 - eps) log sigmoid(m) - eps log sigmoid(-m)` (Mitchell 2023), for noisy preference labels.

Step-level DPO: a pair whose two rows are token-identical up to the first action where they differ
(sibling branches forked from one saved state, or two rollouts of the task whose first difference
is a sampled token, not an observation), scored on that action's tokens alone; the preference is
the two continuations' returns, a Monte-Carlo label of the two actions in the shared state. The
shared prefix would cancel in the DPO margin anyway (same tokens, same positions, same log-probs);
what step level drops is everything after the differing action.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

__all__ = ["PAIR_LEVELS", "Pairs", "policy_mask", "first_divergence", "preference_pairs",
           "pair_masks", "dpo_loss"]

PAIR_LEVELS = ("trajectory", "step")


class Pairs(NamedTuple):
  """`P` preference pairs of a batch's rows (host int arrays)."""
  chosen: np.ndarray  # [P] row of the preferred episode
  rejected: np.ndarray  # [P] row of the other one (same group, strictly lower score)
  step: np.ndarray  # [P] the step of the first action where the two differ (-1: none does)

  def __len__(self) -> int:
    return len(self.chosen)


def policy_mask(batch) -> np.ndarray:
  """`[B, L]` bool: every token the policy sampled in each row, including a branch row's copies of
  its parent's actions before `branch_step` (which `loss_mask` leaves to the parent). Recovery rows
  (parent < -1) are refused: their copied prefix comes from another batch."""
  loss_mask, turn = np.asarray(batch.loss_mask, bool), np.asarray(batch.turn)
  parent, branch_step = np.asarray(batch.parent), np.asarray(batch.branch_step)
  if (parent < -1).any():
    raise ValueError(f"policy_mask: rows {np.flatnonzero(parent < -1)[:5].tolist()} are recovery "
                     f"episodes (parent < -1), whose copied prefix is another batch's.")
  mask = loss_mask.copy()
  for i in np.flatnonzero(parent >= 0):  # parents come first: their masks are complete already
    mask[i] |= mask[parent[i]] & (turn[i] >= 0) & (turn[i] < branch_step[i])
  return mask


def first_divergence(batch, a: int, b: int, mask: np.ndarray | None = None) -> int:
  """The step at which rows `a` and `b` first take different actions from one shared state: the
  `turn` of the first token where they differ, when that token is a policy token in both rows
  (`policy_mask`) of the same step; -1 when they first differ in a prompt or observation token (no
  shared state), in padding only, or not at all."""
  mask = policy_mask(batch) if mask is None else mask
  tokens, live = np.asarray(batch.tokens), np.asarray(batch.attention_mask, bool)
  differ = (tokens[a] != tokens[b]) | (live[a] != live[b])
  if not differ.any():
    return -1
  k = int(np.argmax(differ))
  turn = np.asarray(batch.turn)
  if not (mask[a, k] and mask[b, k] and live[a, k] and live[b, k] and turn[a, k] == turn[b, k]):
    return -1
  return int(turn[a, k])


def preference_pairs(batch, *, level: str = "trajectory", min_gap: float = 0.0) -> Pairs:
  """Disjoint preference pairs within each `group` of `batch` (rollouts of one task), ranked by
  `score`; rows with an environment error never enter a pair.

  level="trajectory": the group's rows sorted by score (descending; ties by row), the i-th best
    paired with the i-th worst while their scores differ by more than `min_gap`.
  level="step": the pairs whose rows first differ in an action from one shared state
    (`first_divergence` >= 0) with scores differing by more than `min_gap`, chosen greedily by
    the latest such step first (the most shared prefix: the most specific credit), then the
    larger score gap, then row order; each row in at most one pair.
  Pairs are returned in group order, then in the order chosen.
  """
  if level not in PAIR_LEVELS:
    raise ValueError(f"level must be one of {PAIR_LEVELS}, got {level!r}.")
  score, group = np.asarray(batch.score, np.float64), np.asarray(batch.group)
  ok = ~np.asarray(batch.env_error, bool).any(-1)
  mask = policy_mask(batch) if level == "step" else None
  chosen, rejected, steps = [], [], []
  for g in dict.fromkeys(group.tolist()):
    rows = np.flatnonzero((group == g) & ok)
    if level == "trajectory":
      order = rows[np.lexsort((rows, -score[rows]))]
      for i in range(len(order) // 2):
        hi, lo = order[i], order[len(order) - 1 - i]
        if score[hi] - score[lo] > min_gap:
          chosen.append(hi), rejected.append(lo), steps.append(-1)
      continue
    candidates = []
    for x in rows:
      for y in rows:
        if score[x] - score[y] > min_gap:
          d = first_divergence(batch, x, y, mask)
          if d >= 0:
            candidates.append((-d, -(score[x] - score[y]), min(x, y), max(x, y), x, y, d))
    used = set()
    for *_, x, y, d in sorted(candidates):
      if x not in used and y not in used:
        used.update((x, y))
        chosen.append(x), rejected.append(y), steps.append(d)
  as_int = lambda v: np.asarray(v, np.int64)
  return Pairs(as_int(chosen), as_int(rejected), as_int(steps))


def pair_masks(batch, pairs: Pairs, level: str) -> tuple[np.ndarray, np.ndarray]:
  """`([P, L], [P, L])` float32 masks of the chosen and rejected rows' scored tokens: every policy
  token (`policy_mask`) for trajectory pairs; for step pairs only the policy tokens of step
  `pairs.step` (the differing action)."""
  mask = policy_mask(batch).astype(np.float32)
  turn = np.asarray(batch.turn)
  out = []
  for rows in (pairs.chosen, pairs.rejected):
    m = mask[rows]
    if level == "step":
      m = m * (turn[rows] == pairs.step[:, None])
    out.append(m)
  return out[0], out[1]


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float,
             label_smoothing: float = 0.0):
  """`(loss [P], margin [P])`: the (conservative) DPO loss of each pair from the summed log-probs of
  its chosen and rejected sequences under the policy and the reference; `margin` is
  `beta * ((pi+ - ref+) - (pi- - ref-))`, the implicit reward difference."""
  margin = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
  loss = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(margin)
          - label_smoothing * jax.nn.log_sigmoid(-margin))
  return loss, margin

