"""Tests of `longhorizon.core.advantages`.

Three kinds (STYLE.md point 10): tiny cases worked out by hand, agreement with slow NumPy references
written here (plain loops over rows, time steps and dict-based groups, following the conventions of
DESIGN.md "Advantage estimators"), and no retracing for repeated calls of the same shapes. Plus
properties that pin down the conventions, masking, input types and shape errors.
"""

import functools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.core import advantages as adv

RTOL = ATOL = 1e-5
SEEDS = [0, 1, 2, 3]
# Random cases share these shapes so that each kernel compiles once per static configuration.
B, T = 8, 32  # token kernels
N = 48  # flat score lists
NT, NS = 16, 6  # GiGPO trajectories, steps
SHAPE_ERRORS = (AssertionError, ValueError, TypeError)
SQRT2 = math.sqrt(2.0)


def _close(got, want, rtol=RTOL, atol=ATOL):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol,
                             atol=atol)


# ----------------------------------------------------------------------------------------------------
# Slow NumPy references (loops and dicts, float64).


def ref_discounted_returns(rewards, mask, gamma):
  rewards = np.asarray(rewards, np.float64)
  num_rows, length = rewards.shape
  gamma = np.broadcast_to(np.asarray(gamma, np.float64), (num_rows,))
  out = np.zeros((num_rows, length))
  for b in range(num_rows):
    running = 0.0
    for t in reversed(range(length)):
      if mask[b][t]:
        running = rewards[b, t] + gamma[b] * running
        out[b, t] = running
  return out


def ref_gae(rewards, values, mask, gamma, lam):
  rewards = np.asarray(rewards, np.float64)
  values = np.asarray(values, np.float64)
  num_rows, length = rewards.shape
  gamma = np.broadcast_to(np.asarray(gamma, np.float64), (num_rows,))
  lam = np.broadcast_to(np.asarray(lam, np.float64), (num_rows,))
  advantages = np.zeros((num_rows, length))
  returns = np.zeros((num_rows, length))
  for b in range(num_rows):
    next_value, next_adv = 0.0, 0.0  # no bootstrap after the last policy token
    for t in reversed(range(length)):
      if not mask[b][t]:
        continue  # observation / prompt / padding: skipped, carries next_value and next_adv
      delta = rewards[b, t] + gamma[b] * next_value - values[b, t]
      a = delta + gamma[b] * lam[b] * next_adv
      advantages[b, t] = a
      returns[b, t] = a + values[b, t]
      next_value, next_adv = values[b, t], a
  return advantages, returns


def ref_whiten(x, mask, eps=1e-8):
  x = np.asarray(x, np.float64)
  picked = [x[idx] for idx in np.ndindex(x.shape) if mask[idx]]
  out = np.zeros(x.shape)
  if not picked:
    return out
  n = len(picked)
  mean = sum(picked) / n
  var = sum((p - mean)**2 for p in picked) / max(n - 1, 1)
  for idx in np.ndindex(x.shape):
    if mask[idx]:
      out[idx] = (x[idx] - mean) / math.sqrt(var + eps)
  return out


def _members(groups, valid):
  """dict label -> list of indices of the valid elements with that label."""
  members = {}
  for i, g in enumerate(groups):
    if valid is None or valid[i]:
      members.setdefault(int(g), []).append(i)
  return members


def ref_group_normalise(scores, groups, valid=None, normalize_std=True, eps=1e-6):
  scores = np.asarray(scores, np.float64)
  out = np.zeros(len(scores))
  for idx in _members(groups, valid).values():
    n = len(idx)
    if n < 2:
      continue  # a group of one gets 0
    vals = [scores[i] for i in idx]
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean)**2 for v in vals) / (n - 1))
    for i in idx:
      out[i] = (scores[i] - mean) / (std + eps) if normalize_std else scores[i] - mean
  return out


def ref_rloo(scores, groups, valid=None):
  scores = np.asarray(scores, np.float64)
  out = np.zeros(len(scores))
  for idx in _members(groups, valid).values():
    for i in idx:
      others = [scores[j] for j in idx if j != i]
      if others:
        out[i] = scores[i] - sum(others) / len(others)
  return out


def ref_reinforce_pp_baseline(rewards, mask, groups, gamma, valid=None):
  rewards = np.asarray(rewards, np.float64)
  num_rows, length = rewards.shape
  episode = [sum(rewards[b, t] for t in range(length) if mask[b][t]) for b in range(num_rows)]
  baseline = {}
  for label, idx in _members(groups, valid).items():
    baseline[label] = sum(episode[i] for i in idx) / len(idx)
  shaped = rewards.copy()
  row_mask = np.zeros((num_rows, length), bool)
  for b in range(num_rows):
    if valid is not None and not valid[b]:
      continue
    policy = [t for t in range(length) if mask[b][t]]
    for t in policy:
      row_mask[b, t] = True
    if policy:
      shaped[b, policy[-1]] -= baseline[int(groups[b])]
  returns = ref_discounted_returns(shaped, row_mask, gamma)
  return ref_whiten(returns, row_mask), returns


def ref_gigpo(episode_returns, step_rewards, step_mask, groups, anchors, gamma, step_weight,
              normalize_std, eps=1e-6, valid=None):
  num_traj, num_steps = np.shape(step_rewards)
  episode_adv = ref_group_normalise(episode_returns, groups, valid, normalize_std, eps)
  live = [[bool(step_mask[i][s]) and (valid is None or bool(valid[i])) for s in range(num_steps)]
          for i in range(num_traj)]
  step_returns = ref_discounted_returns(step_rewards, live, gamma)
  step_groups = {}
  for i in range(num_traj):
    for s in range(num_steps):
      if live[i][s]:
        step_groups.setdefault((int(groups[i]), int(anchors[i][s])), []).append((i, s))
  step_adv = np.zeros((num_traj, num_steps))
  for cells in step_groups.values():
    n = len(cells)
    if n < 2:
      continue
    vals = [step_returns[c] for c in cells]
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean)**2 for v in vals) / (n - 1))
    for c in cells:
      step_adv[c] = (step_returns[c] - mean) / (std + eps) if normalize_std else step_returns[c] - mean
  out = np.zeros((num_traj, num_steps))
  for i in range(num_traj):
    for s in range(num_steps):
      if live[i][s]:
        out[i, s] = episode_adv[i] + step_weight * step_adv[i, s]
  return out


def ref_broadcast_steps(step_values, turn):
  num_rows, length = np.shape(turn)
  num_steps = np.shape(step_values)[1]
  out = np.zeros((num_rows, length))
  for b in range(num_rows):
    for l in range(length):
      if 0 <= turn[b][l] < num_steps:
        out[b, l] = step_values[b][turn[b][l]]
  return out


def ref_place_step_rewards(step_rewards, turn, loss_mask):
  num_rows, length = np.shape(turn)
  num_steps = np.shape(step_rewards)[1]
  out = np.zeros((num_rows, length))
  for b in range(num_rows):
    for s in range(num_steps):
      policy = [l for l in range(length) if turn[b][l] == s and loss_mask[b][l]]
      if policy:
        out[b, policy[-1]] = step_rewards[b][s]
  return out


def _same_partition(ids, keys):
  """ids[i] == ids[j] iff keys[i] == keys[j], for all pairs."""
  ids, keys = list(ids), list(keys)
  for i in range(len(ids)):
    for j in range(len(ids)):
      if (ids[i] == ids[j]) != (keys[i] == keys[j]):
        return False
  return True


# ----------------------------------------------------------------------------------------------------
# Random cases.

SPECIAL_LABELS = [-7, 1000003, 2**31 - 1, -(2**31) + 1, 0]


def random_multi_turn_mask(rng, num_rows, length):
  """Rows of prompt, then policy spans separated by observation spans, then padding.

  Row 0 is completely empty, row 1 has an observation span in the middle; other rows vary in length.
  """
  mask = np.zeros((num_rows, length), np.int32)
  for b in range(1, num_rows):
    pos = int(rng.integers(0, 4))  # prompt
    while pos < length:
      span = int(rng.integers(1, 6))
      mask[b, pos:pos + span] = 1
      pos += span + int(rng.integers(1, 5))  # observation tokens between turns
      if rng.random() < 0.2:
        break  # padding to the end
  mask[1] = 0
  mask[1, 1:4] = 1
  mask[1, 7:9] = 1
  return mask


def random_groups(rng, n):
  """`[n]` int64 labels: group sizes 1..7 (at least one singleton), arbitrary non-contiguous, negative
  and large labels, members scattered (non-contiguous positions)."""
  sizes = [1]
  while sum(sizes) < n:
    sizes.append(int(rng.integers(1, 8)))
  sizes[-1] -= sum(sizes) - n
  sizes = [s for s in sizes if s > 0]
  pool = list(SPECIAL_LABELS) + [int(x) for x in rng.choice(np.arange(-5000, 5000), 64, replace=False)]
  pool = list(dict.fromkeys(pool))[:len(sizes)]
  labels = np.concatenate([np.full(s, lab, np.int64) for s, lab in zip(sizes, pool)])
  return rng.permutation(labels)


def random_scores(rng, groups):
  """Normal scores; about a third of the groups get identical scores (exact float32 values)."""
  scores = rng.normal(size=len(groups))
  for label in np.unique(groups):
    if rng.random() < 0.35:
      scores[groups == label] = rng.choice([0.0, 1.0, -0.5, 2.0])
  return scores.astype(np.float32)


def random_valid(rng, n):
  valid = (rng.random(n) > 0.25).astype(np.int32)
  valid[0] = 0
  return valid


# ----------------------------------------------------------------------------------------------------
# discounted_returns


def test_discounted_returns_by_hand():
  # gamma = 0.5, mask [1, 0, 1, 1]: G3 = 4; G2 = 2 + 0.5*4 = 4; t=1 skipped (reward 7 ignored) -> 0;
  # G0 = 1 + 0.5*G2 = 3. Second row has no valid position -> all 0.
  rewards = np.array([[1.0, 7.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
  mask = np.array([[1, 0, 1, 1], [0, 0, 0, 0]])
  got = adv.discounted_returns(rewards, mask, 0.5)
  _close(got, [[3.0, 0.0, 4.0, 4.0], [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("seed", SEEDS)
def test_discounted_returns_matches_reference(seed):
  rng = np.random.default_rng(seed)
  rewards = rng.normal(size=(B, T)).astype(np.float32)
  mask = random_multi_turn_mask(rng, B, T)
  gamma = rng.uniform(0.5, 1.0, size=B) if seed % 2 else float(rng.uniform(0.5, 1.0))
  got = np.asarray(adv.discounted_returns(rewards, mask, gamma))
  _close(got, ref_discounted_returns(rewards, mask, gamma))
  assert np.all(got[mask == 0] == 0.0)


# ----------------------------------------------------------------------------------------------------
# gae


def test_gae_by_hand():
  # gamma = lam = 0.5 (gamma*lam = 0.25); mask [1, 0, 1, 1]; position 1 (reward 5, value 9) is skipped.
  #   t=3: delta = 1 + 0.5*0 - 0.5 = 0.5             A3 = 0.5                   R3 = 0.5 + 0.5 = 1
  #   t=2: delta = 0 + 0.5*0.5 - 0.25 = 0            A2 = 0 + 0.25*0.5 = 0.125  R2 = 0.375
  #   t=0: delta = 0 + 0.5*0.25 - 1 = -0.875 (V_{t'} = V2, carried over t=1)
  #                                                  A0 = -0.875 + 0.25*0.125 = -0.84375
  #                                                  R0 = -0.84375 + 1 = 0.15625
  # Second row: empty mask -> zeros.
  rewards = np.array([[0.0, 5.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
  values = np.array([[1.0, 9.0, 0.25, 0.5], [1.0, 1.0, 1.0, 1.0]])
  mask = np.array([[1, 0, 1, 1], [0, 0, 0, 0]])
  advantages, returns = adv.gae(rewards, values, mask, gamma=0.5, lam=0.5)
  _close(advantages, [[-0.84375, 0.0, 0.125, 0.5], [0.0] * 4])
  _close(returns, [[0.15625, 0.0, 0.375, 1.0], [0.0] * 4])


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_reference(seed):
  rng = np.random.default_rng(seed)
  num_rows, length = B, T
  rewards = rng.normal(size=(num_rows, length)).astype(np.float32)
  values = rng.normal(size=(num_rows, length)).astype(np.float32)
  mask = random_multi_turn_mask(rng, num_rows, length)
  if seed % 2:  # per-row hyper-parameters
    gamma = rng.uniform(0.8, 1.0, num_rows).astype(np.float32)
    lam = rng.uniform(0.0, 1.0, num_rows).astype(np.float32)
  else:
    gamma, lam = float(rng.uniform(0.8, 1.0)), float(rng.uniform(0.0, 1.0))
  advantages, returns = adv.gae(rewards, values, mask, gamma=gamma, lam=lam)
  want_adv, want_ret = ref_gae(rewards, values, mask, gamma, lam)
  _close(advantages, want_adv)
  _close(returns, want_ret)
  assert np.all(np.asarray(advantages)[mask == 0] == 0.0)
  assert np.all(np.asarray(returns)[mask == 0] == 0.0)


def test_gae_lam_one_is_discounted_returns_minus_values(rng):
  rewards = rng.normal(size=(B, T)).astype(np.float32)
  values = rng.normal(size=(B, T)).astype(np.float32)
  mask = random_multi_turn_mask(rng, B, T)
  advantages, returns = adv.gae(rewards, values, mask, gamma=0.9, lam=1.0)
  mc = np.asarray(adv.discounted_returns(rewards, mask, 0.9))
  _close(advantages, np.where(mask == 1, mc - values, 0.0))
  _close(returns, mc)  # Monte-Carlo value targets


def test_gae_lam_zero_is_one_step_td_error():
  # lam = 0: A_t = r_t + gamma * V_{t'} - V_t, t' the next policy token (V after the last = 0).
  rewards = np.array([[1.0, 2.0, 3.0, 4.0, 5.0]])
  values = np.array([[0.5, 1.5, 2.5, 3.5, 4.5]])
  mask = np.array([[1, 0, 0, 1, 1]])
  advantages, _ = adv.gae(rewards, values, mask, gamma=0.5, lam=0.0)
  # t=4: 5 - 4.5 = 0.5; t=3: 4 + 0.5*4.5 - 3.5 = 2.75; t=0: 1 + 0.5*3.5 - 0.5 = 2.25.
  _close(advantages, [[2.25, 0.0, 0.0, 2.75, 0.5]])


def test_gae_observation_spans_are_transparent(rng):
  # Removing the mask-0 tokens of a row (compacting it) must not change the advantages of its policy
  # tokens: the discount counts policy tokens, not tokens.
  rewards = rng.normal(size=(B, T)).astype(np.float32)
  values = rng.normal(size=(B, T)).astype(np.float32)
  mask = random_multi_turn_mask(rng, B, T)
  advantages, returns = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8)
  dense_r, dense_v, dense_m = (np.zeros((B, T), np.float32) for _ in range(3))
  for b in range(B):  # policy tokens moved to the front of the row, padding after them
    keep = mask[b] == 1
    n = int(keep.sum())
    dense_r[b, :n], dense_v[b, :n], dense_m[b, :n] = rewards[b, keep], values[b, keep], 1
  dense_adv, dense_ret = adv.gae(dense_r, dense_v, dense_m, gamma=0.9, lam=0.8)
  for b in range(B):
    n = int(mask[b].sum())
    _close(np.asarray(advantages)[b, mask[b] == 1], np.asarray(dense_adv)[b, :n])
    _close(np.asarray(returns)[b, mask[b] == 1], np.asarray(dense_ret)[b, :n])


def test_gae_per_row_hyperparameters_equal_row_by_row_calls(rng):
  rewards = rng.normal(size=(3, 12)).astype(np.float32)
  values = rng.normal(size=(3, 12)).astype(np.float32)
  mask = random_multi_turn_mask(rng, 3, 12)
  mask[0, :5] = 1
  gammas, lams = np.array([0.5, 0.9, 1.0]), np.array([0.0, 0.7, 1.0])
  advantages, _ = adv.gae(rewards, values, mask, gamma=gammas, lam=lams)
  for b in range(3):
    row, _ = adv.gae(rewards[b:b + 1], values[b:b + 1], mask[b:b + 1], gamma=float(gammas[b]),
                     lam=float(lams[b]))
    _close(np.asarray(advantages)[b], np.asarray(row)[0])


# ----------------------------------------------------------------------------------------------------
# length_adaptive_gae


def _vapo_lam(length, alpha):
  return 0.0 if length == 0 else max(0.0, 1.0 - 1.0 / (alpha * length))


def test_length_adaptive_gae_by_hand():
  # alpha = 0.5, gamma = 1, values 0 on row 0.
  # Row 0: L = 4 -> lam = 1 - 1/(0.5*4) = 0.5; deltas [0, 0, 0, 1] -> A = [0.125, 0.25, 0.5, 1];
  #        critic_lam = 1 -> returns = Monte-Carlo = 1 everywhere.
  # Row 1: L = 1 -> lam = max(0, 1 - 1/0.5) = 0; single token t=2: delta = 1 - 0.5 = 0.5 = A;
  #        returns = 0.5 + 0.5 = 1.
  # Row 2: L = 0 -> zeros.
  rewards = np.array([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
  values = np.array([[0.0, 0.0, 0.0, 0.0], [3.0, 3.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
  mask = np.array([[1, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]])
  advantages, returns = adv.length_adaptive_gae(rewards, values, mask, gamma=1.0, alpha=0.5)
  _close(advantages, [[0.125, 0.25, 0.5, 1.0], [0.0, 0.0, 0.5, 0.0], [0.0] * 4])
  _close(returns, [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0], [0.0] * 4])


@pytest.mark.parametrize("seed", SEEDS)
def test_length_adaptive_gae_matches_reference(seed):
  rng = np.random.default_rng(seed)
  num_rows, length = B, T
  rewards = rng.normal(size=(num_rows, length)).astype(np.float32)
  values = rng.normal(size=(num_rows, length)).astype(np.float32)
  mask = random_multi_turn_mask(rng, num_rows, length)
  mask[2] = 0
  mask[2, 5] = 1  # L = 1: alpha * L < 1 -> lam clipped at 0
  alpha = float(rng.choice([0.05, 0.1, 0.5]))
  gamma = float(rng.uniform(0.9, 1.0))
  critic_lam = 1.0 if seed % 2 else float(rng.uniform(0.5, 1.0))
  advantages, returns = adv.length_adaptive_gae(rewards, values, mask, gamma=gamma, alpha=alpha,
                                                critic_lam=critic_lam)
  lams = [_vapo_lam(int(mask[b].sum()), alpha) for b in range(num_rows)]
  want_adv, _ = ref_gae(rewards, values, mask, gamma, lams)
  _, want_ret = ref_gae(rewards, values, mask, gamma, critic_lam)
  _close(advantages, want_adv)
  _close(returns, want_ret)
  assert np.all(np.asarray(advantages)[mask == 0] == 0.0)
  assert np.all(np.asarray(returns)[mask == 0] == 0.0)


def test_length_adaptive_gae_equals_gae_with_per_row_lambda(rng):
  rewards = rng.normal(size=(B, T)).astype(np.float32)
  values = rng.normal(size=(B, T)).astype(np.float32)
  mask = random_multi_turn_mask(rng, B, T)
  advantages, returns = adv.length_adaptive_gae(rewards, values, mask, gamma=0.99)  # alpha 0.05
  lams = np.array([_vapo_lam(int(mask[b].sum()), 0.05) for b in range(B)], np.float32)
  want_adv, _ = adv.gae(rewards, values, mask, gamma=0.99, lam=lams)
  _, want_ret = adv.gae(rewards, values, mask, gamma=0.99, lam=1.0)  # critic_lam default 1
  _close(advantages, want_adv)
  _close(returns, want_ret)


# ----------------------------------------------------------------------------------------------------
# masked_whiten


def test_masked_whiten_by_hand():
  # Entries 1, 3, 5 are masked in: mean 3, unbiased var (4 + 0 + 4) / 2 = 4, std 2 -> [-1, 0, 1];
  # the 100 is masked out and returned as 0.
  got = adv.masked_whiten(np.array([1.0, 100.0, 3.0, 5.0]), np.array([1, 0, 1, 1]), eps=0.0)
  _close(got, [-1.0, 0.0, 0.0, 1.0])
  # One entry: variance 0 -> 0; empty mask -> zeros (no NaN).
  _close(adv.masked_whiten(np.array([4.0, 2.0]), np.array([0, 1])), [0.0, 0.0])
  _close(adv.masked_whiten(np.array([4.0, 2.0]), np.array([0, 0])), [0.0, 0.0])


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_whiten_matches_reference(seed):
  rng = np.random.default_rng(seed)
  x = (3.0 + 2.0 * rng.normal(size=(B, T))).astype(np.float32)
  mask = random_multi_turn_mask(rng, B, T)
  got = np.asarray(adv.masked_whiten(x, mask))
  _close(got, ref_whiten(x, mask))
  assert np.all(got[mask == 0] == 0.0)
  picked = got[mask == 1]
  _close(picked.mean(), 0.0)
  _close(picked.std(ddof=1), 1.0)


# ----------------------------------------------------------------------------------------------------
# grpo and rloo

# Hand case shared by grpo / rloo:
#   label 10 at positions 0, 2, 5: scores [1, 0, 0.5] -> mean 0.5, unbiased std sqrt((.25+.25+0)/2) = .5
#   label -7 at positions 1, 6: scores [2, 4] -> mean 3, std sqrt((1 + 1)/1) = sqrt(2)
#   label 1000003 at position 3: singleton -> 0
#   label 4 at positions 4, 7: identical scores 3, 3 -> 0
HAND_SCORES = np.array([1.0, 2.0, 0.0, 9.0, 3.0, 0.5, 4.0, 3.0])
HAND_GROUPS = np.array([10, -7, 10, 1000003, 4, 10, -7, 4])


def test_grpo_by_hand():
  got = adv.grpo(HAND_SCORES, HAND_GROUPS)
  # (s - mean) / (std + 1e-6): [0.5/0.5, -1/sqrt2, -0.5/0.5, 0, 0, 0/0.5, 1/sqrt2, 0]
  _close(got, [1.0, -1 / SQRT2, -1.0, 0.0, 0.0, 0.0, 1 / SQRT2, 0.0])
  # Dr.GRPO: s - mean only.
  got = adv.grpo(HAND_SCORES, HAND_GROUPS, normalize_std=False)
  _close(got, [0.5, -1.0, -0.5, 0.0, 0.0, 0.0, 1.0, 0.0])


def test_rloo_by_hand():
  # label 10: 1 - (0 + .5)/2 = .75; 0 - (1 + .5)/2 = -.75; .5 - (1 + 0)/2 = 0.
  # label -7: 2 - 4 = -2; 4 - 2 = 2.   Singleton and identical groups: 0.
  got = adv.rloo(HAND_SCORES, HAND_GROUPS)
  _close(got, [0.75, -2.0, -0.75, 0.0, 0.0, 0.0, 2.0, 0.0])


def test_valid_by_hand():
  # Position 2 (score 5) is invalid: statistics over [1, 0, 0.5] as label 10 above; position 2 gets 0.
  scores = np.array([1.0, 0.0, 5.0, 0.5, 7.0, 8.0])
  groups = np.array([3, 3, 3, 3, 9, 9])
  valid = np.array([1, 1, 0, 1, 1, 0])  # label 9 becomes a group of one -> 0
  _close(adv.grpo(scores, groups, valid=valid), [1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
  _close(adv.grpo(scores, groups, valid=valid, normalize_std=False), [0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
  _close(adv.rloo(scores, groups, valid=valid), [0.75, -0.75, 0.0, 0.0, 0.0, 0.0])


def test_grpo_identical_scores_give_exactly_zero():
  # Documented: "A group with identical scores gets 0". Arbitrary (non dyadic) float scores whose
  # float32 group mean does not round back to the score exactly must still give 0, not
  # (rounding error) / (std of rounding errors + eps).
  for value, size in [(100.3, 3), (100.3, 6), (1000.1, 7), (12.34, 7), (0.3, 6)]:
    scores = np.full(size, value, np.float32)
    groups = np.full(size, 5)
    _close(adv.grpo(scores, groups), np.zeros(size))
    _close(adv.grpo(scores, groups, normalize_std=False), np.zeros(size))
    _close(adv.rloo(scores, groups), np.zeros(size))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("use_valid", [False, True])
def test_grpo_matches_reference(seed, normalize_std, use_valid):
  rng = np.random.default_rng(seed)
  n = N
  groups = random_groups(rng, n)
  scores = random_scores(rng, groups)
  valid = random_valid(rng, n) if use_valid else None
  got = np.asarray(adv.grpo(scores, groups, normalize_std=normalize_std, valid=valid))
  _close(got, ref_group_normalise(scores, groups, valid, normalize_std, 1e-6))
  if valid is not None:
    assert np.all(got[valid == 0] == 0.0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("use_valid", [False, True])
def test_rloo_matches_reference(seed, use_valid):
  rng = np.random.default_rng(seed)
  n = N
  groups = random_groups(rng, n)
  scores = random_scores(rng, groups)
  valid = random_valid(rng, n) if use_valid else None
  got = np.asarray(adv.rloo(scores, groups, valid=valid))
  _close(got, ref_rloo(scores, groups, valid))
  if valid is not None:
    assert np.all(got[valid == 0] == 0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_group_estimator_properties(seed):
  rng = np.random.default_rng(seed)
  n = N
  groups = random_groups(rng, n)
  scores = rng.normal(size=n).astype(np.float32)
  a_std = np.asarray(adv.grpo(scores, groups))
  a_dr = np.asarray(adv.grpo(scores, groups, normalize_std=False))
  a_rloo = np.asarray(adv.rloo(scores, groups))
  for label in np.unique(groups):
    idx = groups == label
    size = int(idx.sum())
    if size == 1:
      assert a_std[idx][0] == 0.0 and a_dr[idx][0] == 0.0 and a_rloo[idx][0] == 0.0
      continue
    s = scores[idx].astype(np.float64)
    _close(a_std[idx].sum(), 0.0)  # zero mean within each group
    _close(a_dr[idx].sum(), 0.0)
    _close(a_std[idx].std(ddof=1), 1.0 / (1.0 + 1e-6 / s.std(ddof=1)), rtol=1e-4)  # unit std
    _close(a_dr[idx], s - s.mean())
    _close(a_rloo[idx], size / (size - 1) * (s - s.mean()))  # RLOO = n/(n-1) (s - mean)
  # Equivariant to permuting episodes; invariant to relabelling the groups.
  perm = rng.permutation(n)
  _close(np.asarray(adv.grpo(scores[perm], groups[perm])), a_std[perm])
  _close(np.asarray(adv.rloo(scores[perm], groups[perm])), a_rloo[perm])
  relabelled = groups * 3 - 11
  _close(np.asarray(adv.grpo(scores, relabelled)), a_std)
  _close(np.asarray(adv.rloo(scores, relabelled)), a_rloo)


def test_valid_equals_dropping_invalid_episodes(rng):
  n = N
  groups = random_groups(rng, n)
  scores = rng.normal(size=n).astype(np.float32)
  valid = random_valid(rng, n)
  noisy = scores.copy()
  noisy[valid == 0] = 1e4  # values of invalid episodes must not matter
  keep = valid == 1
  for fn in (adv.grpo, functools.partial(adv.grpo, normalize_std=False), adv.rloo):
    got = np.asarray(fn(noisy, groups, valid=valid))
    _close(got[keep], np.asarray(fn(scores[keep], groups[keep])))
    assert np.all(got[~keep] == 0.0)


# ----------------------------------------------------------------------------------------------------
# reinforce_pp and reinforce_pp_baseline


def test_reinforce_pp_by_hand():
  # gamma = 1. Row 0: rewards [1, 0, 1], mask [1, 0, 1] -> returns [2, 0, 1].
  # Row 1: reward 3 on its only policy token -> returns [0, 0, 3].
  # Whitening over the policy tokens {2, 1, 3}: mean 2, unbiased std 1 -> [0, ., -1], [., ., 1].
  rewards = np.array([[1.0, 0.0, 1.0], [0.0, 5.0, 3.0]])
  mask = np.array([[1, 0, 1], [0, 0, 1]])
  advantages, returns = adv.reinforce_pp(rewards, mask, gamma=1.0)
  _close(returns, [[2.0, 0.0, 1.0], [0.0, 0.0, 3.0]])
  _close(advantages, [[0.0, 0.0, -1.0], [0.0, 0.0, 1.0]])


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_matches_reference(seed):
  rng = np.random.default_rng(seed)
  rewards = rng.normal(size=(B, T)).astype(np.float32)
  mask = random_multi_turn_mask(rng, B, T)
  gamma = float(rng.uniform(0.8, 1.0))
  advantages, returns = adv.reinforce_pp(rewards, mask, gamma=gamma)
  want_ret = ref_discounted_returns(rewards, mask, gamma)
  _close(returns, want_ret)
  _close(advantages, ref_whiten(want_ret, mask))
  assert np.all(np.asarray(advantages)[mask == 0] == 0.0)


def test_reinforce_pp_baseline_by_hand():
  # gamma = 1, outcome reward on each row's last policy token.
  # Label 7: rows 0-2 with R = [1, 0, 2] -> mean 1 -> R - mean = [0, -1, 1].
  # Label 9: row 3 alone -> baseline R_3 -> 0.
  # Returns on policy tokens: row 0 [0, 0], row 1 [-1, -1], row 2 [1, 1], row 3 [0, 0, 0].
  # Whitening over these 9 values: mean 0, unbiased var 4/8 = 0.5 -> +-1 / sqrt(0.5) = +-sqrt2.
  rewards = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 5.0]])
  mask = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1]])
  groups = np.array([7, 7, 7, 9])
  advantages, returns = adv.reinforce_pp_baseline(rewards, mask, groups)
  _close(returns, [[0.0, 0.0, 0.0], [0.0, -1.0, -1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
  _close(advantages, [[0.0, 0.0, 0.0], [0.0, -SQRT2, -SQRT2], [SQRT2, 0.0, SQRT2], [0.0, 0.0, 0.0]])
  # Row 2 invalid: label 7 mean over rows 0, 1 = 0.5 -> returns [.5, .5], [-.5, -.5], row 3 [0, 0, 0];
  # whitening over 7 values: mean 0, var (4 * .25) / 6 = 1/6 -> +-0.5 * sqrt(6).
  advantages, returns = adv.reinforce_pp_baseline(rewards, mask, groups, valid=np.array([1, 1, 0, 1]))
  h = 0.5 * math.sqrt(6.0)
  _close(returns, [[0.5, 0.5, 0.0], [0.0, -0.5, -0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
  _close(advantages, [[h, h, 0.0], [0.0, -h, -h], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("use_valid", [False, True])
def test_reinforce_pp_baseline_matches_reference(seed, use_valid):
  rng = np.random.default_rng(seed)
  num_rows, length = 2 * B, T
  rewards = rng.normal(size=(num_rows, length)).astype(np.float32)
  mask = random_multi_turn_mask(rng, num_rows, length)
  groups = random_groups(rng, num_rows)
  valid = random_valid(rng, num_rows) if use_valid else None
  gamma = float(rng.uniform(0.8, 1.0))
  advantages, returns = adv.reinforce_pp_baseline(rewards, mask, groups, gamma=gamma, valid=valid)
  want_adv, want_ret = ref_reinforce_pp_baseline(rewards, mask, groups, gamma, valid)
  _close(returns, want_ret)
  _close(advantages, want_adv)
  assert np.all(np.asarray(advantages)[mask == 0] == 0.0)
  if valid is not None:
    assert np.all(np.asarray(advantages)[valid == 0] == 0.0)
    assert np.all(np.asarray(returns)[valid == 0] == 0.0)


def test_reinforce_pp_baseline_outcome_reward_is_whitened_group_centred_score(rng):
  # Outcome reward on the last policy token, gamma = 1: A_t = whiten(R_i - mean_g) on every token.
  num_rows, length = 2 * B, T
  mask = random_multi_turn_mask(rng, num_rows, length)
  groups = random_groups(rng, num_rows)
  scores = rng.normal(size=num_rows).astype(np.float32)
  scores[mask.sum(axis=1) == 0] = 0.0  # a row without policy tokens has episode reward 0
  rewards = np.zeros((num_rows, length), np.float32)
  for b in range(num_rows):
    if mask[b].any():
      rewards[b, np.nonzero(mask[b])[0][-1]] = scores[b]
  advantages, _ = adv.reinforce_pp_baseline(rewards, mask, groups)
  centred = np.asarray(adv.grpo(scores, groups, normalize_std=False))
  # grpo gives a singleton 0, as does the baseline (R_i - R_i); rows without tokens drop out.
  tokens = np.where(mask == 1, centred[:, None], 0.0)
  _close(advantages, ref_whiten(tokens, mask))


# ----------------------------------------------------------------------------------------------------
# gigpo, step_group_ids, broadcast_steps, place_step_rewards

# Hand case. Label 1: trajectories 0, 1; label 2: trajectory 2. gamma = 0.5.
#   Episode: R = [1, 0, 1] -> label 1 mean 0.5 -> A^E = [0.5, -0.5]; label 2 singleton -> 0.
#   Step returns: traj 0 rewards [0, 0, 1] -> G = [0.25, 0.5, 1]; traj 1 (2 steps) -> [0, 0];
#                 traj 2 rewards [0, 1] (2 steps) -> G = [0.5, 1].
#   Step groups: (1, 10): {0.25, 0} -> [+.125, -.125]; (1, 20): {0.5, 0} -> [+.25, -.25];
#                (1, 30): traj 0 step 2 only (traj 1 step 2 is masked) -> 0;
#                (2, 10): traj 2 steps 0, 1 (repeat visit) {0.5, 1} -> [-.25, +.25].
GIGPO_HAND = dict(
    episode_returns=np.array([1.0, 0.0, 1.0]),
    step_rewards=np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 5.0], [0.0, 1.0, 0.0]]),
    step_mask=np.array([[1, 1, 1], [1, 1, 0], [1, 1, 0]]),
    groups=np.array([1, 1, 2]),
    anchors=np.array([[10, 20, 30], [10, 20, 30], [10, 10, 30]], np.uint32),
)


def test_gigpo_by_hand():
  got = adv.gigpo(**GIGPO_HAND, gamma=0.5)
  # A = A^E + A^S: traj 0 [.5+.125, .5+.25, .5+0]; traj 1 [-.5-.125, -.5-.25, masked];
  # traj 2 [0-.25, 0+.25, masked].
  _close(got, [[0.625, 0.75, 0.5], [-0.625, -0.75, 0.0], [-0.25, 0.25, 0.0]])
  got = adv.gigpo(**GIGPO_HAND, gamma=0.5, step_weight=2.0)
  _close(got, [[0.75, 1.0, 0.5], [-0.75, -1.0, 0.0], [-0.5, 0.5, 0.0]])
  # normalize_std: every non-trivial group has two members {a, b}: (a - mean) / std = +-1/sqrt2.
  got = adv.gigpo(**GIGPO_HAND, gamma=0.5, normalize_std=True)
  r = 1 / SQRT2
  _close(got, [[2 * r, 2 * r, r], [-2 * r, -2 * r, 0.0], [-r, r, 0.0]])
  # Trajectory 1 invalid: label 1 leaves one trajectory -> A^E = 0 and all its step groups singletons.
  got = adv.gigpo(**GIGPO_HAND, gamma=0.5, valid=np.array([1, 0, 1]))
  _close(got, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-0.25, 0.25, 0.0]])


def test_gigpo_identical_returns_give_exactly_zero():
  # Documented: a group of identical returns has advantage 0 (s - mean = 0), also with normalize_std.
  # Six trajectories of one task group, one step each at the same anchor: identical episode returns
  # and identical step returns -> both levels 0.
  n = 6
  value = np.full(n, 100.3, np.float32)
  episode_only = adv.gigpo(value, np.zeros((n, 1)), np.ones((n, 1)), np.full(n, 3),
                           np.zeros((n, 1), np.uint32), normalize_std=True)
  _close(episode_only, np.zeros((n, 1)))
  step_only = adv.gigpo(np.zeros(n), value[:, None], np.ones((n, 1)), np.full(n, 3),
                        np.zeros((n, 1), np.uint32), normalize_std=True)
  _close(step_only, np.zeros((n, 1)))


def random_gigpo_case(rng, num_traj, num_steps, anchor_dtype):
  groups = random_groups(rng, num_traj)
  lengths = rng.integers(0, num_steps + 1, num_traj)
  lengths[0], lengths[1] = 0, num_steps  # an empty trajectory and a full one
  step_mask = (np.arange(num_steps)[None, :] < lengths[:, None]).astype(np.int32)
  if anchor_dtype == np.uint32:
    pool = np.array([0, 7, 2**32 - 1, 2**31, 123456789], np.uint32)
  else:
    pool = np.array([-7, 0, 5, 2**31 - 1, -(2**31)], np.int32)
  anchors = rng.choice(pool[:int(rng.integers(2, 6))], size=(num_traj, num_steps))  # repeats
  step_rewards = rng.normal(size=(num_traj, num_steps)).astype(np.float32)
  episode_returns = random_scores(rng, groups)
  # A duplicated trajectory: a step group with identical returns.
  labels, counts = np.unique(groups, return_counts=True)
  label = labels[np.argmax(counts)]
  i, j = np.nonzero(groups == label)[0][:2]
  for arr in (step_mask, anchors, step_rewards):
    arr[j] = arr[i]
  return episode_returns, step_rewards, step_mask, groups, anchors


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("use_valid", [False, True])
def test_gigpo_matches_reference(seed, normalize_std, use_valid):
  rng = np.random.default_rng(seed)
  num_traj, num_steps = NT, NS
  anchor_dtype = np.uint32 if seed % 2 == 0 else np.int32
  case = random_gigpo_case(rng, num_traj, num_steps, anchor_dtype)
  valid = random_valid(rng, num_traj) if use_valid else None
  gamma = float(rng.choice([0.95, 0.5, 1.0]))
  step_weight = float(rng.choice([1.0, 0.3, 2.0]))
  got = np.asarray(adv.gigpo(*case, gamma=gamma, step_weight=step_weight, normalize_std=normalize_std,
                             valid=valid))
  want = ref_gigpo(*case, gamma=gamma, step_weight=step_weight, normalize_std=normalize_std,
                   valid=valid)
  _close(got, want)
  assert np.all(got[case[2] == 0] == 0.0)
  if valid is not None:
    assert np.all(got[valid == 0] == 0.0)


def test_gigpo_levels_separately(rng):
  case = random_gigpo_case(rng, NT, NS, np.uint32)
  episode_returns, step_rewards, step_mask, groups, anchors = case
  # (Keyword arguments spelled out as in test_gigpo_matches_reference, to reuse its compilations.)
  kw = dict(gamma=0.95, valid=None)
  # step_weight 0: the episode advantage (grpo over trajectories) on every valid step.
  for normalize_std in (False, True):
    got = adv.gigpo(*case, step_weight=0.0, normalize_std=normalize_std, **kw)
    episode = np.asarray(adv.grpo(episode_returns, groups, normalize_std=normalize_std))
    _close(got, np.where(step_mask == 1, episode[:, None], 0.0))
  # All anchors distinct: every step group is a singleton -> again only the episode level.
  distinct = np.arange(anchors.size, dtype=np.uint32).reshape(anchors.shape)
  got = adv.gigpo(episode_returns, step_rewards, step_mask, groups, distinct, step_weight=1.0,
                  normalize_std=False, **kw)
  episode = np.asarray(adv.grpo(episode_returns, groups, normalize_std=False))
  _close(got, np.where(step_mask == 1, episode[:, None], 0.0))
  # Equal episode returns within each group (A^E = 0): only step_weight * A^S remains, and doubling
  # step_weight doubles it.
  flat = np.zeros_like(episode_returns)
  one = np.asarray(adv.gigpo(flat, step_rewards, step_mask, groups, anchors, step_weight=1.0,
                             normalize_std=False, **kw))
  two = np.asarray(adv.gigpo(flat, step_rewards, step_mask, groups, anchors, step_weight=2.0,
                             normalize_std=False, **kw))
  _close(two, 2 * one)
  assert np.abs(one).max() > 0


def test_gigpo_gamma_discounts_per_step():
  # One task group, two trajectories visiting anchors [1, 2]; only the last step is rewarded.
  # gamma = 0.5: G = [0.5, 1] and [0, 0]: step group anchor 1: {0.5, 0} -> +-0.25;
  # anchor 2: {1, 0} -> +-0.5. Episode returns equal -> A^E = 0.
  got = adv.gigpo(np.zeros(2), np.array([[0.0, 1.0], [0.0, 0.0]]), np.ones((2, 2)), np.array([4, 4]),
                  np.array([[1, 2], [1, 2]]), gamma=0.5)
  _close(got, [[0.25, 0.5], [-0.25, -0.5]])
  got = adv.gigpo(np.zeros(2), np.array([[0.0, 1.0], [0.0, 0.0]]), np.ones((2, 2)), np.array([4, 4]),
                  np.array([[1, 2], [1, 2]]), gamma=1.0)
  _close(got, [[0.5, 0.5], [-0.5, -0.5]])


def test_step_group_ids_by_hand():
  # (label, anchor): row 0 (5,1) (5,2); row 1 (5,2) (5,1); row 2 (-7,1) (-7,1).
  # -> {(0,0), (1,1)}, {(0,1), (1,0)}, {(2,0), (2,1)}: same anchor 1 under label -7 is another group.
  ids = np.asarray(adv.step_group_ids(np.array([5, 5, -7]), np.array([[1, 2], [2, 1], [1, 1]],
                                                                        np.uint32)))
  assert ids.dtype == np.int32
  assert ids[0, 0] == ids[1, 1] and ids[0, 1] == ids[1, 0] and ids[2, 0] == ids[2, 1]
  assert len({ids[0, 0], ids[0, 1], ids[2, 0]}) == 3


@pytest.mark.parametrize("seed", SEEDS)
def test_step_group_ids_matches_reference(seed):
  rng = np.random.default_rng(seed)
  anchor_dtype = np.uint32 if seed % 2 == 0 else np.int32
  _, _, _, groups, anchors = random_gigpo_case(rng, NT, NS, anchor_dtype)
  ids = np.asarray(adv.step_group_ids(groups, anchors))
  assert ids.shape == anchors.shape and ids.dtype == np.int32
  assert ids.min() >= 0 and ids.max() < anchors.size
  keys = [(int(groups[i]), int(anchors[i, s])) for i in range(NT) for s in range(NS)]
  assert _same_partition(ids.reshape(-1), keys)


def test_broadcast_steps_by_hand():
  # turn -1 (prompt), 0, 0, 1, 2, 3 (>= S), -1 (padding) -> [0, 1, 1, 2, 3, 0, 0].
  got = adv.broadcast_steps(np.array([[1.0, 2.0, 3.0]]), np.array([[-1, 0, 0, 1, 2, 3, -1]]))
  _close(got, [[0.0, 1.0, 1.0, 2.0, 3.0, 0.0, 0.0]])


def test_place_step_rewards_by_hand():
  # Step 0 policy tokens at 1, 2 (position 3 is an observation token of step 0) -> reward on 2;
  # step 1 policy tokens 4, 5 -> on 5; step 2 has no policy token -> dropped.
  got = adv.place_step_rewards(np.array([[10.0, 20.0, 30.0]]), np.array([[-1, 0, 0, 0, 1, 1, 2, 2]]),
                               np.array([[0, 1, 1, 0, 1, 1, 0, 0]]))
  _close(got, [[0.0, 0.0, 10.0, 0.0, 0.0, 20.0, 0.0, 0.0]])


def random_turn_layout(rng, num_rows, length, num_steps, scrambled):
  if scrambled:
    turn = rng.integers(-2, num_steps + 2, size=(num_rows, length))
  else:
    turn = np.full((num_rows, length), -1)
    for b in range(num_rows):
      pos, s = int(rng.integers(0, 4)), 0
      while pos < length and s <= num_steps:  # s == num_steps: tokens beyond the last step
        span = int(rng.integers(1, 7))
        turn[b, pos:pos + span] = s
        pos, s = pos + span, s + 1
  loss_mask = (rng.random((num_rows, length)) < 0.6).astype(np.int32)
  loss_mask[0] = 0
  return turn.astype(np.int32), loss_mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scrambled", [False, True])
def test_broadcast_and_place_match_reference(seed, scrambled):
  rng = np.random.default_rng(seed)
  num_rows, length, num_steps = B, T, NS
  turn, loss_mask = random_turn_layout(rng, num_rows, length, num_steps, scrambled)
  step_values = rng.normal(size=(num_rows, num_steps)).astype(np.float32)
  _close(adv.broadcast_steps(step_values, turn), ref_broadcast_steps(step_values, turn))
  placed = np.asarray(adv.place_step_rewards(step_values, turn, loss_mask))
  _close(placed, ref_place_step_rewards(step_values, turn, loss_mask))
  assert np.all(placed[loss_mask == 0] == 0.0)


def test_place_step_rewards_feeds_token_returns(rng):
  # With gamma = 1 every policy token of step s has a return that includes r_s and later steps:
  # return(token of step s) = sum_{s' >= s} r_{s'} in a monotone layout where every step has a token.
  num_steps = 4
  turn = np.array([[-1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, -1]])
  loss_mask = np.array([[0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1, 0]])
  step_rewards = rng.normal(size=(1, num_steps)).astype(np.float32)
  token_rewards = adv.place_step_rewards(step_rewards, turn, loss_mask)
  returns = np.asarray(adv.discounted_returns(token_rewards, loss_mask, 1.0))
  suffix = np.cumsum(step_rewards[0, ::-1])[::-1]
  for l in range(turn.shape[1]):
    if loss_mask[0, l]:
      _close(returns[0, l], suffix[turn[0, l]])


# ----------------------------------------------------------------------------------------------------
# Input types, output dtype, shape errors.


def _all_kernel_calls(to_array, rng):
  """(name, call) for every kernel, inputs built with `to_array` (shapes and keyword arguments as in
  the reference tests above, so the compilations are shared)."""
  rewards = to_array(rng.normal(size=(B, T)))  # float64 NumPy input
  values = to_array(rng.normal(size=(B, T)).astype(np.float32))
  mask_np = random_multi_turn_mask(rng, B, T)
  mask, bool_mask = to_array(mask_np), to_array(mask_np.astype(bool))
  scores = to_array(rng.normal(size=N))
  groups = to_array(random_groups(rng, N))
  valid = to_array(random_valid(rng, N))
  rewards2 = to_array(rng.normal(size=(2 * B, T)))
  mask2 = to_array(random_multi_turn_mask(rng, 2 * B, T))
  groups2 = to_array(random_groups(rng, 2 * B))
  step_rewards = to_array(rng.normal(size=(NT, NS)))
  step_mask = to_array((np.arange(NS)[None] < rng.integers(0, NS + 1, (NT, 1))).astype(np.int32))
  traj_groups = to_array(random_groups(rng, NT))
  anchors = to_array(rng.integers(0, 3, (NT, NS)).astype(np.uint32))
  step_values = to_array(rng.normal(size=(B, NS)))
  turn = to_array(rng.integers(-1, NS + 1, (B, T)).astype(np.int32))
  return [
      ("discounted_returns", lambda: adv.discounted_returns(rewards, mask, 0.9)),
      ("gae", lambda: adv.gae(rewards, values, mask, gamma=0.9, lam=0.9)),
      ("gae_bool_mask", lambda: adv.gae(rewards, values, bool_mask, gamma=0.9, lam=0.9)),
      ("length_adaptive_gae", lambda: adv.length_adaptive_gae(rewards, values, mask, gamma=0.9,
                                                              alpha=0.05, critic_lam=1.0)),
      ("masked_whiten", lambda: adv.masked_whiten(rewards, mask)),
      ("grpo", lambda: adv.grpo(scores, groups, normalize_std=True, valid=valid)),
      ("dr_grpo", lambda: adv.grpo(scores, groups, normalize_std=False, valid=None)),
      ("rloo", lambda: adv.rloo(scores, groups, valid=valid)),
      ("reinforce_pp", lambda: adv.reinforce_pp(rewards, mask, gamma=0.9)),
      ("reinforce_pp_baseline", lambda: adv.reinforce_pp_baseline(rewards2, mask2, groups2, gamma=0.9,
                                                                  valid=None)),
      ("gigpo", lambda: adv.gigpo(step_rewards[:, 0], step_rewards, step_mask, traj_groups, anchors,
                                  gamma=0.9, step_weight=1.0, normalize_std=True, valid=None)),
      ("broadcast_steps", lambda: adv.broadcast_steps(step_values, turn)),
      ("place_step_rewards", lambda: adv.place_step_rewards(step_values, turn, mask)),
  ]


def test_numpy_and_jax_inputs_give_same_float32_outputs():
  from_numpy = _all_kernel_calls(np.asarray, np.random.default_rng(7))
  from_jax = _all_kernel_calls(jnp.asarray, np.random.default_rng(7))
  for (name, np_call), (_, jax_call) in zip(from_numpy, from_jax):
    np_out, jax_out = np_call(), jax_call()
    np_out = np_out if isinstance(np_out, tuple) else (np_out,)
    jax_out = jax_out if isinstance(jax_out, tuple) else (jax_out,)
    for a, b in zip(np_out, jax_out):
      assert a.dtype == jnp.float32, f"{name} returned {a.dtype}"
      assert b.dtype == jnp.float32, f"{name} returned {b.dtype}"
      assert np.all(np.isfinite(np.asarray(a))), name
      _close(a, b)
  ids = adv.step_group_ids(np.array([1, 2]), np.array([[3, 4], [3, 4]], np.uint32))
  assert ids.dtype == jnp.int32 and ids.shape == (2, 2)


def _f(*shape):
  return np.zeros(shape, np.float32)


def _i(*shape):
  return np.zeros(shape, np.int32)


BAD_CALLS = {
    "discounted_returns_shape": lambda: adv.discounted_returns(_f(2, 5), _i(2, 4), 0.9),
    "discounted_returns_rank": lambda: adv.discounted_returns(_f(5), _i(5), 0.9),
    "discounted_returns_gamma": lambda: adv.discounted_returns(_f(2, 5), _i(2, 5), np.ones((2, 2))),
    "gae_shape": lambda: adv.gae(_f(2, 5), _f(2, 6), _i(2, 5), gamma=0.9, lam=0.9),
    "gae_rank": lambda: adv.gae(_f(2, 5, 1), _f(2, 5, 1), _i(2, 5, 1), gamma=0.9, lam=0.9),
    "length_adaptive_gae_shape": lambda: adv.length_adaptive_gae(_f(2, 5), _f(2, 5), _i(3, 5),
                                                                 gamma=0.9),
    "masked_whiten_shape": lambda: adv.masked_whiten(_f(2, 5), _i(2, 4)),
    "grpo_shape": lambda: adv.grpo(_f(6), _i(5)),
    "grpo_rank": lambda: adv.grpo(_f(2, 3), _i(2, 3)),
    "grpo_float_groups": lambda: adv.grpo(_f(6), _f(6)),
    "grpo_valid_shape": lambda: adv.grpo(_f(6), _i(6), valid=_i(5)),
    "rloo_shape": lambda: adv.rloo(_f(6), _i(7)),
    "rloo_valid_shape": lambda: adv.rloo(_f(6), _i(6), valid=_i(4)),
    "reinforce_pp_shape": lambda: adv.reinforce_pp(_f(2, 5), _i(2, 6), gamma=0.9),
    "reinforce_pp_baseline_groups": lambda: adv.reinforce_pp_baseline(_f(2, 5), _i(2, 5), _i(3)),
    "reinforce_pp_baseline_mask": lambda: adv.reinforce_pp_baseline(_f(2, 5), _i(2, 4), _i(2)),
    "reinforce_pp_baseline_valid_long": lambda: adv.reinforce_pp_baseline(_f(2, 5), _i(2, 5), _i(2),
                                                                          valid=_i(3)),
    # valid is documented `[B]`; a `[1]` vector must not be broadcast over the rows silently.
    "reinforce_pp_baseline_valid_short": lambda: adv.reinforce_pp_baseline(_f(2, 5), _i(2, 5), _i(2),
                                                                           valid=_i(1)),
    "gigpo_step_shape": lambda: adv.gigpo(_f(3), _f(3, 4), _i(3, 5), _i(3), _i(3, 4)),
    "gigpo_anchor_shape": lambda: adv.gigpo(_f(3), _f(3, 4), _i(3, 4), _i(3), _i(3, 3)),
    "gigpo_groups_shape": lambda: adv.gigpo(_f(3), _f(3, 4), _i(3, 4), _i(4), _i(3, 4)),
    "gigpo_returns_shape": lambda: adv.gigpo(_f(2), _f(3, 4), _i(3, 4), _i(3), _i(3, 4)),
    "gigpo_float_anchors": lambda: adv.gigpo(_f(3), _f(3, 4), _i(3, 4), _i(3), _f(3, 4)),
    "gigpo_valid_shape": lambda: adv.gigpo(_f(3), _f(3, 4), _i(3, 4), _i(3), _i(3, 4), valid=_i(4)),
    "step_group_ids_shape": lambda: adv.step_group_ids(_i(3), _i(4, 2)),
    "step_group_ids_rank": lambda: adv.step_group_ids(_i(3), _i(3)),
    "broadcast_steps_rows": lambda: adv.broadcast_steps(_f(2, 3), _i(3, 6)),
    "broadcast_steps_float_turn": lambda: adv.broadcast_steps(_f(2, 3), _f(2, 6)),
    "place_step_rewards_mask": lambda: adv.place_step_rewards(_f(2, 3), _i(2, 6), _i(2, 5)),
    "place_step_rewards_rows": lambda: adv.place_step_rewards(_f(3, 3), _i(2, 6), _i(2, 6)),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_shapes_raise(name):
  with pytest.raises(SHAPE_ERRORS):
    BAD_CALLS[name]()


# ----------------------------------------------------------------------------------------------------
# Traced once for repeated calls of the same shapes (different values, different Python floats).


def _retrace_cases():
  rng = np.random.default_rng(11)
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)
  mask = lambda rows=B: random_multi_turn_mask(rng, rows, T)
  groups = lambda n: rng.choice([-7, 1000003, 5], n)
  anchors = lambda: rng.integers(0, 3, (NT, NS)).astype(np.uint32)
  step_mask = lambda: (np.arange(NS)[None] < rng.integers(0, NS + 1, (NT, 1))).astype(np.int32)
  valid = lambda n: (rng.random(n) > 0.3).astype(np.int32)
  turn = lambda: rng.integers(-1, NS + 1, (B, T)).astype(np.int32)
  return {
      "discounted_returns": (adv.discounted_returns, [((f(B, T), mask(), g), {}) for g in (0.9, 0.7)]),
      "gae": (adv.gae, [((f(B, T), f(B, T), mask()), dict(gamma=g, lam=l))
                        for g, l in ((0.99, 0.95), (0.9, 0.5), (1.0, 1.0))]),
      "length_adaptive_gae": (adv.length_adaptive_gae,
                              [((f(B, T), f(B, T), mask()), dict(gamma=g, alpha=a, critic_lam=c))
                               for g, a, c in ((0.99, 0.05, 1.0), (0.9, 0.5, 0.9))]),
      "masked_whiten": (adv.masked_whiten, [((f(B, T), mask()), dict(eps=e)) for e in (1e-8, 1e-5)]),
      "grpo": (adv.grpo, [((f(N), groups(N)), dict(eps=e, valid=valid(N))) for e in (1e-6, 1e-4)]),
      "dr_grpo": (adv.grpo, [((f(N), groups(N)), dict(normalize_std=False)) for _ in range(2)]),
      "rloo": (adv.rloo, [((f(N), groups(N)), dict(valid=valid(N))) for _ in range(2)]),
      "reinforce_pp": (adv.reinforce_pp, [((f(B, T), mask()), dict(gamma=g)) for g in (0.9, 1.0)]),
      "reinforce_pp_baseline": (adv.reinforce_pp_baseline,
                                [((f(2 * B, T), mask(2 * B), groups(2 * B)),
                                  dict(gamma=g, valid=valid(2 * B))) for g in (0.9, 1.0)]),
      "gigpo": (adv.gigpo, [((f(NT), f(NT, NS), step_mask(), groups(NT), anchors()),
                             dict(gamma=g, step_weight=w, normalize_std=True, valid=valid(NT)))
                            for g, w in ((0.95, 1.0), (0.5, 0.3))]),
      "step_group_ids": (adv.step_group_ids, [((groups(NT), anchors()), {}) for _ in range(2)]),
      "broadcast_steps": (adv.broadcast_steps, [((f(B, NS), turn()), {}) for _ in range(2)]),
      "place_step_rewards": (adv.place_step_rewards,
                             [((f(B, NS), turn(), mask()), {}) for _ in range(2)]),
  }


RETRACE_CASES = _retrace_cases()


@pytest.mark.parametrize("name", sorted(RETRACE_CASES))
def test_traced_once_for_same_shapes(name, assert_no_retrace):
  fn, calls = RETRACE_CASES[name]
  assert_no_retrace(fn, *calls)


# ----------------------------------------------------------------------------------------------------
# Grouping internals: the hash fast path must never change the grouping.


import jax  # noqa: E402
from longhorizon.core import advantages  # noqa: E402


def _colliding_pairs():
  """Two different (group, anchor) pairs with the same hash (birthday search over 2^18 pairs; for a
  fixed group the hash is a bijection of the anchor, so the pairs differ in their group)."""
  rng = np.random.default_rng(123)
  pairs = rng.integers(0, 2**32, (2**18, 2), dtype=np.uint64).astype(np.uint32)
  h = np.asarray(jax.jit(lambda g, a: advantages._hash_keys([g, a]))(pairs[:, 0], pairs[:, 1]))
  order = np.argsort(h, kind="stable")
  dup = np.nonzero(h[order][1:] == h[order][:-1])[0]
  assert dup.size, "no collision found; enlarge the search"
  first, second = pairs[order[dup[0]]], pairs[order[dup[0] + 1]]
  assert tuple(first) != tuple(second)
  as_group = lambda g: np.array(g, np.uint32).view(np.int32)
  return (as_group(first[0]), first[1]), (as_group(second[0]), second[1])


def test_hash_collision_falls_back_to_exact_grouping():
  (g1, a1), (g2, a2) = _colliding_pairs()
  # Row 0 and 2 in group g1, rows 1 and 3 in group g2; anchor a1 in g1 and a2 in g2 collide.
  groups = np.array([g1, g2, g1, g2], np.int32)
  anchors = np.array([[a1, 5], [a2, 5], [a1, 6], [a2, 6]], np.uint32)
  ids = np.asarray(advantages.step_group_ids(groups, anchors))
  assert ids[0, 0] == ids[2, 0] and ids[1, 0] == ids[3, 0]
  assert ids[0, 0] != ids[1, 0], "colliding (group, anchor) pairs were merged"
  assert len(set(ids.reshape(-1).tolist())) == 6
  # The estimator separates them too: with gamma=0 the step return is the step reward.
  step_rewards = np.array([[1.0, 0.0], [0.0, 0.0], [3.0, 0.0], [4.0, 0.0]], np.float32)
  out = np.asarray(advantages.gigpo(np.zeros(4), step_rewards, np.ones((4, 2)), groups, anchors,
                                    gamma=0.0))
  # (g1, a1): returns 1, 3 -> -1, +1; (g2, a2): 0, 4 -> -2, +2; the other step groups are singletons.
  np.testing.assert_allclose(out[:, 0], [-1.0, -2.0, 1.0, 2.0], atol=1e-6)
  np.testing.assert_allclose(out[:, 1], 0.0, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_fast_grouping_equals_lexsort_grouping(seed):
  rng = np.random.default_rng(seed)
  groups = rng.choice(np.array([-5, 3, 2**31 - 1, -2**31], np.int32), size=300)
  anchors = rng.integers(0, 6, 300).astype(np.uint32) * np.uint32(2**31 + 1)
  fast = np.asarray(jax.jit(advantages._dense_ids)(groups, anchors))
  exact = np.asarray(jax.jit(lambda g, a: advantages._lexsort_ids([g, a]))(
      jax.lax.bitcast_convert_type(groups, np.uint32), anchors))
  pairs = list(zip(groups.tolist(), anchors.tolist()))
  for i in range(0, 300, 7):
    for j in range(300):
      same = pairs[i] == pairs[j]
      assert (fast[i] == fast[j]) == same and (exact[i] == exact[j]) == same
