"""Train state, token log-probs of episodes, and the jitted updates (RL and SFT).

`rl_update` is one jitted function per batch shape: it takes the train state, an `EpisodeBatch`
and the advantages, and runs `epochs x minibatches` optimiser steps in a `lax.scan` (minibatch
order drawn from the state's rng). The state is donated. A step whose loss or gradient is not
finite is skipped (parameters and optimiser state unchanged) and counted in `skipped_updates`.

Loss (per minibatch):

    policy_loss(logp, old_logp, A, mask; clip_low, clip_high, dual_clip, agg, is_weights)  [or GSPO]
    + kl_coef * aggregate(kl(logp, ref_logp, kl_kind), mask)       (KL to a frozen reference)
    - entropy_coef * aggregate(entropy, mask)
    + value_coef * value_loss(values, old_values, returns, mask)    (ppo only)

`mask` is the loss mask (sampled tokens only: prompt and observation tokens never get gradient or
KL) times the algorithm's row weights (env-error episodes and filtered groups are 0).
`old_logp` is the pre-update policy's log-prob (recomputed by the learner); `is_weights` is the
truncated importance weight `min(exp(old_logp - behavior_logp), C)` when `tis_threshold` is set,
correcting sampler/learner mismatch and staleness.

Off-policy correction (`LossOptions.off_policy`, for stale batches of asynchronous rollouts):

- `decoupled` (default): decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy
  optimization"; AReaL, Fu et al. 2025): the trust region is measured against the proximal policy,
  the learner's parameters before this update (`old_logp`), and the behaviour-to-proximal
  correction is the truncated weight `min(pi_prox / pi_behav, C)` above, multiplying the loss
  (`tis_threshold = 0` leaves it out: the synchronous setting, where the two policies agree).
- `tis`: no proximal policy: `old_logp` is the behaviour log-probs and the loss is
  `losses.truncated_is_policy_loss` (V-trace's truncated-IS policy gradient, `C = tis_threshold`);
  the learner skips the proximal forward pass.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from longhorizon.core import logprobs as lp
from longhorizon.core import losses
from longhorizon.core.episode import EpisodeBatch
from longhorizon.models import Critic, ModelConfig, Transformer, unembedding

__all__ = ["TrainState", "LossOptions", "make_optimizer", "episode_logprobs", "rl_update",
           "sft_update", "critic_values"]


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  critic_params: Any  # None without a critic
  critic_opt_state: Any
  step: jax.Array  # [] int32 optimiser steps taken
  policy_version: jax.Array  # [] int32 RL updates applied (the version that samples next)
  rng: jax.Array  # typed PRNG key
  skipped: jax.Array  # [] int32 optimiser steps skipped for non-finite loss/gradients
  ref_params: Any = None  # frozen reference policy for the KL term (None: no KL)


@dataclasses.dataclass(frozen=True)
class LossOptions:
  """Static options of the RL loss (a frozen copy of `config.algorithm` / `config.optim`)."""
  clip_low: float = 0.2
  clip_high: float = 0.2  # > clip_low: DAPO clip-higher
  dual_clip: float | None = None
  agg: str = "token-mean"
  gspo: bool = False
  gspo_clip_low: float = 3e-4
  gspo_clip_high: float = 4e-4
  kl_coef: float = 0.0
  kl_kind: str = "k3"
  entropy_coef: float = 0.0
  tis_threshold: float | None = None  # truncated IS on behaviour log-probs (None: off)
  off_policy: str = "decoupled"  # decoupled (clip vs proximal, IS weight) | tis (see module doc)
  value_coef: float = 0.5
  value_clip: float | None = 0.2
  temperature: float = 1.0  # the sampling temperature: log-probs are of the sampled distribution
  epochs: int = 1
  minibatches: int = 1
  chunk_size: int = 4096  # vocabulary chunk of the fused log-prob kernel


@functools.lru_cache(maxsize=64)
def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, total_steps: int = 1,
                   schedule: str = "constant", max_grad_norm: float | None = 1.0,
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and a warmup + constant/cosine/linear schedule.

  Cached: equal settings return the same (stateless) object, so the jitted updates, which take
  the optimiser as a static argument, compile once per setting rather than once per run."""
  if schedule == "constant":
    decay = optax.constant_schedule(learning_rate)
  elif schedule == "cosine":
    decay = optax.cosine_decay_schedule(learning_rate, max(total_steps - warmup_steps, 1))
  elif schedule == "linear":
    decay = optax.linear_schedule(learning_rate, 0.0, max(total_steps - warmup_steps, 1))
  else:
    raise ValueError(f"optim.schedule must be 'constant', 'cosine' or 'linear', got {schedule!r}.")
  lr = optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps), decay],
                            [warmup_steps]) if warmup_steps > 0 else decay
  parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
  parts.append(optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*parts)


def episode_logprobs(params, config: ModelConfig, batch, *, temperature=1.0, chunk_size=4096,
                     return_entropy=False):
  """`[B, L]` log-probs of each token given its prefix (0 at position 0), optionally entropies.

  Token `t` is scored from the hidden state at `t - 1`; rows are right-padded (`attention_mask`)."""
  tokens = jnp.asarray(batch.tokens)
  lengths = jnp.asarray(batch.attention_mask).sum(-1).astype(jnp.int32)
  out = Transformer(config).apply({"params": params}, tokens, jnp.asarray(batch.positions),
                                  lengths, compute_logits=False)
  res = lp.token_logprobs_from_hidden(out.hidden[:, :-1], unembedding(params, config),
                                      tokens[:, 1:], chunk_size=min(chunk_size, config.vocab_size),
                                      temperature=temperature, return_entropy=return_entropy,
                                      vocab_axis=0 if config.tie_word_embeddings else 1)
  pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
  if return_entropy:
    return pad(res[0]), pad(res[1])
  return pad(res)


def critic_values(critic_params, config: ModelConfig, batch):
  """`[B, L]` critic values aligned like log-probs: the value of token `t`'s decision point is read
  at `t - 1` (0 at position 0)."""
  tokens = jnp.asarray(batch.tokens)
  lengths = jnp.asarray(batch.attention_mask).sum(-1).astype(jnp.int32)
  values = Critic(config).apply({"params": critic_params}, tokens, jnp.asarray(batch.positions), lengths)
  return jnp.pad(values[:, :-1], ((0, 0), (1, 0)))


_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def _finite(tree) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _apply(optimizer, params, opt_state, grads, ok):
  updates, new_opt = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  return keep(new_params, params), keep(new_opt, opt_state)


def _slice_rows(tree, rows):
  return jax.tree.map(lambda a: a[rows] if hasattr(a, "ndim") and a.ndim >= 1 else a, tree)


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "critic_optimizer", "options"),
                   donate_argnames=("state",))
def rl_update(state: TrainState, batch: EpisodeBatch, advantages, returns, row_weight, old_logp,
              ref_logp, old_values, *, config: ModelConfig, optimizer, critic_optimizer,
              options: LossOptions):
  """Runs `epochs x minibatches` optimiser steps on one batch; returns `(state, metrics)`.

  Args:
    state: `TrainState` (donated).
    batch: the `EpisodeBatch` (device arrays).
    advantages: `[B, L]` float32. returns: `[B, L]` value targets or None. row_weight: `[B]`.
    old_logp: `[B, L]` pre-update (proximal) log-probs; with `options.off_policy == "tis"` the
      behaviour log-probs (the anchor of the truncated-IS loss). ref_logp: `[B, L]` reference
      log-probs or None.
    old_values: `[B, L]` critic values at rollout time or None.
  """
  b = batch.tokens.shape[0]
  m = options.minibatches
  if b % m:
    raise ValueError(f"batch of {b} episodes does not split into {m} minibatches.")
  mask = jnp.asarray(batch.loss_mask, jnp.float32) * row_weight[:, None]
  # Values off the loss mask never matter; zero them so a NaN there cannot poison the gradient.
  on = mask > 0
  advantages = jnp.where(on, advantages, 0.0)
  old_logp = jnp.where(on, old_logp, 0.0)
  if ref_logp is not None:
    ref_logp = jnp.where(on, ref_logp, 0.0)
  if options.off_policy not in ("decoupled", "tis"):
    raise ValueError(f"LossOptions.off_policy must be 'decoupled' or 'tis', got "
                     f"{options.off_policy!r}.")
  if options.off_policy == "tis" and (options.tis_threshold is None or options.gspo):
    raise ValueError("LossOptions.off_policy='tis' needs tis_threshold (the truncation C) and "
                     "gspo=False.")
  is_weights = None
  if options.tis_threshold is not None and options.off_policy == "decoupled":
    is_weights = losses.truncated_is_weights(old_logp, batch.behavior_logprobs, mask,
                                             threshold=options.tis_threshold)
  data = dict(batch=batch, adv=advantages, mask=mask, old_logp=old_logp, ref_logp=ref_logp,
              returns=returns, old_values=old_values, is_weights=is_weights)

  def policy_loss_fn(params, mb):
    logp, ent = episode_logprobs(params, config, mb["batch"], temperature=options.temperature,
                                 chunk_size=options.chunk_size, return_entropy=True)
    if options.off_policy == "tis":
      loss, metrics = losses.truncated_is_policy_loss(logp, mb["old_logp"], mb["adv"], mb["mask"],
                                                      threshold=options.tis_threshold,
                                                      agg=options.agg)
    elif options.gspo:
      loss, metrics = losses.gspo_loss(logp, mb["old_logp"], mb["adv"], mb["mask"],
                                       clip_low=options.gspo_clip_low,
                                       clip_high=options.gspo_clip_high, agg=options.agg,
                                       is_weights=mb["is_weights"])
    else:
      loss, metrics = losses.policy_loss(logp, mb["old_logp"], mb["adv"], mb["mask"],
                                         clip_low=options.clip_low, clip_high=options.clip_high,
                                         dual_clip=options.dual_clip, agg=options.agg,
                                         is_weights=mb["is_weights"])
    metrics = dict(metrics, policy_loss=loss)
    entropy = losses.masked_mean(ent, mb["mask"])
    metrics["entropy"] = entropy
    if options.entropy_coef:
      loss = loss - options.entropy_coef * losses.aggregate(ent, mb["mask"], options.agg)
    if mb["ref_logp"] is not None:
      kl = losses.kl(logp, mb["ref_logp"], options.kl_kind)
      kl_value = losses.aggregate(kl, mb["mask"], options.agg)
      metrics["kl_ref"] = losses.masked_mean(kl, mb["mask"])
      if options.kl_coef:
        loss = loss + options.kl_coef * kl_value
    return loss, metrics

  def critic_loss_fn(critic_params, mb):
    values = critic_values(critic_params, config, mb["batch"])
    loss, vmetrics = losses.value_loss(values, mb["old_values"], mb["returns"], mb["mask"],
                                       clip=options.value_clip)
    return options.value_coef * loss, dict(vmetrics, value_loss=loss)

  def minibatch_step(carry, rows):
    state = carry
    mb = _slice_rows(data, rows)
    (loss, metrics), grads = jax.value_and_grad(policy_loss_fn, has_aux=True)(state.params, mb)
    grad_norm = _norm(grads)
    # Non-finite inputs on the mask (the log-ratio clamp would hide an infinite old log-prob) or a
    # non-finite loss/gradient: skip the step.
    inputs_ok = _finite([jnp.where(mb["mask"] > 0, mb["adv"], 0.0),
                         jnp.where(mb["mask"] > 0, mb["old_logp"], 0.0)])
    ok = jnp.isfinite(loss) & _finite(grads) & inputs_ok
    params, opt_state = _apply(optimizer, state.params, state.opt_state, grads, ok)
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm)
    critic_params, critic_opt = state.critic_params, state.critic_opt_state
    if critic_optimizer is not None:
      (closs, cmetrics), cgrads = jax.value_and_grad(critic_loss_fn, has_aux=True)(critic_params, mb)
      cok = jnp.isfinite(closs) & _finite(cgrads)
      critic_params, critic_opt = _apply(critic_optimizer, critic_params, critic_opt, cgrads, cok)
      ok = ok & cok
      metrics.update(cmetrics, critic_grad_norm=_norm(cgrads))
    state = state.replace(params=params, opt_state=opt_state, critic_params=critic_params,
                          critic_opt_state=critic_opt, step=state.step + 1,
                          skipped=state.skipped + (~ok).astype(jnp.int32))
    return state, metrics

  rng, perm_key = jax.random.split(state.rng)
  keys = jax.random.split(perm_key, options.epochs)
  order = jnp.concatenate([jax.random.permutation(k, b) for k in keys]).reshape(-1, b // m)
  state, metrics = jax.lax.scan(minibatch_step, state, order)
  metrics = jax.tree.map(jnp.mean, metrics)
  metrics["skipped_updates"] = state.skipped
  if is_weights is not None:
    metrics["is_weight_mean"] = losses.masked_mean(is_weights, mask)
    metrics["is_truncated_frac"] = losses.masked_mean(
        jnp.exp(jnp.clip(old_logp - batch.behavior_logprobs, -20.0, 20.0)) > options.tis_threshold,
        mask)
  return state.replace(rng=rng, policy_version=state.policy_version + 1), metrics


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "minibatches"),
                   donate_argnames=("state",))
def sft_update(state: TrainState, batch: EpisodeBatch, *, config: ModelConfig, optimizer,
               minibatches: int = 1):
  """Supervised fine-tuning on (oracle) episodes: token-mean negative log-likelihood of the
  loss-mask tokens, the same masks the RL loss uses. Returns `(state, metrics)`."""
  b = batch.tokens.shape[0]
  mask = jnp.asarray(batch.loss_mask, jnp.float32)

  def loss_fn(params, mb, mb_mask):
    logp = episode_logprobs(params, config, mb)
    nll = -losses.masked_mean(logp, mb_mask)
    return nll, {"sft_nll": nll, "sft_token_accuracy": losses.masked_mean(
        (logp > jnp.log(0.5)).astype(jnp.float32), mb_mask)}

  def step(state, rows):
    mb, mb_mask = _slice_rows(batch, rows), mask[rows]
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, mb, mb_mask)
    ok = jnp.isfinite(loss) & _finite(grads)
    params, opt_state = _apply(optimizer, state.params, state.opt_state, grads, ok)
    state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                          skipped=state.skipped + (~ok).astype(jnp.int32))
    return state, dict(metrics, loss=loss, grad_norm=_norm(grads))

  rng, key = jax.random.split(state.rng)
  order = jax.random.permutation(key, b).reshape(minibatches, b // minibatches)
  state, metrics = jax.lax.scan(step, state, order)
  return state.replace(rng=rng), jax.tree.map(jnp.mean, metrics)
