"""Advantage estimators for multi-turn agent RL.

All estimators are pure, jitted and vectorised over the batch: recursions over time are one
`lax.scan`, group statistics are segment sums over dense group ids obtained by sorting, never Python
loops or dicts. Every function accepts NumPy or JAX arrays and returns float32.

Shapes and names used throughout:
  * `B` rows (episodes), `T` (or `L`) token positions, `S` environment steps, `N` episodes in a flat
    list of scores.
  * `mask[B, T]` / `loss_mask`: 1 on policy-sampled tokens, 0 on prompt, observation and padding
    tokens. Token recursions skip mask-0 positions: the running quantities carry through an
    observation span unchanged, so the discount counts policy tokens, not tokens. Outputs are 0 where
    the mask is 0.
  * `groups[N]`: arbitrary integer labels (not necessarily `0..G-1` or contiguous); rollouts of the
    same task share one.
  * `valid[N]` (optional): 0 for episodes excluded from training (environment errors); they neither
    enter group statistics nor receive an advantage.

Conventions deliberately different from some references are marked "Convention:".
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

__all__ = [
    "gae",
    "length_adaptive_gae",
    "masked_whiten",
    "discounted_returns",
    "grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gigpo",
    "step_group_ids",
    "broadcast_steps",
    "place_step_rewards",
]

_F32 = jnp.float32


def _as_f32(x):
  return jnp.asarray(x).astype(_F32)


def _as_bool(x):
  return jnp.asarray(x) != 0


def _per_row(x, num_rows: int):
  """A scalar or `[B]` hyper-parameter as a `[B]` float32 vector."""
  x = _as_f32(x)
  chex.assert_rank(x, {0, 1})
  return jnp.broadcast_to(x, (num_rows,))


def _per_position(x, shape):
  """A scalar, `[B]` or `[B, T]` discount as a `[B, T]` float32 array (one value per position:
  time- and cost-aware discounting gives each step its own)."""
  x = _as_f32(x)
  chex.assert_rank(x, {0, 1, 2})
  return jnp.broadcast_to(x[:, None] if x.ndim == 1 else x, shape)


def _time_major(*xs):
  # Materialise the transposes before the scan: left to fusion, XLA reads them strided inside the loop
  # body, which was 3-4x slower on CPU.
  return jax.lax.optimization_barrier(tuple(x.T for x in xs))


# ----------------------------------------------------------------------------------------------------
# Token-level recursions.


def _check_token_inputs(*arrays):
  for a in arrays:
    chex.assert_rank(a, 2)
  chex.assert_equal_shape(arrays)


@jax.jit
def discounted_returns(rewards: chex.Array, mask: chex.Array, gamma) -> jax.Array:
  """Masked reward-to-go `G_t = r_t + gamma * G_{t'}`, `t'` the next position with mask 1.

  Positions with mask 0 are skipped (their reward is ignored and the running return carries through
  them unchanged); after the last valid position the return bootstraps to 0.

  Args:
    rewards: `[B, T]` per-token rewards (a step's reward sits on its last policy token, see
      `place_step_rewards`).
    mask: `[B, T]` 1 on positions that take part in the recursion.
    gamma: scalar, `[B]` or `[B, T]` discount per valid position (`[B, T]`: position `t`'s
      `gamma_t` discounts the return that follows it).

  Returns:
    `[B, T]` float32 returns, 0 where `mask` is 0.
  """
  rewards, mask = jnp.asarray(rewards), jnp.asarray(mask)
  _check_token_inputs(rewards, mask)
  gamma = _per_position(gamma, rewards.shape)
  rewards_tb, valid_tb, gamma_tb = _time_major(_as_f32(rewards), _as_bool(mask), gamma)

  def step(g_next, xs):
    r_t, valid_t, gamma_t = xs
    g_t = jnp.where(valid_t, r_t + gamma_t * g_next, g_next)
    return g_t, jnp.where(valid_t, g_t, 0.0)

  _, returns_tb = jax.lax.scan(step, jnp.zeros(rewards.shape[0], _F32),
                               (rewards_tb, valid_tb, gamma_tb), reverse=True)
  return returns_tb.T


def _gae_scan(rewards, values, mask, gamma, lam, critic_lam=None):
  """One reverse scan giving GAE(lam) advantages and GAE(critic_lam) + V returns (`critic_lam=None`:
  the same lam). Both outputs are emitted time-major by the scan and transposed once: computing the
  returns from the transposed advantages afterwards cost an extra pass that doubled the time on CPU."""
  num_rows = rewards.shape[0]
  lams = (_per_row(lam, num_rows),) + (() if critic_lam is None else (_per_row(critic_lam, num_rows),))
  rewards_tb, values_tb, valid_tb, gamma_tb = _time_major(
      _as_f32(rewards), _as_f32(values), _as_bool(mask), _per_position(gamma, rewards.shape))

  def step(carry, xs):
    value_tp1, running = carry
    r_t, v_t, valid_t, gamma = xs
    delta_t = r_t + gamma * value_tp1 - v_t
    adv_t = tuple(delta_t + gamma * lam_ * run for lam_, run in zip(lams, running))
    running = tuple(jnp.where(valid_t, a, run) for a, run in zip(adv_t, running))
    value_tp1 = jnp.where(valid_t, v_t, value_tp1)
    outputs = (jnp.where(valid_t, adv_t[0], 0.0), jnp.where(valid_t, adv_t[-1] + v_t, 0.0))
    return (value_tp1, running), outputs

  zeros = jnp.zeros(num_rows, _F32)
  _, outputs_tb = jax.lax.scan(step, (zeros, tuple(zeros for _ in lams)),
                               (rewards_tb, values_tb, valid_tb, gamma_tb), reverse=True)
  advantages_tb, returns_tb = jax.lax.optimization_barrier(outputs_tb)
  return advantages_tb.T, returns_tb.T


@jax.jit
def gae(rewards: chex.Array, values: chex.Array, mask: chex.Array, *, gamma, lam, critic_lam=None):
  """Generalised advantage estimation over the policy tokens of multi-turn rows.

  Recursion over valid positions only (Schulman et al. 2016, "High-Dimensional Continuous Control
  Using Generalized Advantage Estimation"):

      delta_t = r_t + gamma * V_{t'} - V_t,      A_t = delta_t + gamma * lam * A_{t'},

  where `t'` is the next position with mask 1 (observation tokens in between are skipped: `V_{t'}` and
  `A_{t'}` carry through them) and `V_{t'} = A_{t'} = 0` after the last valid position (no bootstrap:
  rows end in a terminal state or are truncated on purpose). Rewards at mask-0 positions are ignored.
  `returns = A + V` on valid positions (with `critic_lam`: `GAE(critic_lam) + V`, from the same
  scan). No whitening here: use `masked_whiten`.

  Args:
    rewards: `[B, T]` token rewards.
    values: `[B, T]` critic values `V(h_t)`.
    mask: `[B, T]` 1 on policy tokens.
    gamma: scalar or `[B]` discount per policy token.
    lam: scalar or `[B]` GAE lambda.
    critic_lam: optional scalar or `[B]` lambda of the value targets (None: `lam`).

  Returns:
    `(advantages, returns)`, both `[B, T]` float32 and 0 where `mask` is 0.
  """
  rewards, values, mask = map(jnp.asarray, (rewards, values, mask))
  _check_token_inputs(rewards, values, mask)
  return _gae_scan(rewards, values, mask, gamma, lam, critic_lam)


@jax.jit
def length_adaptive_gae(rewards: chex.Array, values: chex.Array, mask: chex.Array, *, gamma,
                        alpha=0.05, critic_lam=1.0):
  """Length-adaptive GAE (VAPO; Yue et al. 2025, "VAPO: Efficient and Reliable Reinforcement Learning
  for Advanced Reasoning Tasks", Sec. 3.2).

  The policy's lambda is set per row from its number of policy tokens `L`:

      lam_policy = max(0, 1 - 1 / (alpha * L))      (L = 0 -> lam_policy = 0),

  so `sum_t lam^t ~ alpha * L` and the final reward reaches early tokens of long rows. The value
  targets come from a second GAE pass with `critic_lam` (VAPO uses 1.0: Monte-Carlo targets for the
  critic): `returns = GAE(critic_lam) + V`. Both passes share one scan. Masking as in `gae`.

  Args:
    rewards, values, mask: `[B, T]` as in `gae`.
    gamma: scalar or `[B]` discount.
    alpha: scalar length coefficient (VAPO: 0.05).
    critic_lam: scalar or `[B]` lambda of the value targets.

  Returns:
    `(advantages, returns)`, both `[B, T]` float32, 0 where `mask` is 0.
  """
  rewards, values, mask = map(jnp.asarray, (rewards, values, mask))
  _check_token_inputs(rewards, values, mask)
  length = jnp.sum(_as_bool(mask), axis=-1).astype(_F32)
  alpha = _as_f32(alpha)
  lam_policy = jnp.where(length > 0, jnp.maximum(0.0, 1.0 - 1.0 / (alpha * jnp.maximum(length, 1.0))),
                         0.0)
  return _gae_scan(rewards, values, mask, gamma, lam_policy, critic_lam)


@jax.jit
def masked_whiten(x: chex.Array, mask: chex.Array, eps=1e-8) -> jax.Array:
  """`(x - mean) / sqrt(var + eps)` with mean and unbiased variance over the masked entries only.

  Statistics are over all entries of `x` with mask 1 (the whole batch, as in PPO advantage
  whitening); the variance divides by `n - 1` (`n = 1` gives variance 0). Entries with mask 0 are
  returned as 0. An all-zero mask returns zeros.

  Args:
    x: any shape.
    mask: same shape as `x`.
    eps: added to the variance.
  """
  x, mask = jnp.asarray(x), jnp.asarray(mask)
  chex.assert_equal_shape([x, mask])
  x = _as_f32(x)
  m = _as_bool(mask)
  n = jnp.sum(m).astype(_F32)
  mean = jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(n, 1.0)
  var = jnp.sum(jnp.where(m, (x - mean)**2, 0.0)) / jnp.maximum(n - 1.0, 1.0)
  return jnp.where(m, (x - mean) * jax.lax.rsqrt(var + eps), 0.0)


# ----------------------------------------------------------------------------------------------------
# Group statistics by sorting (labels are arbitrary integers).
#
# XLA:CPU sorts a single array on a fast path but compares multi-operand sorts (argsort, lexsort)
# through a generic comparator, ~7x slower at 40k elements. So segment ids are positions in a sorted
# copy of one key (found by binary search), not ranks from an argsort. Several keys are first hashed
# into one; a hash collision (two different key tuples, one hash) is detected exactly and then the
# ids are recomputed with a lexsort, so the result never depends on the hash.


def _as_u32(key):
  key = jnp.asarray(key)
  if key.dtype == jnp.int32:
    return jax.lax.bitcast_convert_type(key, jnp.uint32)
  return key.astype(jnp.uint32)


def _mix(h):
  # murmur3's 32-bit finaliser: every input bit affects every output bit.
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _hash_keys(keys):
  """One uint32 hash of several uint32 key arrays (elementwise)."""
  h = jnp.uint32(0x9E3779B9)
  for k in keys:
    h = _mix(h ^ _mix(k))
  return h


def _first_position_ids(key):
  """For each element, the first position of its value in `sort(key)`: equal values share an id."""
  ordered = jnp.sort(key)
  return jnp.searchsorted(ordered, key, side="left", method="scan_unrolled").astype(jnp.int32)


def _lexsort_ids(keys):
  """Exact dense ids from a lexicographic argsort (the slow path, used after a hash collision)."""
  n = keys[0].shape[0]
  order = jnp.lexsort(keys[::-1])
  sorted_keys = [k[order] for k in keys]
  new_segment = jnp.zeros(n, bool).at[1:].set(
      functools.reduce(jnp.logical_or, [k[1:] != k[:-1] for k in sorted_keys]))
  return jnp.zeros(n, jnp.int32).at[order].set(jnp.cumsum(new_segment.astype(jnp.int32)))


def _dense_ids(*keys):
  """Segment ids in `[0, N)` such that two elements share an id iff all their keys are equal.

  Args:
    *keys: `[N]` integer arrays (int32, uint32 or narrower).

  Returns:
    `[N]` int32 ids (not contiguous; use them with `num_segments=N`).
  """
  keys = [_as_u32(k) for k in keys]
  if len(keys) == 1:
    return _first_position_ids(keys[0])
  h = _hash_keys(keys)
  ids = _first_position_ids(h)
  n = h.shape[0]
  # Exact collision test: within every id, each key must be constant (equal to its segment minimum).
  collided = functools.reduce(jnp.logical_or, [
      jnp.any(jax.ops.segment_min(k, ids, num_segments=n)[ids] != k) for k in keys])
  return jax.lax.cond(collided, lambda: _lexsort_ids(keys), lambda: ids)


def _group_moments(x, ids, weight):
  """Per element: its group's size, `x - mean_g` and the unbiased std (weighted by 0/1 `weight`).

  Statistics are computed on `x` shifted by its group's maximum, so a group of identical scores gives
  exactly zero (in float32, `x - mean(x)` of identical large values is not exactly 0, and divided by
  `std + eps` ~ 1e-6 it became O(1)).
  """
  n = x.shape[0]
  member = weight > 0
  shift = jax.ops.segment_max(jnp.where(member, x, -jnp.inf), ids, num_segments=n)[ids]
  shifted = jnp.where(member, x - shift, 0.0)
  count = jax.ops.segment_sum(weight, ids, num_segments=n)
  mean = jax.ops.segment_sum(shifted, ids, num_segments=n) / jnp.maximum(count, 1.0)
  centred = jnp.where(member, shifted - mean[ids], 0.0)
  sq = jax.ops.segment_sum(centred**2, ids, num_segments=n)
  std = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))
  return count[ids], centred, std[ids]


def _check_scores(scores, groups, valid):
  chex.assert_rank(scores, 1)
  chex.assert_equal_shape([scores, groups])
  chex.assert_type(groups, int)
  if valid is not None:
    chex.assert_equal_shape([scores, valid])


def _valid_weight(valid, like):
  if valid is None:
    return jnp.ones(like.shape, _F32)
  return _as_bool(valid).astype(_F32)


def _group_normalise(scores, ids, weight, normalize_std, eps):
  count, advantage, std = _group_moments(scores, ids, weight)
  if normalize_std:
    advantage = advantage / (std + eps)
  return jnp.where((count > 1) & (weight > 0), advantage, 0.0)


@functools.partial(jax.jit, static_argnames=("normalize_std",))
def grpo(scores: chex.Array, groups: chex.Array, *, normalize_std: bool = True, eps=1e-6,
         valid: chex.Array | None = None) -> jax.Array:
  """Group-relative advantages (GRPO; Shao et al. 2024, "DeepSeekMath", Sec. 4.1.2).

      A_i = (s_i - mean_g) / (std_g + eps)     (normalize_std=True, GRPO)
      A_i =  s_i - mean_g                      (normalize_std=False, Dr.GRPO; Liu et al. 2025,
                                                "Understanding R1-Zero-Like Training")

  `std_g` is the unbiased (n-1) standard deviation of the group, `eps` is added to the std. A group
  with identical scores gets 0. Convention: a group of one (after removing invalid episodes) gets 0
  (some references return the raw score there).

  Args:
    scores: `[N]` episode scores.
    groups: `[N]` int task-group labels (arbitrary integers).
    normalize_std: divide by the group std (static).
    eps: added to the std.
    valid: optional `[N]` 0/1; invalid episodes are left out of the statistics and get 0.

  Returns:
    `[N]` float32 advantages.
  """
  scores, groups = jnp.asarray(scores), jnp.asarray(groups)
  _check_scores(scores, groups, valid)
  scores = _as_f32(scores)
  weight = _valid_weight(valid, scores)
  return _group_normalise(scores, _dense_ids(groups), weight, normalize_std, _as_f32(eps))


@jax.jit
def rloo(scores: chex.Array, groups: chex.Array, *, valid: chex.Array | None = None) -> jax.Array:
  """REINFORCE leave-one-out advantages (Ahmadian et al. 2024, "Back to Basics: Revisiting
  REINFORCE-Style Optimization for Learning from Human Feedback in LLMs"; Kool et al. 2019).

      A_i = s_i - 1/(n_g - 1) * sum_{j in g, j != i} s_j  =  n_g/(n_g - 1) * (s_i - mean_g).

  A group of one gets 0 (there is no other rollout to form a baseline).

  Args:
    scores: `[N]` episode scores.
    groups: `[N]` int task-group labels.
    valid: optional `[N]` 0/1 as in `grpo`.

  Returns:
    `[N]` float32 advantages.
  """
  scores, groups = jnp.asarray(scores), jnp.asarray(groups)
  _check_scores(scores, groups, valid)
  scores = _as_f32(scores)
  weight = _valid_weight(valid, scores)
  count, centred, _ = _group_moments(scores, _dense_ids(groups), weight)
  # s_i - (sum_g - s_i) / (n - 1) == n / (n - 1) * (s_i - mean_g)
  return jnp.where((count > 1) & (weight > 0), count / jnp.maximum(count - 1.0, 1.0) * centred, 0.0)


@jax.jit
def reinforce_pp(rewards: chex.Array, mask: chex.Array, *, gamma):
  """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
  Models"): token returns, then whitening over the whole batch (no critic, no group baseline).

      G_t = r_t + gamma * G_{t'}    (t' the next policy token; observation tokens skipped)
      A_t = (G_t - mean(G)) / sqrt(var(G) + 1e-8)    over all policy tokens of the batch.

  A per-token KL penalty, if used, is folded into `rewards` by the caller.

  Args:
    rewards: `[B, T]` token rewards.
    mask: `[B, T]` 1 on policy tokens.
    gamma: scalar or `[B]` discount.

  Returns:
    `(advantages, returns)`, both `[B, T]` float32, 0 where `mask` is 0.
  """
  returns = discounted_returns(rewards, mask, gamma)
  return masked_whiten(returns, mask), returns


@jax.jit
def reinforce_pp_baseline(rewards: chex.Array, mask: chex.Array, groups: chex.Array, *, gamma=1.0,
                          valid: chex.Array | None = None):
  """REINFORCE++-baseline: subtract the group mean of episode rewards, then REINFORCE++.

  Each row's episode reward `R_i = sum_t r_t` (undiscounted) is compared with the mean over its task
  group; `mean_g` is subtracted from the reward on the row's last policy token, then returns and
  batch whitening follow `reinforce_pp`. With an outcome reward on the last token and `gamma=1` this
  is exactly `A_t = whiten(R_i - mean_g)` as in OpenRLHF's `reinforce_baseline`. A group of one gets
  baseline `R_i` (advantage before whitening 0). Invalid rows get 0 everywhere.

  Args:
    rewards: `[B, T]` token rewards.
    mask: `[B, T]` 1 on policy tokens.
    groups: `[B]` int task-group labels.
    gamma: scalar or `[B]` discount (default 1).
    valid: optional `[B]` 0/1.

  Returns:
    `(advantages, returns)`, both `[B, T]` float32 (returns are baseline-subtracted).
  """
  rewards, mask, groups = map(jnp.asarray, (rewards, mask, groups))
  _check_token_inputs(rewards, mask)
  chex.assert_shape(groups, (rewards.shape[0],))
  chex.assert_type(groups, int)
  if valid is not None:
    chex.assert_shape(valid, (rewards.shape[0],))
  weight = _valid_weight(valid, groups)
  m = _as_bool(mask)
  episode = jnp.sum(jnp.where(m, _as_f32(rewards), 0.0), axis=-1)
  _, centred, _ = _group_moments(episode, _dense_ids(groups), weight)
  mean = episode - centred
  positions = jnp.arange(mask.shape[1])
  last = jnp.max(jnp.where(m, positions, -1), axis=-1)
  shaped = jnp.where(positions[None, :] == last[:, None], _as_f32(rewards) - mean[:, None],
                     _as_f32(rewards))
  row_mask = m & (weight[:, None] > 0)
  returns = discounted_returns(shaped, row_mask, gamma)
  return masked_whiten(returns, row_mask), returns


# ----------------------------------------------------------------------------------------------------
# Step-level estimators (GiGPO) and step <-> token helpers.


@jax.jit
def step_group_ids(groups: chex.Array, anchors: chex.Array) -> jax.Array:
  """Dense ids of GiGPO step groups: steps share an id iff same task group and same anchor state.

  Args:
    groups: `[N]` int task-group labels.
    anchors: `[N, S]` int (e.g. uint32 state hashes).

  Returns:
    `[N, S]` int32 ids in `[0, N*S)` (equal ids <=> equal (group, anchor); not contiguous).
  """
  groups, anchors = jnp.asarray(groups), jnp.asarray(anchors)
  chex.assert_rank(anchors, 2)
  chex.assert_shape(groups, (anchors.shape[0],))
  chex.assert_type([groups, anchors], int)
  flat_groups = jnp.broadcast_to(groups[:, None], anchors.shape).reshape(-1)
  return _dense_ids(flat_groups, anchors.reshape(-1)).reshape(anchors.shape)


@functools.partial(jax.jit, static_argnames=("normalize_std",))
def gigpo(episode_returns: chex.Array,
          step_rewards: chex.Array,
          step_mask: chex.Array,
          groups: chex.Array,
          anchors: chex.Array,
          *,
          gamma=0.95,
          step_weight=1.0,
          normalize_std: bool = False,
          eps=1e-6,
          valid: chex.Array | None = None) -> jax.Array:
  """Group-in-Group policy optimisation advantages (GiGPO; Feng et al. 2025, "Group-in-Group Policy
  Optimization for LLM Agent Training").

  Episode level, over the `N` trajectories of each task group (one statistic per trajectory, not per
  step row):
      A^E_i = (R_i - mean_g(R)) / F(R),     F = std_g + eps if normalize_std else 1.
  Step level: discounted step returns within each trajectory over valid steps,
      G_{i,s} = r_{i,s} + gamma * G_{i,s'}   (s' the next valid step; 0 after the last),
  and step groups = all valid steps of one task group whose `anchor` (hash of the state the action was
  taken in) is equal, repeat visits inside one trajectory included:
      A^S_{i,s} = (G_{i,s} - mean_{step group}(G)) / F(G),
  with `A^S = 0` for a step group of one (convention: the reference implementation returns the raw
  return there). Final per-step advantage:
      A_{i,s} = A^E_i + step_weight * A^S_{i,s},   0 where `step_mask` is 0.
  Broadcast to tokens with `broadcast_steps`.

  Args:
    episode_returns: `[N]` trajectory returns `R_i` (usually the outcome reward).
    step_rewards: `[N, S]` per-step rewards (outcome on the last step, plus any shaping).
    step_mask: `[N, S]` 1 on steps that happened.
    groups: `[N]` int task-group labels.
    anchors: `[N, S]` int anchor-state hashes (uint32 or int32).
    gamma: scalar step discount (GiGPO: 0.95), or `[N, S]` per step (time-aware discounting).
    step_weight: scalar weight `omega` of the step advantage.
    normalize_std: divide both levels by std + eps (static; GiGPO's "mean_std_norm" vs "mean_norm").
    eps: added to the std.
    valid: optional `[N]` 0/1; invalid trajectories are excluded from both levels and get 0.

  Returns:
    `[N, S]` float32 per-step advantages.
  """
  episode_returns, step_rewards, step_mask, groups, anchors = map(
      jnp.asarray, (episode_returns, step_rewards, step_mask, groups, anchors))
  chex.assert_rank([episode_returns, step_rewards], [1, 2])
  chex.assert_equal_shape([step_rewards, step_mask, anchors])
  chex.assert_shape([episode_returns, groups], (step_rewards.shape[0],))
  chex.assert_type([groups, anchors], int)
  if valid is not None:
    chex.assert_shape(valid, (step_rewards.shape[0],))
  eps = _as_f32(eps)
  weight = _valid_weight(valid, groups)
  episode_adv = _group_normalise(_as_f32(episode_returns), _dense_ids(groups), weight, normalize_std,
                                 eps)

  steps_valid = _as_bool(step_mask) & (weight[:, None] > 0)
  step_returns = discounted_returns(step_rewards, steps_valid, gamma)
  ids = step_group_ids(groups, anchors).reshape(-1)
  step_adv = _group_normalise(step_returns.reshape(-1), ids,
                              steps_valid.reshape(-1).astype(_F32), normalize_std, eps)
  step_adv = step_adv.reshape(step_rewards.shape)
  return jnp.where(steps_valid, episode_adv[:, None] + _as_f32(step_weight) * step_adv, 0.0)


@jax.jit
def broadcast_steps(step_values: chex.Array, turn: chex.Array) -> jax.Array:
  """Places a per-step quantity on the tokens of that step: `out[b, l] = step_values[b, turn[b, l]]`.

  Args:
    step_values: `[B, S]` per-step values (e.g. GiGPO advantages).
    turn: `[B, L]` int environment-step index of each token; -1 (prompt, padding) or `>= S` gives 0.

  Returns:
    `[B, L]` float32. Multiply by `loss_mask` to keep policy tokens only.
  """
  step_values, turn = jnp.asarray(step_values), jnp.asarray(turn)
  chex.assert_rank([step_values, turn], 2)
  chex.assert_equal_shape_prefix([step_values, turn], 1)
  chex.assert_type(turn, int)
  num_steps = step_values.shape[1]
  inside = (turn >= 0) & (turn < num_steps)
  picked = jnp.take_along_axis(_as_f32(step_values), jnp.clip(turn, 0, num_steps - 1), axis=1)
  return jnp.where(inside, picked, 0.0)


@jax.jit
def place_step_rewards(step_rewards: chex.Array, turn: chex.Array, loss_mask: chex.Array) -> jax.Array:
  """Puts each step's reward on the last policy token of that step (0 elsewhere).

  This is the token-level reward layout `gae`, `discounted_returns` and `reinforce_pp` expect: with
  `gamma = 1` the return of every policy token of step `s` includes `r_s`. A step with no policy token
  (which a well-formed `EpisodeBatch` never has; `EpisodeBatch.validate` rejects it) has nowhere to go
  and is dropped.

  Args:
    step_rewards: `[B, S]` per-step rewards.
    turn: `[B, L]` int environment-step index of each token (-1 outside steps).
    loss_mask: `[B, L]` 1 on policy tokens.

  Returns:
    `[B, L]` float32 token rewards.
  """
  step_rewards, turn, loss_mask = map(jnp.asarray, (step_rewards, turn, loss_mask))
  chex.assert_rank([step_rewards, turn, loss_mask], 2)
  chex.assert_equal_shape([turn, loss_mask])
  chex.assert_equal_shape_prefix([step_rewards, turn], 1)
  chex.assert_type(turn, int)
  num_rows, length = turn.shape
  num_steps = step_rewards.shape[1]
  policy = _as_bool(loss_mask) & (turn >= 0) & (turn < num_steps)
  slot = jnp.where(policy, turn, num_steps)  # slot S collects everything that is not a policy token
  positions = jnp.broadcast_to(jnp.arange(length), (num_rows, length))
  rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], (num_rows, length))
  last = jnp.full((num_rows, num_steps + 1), -1, jnp.int32).at[rows, slot].max(positions)
  is_last = policy & (jnp.take_along_axis(last, slot, axis=1) == positions)
  return jnp.where(is_last, broadcast_steps(step_rewards, turn), 0.0)
