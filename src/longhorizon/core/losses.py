"""Policy, value and KL losses with explicit token aggregation.

Names: `logp` are log-probs of the sampled tokens under the policy being trained, `old_logp` under the
policy that the update's trust region is measured against (the policy before this update; recomputed by
the learner), `rollout_logp` the behaviour log-probs the sampler recorded, `ref_logp` a frozen reference
policy. All token arrays are `[B, T]` with `mask[B, T]` 1 on policy tokens; masked positions never
contribute. Losses are to be minimised and returned as float32 scalars with a dict of float32 metrics.
"""

from __future__ import annotations

import functools
from typing import Callable

import chex
import jax
import jax.numpy as jnp

__all__ = [
    "AGGREGATION_MODES",
    "TURN_MODES",
    "KL_ESTIMATORS",
    "aggregate",
    "policy_loss",
    "gspo_loss",
    "truncated_is_policy_loss",
    "kl",
    "value_loss",
    "truncated_is_weights",
    "masked_mean",
]

_F32 = jnp.float32
# exp() of a log-ratio is clamped to this range: beyond it the ratio is clipped away anyway and
# exp would overflow float32.
_MAX_LOG_RATIO = 20.0


def _f32(x):
  return jnp.asarray(x).astype(_F32)


def _bool(x):
  return jnp.asarray(x) != 0


def masked_mean(x, mask):
  """Mean of `x` over entries with mask 1 (0 when there are none)."""
  m = _bool(mask)
  return jnp.sum(jnp.where(m, _f32(x), 0.0)) / jnp.maximum(jnp.sum(m), 1).astype(_F32)


# ----------------------------------------------------------------------------------------------------
# Aggregation.


def _row_stats(x, mask):
  m = _bool(mask)
  row_sum = jnp.sum(jnp.where(m, x, 0.0), axis=-1)
  row_count = jnp.sum(m, axis=-1).astype(_F32)
  return row_sum, row_count, row_count > 0


def _mean_over_rows(per_row, has_tokens):
  return jnp.sum(jnp.where(has_tokens, per_row, 0.0)) / jnp.maximum(jnp.sum(has_tokens), 1).astype(_F32)


def _token_mean(x, mask, norm_constant, turn):
  del norm_constant, turn
  return masked_mean(x, mask)


def _token_sum(x, mask, norm_constant, turn):
  del norm_constant, turn
  return jnp.sum(jnp.where(_bool(mask), x, 0.0))


def _seq_mean_token_sum(x, mask, norm_constant, turn):
  del norm_constant, turn
  row_sum, _, has_tokens = _row_stats(x, mask)
  return _mean_over_rows(row_sum, has_tokens)


def _seq_mean_token_mean(x, mask, norm_constant, turn):
  del norm_constant, turn
  row_sum, row_count, has_tokens = _row_stats(x, mask)
  return _mean_over_rows(row_sum / jnp.maximum(row_count, 1.0), has_tokens)


def _seq_mean_token_sum_norm(x, mask, norm_constant, turn):
  del turn
  row_sum, _, has_tokens = _row_stats(x, mask)
  if norm_constant is None:
    norm_constant = x.shape[-1]
  return _mean_over_rows(row_sum / _f32(norm_constant), has_tokens)


def _turn_runs(mask, turn):
  """`(token_weight, turns_per_row)`: each masked token's `1 / n` with `n` the masked tokens of its
  turn in its row, and `[B]` the number of turns with masked tokens per row. A turn is a run of
  masked tokens of one row with the same `turn` id and no masked token of another turn between
  them (a turn's action is contiguous in an `EpisodeBatch`; unmasked observation tokens between two
  runs of one id do not split it). O(B T): no `[B, T, T]` comparison, no static turn count."""
  if turn is None:
    raise ValueError(f"the turn-level aggregation modes {TURN_MODES} need each token's turn id "
                     "(`turn`, the EpisodeBatch field of the same [B, T] shape); got None.")
  m = _bool(mask)
  turn = jnp.asarray(turn).astype(jnp.int32)
  chex.assert_equal_shape([m, turn])
  b, t = m.shape
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  last = jax.lax.cummax(jnp.where(m, pos, -1), axis=1)  # the last masked position <= t
  before = jnp.pad(last[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # ... < t
  prev_turn = jnp.take_along_axis(turn, jnp.maximum(before, 0), axis=1)
  starts = m & ((before < 0) | (turn != prev_turn))
  run = jnp.maximum(jnp.cumsum(starts, axis=1) - 1, 0) + t * jnp.arange(b)[:, None]
  count = jax.ops.segment_sum(m.astype(_F32).ravel(), run.ravel(), num_segments=b * t)
  weight = jnp.where(m, 1.0 / jnp.maximum(count[run], 1.0), 0.0)
  return weight, jnp.sum(starts, axis=1).astype(_F32)


def _turn_mean(x, mask, norm_constant, turn):
  del norm_constant
  weight, turns = _turn_runs(mask, turn)
  return jnp.sum(jnp.where(weight > 0, weight * x, 0.0)) / jnp.maximum(jnp.sum(turns), 1.0)


def _seq_mean_turn_mean(x, mask, norm_constant, turn):
  del norm_constant
  weight, turns = _turn_runs(mask, turn)
  per_row = jnp.sum(jnp.where(weight > 0, weight * x, 0.0), axis=-1) / jnp.maximum(turns, 1.0)
  return _mean_over_rows(per_row, turns > 0)


_AGGREGATORS: dict[str, Callable] = {
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
    "turn-mean": _turn_mean,
    "seq-mean-turn-mean": _seq_mean_turn_mean,
}
TURN_MODES = ("turn-mean", "seq-mean-turn-mean")  # the modes that read `turn`
AGGREGATION_MODES = tuple(_AGGREGATORS)


def _aggregator(mode: str) -> Callable:
  try:
    return _AGGREGATORS[mode]
  except KeyError:
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}.") from None


@functools.partial(jax.jit, static_argnames=("mode",))
def aggregate(x: chex.Array, mask: chex.Array, mode: str, norm_constant=None,
              turn: chex.Array | None = None) -> jax.Array:
  """Reduces a `[B, T]` per-token quantity to a scalar over the tokens with mask 1.

  Modes (`n_b` = valid tokens of row `b`, `R` = rows with `n_b > 0`):
    * `token-mean`: `sum_{b,t} x / sum_b n_b` (DAPO; every token weighs the same).
    * `token-sum`: `sum_{b,t} x`.
    * `seq-mean-token-sum`: `1/|R| sum_{b in R} sum_t x`.
    * `seq-mean-token-mean`: `1/|R| sum_{b in R} (1/n_b) sum_t x` (original GRPO; long rows' tokens
      weigh less).
    * `seq-mean-token-sum-norm`: `1/|R| sum_{b in R} (1/C) sum_t x` with the constant `C =
      norm_constant`, default the padded length `T` (Dr.GRPO). Convention: averaged over rows with
      tokens; verl's mode of this name sums over rows instead (a constant factor `B` apart).
    * `turn-mean`: `1/sum_b K_b sum_{b,k} (1/n_bk) sum_{t in turn k} x` with `n_bk` the valid
      tokens of turn `k` of row `b` and `K_b` the turns of row `b` with valid tokens: every turn
      of the batch weighs the same, however many tokens its action has (DAPO's token-level
      normalisation moved to turns: a long episode's turns are not diluted by its length, and a
      verbose turn does not outweigh a terse one).
    * `seq-mean-turn-mean`: `1/|R| sum_{b in R} (1/K_b) sum_k (1/n_bk) sum_{t in turn k} x`:
      every row weighs the same, and within it every turn.
  Sequence modes average over rows with at least one valid token (a row is an episode, or one
  context segment of it); with no valid token at all every mode returns 0. The turn modes read
  `turn` (`EpisodeBatch.turn`); a turn is a run of valid tokens with one turn id (`_turn_runs`).

  Args:
    x: `[B, T]` per-token values.
    mask: `[B, T]` 1 on tokens that count.
    mode: one of `AGGREGATION_MODES` (static).
    norm_constant: scalar `C` for `seq-mean-token-sum-norm` (ignored by other modes).
    turn: `[B, T]` int turn id of each token, for `TURN_MODES` (ignored by other modes).
  """
  x, mask = jnp.asarray(x), jnp.asarray(mask)
  chex.assert_rank(x, 2)
  chex.assert_equal_shape([x, mask])
  return _aggregator(mode)(_f32(x), mask, norm_constant, turn)


# ----------------------------------------------------------------------------------------------------
# Policy losses.


def _masked_quantiles(x, mask, qs):
  """Quantiles (lower order statistic) of the masked entries of `x`; 1.0 when none is masked in."""
  flat = jnp.where(_bool(mask), x, jnp.inf).reshape(-1)
  n = jnp.sum(_bool(mask))
  ordered = jnp.sort(flat)
  out = {}
  for name, q in qs:
    idx = jnp.clip(jnp.floor(q * (n - 1)).astype(jnp.int32), 0, flat.shape[0] - 1)
    out[name] = jnp.where(n > 0, ordered[idx], 1.0)
  return out


def _clipped_surrogate(log_ratio, advantages, mask, *, clip_low, clip_high, dual_clip, is_weights,
                       agg, norm_constant, turn, extra_metrics):
  """PPO clipped surrogate on given log-ratios; shared by `policy_loss` and `gspo_loss`."""
  ratio = jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
  loss_unclipped = -advantages * ratio
  loss_clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  per_token = jnp.maximum(loss_unclipped, loss_clipped)
  if dual_clip is not None:
    # Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): for A < 0
    # the loss is capped at -c * A, so a huge ratio on a bad action cannot blow the update up.
    lower_bound = -advantages * dual_clip
    capped = (advantages < 0) & (per_token > lower_bound)
    per_token = jnp.where(advantages < 0, jnp.minimum(per_token, lower_bound), per_token)
  else:
    capped = jnp.zeros_like(mask, dtype=bool)
  if is_weights is not None:
    per_token = per_token * jax.lax.stop_gradient(_f32(is_weights))
  loss = _aggregator(agg)(per_token, mask, norm_constant, turn)
  metrics = {
      "clipfrac": masked_mean(loss_clipped > loss_unclipped, mask),
      "clipfrac_lower": masked_mean(capped, mask),
      "ratio_mean": masked_mean(ratio, mask),
      **_masked_quantiles(ratio, mask, (("ratio_min", 0.0), ("ratio_q05", 0.05), ("ratio_q50", 0.5),
                                        ("ratio_q95", 0.95), ("ratio_max", 1.0))),
      **extra_metrics,
  }
  return loss, {k: _f32(v) for k, v in metrics.items()}


def _policy_inputs(logp, ref_logp, advantages, mask, is_weights=None, dual_clip=None):
  """Checks the shapes of a policy loss's inputs and returns `(logp, ref_logp, advantages, mask)`:
  log-probs and advantages in float32, `[B]` advantages broadcast to `[B, T]`."""
  logp, ref_logp, advantages, mask = map(jnp.asarray, (logp, ref_logp, advantages, mask))
  chex.assert_rank(logp, 2)
  chex.assert_equal_shape([logp, ref_logp, mask])
  if advantages.ndim == 1:
    chex.assert_shape(advantages, (logp.shape[0],))
  else:
    chex.assert_equal_shape([logp, advantages])
  if is_weights is not None:
    chex.assert_equal_shape([logp, is_weights])
  if dual_clip is not None and not dual_clip > 1.0:
    raise ValueError(f"dual_clip must be > 1 (it caps the loss at -dual_clip * A), got {dual_clip}.")
  advantages = _f32(advantages)
  if advantages.ndim == 1:
    advantages = jnp.broadcast_to(advantages[:, None], logp.shape)
  return _f32(logp), _f32(ref_logp), advantages, mask


@functools.partial(jax.jit, static_argnames=("dual_clip", "agg"))
def policy_loss(logp: chex.Array,
                old_logp: chex.Array,
                advantages: chex.Array,
                mask: chex.Array,
                *,
                clip_low=0.2,
                clip_high=0.2,
                dual_clip: float | None = None,
                agg: str = "token-mean",
                is_weights: chex.Array | None = None,
                norm_constant=None,
                turn: chex.Array | None = None):
  """PPO clipped policy loss (Schulman et al. 2017) with clip-higher, dual clip and IS weights.

      r_t = exp(clip(logp_t - old_logp_t, -20, 20))
      l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
      l_t = min(l_t, -dual_clip * A_t)          if dual_clip and A_t < 0
      l_t = w_t * l_t                            if is_weights (detached; truncated IS)
      loss = aggregate(l, mask, agg)

  `clip_high > clip_low` is DAPO's clip-higher (Yu et al. 2025).

  Args:
    logp: `[B, T]` log-probs under the current parameters.
    old_logp: `[B, T]` log-probs under the pre-update policy.
    advantages: `[B, T]` per-token (or `[B]` per-row) advantages.
    mask: `[B, T]` 1 on policy tokens.
    clip_low, clip_high: ratio clip range `[1 - clip_low, 1 + clip_high]`.
    dual_clip: constant `c > 1`, or None (static).
    agg: aggregation mode (static), see `aggregate`.
    is_weights: optional `[B, T]` importance weights, e.g. `truncated_is_weights`.
    norm_constant: constant for `seq-mean-token-sum-norm`.
    turn: `[B, T]` turn ids, for the turn-level modes (`TURN_MODES`).

  Returns:
    `(loss, metrics)`: `clipfrac` (share of tokens where the clipped branch is active),
    `clipfrac_lower` (share capped by the dual clip), `approx_kl` (`mean(old_logp - logp)`),
    `approx_kl_k3`, `ratio_mean` and ratio quantiles `ratio_{min,q05,q50,q95,max}`.
  """
  logp, old_logp, advantages, mask = _policy_inputs(logp, old_logp, advantages, mask, is_weights,
                                                    dual_clip)
  log_ratio = logp - old_logp
  extra = {
      "approx_kl": masked_mean(-log_ratio, mask),
      "approx_kl_k3": masked_mean(kl(old_logp, logp, "k3"), mask),
  }
  return _clipped_surrogate(log_ratio, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                            dual_clip=dual_clip, is_weights=is_weights, agg=agg,
                            norm_constant=norm_constant, turn=turn, extra_metrics=extra)


@functools.partial(jax.jit, static_argnames=("agg",))
def gspo_loss(logp: chex.Array,
              old_logp: chex.Array,
              advantages: chex.Array,
              mask: chex.Array,
              *,
              clip_low=3e-4,
              clip_high=4e-4,
              agg: str = "seq-mean-token-mean",
              is_weights: chex.Array | None = None,
              norm_constant=None,
              turn: chex.Array | None = None):
  """GSPO: PPO clipping on the sequence-level ratio (Zheng et al. 2025, "Group Sequence Policy
  Optimization"), in its GSPO-token form.

      log s_i = (1/|y_i|) sum_t (logp_t - old_logp_t)            (length-normalised, over mask)
      s_{i,t} = exp(sg[log s_i] + logp_t - sg[logp_t])           (value s_i, gradient of s_i * logp_t)
      l_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - clip_low, 1 + clip_high))

  With a per-sequence advantage this has exactly GSPO's gradient; per-token advantages are allowed
  (GSPO-token). Defaults follow the paper (clip 3e-4 / 4e-4, sequence-mean aggregation); every
  aggregation mode of `aggregate` is available. Rows without valid tokens contribute nothing.

  Args:
    logp, old_logp, mask: `[B, T]`.
    advantages: `[B]` or `[B, T]`.
    clip_low, clip_high: clip range of the sequence ratio.
    agg: aggregation mode (static).
    is_weights: optional `[B, T]` detached weights.
    norm_constant: constant for `seq-mean-token-sum-norm`.
    turn: `[B, T]` turn ids, for the turn-level modes (`TURN_MODES`).

  Returns:
    `(loss, metrics)` with the metrics of `policy_loss` computed on the sequence ratio.
  """
  logp, old_logp, advantages, mask = _policy_inputs(logp, old_logp, advantages, mask, is_weights)
  m = _bool(mask)
  token_log_ratio = jnp.where(m, logp - old_logp, 0.0)
  seq_log_ratio = jnp.sum(token_log_ratio, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1)
  log_ratio = jax.lax.stop_gradient(seq_log_ratio)[:, None] + logp - jax.lax.stop_gradient(logp)
  extra = {
      "approx_kl": masked_mean(-token_log_ratio, mask),
      "approx_kl_k3": masked_mean(kl(old_logp, logp, "k3"), mask),
  }
  return _clipped_surrogate(log_ratio, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                            dual_clip=None, is_weights=is_weights, agg=agg,
                            norm_constant=norm_constant, turn=turn, extra_metrics=extra)


@functools.partial(jax.jit, static_argnames=("agg",))
def truncated_is_policy_loss(logp: chex.Array,
                             behavior_logp: chex.Array,
                             advantages: chex.Array,
                             mask: chex.Array,
                             *,
                             threshold=2.0,
                             agg: str = "token-mean",
                             norm_constant=None,
                             turn: chex.Array | None = None):
  """Truncated importance-sampled policy gradient against the behaviour policy (no proximal policy,
  no PPO clip): the policy-gradient term of V-trace (Espeholt et al. 2018, "IMPALA", with
  `rho_bar = C`), as used for stale samples in asynchronous RL.

      rho_t = exp(clip(logp_t - behavior_logp_t, -20, 20))
      l_t   = -A_t * min(rho_t, C) * exp(logp_t - sg[logp_t])     (value -A_t min(rho_t, C))
      loss  = aggregate(l, mask, agg)

  The gradient is `-min(rho_t, C) A_t grad logp_t`: the importance weight is detached and truncated
  at `C`, so a token the current policy already likes far more than the behaviour policy did keeps
  a bounded push (unlike `min(rho, C)` itself, whose gradient vanishes past `C`). On-policy
  (`logp == behavior_logp`) it is REINFORCE with the given advantages.

  Args:
    logp: `[B, T]` log-probs under the current parameters.
    behavior_logp: `[B, T]` log-probs the sampler recorded (the behaviour policy).
    advantages: `[B, T]` per-token (or `[B]` per-row) advantages.
    mask: `[B, T]` 1 on policy tokens.
    threshold: truncation constant `C > 0`.
    agg: aggregation mode (static), see `aggregate`.
    norm_constant: constant for `seq-mean-token-sum-norm`.
    turn: `[B, T]` turn ids, for the turn-level modes (`TURN_MODES`).

  Returns:
    `(loss, metrics)` with the keys of `policy_loss`: `clipfrac` is the share of truncated tokens
    (`rho > C`), `clipfrac_lower` 0, `approx_kl` / `approx_kl_k3` and the ratio statistics are of
    `rho` (current against behaviour).
  """
  logp, behavior_logp, advantages, mask = _policy_inputs(logp, behavior_logp, advantages, mask)
  log_ratio = logp - behavior_logp
  rho = jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
  weight = jax.lax.stop_gradient(jnp.minimum(rho, _f32(threshold)))
  per_token = -advantages * weight * jnp.exp(logp - jax.lax.stop_gradient(logp))
  loss = _aggregator(agg)(per_token, mask, norm_constant, turn)
  metrics = {
      "clipfrac": masked_mean(rho > threshold, mask),
      "clipfrac_lower": jnp.zeros((), _F32),
      "ratio_mean": masked_mean(rho, mask),
      **_masked_quantiles(rho, mask, (("ratio_min", 0.0), ("ratio_q05", 0.05), ("ratio_q50", 0.5),
                                      ("ratio_q95", 0.95), ("ratio_max", 1.0))),
      "approx_kl": masked_mean(-log_ratio, mask),
      "approx_kl_k3": masked_mean(kl(behavior_logp, logp, "k3"), mask),
  }
  return loss, {k: _f32(v) for k, v in metrics.items()}


# ----------------------------------------------------------------------------------------------------
# KL, value loss, importance weights.


def _k1(log_ratio):
  return log_ratio


def _k2(log_ratio):
  return 0.5 * log_ratio**2


def _k3(log_ratio):
  # Schulman's unbiased, always non-negative estimator of KL(pi || ref) with samples from pi:
  # exp(ref - logp) - (ref - logp) - 1. Clamped like k1/k2's ratio, and the value at 10 (as verl's
  # low_var_kl) so one wild token cannot dominate.
  neg = jnp.clip(-log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  return jnp.clip(jnp.exp(neg) - neg - 1.0, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable] = {"k1": _k1, "k2": _k2, "k3": _k3}


@functools.partial(jax.jit, static_argnames=("kind",))
def kl(logp: chex.Array, ref_logp: chex.Array, kind: str) -> jax.Array:
  """Per-token estimators of `KL(pi || ref)` from tokens sampled by `pi` (Schulman 2020, "Approximating
  KL Divergence").

    * `k1`: `logp - ref_logp` (unbiased, high variance, can be negative).
    * `k2`: `0.5 * (logp - ref_logp)^2` (biased, low variance; its gradient is the true KL's).
    * `k3`: `exp(ref - logp) - (ref - logp) - 1`, `ref - logp` clamped to `[-20, 20]`, value clamped
      to at most 10 (unbiased, non-negative).

  Args:
    logp, ref_logp: same shape, any rank.
    kind: `k1`, `k2` or `k3` (static).

  Returns:
    Float32 array of `logp`'s shape (unmasked: aggregate with the loss mask).
  """
  logp, ref_logp = jnp.asarray(logp), jnp.asarray(ref_logp)
  chex.assert_equal_shape([logp, ref_logp])
  try:
    estimator = KL_ESTIMATORS[kind]
  except KeyError:
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {tuple(KL_ESTIMATORS)}.") from None
  return estimator(_f32(logp) - _f32(ref_logp))


@functools.partial(jax.jit, static_argnames=("clip", "agg"))
def value_loss(values: chex.Array,
               old_values: chex.Array,
               returns: chex.Array,
               mask: chex.Array,
               *,
               clip: float | None,
               agg: str = "token-mean",
               turn: chex.Array | None = None):
  """Clipped value loss (PPO2 / OpenAI baselines); `clip` has no default (the learner passes
  `LossOptions.value_clip`, the one place it is set):

      v_clip = old + clip(v - old, -clip, clip)
      l_t = 0.5 * max((v - R)^2, (v_clip - R)^2)          (clip=None: 0.5 * (v - R)^2)

  Args:
    values: `[B, T]` current critic values.
    old_values: `[B, T]` values recorded when the batch was collected.
    returns: `[B, T]` value targets.
    mask: `[B, T]` 1 on tokens with a target.
    clip: clip range (static) or None.
    agg: aggregation mode (static).
    turn: `[B, T]` turn ids, for the turn-level modes (`TURN_MODES`).

  Returns:
    `(loss, metrics)`: `vf_clipfrac` (share of tokens where the clipped branch is larger),
    `vf_explained_var` (`1 - var(R - v) / var(R)` over the mask), `value_mean`.
  """
  values, old_values, returns, mask = map(jnp.asarray, (values, old_values, returns, mask))
  chex.assert_rank(values, 2)
  chex.assert_equal_shape([values, old_values, returns, mask])
  if clip is not None and not clip > 0:
    raise ValueError(f"value clip must be > 0 or None, got {clip}.")
  values, old_values, returns = _f32(values), _f32(old_values), _f32(returns)
  err = (values - returns)**2
  if clip is None:
    per_token = 0.5 * err
    clipped_active = jnp.zeros_like(err, dtype=bool)
  else:
    v_clip = old_values + jnp.clip(values - old_values, -clip, clip)
    err_clip = (v_clip - returns)**2
    per_token = 0.5 * jnp.maximum(err, err_clip)
    clipped_active = err_clip > err
  residual = returns - values
  var_r = masked_mean((returns - masked_mean(returns, mask))**2, mask)
  var_res = masked_mean((residual - masked_mean(residual, mask))**2, mask)
  metrics = {
      "vf_clipfrac": masked_mean(clipped_active, mask),
      "vf_explained_var": jnp.where(var_r > 0, 1.0 - var_res / jnp.maximum(var_r, 1e-12), 0.0),
      "value_mean": masked_mean(values, mask),
  }
  return _aggregator(agg)(per_token, mask, None, turn), {k: _f32(v) for k, v in metrics.items()}


_IS_LEVELS = ("token", "sequence")


@functools.partial(jax.jit, static_argnames=("level",))
def truncated_is_weights(old_logp: chex.Array,
                         rollout_logp: chex.Array,
                         mask: chex.Array,
                         *,
                         level: str = "token",
                         threshold=2.0) -> jax.Array:
  """Truncated importance weights correcting rollout/trainer mismatch (TIS; Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training"; also DART's asynchronous
  correction).

      token:    w_t = min(exp(old_logp_t - rollout_logp_t), C)
      sequence: w_t = min(exp(sum_{t' in mask} (old_logp_t' - rollout_logp_t')), C)   for every t of the row

  Log-ratios are clamped to `[-20, 20]` before `exp`. The weights are detached (`stop_gradient`) and 0
  where `mask` is 0.

  Args:
    old_logp: `[B, T]` log-probs under the trainer's pre-update policy.
    rollout_logp: `[B, T]` behaviour log-probs recorded by the sampler.
    mask: `[B, T]` 1 on policy tokens.
    level: `token` or `sequence` (static).
    threshold: truncation constant `C`.

  Returns:
    `[B, T]` float32 weights in `[0, C]`.
  """
  old_logp, rollout_logp, mask = map(jnp.asarray, (old_logp, rollout_logp, mask))
  chex.assert_rank(old_logp, 2)
  chex.assert_equal_shape([old_logp, rollout_logp, mask])
  if level not in _IS_LEVELS:
    raise ValueError(f"unknown importance-sampling level {level!r}; expected one of {_IS_LEVELS}.")
  m = _bool(mask)
  log_ratio = jnp.where(m, _f32(old_logp) - _f32(rollout_logp), 0.0)
  if level == "sequence":
    log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, axis=-1, keepdims=True), log_ratio.shape)
  weights = jnp.minimum(jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)), _f32(threshold))
  return jax.lax.stop_gradient(jnp.where(m, weights, 0.0))
