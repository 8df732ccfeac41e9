"""Preference pairs, masks and the DPO loss (`core/preference.py`): hand-checked cases and NumPy
references."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.core import episode
from longhorizon.core import preference


def _np_dpo(pc, pr, rc, rr, beta, eps):
  """Obviously correct NumPy DPO loss (log sigmoid written out)."""
  m = beta * ((pc - rc) - (pr - rr))
  log_sig = lambda x: -np.log1p(np.exp(-x))
  return -(1 - eps) * log_sig(m) - eps * log_sig(-m), m


def test_dpo_loss_hand_checked():
  # margin = 1 * ((-1 + 1.5) - (-2 + 1.5)) = 1: loss = log(1 + e^-1)
  loss, margin = preference.dpo_loss(jnp.array([-1.0]), jnp.array([-2.0]), jnp.array([-1.5]),
                                     jnp.array([-1.5]), beta=1.0)
  assert float(margin[0]) == pytest.approx(1.0)
  assert float(loss[0]) == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)  # 0.31326
  # conservative DPO, eps = 0.1: 0.9 log(1 + e^-1) + 0.1 log(1 + e)
  loss, _ = preference.dpo_loss(jnp.array([-1.0]), jnp.array([-2.0]), jnp.array([-1.5]),
                                jnp.array([-1.5]), beta=1.0, label_smoothing=0.1)
  assert float(loss[0]) == pytest.approx(0.9 * 0.3132617 + 0.1 * 1.3132617, abs=1e-6)
  # policy == reference: margin 0, loss log 2 whatever beta
  loss, margin = preference.dpo_loss(jnp.array([-3.0]), jnp.array([-0.5]), jnp.array([-3.0]),
                                     jnp.array([-0.5]), beta=0.3)
  assert float(margin[0]) == 0.0 and float(loss[0]) == pytest.approx(math.log(2.0), abs=1e-7)


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (2.0, 0.0), (0.5, 0.25)])
def test_dpo_loss_matches_numpy_on_masked_sequences(beta, eps):
  rng = np.random.default_rng(0)
  p, length = 7, 12
  logp = -rng.exponential(size=(4, p, length)).astype(np.float32)  # policy c/r, reference c/r
  mask = rng.random((4, p, length)) < 0.5
  sums = (logp * mask).sum(-1)
  want_loss, want_margin = _np_dpo(*sums.astype(np.float64), beta, eps)
  loss, margin = preference.dpo_loss(*jnp.asarray(sums), beta=beta, label_smoothing=eps)
  np.testing.assert_allclose(np.asarray(margin), want_margin, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(loss), want_loss, rtol=1e-5, atol=1e-6)


# Rows of the hand-built batch (tokens; P prompt, a action, o observation; turn in brackets):
#   0: P P a5[0] o7[0] a8[1]          score 1   (root)
#   1: P P a5[0] o7[0] a9[1]          score 0   differs from 0 first at its step-1 action
#   2: P P a6[0] o7[0] a8[1]          score 0   differs from 0 first at its step-0 action
#   3: P P a5[0] o70[0] a8[1]         score 0.5 differs from 0 first in an observation
#   4: copy of row 0 before step 1 (loss mask 0), a10[1]: a branch of row 0 at step 1, score 0.5
_ROWS = [([1, 2, 5, 7, 8], 1.0), ([1, 2, 5, 7, 9], 0.0), ([1, 2, 6, 7, 8], 0.0),
         ([1, 2, 5, 70, 8], 0.5), ([1, 2, 5, 7, 10], 0.5)]
_TURN = [-1, -1, 0, 0, 1]
_POLICY = [0, 0, 1, 0, 1]


def _batch(groups=(0, 0, 0, 0, 0)):
  b = episode.empty(len(_ROWS), 6, 3)
  for i, (tokens, score) in enumerate(_ROWS):
    b.tokens[i, :5] = tokens
    b.attention_mask[i, :5] = True
    b.positions[i, :5] = np.arange(5)
    b.turn[i, :5] = _TURN
    b.loss_mask[i, :5] = _POLICY
    b.score[i] = score
    b.group[i] = groups[i]
    b.num_steps[i] = 2
    b.step_mask[i, :2] = True
  b.loss_mask[4, 2] = False  # the branch's copy of its parent's step-0 action
  b.parent[4], b.branch_step[4] = 0, 1
  return b.validate()


def test_policy_mask_restores_a_branch_rows_copied_actions():
  b = _batch()
  mask = preference.policy_mask(b)
  np.testing.assert_array_equal(mask[4, :5], [0, 0, 1, 0, 1])
  np.testing.assert_array_equal(mask[:4], np.asarray(b.loss_mask[:4]))
  with pytest.raises(ValueError, match="recovery"):
    preference.policy_mask(b.replace(parent=np.array([-1, -1, -1, -1, -2], np.int32)))


def test_first_divergence_is_an_action_from_a_shared_state():
  b = _batch()
  assert preference.first_divergence(b, 0, 1) == 1
  assert preference.first_divergence(b, 0, 2) == 0
  assert preference.first_divergence(b, 0, 3) == -1  # the observations differ first
  assert preference.first_divergence(b, 0, 4) == 1  # a branch and its parent
  assert preference.first_divergence(b, 0, 0) == -1  # identical rows


def test_trajectory_pairs_hand_checked():
  # scores 1, 0, 0, 0.5, 0.5: sorted (ties by row) 0, 3, 4, 1, 2 -> (0, 2), (3, 1)
  pairs = preference.preference_pairs(_batch())
  np.testing.assert_array_equal(pairs.chosen, [0, 3])
  np.testing.assert_array_equal(pairs.rejected, [2, 1])
  np.testing.assert_array_equal(pairs.step, [-1, -1])
  # min_gap 0.5 drops (3, 1) (a gap of exactly 0.5) and keeps (0, 2)
  pairs = preference.preference_pairs(_batch(), min_gap=0.5)
  np.testing.assert_array_equal(pairs.chosen, [0])
  # groups are kept apart: rows 0..2 and 3..4
  pairs = preference.preference_pairs(_batch(groups=(0, 0, 0, 1, 1)))
  assert list(zip(pairs.chosen, pairs.rejected)) == [(0, 2)]  # 3 and 4 tie


def test_step_pairs_prefer_the_latest_shared_state():
  # candidates (chosen, rejected, step, gap): (0,1,1,1) (0,4,1,.5) (4,1,1,.5) (0,2,0,1) (3,2,0,.5)
  # (4,2,0,.5); none of (0,3) or (3,1), which first differ in an observation. Greedy by latest
  # step, then gap, then rows: (0, 1) at step 1, then (3, 2) at step 0; 4 is left unpaired.
  pairs = preference.preference_pairs(_batch(), level="step")
  assert list(zip(pairs.chosen, pairs.rejected, pairs.step)) == [(0, 1, 1), (3, 2, 0)]
  chosen, rejected = preference.pair_masks(_batch(), pairs, "step")
  np.testing.assert_array_equal(chosen[:, :5], [[0, 0, 0, 0, 1], [0, 0, 1, 0, 0]])
  np.testing.assert_array_equal(rejected[:, :5], [[0, 0, 0, 0, 1], [0, 0, 1, 0, 0]])
  chosen, _ = preference.pair_masks(_batch(), pairs, "trajectory")
  np.testing.assert_array_equal(chosen[:, :5], [[0, 0, 1, 0, 1], [0, 0, 1, 0, 1]])


def test_env_error_rows_never_pair():
  b = _batch()
  env_error = np.zeros_like(b.env_error)
  env_error[0, 1] = True
  pairs = preference.preference_pairs(b.replace(env_error=env_error))
  assert 0 not in set(pairs.chosen) | set(pairs.rejected)


def test_random_groups_pairs_are_valid_and_disjoint():
  """On random groups: every pair in one group, chosen strictly better, rows used once, and as
  many trajectory pairs as a brute-force count of the sorted halves."""
  rng = np.random.default_rng(1)
  b = episode.empty(40, 4, 2)
  group = rng.integers(0, 6, 40).astype(np.int32)
  score = rng.integers(0, 3, 40).astype(np.float32)
  b = b.replace(group=group, score=score)
  pairs = preference.preference_pairs(b)
  rows = np.concatenate([pairs.chosen, pairs.rejected])
  assert len(set(rows.tolist())) == len(rows)
  assert (group[pairs.chosen] == group[pairs.rejected]).all()
  assert (score[pairs.chosen] > score[pairs.rejected]).all()
  want = 0
  for g in np.unique(group):
    s = np.sort(score[group == g])[::-1]
    want += sum(s[i] > s[len(s) - 1 - i] for i in range(len(s) // 2))
  assert len(pairs) == want
