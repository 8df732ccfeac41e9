"""Tests for `longhorizon.core.losses`: hand-checked cases, a float64 NumPy reference written with loops,
and no retracing for repeated shapes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.core import losses

TOKEN_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
               "seq-mean-token-sum-norm")
TURN_MODES = ("turn-mean", "seq-mean-turn-mean")
MODES = TOKEN_MODES + TURN_MODES
QUANTILES = (("ratio_min", 0.0), ("ratio_q05", 0.05), ("ratio_q50", 0.5), ("ratio_q95", 0.95),
             ("ratio_max", 1.0))
TOL = dict(rtol=1e-5, atol=1e-5)

# ----------------------------------------------------------------------------------------------------
# Random multi-turn cases.


def multiturn_mask(rng, b, t):
  """Rows of different lengths: a prompt (mask 0), alternating action spans (1) and observation spans
  (0) in the middle, then padding. Row 1 is completely empty."""
  mask = np.zeros((b, t), np.int32)
  for i in range(b):
    if i == 1:
      continue
    length = int(rng.integers(t // 2, t + 1))
    pos = int(rng.integers(1, 4))
    while pos < length:
      act = int(rng.integers(1, 5))
      mask[i, pos:min(pos + act, length)] = 1
      pos += act + int(rng.integers(1, 4))
  # The generator must really produce what the tests claim to cover.
  assert not mask[1].any() and mask.sum(axis=1).min() == 0
  assert len(set(mask.sum(axis=1).tolist())) > 2, "rows of different lengths"
  assert any(np.any(np.diff(row) == 1) and np.sum(np.diff(row) == 1) >= 2 for row in mask), (
      "an observation span between two action spans")
  return mask


def multiturn_turns(rng, mask):
  """Turn ids for `multiturn_mask`: each action span starts a new turn, except that about a third of
  them continue the previous span's turn (a turn whose middle tokens are off the mask, e.g. zeroed
  by a token weight). Ids never decrease along a row's masked tokens; off the mask they are garbage
  (-1 to 3 T) that must not matter."""
  b, t = mask.shape
  turn = rng.integers(-1, 3 * t, size=(b, t)).astype(np.int32)
  for i in range(b):
    k, prev = -1, False
    for j in range(t):
      if mask[i, j] and not prev:
        k += 1 if (k < 0 or rng.random() > 0.35) else 0
      if mask[i, j]:
        turn[i, j] = k
      prev = bool(mask[i, j])
  return turn


def random_policy_case(seed, b=6, t=24):
  rng = np.random.default_rng(seed)
  mask = multiturn_mask(rng, b, t)
  old = (-rng.exponential(1.5, size=(b, t))).astype(np.float32)
  logp = (old + rng.normal(0.0, 0.6, size=(b, t))).astype(np.float32)
  # Masked positions hold wild values that must never contribute.
  wild = (mask == 0) & (rng.random((b, t)) < 0.5)
  logp[wild] = old[wild] + 30.0
  adv = rng.normal(size=(b, t)).astype(np.float32)
  w = rng.uniform(0.0, 2.0, size=(b, t)).astype(np.float32)
  return logp, old, adv, mask, w


# ----------------------------------------------------------------------------------------------------
# Slow, obviously-correct NumPy reference (float64 loops over rows and tokens).


def ref_turn_groups(mask, turn):
  """Per row, `{turn id: [positions of its masked tokens]}` (the reference groups by id)."""
  groups = []
  for i in range(mask.shape[0]):
    row = {}
    for j in range(mask.shape[1]):
      if mask[i, j]:
        row.setdefault(int(turn[i, j]), []).append(j)
    groups.append(row)
  return groups


def ref_aggregate(x, mask, mode, norm_constant=None, turn=None):
  if mode in TURN_MODES:
    return float(np.sum(ref_aggregate_weights(mask, mode, norm_constant, turn) * x))
  b, t = x.shape
  row_sums, row_means, total, count = [], [], 0.0, 0
  for i in range(b):
    vals = [float(x[i, j]) for j in range(t) if mask[i, j]]
    total += sum(vals)
    count += len(vals)
    if vals:  # sequence modes only see rows with at least one valid token
      row_sums.append(sum(vals))
      row_means.append(sum(vals) / len(vals))
  if count == 0:
    return 0.0
  if mode == "token-mean":
    return total / count
  if mode == "token-sum":
    return total
  if mode == "seq-mean-token-sum":
    return sum(row_sums) / len(row_sums)
  if mode == "seq-mean-token-mean":
    return sum(row_means) / len(row_means)
  if mode == "seq-mean-token-sum-norm":
    c = t if norm_constant is None else norm_constant
    return sum(s / c for s in row_sums) / len(row_sums)
  raise AssertionError(mode)


def ref_aggregate_weights(mask, mode, norm_constant=None, turn=None):
  """d aggregate / d x_{b,t} (the aggregate is linear in x)."""
  b, t = mask.shape
  if mode in TURN_MODES:  # a turn weighs 1 / (turns counted), shared by its tokens
    groups = ref_turn_groups(mask, turn)
    total, rows = sum(len(g) for g in groups), sum(1 for g in groups if g)
    out = np.zeros((b, t))
    for i, row in enumerate(groups):
      for positions in row.values():
        for j in positions:
          share = 1.0 / total if mode == "turn-mean" else 1.0 / (rows * len(row))
          out[i, j] = share / len(positions)
    return out
  counts = [int(sum(mask[i])) for i in range(b)]
  n_total, n_rows = sum(counts), sum(1 for c in counts if c > 0)
  out = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      if not mask[i, j]:
        continue
      out[i, j] = {
          "token-mean": 1.0 / n_total,
          "token-sum": 1.0,
          "seq-mean-token-sum": 1.0 / n_rows,
          "seq-mean-token-mean": 1.0 / (n_rows * counts[i]),
          "seq-mean-token-sum-norm": 1.0 / (n_rows * (t if norm_constant is None else norm_constant)),
      }[mode]
  return out


def ref_masked_mean(x, mask):
  vals = [float(v) for v, m in zip(np.ravel(x), np.ravel(mask)) if m]
  return sum(vals) / len(vals) if vals else 0.0


def ref_quantiles(ratio, mask):
  vals = sorted(float(v) for v, m in zip(np.ravel(ratio), np.ravel(mask)) if m)
  if not vals:
    return {name: 1.0 for name, _ in QUANTILES}
  # Lower order statistic at floor(q (n - 1)); the index is computed in float32 like the library.
  return {name: vals[int(np.floor(np.float32(q) * np.float32(len(vals) - 1)))] for name, q in QUANTILES}


def clamp(v, lo, hi):
  return min(max(v, lo), hi)


def ref_surrogate_token(log_ratio, a, clip_low, clip_high, dual_clip):
  """One token of the clipped surrogate: (loss, d loss / d log_ratio, clipped, capped)."""
  lr = clamp(log_ratio, -20.0, 20.0)
  r = math.exp(lr)
  dr = r if -20.0 < log_ratio < 20.0 else 0.0
  unclipped = -a * r
  clipped = -a * clamp(r, 1.0 - clip_low, 1.0 + clip_high)
  if clipped > unclipped:  # only possible with r outside the clip range, where the clip is flat
    loss, grad, is_clipped = clipped, 0.0, True
  else:
    loss, grad, is_clipped = unclipped, -a * dr, False
  capped = False
  if dual_clip is not None and a < 0 and loss > -dual_clip * a:
    loss, grad, capped = -dual_clip * a, 0.0, True
  return loss, grad, is_clipped, capped, r


def ref_policy_loss(logp, old, adv, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean",
                    is_weights=None, norm_constant=None, turn=None):
  b, t = logp.shape
  adv = np.broadcast_to(np.asarray(adv)[:, None], (b, t)) if np.ndim(adv) == 1 else adv
  per_token, dloss, clipped, capped, ratio = (np.zeros((b, t)) for _ in range(5))
  k3 = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      lr = float(logp[i, j]) - float(old[i, j])
      l, g, c, cap, r = ref_surrogate_token(lr, float(adv[i, j]), clip_low, clip_high, dual_clip)
      w = 1.0 if is_weights is None else float(is_weights[i, j])
      per_token[i, j], dloss[i, j], clipped[i, j], capped[i, j], ratio[i, j] = l * w, g * w, c, cap, r
      k3[i, j] = min(r - lr - 1.0, 10.0)
  loss = ref_aggregate(per_token, mask, agg, norm_constant, turn)
  grad = ref_aggregate_weights(mask, agg, norm_constant, turn) * dloss
  metrics = {
      "clipfrac": ref_masked_mean(clipped, mask),
      "clipfrac_lower": ref_masked_mean(capped, mask),
      "approx_kl": ref_masked_mean(old.astype(np.float64) - logp, mask),
      "approx_kl_k3": ref_masked_mean(k3, mask),
      "ratio_mean": ref_masked_mean(ratio, mask),
      **ref_quantiles(ratio, mask),
  }
  return loss, metrics, grad


def ref_gspo_loss(logp, old, adv, mask, *, clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean",
                  is_weights=None, norm_constant=None, turn=None):
  b, t = logp.shape
  adv = np.broadcast_to(np.asarray(adv)[:, None], (b, t)) if np.ndim(adv) == 1 else adv
  per_token, dloss, clipped, ratio = (np.zeros((b, t)) for _ in range(4))
  for i in range(b):
    valid = [j for j in range(t) if mask[i, j]]
    seq_lr = sum(float(logp[i, j]) - float(old[i, j]) for j in valid) / max(len(valid), 1)
    for j in range(t):
      # Value: the sequence ratio s_i; gradient w.r.t. logp_t: that of s_i * logp_t.
      l, g, c, _, s = ref_surrogate_token(seq_lr, float(adv[i, j]), clip_low, clip_high, None)
      w = 1.0 if is_weights is None else float(is_weights[i, j])
      per_token[i, j], dloss[i, j], clipped[i, j], ratio[i, j] = l * w, g * w, c, s
  loss = ref_aggregate(per_token, mask, agg, norm_constant, turn)
  grad = ref_aggregate_weights(mask, agg, norm_constant, turn) * dloss
  metrics = {
      "clipfrac": ref_masked_mean(clipped, mask),
      "clipfrac_lower": 0.0,
      "approx_kl": ref_masked_mean(old.astype(np.float64) - logp, mask),
      "ratio_mean": ref_masked_mean(ratio, mask),
      **ref_quantiles(ratio, mask),
  }
  return loss, metrics, grad


def ref_kl(logp, ref, kind):
  out = np.zeros(logp.shape)
  for idx in np.ndindex(logp.shape):
    d = float(logp[idx]) - float(ref[idx])
    if kind == "k1":
      out[idx] = d
    elif kind == "k2":
      out[idx] = 0.5 * d * d
    else:
      x = clamp(-d, -20.0, 20.0)
      out[idx] = min(math.exp(x) - x - 1.0, 10.0)
  return out


def ref_value_loss(v, old, ret, mask, clip, agg):
  b, t = v.shape
  per_token, active = np.zeros((b, t)), np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      err = (float(v[i, j]) - float(ret[i, j]))**2
      if clip is None:
        per_token[i, j] = 0.5 * err
      else:
        v_clip = float(old[i, j]) + clamp(float(v[i, j]) - float(old[i, j]), -clip, clip)
        err_clip = (v_clip - float(ret[i, j]))**2
        per_token[i, j] = 0.5 * max(err, err_clip)
        active[i, j] = err_clip > err
  valid_r = np.array([float(ret[i, j]) for i in range(b) for j in range(t) if mask[i, j]])
  valid_res = np.array(
      [float(ret[i, j]) - float(v[i, j]) for i in range(b) for j in range(t) if mask[i, j]])
  var_r = np.var(valid_r) if valid_r.size else 0.0
  explained = 1.0 - np.var(valid_res) / var_r if var_r > 0 else 0.0
  metrics = {"vf_clipfrac": ref_masked_mean(active, mask), "vf_explained_var": explained,
             "value_mean": ref_masked_mean(v, mask)}
  return ref_aggregate(per_token, mask, agg), metrics


def ref_is_weights(old, rollout, mask, level, threshold):
  b, t = old.shape
  out = np.zeros((b, t))
  for i in range(b):
    seq = sum(float(old[i, j]) - float(rollout[i, j]) for j in range(t) if mask[i, j])
    for j in range(t):
      if mask[i, j]:
        lr = float(old[i, j]) - float(rollout[i, j]) if level == "token" else seq
        out[i, j] = min(math.exp(clamp(lr, -20.0, 20.0)), threshold)
  return out


def assert_metrics(got, want, **tol):
  assert set(want) <= set(got), set(want) - set(got)
  for k, v in want.items():
    assert got[k].dtype == jnp.float32 and got[k].shape == (), k
    np.testing.assert_allclose(got[k], v, err_msg=k, **(tol or TOL))


# ----------------------------------------------------------------------------------------------------
# aggregate

# Hand case: row 0 keeps [1, 2, _, 4] (sum 7, n 3), row 1 keeps [_, 6, _, _] (sum 6, n 1), row 2 is
# empty (its 9s must not count, not even as a row).
AGG_X = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]], np.float32)
AGG_MASK = np.array([[1, 1, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]], np.int32)
AGG_HAND = {
    "token-mean": 3.25,  # (7 + 6) / 4
    "token-sum": 13.0,  # 7 + 6
    "seq-mean-token-sum": 6.5,  # (7 + 6) / 2 rows
    "seq-mean-token-mean": 4.1666667,  # (7/3 + 6/1) / 2
    "seq-mean-token-sum-norm": 1.625,  # (7/4 + 6/4) / 2, C = padded length T = 4
    "turn-mean": 3.8333333,  # turns (1 + 2)/2, 4/1 and 6/1 (AGG_TURN): (1.5 + 4 + 6) / 3
    "seq-mean-turn-mean": 4.375,  # ((1.5 + 4) / 2 + 6) / 2
}
# Row 0's two turns are [1, 2] and [4]; ids off the mask (-1, 9) do not count.
AGG_TURN = np.array([[0, 0, -1, 1], [-1, 0, 9, -1], [-1, -1, -1, -1]], np.int32)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_by_hand(mode):
  out = losses.aggregate(AGG_X, AGG_MASK, mode, turn=AGG_TURN)
  assert out.dtype == jnp.float32 and out.shape == ()
  np.testing.assert_allclose(out, AGG_HAND[mode], rtol=1e-6)
  # JAX and bool-mask inputs give the same.
  np.testing.assert_allclose(losses.aggregate(jnp.asarray(AGG_X), jnp.asarray(AGG_MASK, bool), mode,
                                              turn=jnp.asarray(AGG_TURN)), AGG_HAND[mode], rtol=1e-6)
  # With no valid token at all every mode returns 0.
  assert float(losses.aggregate(AGG_X, np.zeros_like(AGG_MASK), mode, turn=AGG_TURN)) == 0.0


def test_turn_modes_by_hand():
  """A turn is a run of one id over the masked tokens: with row 0's tokens all in turn 0 (the
  unmasked token between them in another turn) row 0 is one turn [1, 2, 4]; turn-mean is then
  (7/3 + 6) / 2 = 4.1666667 for both turn modes, and a row with more turns weighs more in
  turn-mean only: with row 0 split into three turns, turn-mean = (1 + 2 + 4 + 6) / 4 = 3.25 and
  seq-mean-turn-mean = (7/3 + 6) / 2."""
  one = np.array([[0, 0, 5, 0], [-1, 3, -1, -1], [0, 0, 0, 0]], np.int32)
  for mode in TURN_MODES:
    np.testing.assert_allclose(losses.aggregate(AGG_X, AGG_MASK, mode, turn=one), 4.1666667,
                               rtol=1e-6)
  three = np.array([[0, 1, 1, 2], [-1, 0, -1, -1], [0, 0, 0, 0]], np.int32)
  np.testing.assert_allclose(losses.aggregate(AGG_X, AGG_MASK, "turn-mean", turn=three), 3.25,
                             rtol=1e-6)
  np.testing.assert_allclose(losses.aggregate(AGG_X, AGG_MASK, "seq-mean-turn-mean", turn=three),
                             4.1666667, rtol=1e-6)
  # Turn ids far beyond T (a context segment late in a long episode) are just ids.
  np.testing.assert_allclose(losses.aggregate(AGG_X, AGG_MASK, "turn-mean", turn=AGG_TURN + 1000),
                             AGG_HAND["turn-mean"], rtol=1e-6)


@pytest.mark.parametrize("mode", TURN_MODES)
def test_turn_modes_need_turn_ids(mode):
  with pytest.raises(ValueError, match="need each token's turn id"):
    losses.aggregate(AGG_X, AGG_MASK, mode)
  logp, old, adv, mask, _ = random_policy_case(0)
  with pytest.raises(ValueError, match="need each token's turn id"):
    losses.policy_loss(logp, old, adv, mask, agg=mode)


def test_aggregate_norm_constant():
  # (7/2 + 6/2) / 2 = 3.25 with C = 2; other modes ignore the constant.
  np.testing.assert_allclose(losses.aggregate(AGG_X, AGG_MASK, "seq-mean-token-sum-norm", 2.0), 3.25)
  np.testing.assert_allclose(losses.aggregate(AGG_X, AGG_MASK, "token-mean", 2.0), 3.25)
  # The default is the padded length T, not the longest row: padding a column changes it.
  padded_x = np.pad(AGG_X, ((0, 0), (0, 4)))
  padded_mask = np.pad(AGG_MASK, ((0, 0), (0, 4)))
  np.testing.assert_allclose(losses.aggregate(padded_x, padded_mask, "seq-mean-token-sum-norm"),
                             0.8125)  # (7/8 + 6/8) / 2


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_reference(seed, mode):
  rng = np.random.default_rng(seed)
  mask = multiturn_mask(rng, 7, 20)
  turn = multiturn_turns(rng, mask)
  x = rng.normal(size=(7, 20)).astype(np.float32)
  x[mask == 0] = 1e3  # garbage that must be masked out
  np.testing.assert_allclose(losses.aggregate(x, mask, mode, turn=turn),
                             ref_aggregate(x, mask, mode, turn=turn), **TOL)
  np.testing.assert_allclose(losses.aggregate(x, mask, mode, 5.0, turn),
                             ref_aggregate(x, mask, mode, 5.0, turn), **TOL)
  # The gradient is the reference's per-token weights (masked positions get none).
  grad = jax.grad(lambda x: losses.aggregate(x, mask, mode, turn=turn))(jnp.asarray(x))
  np.testing.assert_allclose(grad, ref_aggregate_weights(mask, mode, turn=turn), **TOL)
  if mode in TURN_MODES:  # the case has turns of different lengths, continued across a gap
    groups = ref_turn_groups(mask, turn)
    assert len({len(p) for row in groups for p in row.values()}) > 2
    assert any(np.ptp(p) >= len(p) for row in groups for p in row.values())


def test_aggregate_unknown_mode_lists_modes():
  with pytest.raises(ValueError, match="token-means") as err:
    losses.aggregate(AGG_X, AGG_MASK, "token-means")
  for mode in MODES:
    assert mode in str(err.value)
  assert tuple(losses.AGGREGATION_MODES) == MODES and tuple(losses.TURN_MODES) == TURN_MODES


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_traced_once(assert_no_retrace, mode):
  rng = np.random.default_rng(3)
  calls = [((jnp.asarray(rng.normal(size=(4, 9)), jnp.float32),
             jnp.asarray(rng.integers(0, 2, size=(4, 9)), jnp.int32), mode),
            {"norm_constant": c, "turn": jnp.asarray(rng.integers(0, 4, size=(4, 9)), jnp.int32)})
           for c in (3.0, 7.0, 11.0)]
  assert_no_retrace(losses.aggregate, *calls)


# ----------------------------------------------------------------------------------------------------
# policy_loss

# Hand case: old = 0, ratios r = [1.1, 1.5, 0.5, 4.0, 100 (masked)], A = [1, 1, -1, -1, 1],
# clip range [0.8, 1.28] (clip-higher: clip_low 0.2, clip_high 0.28):
#   t0: max(-1.1, -1.1)   = -1.1  (inside the range)
#   t1: max(-1.5, -1.28)  = -1.28 (clipped)
#   t2: max(0.5, 0.8)     = 0.8   (clipped)
#   t3: max(4.0, 1.28)    = 4.0;  with dual clip 3: min(4.0, 3.0) = 3.0 (capped)
# token-mean: (-1.1 - 1.28 + 0.8 + 4.0) / 4 = 0.605; dual clip: (-1.1 - 1.28 + 0.8 + 3.0) / 4 = 0.355.
HAND_R = np.array([[1.1, 1.5, 0.5, 4.0, 100.0]])
HAND_LOGP = np.log(HAND_R).astype(np.float32)
HAND_OLD = np.zeros((1, 5), np.float32)
HAND_ADV = np.array([[1.0, 1.0, -1.0, -1.0, 1.0]], np.float32)
HAND_MASK = np.array([[1, 1, 1, 1, 0]], np.int32)


def test_policy_loss_by_hand():
  loss, m = losses.policy_loss(HAND_LOGP, HAND_OLD, HAND_ADV, HAND_MASK, clip_low=0.2, clip_high=0.28)
  assert loss.dtype == jnp.float32 and loss.shape == ()
  np.testing.assert_allclose(loss, 0.605, rtol=1e-6)
  assert_metrics(m, {
      "clipfrac": 0.5,  # t1, t2
      "clipfrac_lower": 0.0,
      "ratio_mean": 1.775,  # (1.1 + 1.5 + 0.5 + 4.0) / 4
      "approx_kl": -0.2984806,  # -(ln 1.1 + ln 1.5 + ln 0.5 + ln 4) / 4 = -ln(3.3) / 4
      # mean(r - 1 - ln r) = (0.0046898 + 0.0945349 + 0.1931472 + 1.6137056) / 4
      "approx_kl_k3": 0.4765194,
      # sorted [0.5, 1.1, 1.5, 4.0], lower order statistic at floor(q * 3) = 0, 0, 1, 2, 3
      "ratio_min": 0.5, "ratio_q05": 0.5, "ratio_q50": 1.1, "ratio_q95": 1.5, "ratio_max": 4.0,
  }, rtol=1e-6, atol=1e-6)
  # d loss / d logp_t = (1/4) * (-A_t r_t) on the unclipped branch, 0 where clipped or masked:
  # [-1.1/4, 0, 0, 4/4, 0].
  grad = jax.grad(lambda lp: losses.policy_loss(lp, HAND_OLD, HAND_ADV, HAND_MASK, clip_low=0.2,
                                                clip_high=0.28)[0])(jnp.asarray(HAND_LOGP))
  np.testing.assert_allclose(grad, [[-0.275, 0.0, 0.0, 1.0, 0.0]], atol=1e-6)


def test_policy_loss_dual_clip_by_hand():
  f = lambda lp: losses.policy_loss(lp, HAND_OLD, HAND_ADV, HAND_MASK, clip_low=0.2, clip_high=0.28,
                                    dual_clip=3.0)
  loss, m = f(HAND_LOGP)
  np.testing.assert_allclose(loss, 0.355, rtol=1e-6)
  np.testing.assert_allclose(m["clipfrac_lower"], 0.25)  # t3
  np.testing.assert_allclose(m["clipfrac"], 0.5)
  grad = jax.grad(lambda lp: f(lp)[0])(jnp.asarray(HAND_LOGP))
  np.testing.assert_allclose(grad, [[-0.275, 0.0, 0.0, 0.0, 0.0]], atol=1e-6)  # capped: no gradient


def test_policy_loss_is_weights_and_clamp_by_hand():
  # Weights [2, 1, 0.5, 0.25, 9 (masked)]: (-2.2 - 1.28 + 0.4 + 1.0) / 4 = -0.52.
  w = np.array([[2.0, 1.0, 0.5, 0.25, 9.0]], np.float32)
  loss, _ = losses.policy_loss(HAND_LOGP, HAND_OLD, HAND_ADV, HAND_MASK, clip_low=0.2, clip_high=0.28,
                               is_weights=w)
  np.testing.assert_allclose(loss, -0.52, rtol=1e-6)
  # The weights are detached.
  g = jax.grad(lambda w: losses.policy_loss(HAND_LOGP, HAND_OLD, HAND_ADV, HAND_MASK, is_weights=w)[0])(
      jnp.asarray(w))
  np.testing.assert_array_equal(g, 0.0)
  # log-ratio 25 is clamped to 20: r = e^20 = 4.8516520e8 (finite); with A = 1 the clipped branch
  # -1.2 wins; with A = -1 and dual clip 3 the loss is capped at 3.
  logp = np.array([[25.0, 25.0]], np.float32)
  zeros, ones = np.zeros((1, 2), np.float32), np.ones((1, 2), np.int32)
  loss, m = losses.policy_loss(logp, zeros, np.array([1.0, -1.0], np.float32)[None], ones,
                               dual_clip=3.0, agg="token-sum")
  np.testing.assert_allclose(loss, -1.2 + 3.0, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_max"], math.exp(20.0), rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", MODES)
def test_policy_loss_matches_reference(seed, agg):
  logp, old, adv, mask, _ = random_policy_case(seed)
  turn = multiturn_turns(np.random.default_rng(seed), mask)
  kw = dict(clip_low=0.2, clip_high=0.28, agg=agg, turn=turn)
  loss, metrics = losses.policy_loss(logp, old, adv, mask, **kw)
  want_loss, want_metrics, want_grad = ref_policy_loss(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, want_loss, **TOL)
  assert_metrics(metrics, want_metrics)
  assert 0.0 < float(metrics["clipfrac"]) < 1.0  # the case exercises both branches
  grad = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask, **kw)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(grad, want_grad, **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_policy_loss_dual_clip_is_weights_matches_reference(seed, agg):
  logp, old, adv, mask, w = random_policy_case(seed + 10)
  kw = dict(clip_low=0.1, clip_high=0.3, dual_clip=2.0, agg=agg, is_weights=w, norm_constant=16.0)
  loss, metrics = losses.policy_loss(logp, old, adv, mask, **kw)
  want_loss, want_metrics, want_grad = ref_policy_loss(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, want_loss, **TOL)
  assert_metrics(metrics, want_metrics)
  assert float(metrics["clipfrac_lower"]) > 0.0  # the dual clip is exercised
  grad = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask, **kw)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(grad, want_grad, **TOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_row_advantages_broadcast(seed):
  logp, old, _, mask, _ = random_policy_case(seed)
  row_adv = np.random.default_rng(seed).normal(size=(logp.shape[0],)).astype(np.float32)
  loss, metrics = losses.policy_loss(logp, old, row_adv, mask, agg="seq-mean-token-mean")
  want_loss, want_metrics, _ = ref_policy_loss(logp, old, row_adv, mask, agg="seq-mean-token-mean")
  np.testing.assert_allclose(loss, want_loss, **TOL)
  assert_metrics(metrics, want_metrics)
  full, _ = losses.policy_loss(logp, old, np.repeat(row_adv[:, None], logp.shape[1], 1), mask,
                               agg="seq-mean-token-mean")
  np.testing.assert_allclose(loss, full, rtol=1e-6)


def test_policy_loss_gradient_finite_differences():
  # Independent of the analytic reference: central differences of the float64 reference loss.
  logp, old, adv, mask, w = random_policy_case(21, b=3, t=10)
  kw = dict(clip_low=0.15, clip_high=0.25, dual_clip=2.5, agg="seq-mean-token-mean", is_weights=w)
  grad = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask, **kw)[0])(jnp.asarray(logp))
  eps = 1e-6
  fd = np.zeros(logp.shape)
  for idx in np.ndindex(logp.shape):
    hi, lo = logp.astype(np.float64), logp.astype(np.float64)
    hi[idx] += eps
    lo[idx] -= eps
    fd[idx] = (ref_policy_loss(hi, old, adv, mask, **kw)[0] -
               ref_policy_loss(lo, old, adv, mask, **kw)[0]) / (2 * eps)
  np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-5)


def test_policy_loss_empty_mask():
  logp, old, adv, _, _ = random_policy_case(4)
  loss, m = losses.policy_loss(logp, old, adv, np.zeros(logp.shape, np.int32))
  assert float(loss) == 0.0
  for k in ("clipfrac", "clipfrac_lower", "approx_kl", "approx_kl_k3", "ratio_mean"):
    assert float(m[k]) == 0.0, k
  for k, _ in QUANTILES:
    assert float(m[k]) == 1.0, k


def test_policy_loss_inputs_numpy_jax_bf16():
  logp, old, adv, mask, w = random_policy_case(5)
  a = losses.policy_loss(logp, old, adv, mask, is_weights=w)
  b = losses.policy_loss(*map(jnp.asarray, (logp, old, adv, mask)), is_weights=jnp.asarray(w))
  assert a[0].dtype == b[0].dtype == jnp.float32
  np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
  for k in a[1]:
    assert a[1][k].dtype == jnp.float32
    np.testing.assert_allclose(a[1][k], b[1][k], rtol=1e-6, err_msg=k)
  lp16, old16 = jnp.asarray(logp, jnp.bfloat16), jnp.asarray(old, jnp.bfloat16)
  loss16, m16 = losses.policy_loss(lp16, old16, jnp.asarray(adv, jnp.bfloat16), mask)
  assert loss16.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in m16.values())


@pytest.mark.parametrize("dual_clip", [1.0, 0.5])
def test_policy_loss_dual_clip_must_exceed_one(dual_clip):
  with pytest.raises(ValueError, match="dual_clip"):
    losses.policy_loss(HAND_LOGP, HAND_OLD, HAND_ADV, HAND_MASK, dual_clip=dual_clip)


def test_policy_loss_traced_once(assert_no_retrace):
  calls = []
  for seed, (lo, hi, c) in enumerate([(0.2, 0.2, 10.0), (0.1, 0.28, 12.0), (0.3, 0.25, 8.0)]):
    logp, old, adv, mask, w = map(jnp.asarray, random_policy_case(seed))
    calls.append(((logp, old, adv, mask), dict(clip_low=lo, clip_high=hi, dual_clip=3.0,
                                               agg="seq-mean-token-sum-norm", is_weights=w,
                                               norm_constant=c)))
  assert_no_retrace(losses.policy_loss, *calls)


# ----------------------------------------------------------------------------------------------------
# gspo_loss

# Hand case, clip range [0.7, 1.3]:
#   row 0: mask [1, 1, 0], logp - old = [0.1, 0.3, 5 (masked)] -> s = e^0.2 = 1.2214028, A = 1:
#          unclipped, per token -1.2214028.
#   row 1: mask [1, 0, 1], logp - old = [-0.2, 9 (masked), -0.6] -> s = e^-0.4 = 0.6703200, A = -1:
#          max(0.67032, 0.7) = 0.7 (clipped).
#   row 2: empty (A = 5 must not count).
# seq-mean-token-mean: (-1.2214028 + 0.7) / 2 = -0.2607014.
# Gradient: row 0 tokens -A s / (n_0 |R|) = -1.2214028 / 4 = -0.3053507; row 1 clipped: 0.
GSPO_OLD = np.array([[-1.0, -2.0, -1.0], [-0.5, -3.0, -1.5], [-1.0, -1.0, -1.0]], np.float32)
GSPO_LOGP = GSPO_OLD + np.array([[0.1, 0.3, 5.0], [-0.2, 9.0, -0.6], [1.0, 1.0, 1.0]], np.float32)
GSPO_ADV = np.array([1.0, -1.0, 5.0], np.float32)
GSPO_MASK = np.array([[1, 1, 0], [1, 0, 1], [0, 0, 0]], np.int32)


def test_gspo_loss_by_hand():
  f = lambda lp: losses.gspo_loss(lp, GSPO_OLD, GSPO_ADV, GSPO_MASK, clip_low=0.3, clip_high=0.3)
  loss, m = f(GSPO_LOGP)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, -0.2607014, rtol=1e-5)
  np.testing.assert_allclose(m["clipfrac"], 0.5, rtol=1e-6)  # the two row-1 tokens of 4
  # Token-weighted mean of the sequence ratio: (2 * 1.2214028 + 2 * 0.6703200) / 4 = 0.9458614.
  np.testing.assert_allclose(m["ratio_mean"], 0.9458614, rtol=1e-5)
  np.testing.assert_allclose(m["ratio_max"], 1.2214028, rtol=1e-5)
  np.testing.assert_allclose(m["ratio_min"], 0.6703200, rtol=1e-5)
  grad = jax.grad(lambda lp: f(lp)[0])(jnp.asarray(GSPO_LOGP))
  np.testing.assert_allclose(grad, [[-0.3053507, -0.3053507, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
                             rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", MODES)
def test_gspo_loss_matches_reference(seed, agg):
  logp, old, adv, mask, w = random_policy_case(seed, b=8)
  logp = (old + (logp - old) * 0.2).astype(np.float32)  # sequence ratios near 1 (and masked wild ones)
  # Per-token advantages (GSPO-token) and IS weights; a clip range that clips some rows but not all.
  kw = dict(clip_low=0.02, clip_high=0.03, agg=agg, is_weights=w, norm_constant=12.0,
            turn=multiturn_turns(np.random.default_rng(seed), mask))
  loss, metrics = losses.gspo_loss(logp, old, adv, mask, **kw)
  want_loss, want_metrics, want_grad = ref_gspo_loss(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, want_loss, **TOL)
  assert_metrics(metrics, want_metrics)
  assert 0.0 < float(metrics["clipfrac"]) < 1.0  # some rows clipped, some not
  grad = jax.grad(lambda lp: losses.gspo_loss(lp, old, adv, mask, **kw)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(grad, want_grad, **TOL)


def sequence_level_gspo(logp, old, adv, mask, clip_low, clip_high):
  """GSPO as the paper writes it (not the library's token form): J = 1/|R| sum_i max(-A_i s_i,
  -A_i clip(s_i)), s_i = exp(mean over valid tokens of logp - old)."""
  m = mask.astype(bool)
  n = m.sum(axis=1)
  s = jnp.exp(jnp.sum(jnp.where(m, logp - old, 0.0), axis=1) / np.maximum(n, 1))
  per_row = jnp.maximum(-adv * s, -adv * jnp.clip(s, 1 - clip_low, 1 + clip_high))
  return jnp.sum(jnp.where(n > 0, per_row, 0.0)) / np.sum(n > 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_gradient_equals_sequence_level_gspo(seed):
  logp, old, _, mask, _ = random_policy_case(seed, b=8)
  logp = (old + (logp - old) * 0.2).astype(np.float32)
  adv = np.random.default_rng(seed).normal(size=(8,)).astype(np.float32)
  f = lambda lp: losses.gspo_loss(lp, old, adv, mask, clip_low=0.02, clip_high=0.03)[0]
  g = lambda lp: sequence_level_gspo(lp, old, adv, mask, 0.02, 0.03)
  lp = jnp.asarray(logp)
  np.testing.assert_allclose(f(lp), g(lp), **TOL)
  got, want = jax.grad(f)(lp), jax.grad(g)(lp)
  np.testing.assert_allclose(got, want, **TOL)
  # Unclipped rows: every valid token gets -A_i s_i / (n_i |R|); at least one row must be unclipped.
  n = mask.sum(axis=1)
  got = np.asarray(got)
  s = np.exp(np.array([np.mean(logp[i][mask[i] == 1].astype(np.float64) - old[i][mask[i] == 1])
                       if n[i] else 0.0 for i in range(8)]))
  unclipped = (n > 0) & (s > 1 - 0.02) & (s < 1 + 0.03)
  assert unclipped.any()
  for i in np.flatnonzero(unclipped):
    np.testing.assert_allclose(got[i][mask[i] == 1], -adv[i] * s[i] / (n[i] * np.sum(n > 0)), **TOL)
  np.testing.assert_array_equal(got[mask == 0], 0.0)


def test_gspo_loss_numpy_and_jax_inputs():
  logp, old, adv, mask, _ = random_policy_case(6)
  a = losses.gspo_loss(logp, old, adv[:, 0], mask)
  b = losses.gspo_loss(*map(jnp.asarray, (logp, old, adv[:, 0], mask)))
  assert a[0].dtype == b[0].dtype == jnp.float32
  np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
  assert all(v.dtype == jnp.float32 for v in a[1].values())


def test_gspo_loss_traced_once(assert_no_retrace):
  calls = []
  for seed, (lo, hi) in enumerate([(3e-4, 4e-4), (1e-3, 2e-3), (0.1, 0.2)]):
    logp, old, adv, mask, w = map(jnp.asarray, random_policy_case(seed))
    calls.append(((logp, old, adv[:, 0], mask), dict(clip_low=lo, clip_high=hi, is_weights=w)))
  assert_no_retrace(losses.gspo_loss, *calls)


# ----------------------------------------------------------------------------------------------------
# kl


def test_kl_by_hand():
  logp = np.array([-1.0, -2.0, -1.0, -30.0, -4.0, -1.0], np.float32)
  ref = np.array([-2.0, -1.0, -1.0, -1.0, -1.0, -30.0], np.float32)
  # d = logp - ref = [1, -1, 0, -29, -3, 29]
  np.testing.assert_allclose(losses.kl(logp, ref, "k1"), [1, -1, 0, -29, -3, 29], atol=1e-6)
  np.testing.assert_allclose(losses.kl(logp, ref, "k2"), [0.5, 0.5, 0, 420.5, 4.5, 420.5], atol=1e-4)
  # k3 = e^x - x - 1, x = ref - logp = [-1, 1, 0, 29 -> 20, 3, -29 -> -20]:
  # [e^-1 = 0.3678794, e - 2 = 0.7182818, 0, >10 -> 10, e^3 - 4 = 16.09 -> 10, 19 -> 10].
  k3 = losses.kl(logp, ref, "k3")
  assert k3.dtype == jnp.float32
  np.testing.assert_allclose(k3, [0.3678794, 0.7182818, 0.0, 10.0, 10.0, 10.0], atol=1e-6)
  # The clamps keep the gradient finite (and zero beyond them).
  g = jax.grad(lambda lp: jnp.sum(losses.kl(lp, ref, "k3")))(jnp.asarray(logp))
  assert np.all(np.isfinite(g))
  # d/dlogp (e^x - x - 1) = 1 - e^x with x = ref - logp: [1 - e^-1, 1 - e, 0, 0, 0, 0].
  np.testing.assert_allclose(g, [0.6321206, -1.7182818, 0, 0, 0, 0], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_matches_reference(seed, kind):
  rng = np.random.default_rng(seed)
  logp = (-rng.exponential(2.0, size=(5, 16))).astype(np.float32)
  ref = (logp + rng.normal(0.0, 2.0, size=(5, 16))).astype(np.float32)
  ref[0, :3] = [40.0, -40.0, 15.0]  # beyond the clamps
  out = losses.kl(logp, ref, kind)
  assert out.dtype == jnp.float32 and out.shape == logp.shape
  np.testing.assert_allclose(out, ref_kl(logp, ref, kind), **TOL)
  np.testing.assert_array_equal(out, losses.kl(jnp.asarray(logp), jnp.asarray(ref), kind))
  if kind == "k3":
    assert np.all(np.asarray(out) >= 0.0) and np.all(np.asarray(out) <= 10.0)


def test_kl_unknown_kind():
  with pytest.raises(ValueError, match=r"k4.*k1.*k2.*k3"):
    losses.kl(np.zeros(3, np.float32), np.zeros(3, np.float32), "k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_traced_once(assert_no_retrace, kind):
  rng = np.random.default_rng(8)
  calls = [((jnp.asarray(rng.normal(size=(3, 7)), jnp.float32),
             jnp.asarray(rng.normal(size=(3, 7)), jnp.float32), kind), {}) for _ in range(3)]
  assert_no_retrace(losses.kl, *calls)


# ----------------------------------------------------------------------------------------------------
# value_loss

# Hand case, clip 0.2, v = [1, 2, 0], old = [0.5, 2, 0], R = [2, 1, 0.3]:
#   t0: (1-2)^2 = 1; v_clip = 0.5 + 0.2 = 0.7, (0.7-2)^2 = 1.69 -> 0.5 * 1.69 = 0.845 (clip active)
#   t1: (2-1)^2 = 1 = clipped -> 0.5
#   t2: 0.3^2 = 0.09 -> 0.045
# token-mean: (0.845 + 0.5 + 0.045) / 3 = 0.4633333; clip=None: 0.5 * (1 + 1 + 0.09) / 3 = 0.3483333.
# Explained variance: var(R) = (0.81 + 0.01 + 0.64) / 3, var(R - v = [1, -1, 0.3]) = (0.81 + 1.21 +
# 0.04) / 3 -> 1 - 2.06 / 1.46 = -0.4109589.
VL_V = np.array([[1.0, 2.0, 0.0, 50.0]], np.float32)  # last token masked
VL_OLD = np.array([[0.5, 2.0, 0.0, 0.0]], np.float32)
VL_R = np.array([[2.0, 1.0, 0.3, -50.0]], np.float32)
VL_MASK = np.array([[1, 1, 1, 0]], np.int32)


def test_value_loss_by_hand():
  loss, m = losses.value_loss(VL_V, VL_OLD, VL_R, VL_MASK, clip=0.2)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, 0.4633333, rtol=1e-6)
  assert_metrics(m, {"vf_clipfrac": 1 / 3, "vf_explained_var": -0.4109589, "value_mean": 1.0},
                 rtol=1e-5)
  loss, m = losses.value_loss(VL_V, VL_OLD, VL_R, VL_MASK, clip=None)
  np.testing.assert_allclose(loss, 0.3483333, rtol=1e-6)
  assert float(m["vf_clipfrac"]) == 0.0
  # Perfect values explain all the variance.
  _, m = losses.value_loss(VL_R, VL_R, VL_R, VL_MASK, clip=None)
  np.testing.assert_allclose(m["vf_explained_var"], 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [0.2, None])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_reference(seed, clip, agg):
  rng = np.random.default_rng(seed)
  mask = multiturn_mask(rng, 6, 20)
  old = rng.normal(size=(6, 20)).astype(np.float32)
  values = (old + rng.normal(0.0, 0.4, size=(6, 20))).astype(np.float32)
  returns = (old + rng.normal(0.0, 1.0, size=(6, 20))).astype(np.float32)
  returns[mask == 0] = 100.0
  loss, metrics = losses.value_loss(values, old, returns, mask, clip=clip, agg=agg)
  want_loss, want_metrics = ref_value_loss(values, old, returns, mask, clip, agg)
  np.testing.assert_allclose(loss, want_loss, **TOL)
  assert_metrics(metrics, want_metrics)
  if clip is not None:
    assert 0.0 < float(metrics["vf_clipfrac"]) < 1.0
  jax_loss, _ = losses.value_loss(*map(jnp.asarray, (values, old, returns, mask)), clip=clip, agg=agg)
  np.testing.assert_allclose(jax_loss, loss, rtol=1e-6)


def test_value_loss_traced_once(assert_no_retrace):
  rng = np.random.default_rng(9)
  calls = [(tuple(jnp.asarray(rng.normal(size=(3, 8)), jnp.float32) for _ in range(3)) +
            (jnp.asarray(rng.integers(0, 2, size=(3, 8)), jnp.int32),), {"clip": 0.3}) for _ in range(3)]
  assert_no_retrace(losses.value_loss, *calls)


# ----------------------------------------------------------------------------------------------------
# truncated_is_weights

# Hand case, C = 2:
#   row 0: old - rollout = [0.5, -1, 0.2, 7 (masked)]:
#     token:    [e^0.5 = 1.6487213, e^-1 = 0.3678794, e^0.2 = 1.2214028, 0]
#     sequence: e^(0.5 - 1 + 0.2) = e^-0.3 = 0.7408182 on the three valid tokens, 0 on the masked one
#   row 1: [1, 0.5, 3, x (masked)]: token [2 (e > 2), 1.6487213, 2, 0]; sequence e^4.5 -> 2.
IS_OLD = np.array([[0.5, -1.0, 0.2, 7.0], [1.0, 0.5, 3.0, -9.0]], np.float32) - 1.0
IS_ROLL = np.full((2, 4), -1.0, np.float32)
IS_MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], np.int32)


def test_truncated_is_weights_by_hand():
  tok = losses.truncated_is_weights(IS_OLD, IS_ROLL, IS_MASK, level="token", threshold=2.0)
  assert tok.dtype == jnp.float32
  np.testing.assert_allclose(tok, [[1.6487213, 0.3678794, 1.2214028, 0.0], [2.0, 1.6487213, 2.0, 0.0]],
                             rtol=1e-6)
  seq = losses.truncated_is_weights(IS_OLD, IS_ROLL, IS_MASK, level="sequence", threshold=2.0)
  np.testing.assert_allclose(seq, [[0.7408182] * 3 + [0.0], [2.0, 2.0, 2.0, 0.0]], rtol=1e-6)
  # A larger threshold lets e^4.5 = 90.0171313 through.
  seq = losses.truncated_is_weights(IS_OLD, IS_ROLL, IS_MASK, level="sequence", threshold=100.0)
  np.testing.assert_allclose(seq[1], [90.0171313] * 3 + [0.0], rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.5, 5.0])
def test_truncated_is_weights_matches_reference(seed, level, threshold):
  rng = np.random.default_rng(seed)
  mask = multiturn_mask(rng, 6, 20)
  rollout = (-rng.exponential(1.5, size=(6, 20))).astype(np.float32)
  old = (rollout + rng.normal(0.0, 0.3, size=(6, 20))).astype(np.float32)
  old[mask == 0] += 50.0  # masked garbage
  out = losses.truncated_is_weights(old, rollout, mask, level=level, threshold=threshold)
  assert out.dtype == jnp.float32
  want = ref_is_weights(old, rollout, mask, level, threshold)
  np.testing.assert_allclose(out, want, **TOL)
  np.testing.assert_array_equal(np.asarray(out)[mask == 0], 0.0)
  np.testing.assert_array_equal(
      out, losses.truncated_is_weights(*map(jnp.asarray, (old, rollout, mask)), level=level,
                                       threshold=threshold))
  # Detached: no gradient to either log-prob argument.
  f = lambda o, r: jnp.sum(losses.truncated_is_weights(o, r, mask, level=level, threshold=threshold))
  go, gr = jax.grad(f, argnums=(0, 1))(jnp.asarray(old), jnp.asarray(rollout))
  np.testing.assert_array_equal(go, 0.0)
  np.testing.assert_array_equal(gr, 0.0)


def test_truncated_is_weights_unknown_level():
  with pytest.raises(ValueError, match=r"tokens.*token.*sequence"):
    losses.truncated_is_weights(IS_OLD, IS_ROLL, IS_MASK, level="tokens")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_traced_once(assert_no_retrace, level):
  rng = np.random.default_rng(10)
  calls = [((jnp.asarray(rng.normal(size=(3, 8)), jnp.float32),
             jnp.asarray(rng.normal(size=(3, 8)), jnp.float32),
             jnp.asarray(rng.integers(0, 2, size=(3, 8)), jnp.int32)),
            {"level": level, "threshold": c}) for c in (2.0, 3.5, 10.0)]
  assert_no_retrace(losses.truncated_is_weights, *calls)


# ----------------------------------------------------------------------------------------------------
# truncated_is_policy_loss (behaviour-anchored truncated IS policy gradient)

# Hand case: behaviour 0, rho = [0.5, 1.0, 3.0, 100 (masked)], A = [1, -1, 2, 1], C = 2:
#   values -A min(rho, C): [-0.5, 1.0, -4.0]; token-mean -3.5 / 3 = -1.1666667;
#   gradient d/dlogp = -A min(rho, C) / 3: [-0.5, 1.0, -4.0] / 3 (the truncated token keeps C A).


def test_truncated_is_policy_loss_by_hand():
  logp = np.log(np.array([[0.5, 1.0, 3.0, 100.0]])).astype(np.float32)
  behavior = np.zeros((1, 4), np.float32)
  adv = np.array([[1.0, -1.0, 2.0, 1.0]], np.float32)
  mask = np.array([[1, 1, 1, 0]], np.int32)
  f = lambda lp: losses.truncated_is_policy_loss(lp, behavior, adv, mask, threshold=2.0)
  loss, m = f(logp)
  np.testing.assert_allclose(loss, -3.5 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["clipfrac"], 1 / 3, rtol=1e-6)  # the rho = 3 token is truncated
  np.testing.assert_allclose(m["ratio_mean"], 4.5 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_max"], 3.0, rtol=1e-6)
  grad = jax.grad(lambda lp: f(lp)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(grad, [[-0.5 / 3, 1.0 / 3, -4.0 / 3, 0.0]], rtol=1e-6)


def ref_truncated_is_policy_loss(logp, behavior, adv, mask, threshold, agg, turn=None):
  b, t = logp.shape
  per_token, dloss, rho = (np.zeros((b, t)) for _ in range(3))
  for i in range(b):
    for j in range(t):
      r = math.exp(clamp(float(logp[i, j]) - float(behavior[i, j]), -20.0, 20.0))
      rho[i, j] = r
      per_token[i, j] = -float(adv[i, j]) * min(r, threshold)
      dloss[i, j] = per_token[i, j]  # d/dlogp of -A w exp(logp - sg(logp)) with w detached
  loss = ref_aggregate(per_token, mask, agg, None, turn)
  grad = ref_aggregate_weights(mask, agg, None, turn) * dloss
  metrics = {"clipfrac": ref_masked_mean(rho > threshold, mask),
             "approx_kl": ref_masked_mean(behavior.astype(np.float64) - logp, mask),
             "ratio_mean": ref_masked_mean(rho, mask), **ref_quantiles(rho, mask)}
  return loss, metrics, grad


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("agg", MODES)
def test_truncated_is_policy_loss_matches_reference(seed, agg):
  logp, behavior, adv, mask, _ = random_policy_case(seed + 30)
  turn = multiturn_turns(np.random.default_rng(seed), mask)
  loss, metrics = losses.truncated_is_policy_loss(logp, behavior, adv, mask, threshold=1.5, agg=agg,
                                                  turn=turn)
  want_loss, want_metrics, want_grad = ref_truncated_is_policy_loss(logp, behavior, adv, mask, 1.5,
                                                                    agg, turn)
  np.testing.assert_allclose(loss, want_loss, **TOL)
  assert_metrics(metrics, want_metrics)
  assert 0.0 < float(metrics["clipfrac"]) < 1.0  # both truncated and untruncated tokens
  grad = jax.grad(lambda lp: losses.truncated_is_policy_loss(lp, behavior, adv, mask, threshold=1.5,
                                                             agg=agg, turn=turn)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(grad, want_grad, **TOL)


def test_truncated_is_policy_loss_on_policy_is_reinforce():
  """With logp == behaviour, the gradient is the policy gradient -A grad logp (aggregated)."""
  logp, _, adv, mask, _ = random_policy_case(40)
  grad = jax.grad(lambda lp: losses.truncated_is_policy_loss(
      lp, jax.lax.stop_gradient(lp), adv, mask, threshold=2.0)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(grad, -adv * ref_aggregate_weights(mask, "token-mean"), **TOL)
