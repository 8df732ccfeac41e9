"""Turn-level credit for multi-turn rows: GAE whose recursion counts turns, bi-level GAE, and
entropy-modulated policy gradients (EMPG).

The token estimators of `advantages.py` recurse over policy tokens, so a discount or a GAE lambda
below 1 decays with the number of tokens an agent emits, not with the number of decisions it takes.
Here the environment step (turn) is the unit:

  * `turn_start_values` reads the critic's value of each turn's state: the value at the turn's first
    policy token, which (critic values are aligned like log-probs, `update.critic_values`) is the
    value of the history up to the end of the observation, before any token of the action.
  * `turn_gae`: GAE over the `[B, S]` steps of each row, to be broadcast to the turn's tokens.
  * `bilevel_gae`: turn-level GAE, then token-level GAE inside each turn whose last token is
    rewarded with the turn's reward plus the discounted turn-level return of the next state (RAGEN's
    bi-level GAE, with the turn ends read from the structure, not from non-zero rewards).
  * `adaptive_lambda`: VAPO's length-adaptive lambda, for a length counted in tokens or turns.
  * `empg`: EMPG's entropy-modulated step advantages.

Shapes and masking follow `advantages.py`: `[B, L]` token arrays with `loss_mask` 1 on policy tokens
and `turn` the step index of each token (-1 outside steps); `[B, S]` step arrays with `step_mask`.
Everything is jitted and returns float32.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from longhorizon.core.advantages import (_as_bool, _as_f32, _dense_ids, _gae_scan, _group_moments,
                                         _per_row, _time_major,
                                         broadcast_steps, place_step_rewards)

__all__ = ["adaptive_lambda", "time_discounts", "turn_start_values", "turn_gae", "bilevel_gae",
           "step_means", "empg", "verifier_advantages"]

_F32 = jnp.float32


def _check_steps(step_rewards, step_mask):
  chex.assert_rank([step_rewards, step_mask], 2)
  chex.assert_equal_shape([step_rewards, step_mask])


def _check_tokens(turn, loss_mask, num_rows):
  chex.assert_rank([turn, loss_mask], 2)
  chex.assert_equal_shape([turn, loss_mask])
  chex.assert_type(turn, int)
  chex.assert_axis_dimension(turn, 0, num_rows)


def _policy_slots(turn, loss_mask, num_steps):
  """`[B, L]` step index of each policy token, `num_steps` on every other token (a spare slot)."""
  policy = _as_bool(loss_mask) & (turn >= 0) & (turn < num_steps)
  return jnp.where(policy, turn, num_steps), policy


@jax.jit
def time_discounts(durations: chex.Array, step_mask: chex.Array, rate) -> jax.Array:
  """Per-step discounts from each step's measured duration or cost (time-aware discounting):

      gamma_k = exp(-rate * d_k),

  so a step that took twice as long discounts what follows it twice as much (in log space), where a
  constant per-token or per-turn gamma charges a slow tool call and a fast one alike. `rate` is in
  1/seconds for latencies (`EpisodeBatch.latency`) or per cost unit (`EpisodeBatch.cost`). Feed
  the result as `gamma` to `turn_gae` or as GiGPO's step discount.

  Args:
    durations: `[B, S]` non-negative step durations or costs.
    step_mask: `[B, S]` 1 on steps that happened.
    rate: scalar `lambda >= 0`.

  Returns:
    `[B, S]` float32 discounts in `(0, 1]`, 1 where `step_mask` is 0.
  """
  durations, step_mask = jnp.asarray(durations), jnp.asarray(step_mask)
  _check_steps(durations, step_mask)
  d = jnp.maximum(_as_f32(durations), 0.0)
  return jnp.where(_as_bool(step_mask), jnp.exp(-_as_f32(rate) * d), 1.0)


@jax.jit
def adaptive_lambda(length: chex.Array, alpha) -> jax.Array:
  """VAPO's length-adaptive lambda, `max(0, 1 - 1 / (alpha * L))` (0 where `L` is 0).

  VAPO (Yue et al. 2025, Sec. 3.2) counts `L` in tokens with `alpha = 0.05`; an agent's actions are
  often a few tokens each, where that lambda is 0 and the final reward never reaches an early turn.
  Counting `L` in turns (with `alpha` near 1: `lam = 1 - 1/L`) keeps `sum_k lam^k ~ alpha * L` turns.

  Args:
    length: `[B]` lengths (tokens or turns).
    alpha: scalar or `[B]` coefficient.

  Returns:
    `[B]` float32 lambdas in `[0, 1)`.
  """
  length = _as_f32(length)
  alpha = _as_f32(alpha)
  return jnp.where(length > 0, jnp.maximum(0.0, 1.0 - 1.0 / (alpha * jnp.maximum(length, 1.0))), 0.0)


@jax.jit
def turn_start_values(values: chex.Array, turn: chex.Array, loss_mask: chex.Array,
                      step_mask: chex.Array) -> jax.Array:
  """`[B, S]` value of each turn's state: `values` at the turn's first policy token (0 for a step
  with no policy token or with `step_mask` 0).

  Args:
    values: `[B, L]` critic values aligned like log-probs (the value before token `t` at `t`).
    turn: `[B, L]` int step index of each token.
    loss_mask: `[B, L]` 1 on policy tokens.
    step_mask: `[B, S]` 1 on steps that happened.
  """
  values, turn, loss_mask, step_mask = map(jnp.asarray, (values, turn, loss_mask, step_mask))
  num_rows, length = turn.shape
  num_steps = step_mask.shape[1]
  _check_tokens(turn, loss_mask, step_mask.shape[0])
  chex.assert_equal_shape([values, turn])
  slot, _ = _policy_slots(turn, loss_mask, num_steps)
  positions = jnp.broadcast_to(jnp.arange(length), (num_rows, length))
  rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], (num_rows, length))
  first = jnp.full((num_rows, num_steps + 1), length, jnp.int32).at[rows, slot].min(positions)
  first = first[:, :num_steps]
  picked = jnp.take_along_axis(_as_f32(values), jnp.clip(first, 0, length - 1), axis=1)
  return jnp.where((first < length) & _as_bool(step_mask), picked, 0.0)


@jax.jit
def turn_gae(step_rewards: chex.Array, step_values: chex.Array, step_mask: chex.Array, *, gamma,
             lam, critic_lam=None):
  """GAE over environment steps (turns) instead of tokens.

      delta_k = r_k + gamma * V_{k'} - V_k,      A_k = delta_k + gamma * lam * A_{k'},

  with `k'` the next step with `step_mask` 1 and `V_{k'} = A_{k'} = 0` after the last one (no
  bootstrap). `gamma` and `lam` are per turn. The value targets are `GAE(critic_lam) + V`
  (`critic_lam=None`: `lam`). Place both on the turn's tokens with `broadcast_steps(., turn)`.

  Args:
    step_rewards: `[B, S]` per-step rewards.
    step_values: `[B, S]` state values (`turn_start_values`).
    step_mask: `[B, S]` 1 on steps that happened.
    gamma: scalar, `[B]`, or `[B, S]` per step (`time_discounts`: each step discounted by its
      own duration or cost).
    lam, critic_lam: scalars or `[B]`.

  Returns:
    `(advantages, returns)`, both `[B, S]` float32, 0 where `step_mask` is 0.
  """
  step_rewards, step_values, step_mask = map(jnp.asarray, (step_rewards, step_values, step_mask))
  _check_steps(step_rewards, step_mask)
  chex.assert_equal_shape([step_rewards, step_values])
  return _gae_scan(step_rewards, step_values, step_mask, gamma, lam, critic_lam)


def _next_valid(x, mask):
  """`[B, S]`: `x` at the next position after `s` whose mask is 1 (0 if there is none)."""
  x_tb, valid_tb = _time_major(_as_f32(x), _as_bool(mask))

  def step(following, xs):
    x_t, valid_t = xs
    return jnp.where(valid_t, x_t, following), following

  _, out_tb = jax.lax.scan(step, jnp.zeros(x.shape[0], _F32), (x_tb, valid_tb), reverse=True)
  return out_tb.T


def _last_policy_tokens(turn, loss_mask, num_steps):
  """`[B, L]` bool: the last policy token of each step."""
  num_rows, length = turn.shape
  slot, policy = _policy_slots(turn, loss_mask, num_steps)
  positions = jnp.broadcast_to(jnp.arange(length), (num_rows, length))
  rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], (num_rows, length))
  last = jnp.full((num_rows, num_steps + 1), -1, jnp.int32).at[rows, slot].max(positions)
  return policy & (jnp.take_along_axis(last, slot, axis=1) == positions)


def _segment_gae_scan(rewards, values, mask, ends, gamma, lam):
  """Token GAE over valid positions that never bootstraps across an `ends` position: the value and
  the running advantage after a turn's last token are 0."""
  num_rows = rewards.shape[0]
  gamma, lam = _per_row(gamma, num_rows), _per_row(lam, num_rows)
  rewards_tb, values_tb, valid_tb, ends_tb = _time_major(_as_f32(rewards), _as_f32(values),
                                                         _as_bool(mask), _as_bool(ends))

  def step(carry, xs):
    value_tp1, running = carry
    r_t, v_t, valid_t, end_t = xs
    value_tp1 = jnp.where(end_t, 0.0, value_tp1)
    running = jnp.where(end_t, 0.0, running)
    adv_t = r_t + gamma * value_tp1 - v_t + gamma * lam * running
    carry = (jnp.where(valid_t, v_t, value_tp1), jnp.where(valid_t, adv_t, running))
    return carry, (jnp.where(valid_t, adv_t, 0.0), jnp.where(valid_t, adv_t + v_t, 0.0))

  zeros = jnp.zeros(num_rows, _F32)
  _, (adv_tb, ret_tb) = jax.lax.scan(step, (zeros, zeros), (rewards_tb, values_tb, valid_tb, ends_tb),
                                     reverse=True)
  return adv_tb.T, ret_tb.T


@jax.jit
def bilevel_gae(step_rewards: chex.Array, step_mask: chex.Array, values: chex.Array,
                turn: chex.Array, loss_mask: chex.Array, *, gamma, lam, turn_gamma, turn_lam):
  """Bi-level GAE (RAGEN; Wang et al. 2025): a turn-level GAE, then a token-level GAE inside each
  turn.

  Turn level, with `V_k = turn_start_values(...)`: `G_k = GAE_k(turn_gamma, turn_lam) + V_k`, the
  lambda-return of the state before turn `k`. Token level: the last policy token of turn `k` is
  rewarded `r_k + turn_gamma * G_{k'}` (`k'` the next step, `G = 0` after the last), every other
  token 0, and token GAE(`gamma`, `lam`) runs over the turn's policy tokens without bootstrapping
  past its last one. With `gamma = lam = 1` every token of turn `k` gets
  `r_k + turn_gamma * G_{k'} - V_t`; with `turn_lam = 1` as well, its first token's advantage equals
  the turn-level one.

  Convention: RAGEN finds turn ends as the tokens with a non-zero reward, so a turn rewarded 0 is
  merged into the next; here turn ends come from `turn` and `loss_mask`, and every step counts.

  Args:
    step_rewards: `[B, S]` per-step rewards.
    step_mask: `[B, S]` 1 on steps that happened.
    values: `[B, L]` critic values aligned like log-probs.
    turn: `[B, L]` int step index of each token.
    loss_mask: `[B, L]` 1 on policy tokens.
    gamma, lam: scalars or `[B]`: token level.
    turn_gamma, turn_lam: scalars or `[B]`: turn level.

  Returns:
    `(advantages, returns)`, both `[B, L]` float32, 0 off the policy tokens of steps that happened.
  """
  step_rewards, step_mask, values, turn, loss_mask = map(
      jnp.asarray, (step_rewards, step_mask, values, turn, loss_mask))
  _check_steps(step_rewards, step_mask)
  _check_tokens(turn, loss_mask, step_rewards.shape[0])
  chex.assert_equal_shape([values, turn])
  num_steps = step_rewards.shape[1]
  step_values = turn_start_values(values, turn, loss_mask, step_mask)
  _, step_returns = _gae_scan(step_rewards, step_values, step_mask, turn_gamma, turn_lam)
  turn_gamma = _per_row(turn_gamma, step_rewards.shape[0])
  target = _as_f32(step_rewards) + turn_gamma[:, None] * _next_valid(step_returns, step_mask)
  target = jnp.where(_as_bool(step_mask), target, 0.0)
  in_steps = _as_bool(loss_mask) & (broadcast_steps(step_mask, turn) > 0)
  rewards = place_step_rewards(target, turn, in_steps)
  ends = _last_policy_tokens(turn, in_steps, num_steps)
  return _segment_gae_scan(rewards, values, in_steps, ends, gamma, lam)


@jax.jit
def step_means(token_values: chex.Array, turn: chex.Array, loss_mask: chex.Array,
               step_mask: chex.Array) -> jax.Array:
  """`[B, S]` mean of `token_values` over each step's policy tokens (0 for a step without any, or
  with `step_mask` 0); e.g. the step entropy from per-token entropies."""
  token_values, turn, loss_mask, step_mask = map(jnp.asarray, (token_values, turn, loss_mask,
                                                               step_mask))
  _check_tokens(turn, loss_mask, step_mask.shape[0])
  chex.assert_equal_shape([token_values, turn])
  num_rows, num_steps = step_mask.shape
  slot, policy = _policy_slots(turn, loss_mask, num_steps)
  rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], turn.shape)
  sums = jnp.zeros((num_rows, num_steps + 1), _F32).at[rows, slot].add(
      jnp.where(policy, _as_f32(token_values), 0.0))
  counts = jnp.zeros((num_rows, num_steps + 1), _F32).at[rows, slot].add(policy.astype(_F32))
  mean = sums[:, :num_steps] / jnp.maximum(counts[:, :num_steps], 1.0)
  return jnp.where(_as_bool(step_mask) & (counts[:, :num_steps] > 0), mean, 0.0)


@jax.jit
def empg(step_advantages: chex.Array, step_entropy: chex.Array, step_mask: chex.Array, *, k=1.0,
         k_future=1.0, zeta=0.1, eps=1e-8) -> jax.Array:
  """Entropy-modulated policy gradient step advantages (EMPG; Wang et al. 2025, "Harnessing
  Uncertainty: Entropy-Modulated Policy Gradients for Long-Horizon LLM Agents", arXiv 2509.09265).

  Over the valid steps of the batch (`step_mask` 1), with the step entropies min-max normalised,
  `h = (H - min H) / (max H - min H + eps)`:

      g_s = exp(-k * h_s) / mean_valid(exp(-k * h)),          (self-calibrating scale, mean 1)
      f_s = exp(-k_future * h_s),                              (future clarity)
      A'_s = g_s * A_s + zeta * f_{s'},                        (s' the next valid step of the row;
                                                                no bonus on a row's last step)

  and finally `A'` is centred to zero mean over the valid steps. Confident steps (low entropy) get
  larger updates in the direction of their advantage, uncertain ones smaller; steps that lead to a
  confident next step get a bonus.

  Args:
    step_advantages: `[B, S]` per-step advantages (e.g. the outcome advantage on every step).
    step_entropy: `[B, S]` mean token entropy of each step (`step_means`).
    step_mask: `[B, S]` 1 on valid steps (steps that happened, of rows in the loss).
    k, k_future, zeta: scalars.
    eps: added to the entropy range.

  Returns:
    `[B, S]` float32, 0 where `step_mask` is 0.
  """
  step_advantages, step_entropy, step_mask = map(jnp.asarray, (step_advantages, step_entropy,
                                                               step_mask))
  _check_steps(step_advantages, step_mask)
  chex.assert_equal_shape([step_advantages, step_entropy])
  valid = _as_bool(step_mask)
  h = _as_f32(step_entropy)
  lo = jnp.min(jnp.where(valid, h, jnp.inf))
  hi = jnp.max(jnp.where(valid, h, -jnp.inf))
  any_valid = jnp.any(valid)
  lo, hi = jnp.where(any_valid, lo, 0.0), jnp.where(any_valid, hi, 0.0)
  h = (h - lo) / (hi - lo + _as_f32(eps))
  weight = valid.astype(_F32)
  count = jnp.maximum(weight.sum(), 1.0)
  scale = jnp.exp(-_as_f32(k) * h)
  scale = scale / jnp.maximum(jnp.sum(scale * weight) / count, 1e-30)
  clarity = jnp.exp(-_as_f32(k_future) * h)
  has_next = _next_valid(jnp.ones_like(h), valid) > 0
  bonus = jnp.where(has_next, _as_f32(zeta) * _next_valid(clarity, valid), 0.0)
  modulated = scale * _as_f32(step_advantages) + bonus
  modulated = modulated - jnp.sum(modulated * weight) / count
  return jnp.where(valid, modulated, 0.0)


@functools.partial(jax.jit, static_argnames=("normalize_std",))
def verifier_advantages(step_scores: chex.Array, known: chex.Array, groups: chex.Array, *,
                        normalize_std: bool = True, eps=1e-6) -> jax.Array:
  """Step advantages from a step verifier's scores, kept apart from the outcome reward.

  A step verifier judges each action on its own (did it match the oracle's, did it reach a
  milestone); folding its score into the episode return would let a long episode of locally
  "good" steps outscore a short successful one (the "fake PRM" failure). Here its scores are
  compared within the task group instead, over every judged step of the group's episodes:

      A^V_{i,t} = (v_{i,t} - mean_g(v)) / (std_g(v) + eps)    (no division if not normalize_std)

  and added to an outcome estimator's step advantages by the caller. `std_g` is unbiased (n - 1);
  a group with fewer than 2 judged steps, or with equal scores, gets 0.

  Args:
    step_scores: `[B, S]` the verifier's score of each step.
    known: `[B, S]` 1 on the steps the verifier judged (steps that happened, rows in the loss).
    groups: `[B]` int task-group labels.
    normalize_std: divide by the group std (static).
    eps: added to the std.

  Returns:
    `[B, S]` float32, 0 where `known` is 0.
  """
  step_scores, known, groups = map(jnp.asarray, (step_scores, known, groups))
  _check_steps(step_scores, known)
  chex.assert_shape(groups, (step_scores.shape[0],))
  chex.assert_type(groups, int)
  member = _as_bool(known)
  ids = _dense_ids(jnp.broadcast_to(groups[:, None], step_scores.shape).reshape(-1))
  count, centred, std = _group_moments(_as_f32(step_scores).reshape(-1), ids,
                                       member.reshape(-1).astype(_F32))
  adv = centred / (std + _as_f32(eps)) if normalize_std else centred
  return jnp.where(member & (count.reshape(member.shape) > 1), adv.reshape(member.shape), 0.0)
