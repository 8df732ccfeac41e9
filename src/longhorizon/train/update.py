"""Train state, token log-probs of episodes, and the RL, SFT and DPO updates.

`rl_update` runs `epochs x minibatches` optimiser steps on one batch in a `lax.scan` (minibatch
order drawn from the state's rng); `jit_rl_update(...)` jits it with its static parts closed over
(model config, optimisers, `LossOptions`, temperature, schedule) and, on a mesh, explicit
`in_shardings` / `out_shardings`; the state is donated. A step whose loss or gradient is not finite
is skipped (parameters and optimiser state unchanged) and counted in `skipped_updates`; the
fraction of steps whose policy gradient is exactly zero is `zero_grad_fraction` (the steps
`make_optimizer(skip_zero_grad=True)` leaves out).

With LoRA (`ModelConfig.lora_rank > 0`) only the adapters are differentiated and optimised
(`lora.partition`): the optimiser state covers them alone, the frozen weights get no gradient, and
with `lora_dropout > 0` the training losses (not the scoring passes) draw adapter dropout.

Loss (per minibatch):

    POLICY_LOSSES[loss.name](logp, old_logp, A, mask, is_weights)    (train/policy_losses.py)
    + kl_coef * aggregate(kl(logp, ref_logp, kl_kind), mask)       (KL to a frozen reference)
    - entropy_coef * aggregate(entropy, mask)
    + value_coef * value_loss(values, old_values, returns, mask)    (algorithms with a critic)

The value term: with a separate critic (`algorithm.critic='separate'`: a `Critic` with its own
trunk in `TrainState.critic_params`) it is a second loss, differentiated and stepped by the critic
optimiser alone, so it never moves the policy. With the shared critic (`'shared'`:
`critic_params` is only a value head, read on the policy's final hidden states of the same
forward pass, as in `PolicyWithValue`) it is part of the one loss above: its gradient reaches the
policy trunk (with LoRA, the adapters alone), the policy optimiser steps the trunk and the critic
optimiser the head, and the `loss` metric includes it. The head is float32 parameters applied to
the hidden states cast to float32, whatever the model's compute dtype (`model.dtype`).

`mask` is the loss mask (sampled tokens only: prompt and observation tokens never get gradient or
KL) times the algorithm's row weights (env-error episodes and filtered groups are 0). `old_logp`
is the loss's anchor (`PolicyLoss.anchor`): the pre-update (proximal) policy's log-probs,
recomputed by the learner, or the behaviour log-probs. With a proximal anchor and
`tis_threshold > 0`, `is_weights = min(exp(old_logp - behavior_logp), C)` corrects
sampler/learner mismatch and staleness (decoupled PPO: Hilton et al. 2022; AReaL, Fu et al. 2025).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import optax

from longhorizon.core import logprobs as lp
from longhorizon.core import losses
from longhorizon.core import preference
from longhorizon.core.episode import EpisodeBatch
from longhorizon.models import (Critic, ModelConfig, PolicyWithValue, Transformer, lora,
                                unembedding)
from longhorizon.train.policy_losses import LossOptions

__all__ = ["TrainState", "LearnInputs", "make_optimizer", "episode_logprobs", "rl_update",
           "jit_rl_update", "sft_update", "dpo_update", "critic_values"]


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


def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, total_steps: int = 1,
                   schedule: str = "constant", max_grad_norm: float | None = 1.0,
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999,
                   skip_zero_grad: bool = False) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and a warmup + constant/cosine/linear schedule (the learner
  builds it once per run and closes its jitted update over it).

  `skip_zero_grad`: a step whose gradient is exactly zero everywhere returns zero updates and
  leaves the Adam moments, the step count and the schedule where they were (optax.MultiSteps with
  one step per update and a skip test), where plain Adam would still move the parameters by its
  momentum. The state's `gradient_step` then counts the steps taken."""
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
  if not skip_zero_grad:
    return optax.chain(*parts)
  return optax.MultiSteps(optax.chain(*parts), every_k_schedule=1,
                          should_skip_update_fn=_zero_gradient).gradient_transformation()


def _zero_gradient(updates, gradient_step, params):
  """`optax.MultiSteps`'s skip test: the gradient is exactly zero in every leaf."""
  del gradient_step, params
  nonzero = [jnp.any(x != 0) for x in jax.tree.leaves(updates)]
  return ~jnp.any(jnp.stack(nonzero)) if nonzero else jnp.array(True), {}


def _forward(params, config: ModelConfig, batch, *, dropout_rng=None, value_head=None,
             prefix_length: int = 0):
  """`(DecoderOutput, values)` of the policy on `batch`: `Transformer(config)`, or with
  `value_head` (a shared critic's head parameters) the family's `PolicyWithValue` over `params` as
  its trunk, whose `[B, L]` values come from the same pass (else `values` is None).
  `prefix_length`: the rows' shared prefix, computed once (`Transformer`; no `value_head`)."""
  tokens = jnp.asarray(batch.tokens)
  lengths = jnp.asarray(batch.attention_mask).sum(-1).astype(jnp.int32)
  rngs = {"dropout": dropout_rng} if dropout_rng is not None and config.lora_dropout else None
  routing = getattr(batch, "routing", None) if config.num_experts else None
  args = (tokens, jnp.asarray(batch.positions), lengths)
  if value_head is None:
    return Transformer(config).apply({"params": params}, *args, compute_logits=False, rngs=rngs,
                                     routing=routing, prefix_length=prefix_length), None
  if prefix_length:
    raise ValueError("prefix_length: not with a shared critic's value head.")
  return PolicyWithValue(config).apply({"params": {"trunk": params, "value_head": value_head}},
                                       *args, compute_logits=False, rngs=rngs, routing=routing)


def _shift(x):
  """`[B, L]` per-position outputs moved to the next token: the value (or log-prob) of token `t`'s
  decision is read at `t - 1`; 0 at position 0."""
  return jnp.pad(x[:, :-1], ((0, 0), (1, 0)))


def episode_logprobs(params, config: ModelConfig, batch, *, temperature=1.0, chunk_size=4096,
                     return_entropy=False, dropout_rng=None, return_aux=False, value_head=None,
                     prefix_length: int = 0):
  """`[B, L]` log-probs of each token given its prefix (0 at position 0), optionally entropies.

  `prefix_length` `P > 0` (static): every row's first `P` tokens and positions are the same (see
  `shared_prefix_length`); they go through the model once, and only tokens `P..L-1` are scored
  (log-probs and entropies 0 before them, where no loss may read them).

  Token `t` is scored from the hidden state at `t - 1`; rows are right-padded (`attention_mask`).
  `dropout_rng` turns on LoRA adapter dropout (`ModelConfig.lora_dropout`; training losses only).
  A mixture-of-experts model replays `batch.routing` (the sampler's experts, R3) when the batch
  carries it, else routes afresh. `return_aux` appends its load-balancing loss (0 for dense ones).
  `value_head` (the shared critic's head parameters) appends the `[B, L]` values of that head on
  the same pass's final hidden states, aligned as `critic_values` aligns them."""
  tokens = jnp.asarray(batch.tokens)
  out, values = _forward(params, config, batch, dropout_rng=dropout_rng, value_head=value_head,
                         prefix_length=prefix_length)
  first = max(prefix_length, 1)  # the first token scored; `out.hidden` starts at `first - 1`
  res = lp.token_logprobs_from_hidden(
      out.hidden[:, :-1], unembedding(params, config), tokens[:, first:],
      chunk_size=min(chunk_size, config.vocab_size), temperature=temperature,
      return_entropy=return_entropy, vocab_axis=0 if config.tie_word_embeddings else 1,
      softcap=config.final_logit_softcapping)
  pad = lambda x: jnp.pad(x, ((0, 0), (first, 0)))
  res = (pad(res[0]), pad(res[1])) if return_entropy else (pad(res),)
  if return_aux:
    res = (*res, jnp.zeros((), jnp.float32) if out.aux_loss is None else out.aux_loss)
  if value_head is not None:
    res = (*res, _shift(values))
  return res if len(res) > 1 else res[0]


def critic_values(critic_params, config: ModelConfig, batch, trunk_params=None):
  """`[B, L]` critic values aligned like log-probs: the value of token `t`'s decision point is read
  at `t - 1` (0 at position 0).

  `critic_params` is a separate `Critic` (its own trunk and head), or with `trunk_params` (the
  shared critic, `algorithm.critic='shared'`) only the value head, read on the final hidden states
  of the policy `trunk_params` (`PolicyWithValue`)."""
  if trunk_params is not None:
    return _shift(_forward(trunk_params, config, batch, value_head=critic_params)[1])
  tokens = jnp.asarray(batch.tokens)
  lengths = jnp.asarray(batch.attention_mask).sum(-1).astype(jnp.int32)
  values = Critic(config).apply({"params": critic_params}, tokens, jnp.asarray(batch.positions), lengths)
  return _shift(values)


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


class LearnInputs(NamedTuple):
  """What the learner computes for a batch before the update (all `[B, L]` but `row_weight`)."""
  advantages: jax.Array  # float32, 0 off the loss mask
  returns: jax.Array | None  # value targets (algorithms with a critic)
  row_weight: jax.Array  # [B] float32: 0 drops a row (env error, filtered group, too stale)
  old_logp: jax.Array  # the loss's anchor: proximal or behaviour log-probs
  ref_logp: jax.Array | None  # the KL reference's log-probs
  old_values: jax.Array | None  # critic values at rollout time
  # [B, L] float32 per-token weights (the async staleness filter with partial rollouts), or None
  token_weight: jax.Array | None = None


def _prepare(batch: EpisodeBatch, x: LearnInputs, loss: LossOptions) -> dict:
  """The scanned data: the row-weighted loss mask, inputs zeroed off it (so a NaN there cannot
  poison the gradient) and the truncated-IS weights of a proximal anchor."""
  mask = jnp.asarray(batch.loss_mask, jnp.float32) * x.row_weight[:, None]
  if x.token_weight is not None:
    mask = mask * x.token_weight
  on = mask > 0
  old_logp = jnp.where(on, x.old_logp, 0.0)
  ref_logp = None if x.ref_logp is None else jnp.where(on, x.ref_logp, 0.0)
  is_weights = None
  if loss.tis_threshold and loss.spec.anchor == "proximal":
    is_weights = losses.truncated_is_weights(old_logp, batch.behavior_logprobs, mask,
                                             threshold=loss.tis_threshold)
  return dict(batch=batch, adv=jnp.where(on, x.advantages, 0.0), mask=mask, old_logp=old_logp,
              ref_logp=ref_logp, returns=x.returns, old_values=x.old_values, is_weights=is_weights)


def _policy_loss(trainable, frozen, mb, *, config: ModelConfig, loss: LossOptions,
                 temperature: float, value_head=None, prefix_length: int = 0):
  """The minibatch's policy loss (plus KL, entropy and MoE terms) and its metrics; with
  `value_head` (the shared critic) also `value_coef` times the value loss of that head on the same
  pass's hidden states, so the value gradient reaches the trunk's trainable parameters."""
  logp, ent, aux, *values = episode_logprobs(
      lora.combine(trainable, frozen), config, mb["batch"], temperature=temperature,
      chunk_size=loss.chunk_size, return_entropy=True, dropout_rng=mb["dropout_rng"],
      return_aux=True, value_head=value_head, prefix_length=prefix_length)
  turn = mb["batch"].turn  # the turn-level aggregation modes' turns (`losses.TURN_MODES`)
  value, metrics = loss.spec.fn(logp, mb["old_logp"], mb["adv"], mb["mask"], mb["is_weights"], loss,
                                turn)
  metrics = dict(metrics, policy_loss=value, entropy=losses.masked_mean(ent, mb["mask"]))
  if config.num_experts:  # MoE: the load-balancing loss, over every real token of the minibatch
    metrics["moe_aux_loss"] = aux
    value = value + config.router_aux_loss_coef * aux
  if loss.entropy_coef:
    value = value - loss.entropy_coef * losses.aggregate(ent, mb["mask"], loss.agg,
                                                         loss.norm_length or None, turn)
  if mb["ref_logp"] is not None:
    kl = losses.kl(logp, mb["ref_logp"], loss.kl_kind)
    metrics["kl_ref"] = losses.masked_mean(kl, mb["mask"])
    if loss.kl_coef:
      value = value + loss.kl_coef * losses.aggregate(kl, mb["mask"], loss.agg,
                                                   loss.norm_length or None, turn)
  if value_head is not None:
    vvalue, vmetrics = _value_term(values[0], mb, loss)
    value, metrics = value + vvalue, dict(metrics, **vmetrics)
  return value, metrics


def _value_term(values, mb, loss: LossOptions):
  """`value_coef` times the (clipped) value loss of `[B, L]` `values`, and its metrics."""
  value, metrics = losses.value_loss(values, mb["old_values"], mb["returns"], mb["mask"],
                                     clip=loss.value_clip or None)
  return loss.value_coef * value, dict(metrics, value_loss=value)


def _critic_loss(critic_params, mb, *, config: ModelConfig, loss: LossOptions):
  return _value_term(critic_values(critic_params, config, mb["batch"]), mb, loss)


def _minibatch_step(state: TrainState, mb, *, config, optimizer, critic_optimizer, loss,
                    temperature, shared_critic=False, prefix_length=0):
  """One optimiser step (policy, and critic if any) on minibatch `mb`; skipped if not finite.

  A separate critic is a second loss and step (skipped on its own if not finite). A shared one
  (`shared_critic`) is one loss over `(trainable policy parameters, value head)`: `optimizer`
  steps the policy part (its global-norm clip sees the value gradient too), `critic_optimizer`
  the head, both skipped together."""
  policy = functools.partial(_policy_loss, config=config, loss=loss, temperature=temperature,
                             prefix_length=prefix_length)
  trainable, frozen = lora.partition(state.params, config)
  critic_params, critic_opt = state.critic_params, state.critic_opt_state
  if shared_critic:
    joint = lambda both, frozen, mb: policy(both[0], frozen, mb, value_head=both[1])
    (value, metrics), (grads, cgrads) = jax.value_and_grad(joint, has_aux=True)(
        (trainable, critic_params), frozen, mb)
  else:
    (value, metrics), grads = jax.value_and_grad(policy, has_aux=True)(trainable, frozen, mb)
  # Non-finite inputs on the mask (the log-ratio clamp would hide an infinite old log-prob) or a
  # non-finite loss/gradient: skip the step.
  on = mb["mask"] > 0
  ok = (jnp.isfinite(value) & _finite(grads)
        & _finite([jnp.where(on, mb["adv"], 0.0), jnp.where(on, mb["old_logp"], 0.0)]))
  if shared_critic:
    ok = ok & _finite(cgrads)
    critic_params, critic_opt = _apply(critic_optimizer, critic_params, critic_opt, cgrads, ok)
    metrics["critic_grad_norm"] = _norm(cgrads)
  trainable, opt_state = _apply(optimizer, trainable, state.opt_state, grads, ok)
  params = lora.combine(trainable, frozen)
  grad_norm = _norm(grads)
  # 1 when the policy gradient is exactly zero (every group of the minibatch had one outcome):
  # averaged over the update, the fraction of steps `optim.skip_zero_grad` leaves out.
  metrics = dict(metrics, loss=value, grad_norm=grad_norm,
                 zero_grad_fraction=(grad_norm == 0).astype(jnp.float32))
  if critic_optimizer is not None and not shared_critic:
    critic = functools.partial(_critic_loss, config=config, loss=loss)
    (cvalue, cmetrics), cgrads = jax.value_and_grad(critic, has_aux=True)(critic_params, mb)
    cok = jnp.isfinite(cvalue) & _finite(cgrads)
    critic_params, critic_opt = _apply(critic_optimizer, critic_params, critic_opt, cgrads, cok)
    ok = ok & cok
    metrics.update(cmetrics, critic_grad_norm=_norm(cgrads))
  state = state.replace(params=params, opt_state=opt_state, critic_params=critic_params,
                        critic_opt_state=critic_opt, step=state.step + 1,
                        skipped=state.skipped + (~ok).astype(jnp.int32))
  return state, metrics


def rl_update(state: TrainState, batch: EpisodeBatch, inputs: LearnInputs, *, config: ModelConfig,
              optimizer, critic_optimizer, loss: LossOptions, temperature: float = 1.0,
              epochs: int = 1, minibatches: int = 1, shared_critic: bool = False,
              prefix_length: int = 0):
  """Runs `epochs x minibatches` optimiser steps on one batch; returns `(state, metrics)`.

  `inputs` holds the advantages, row weights and log-probs of the batch (see `LearnInputs`);
  `temperature` is the sampling temperature (log-probs are of the sampled distribution).
  `shared_critic`: `state.critic_params` is a value head on the policy's trunk (see
  `_minibatch_step`; `critic_optimizer` steps it), not a separate `Critic`. `prefix_length`: the
  batch's shared prefix (`shared_prefix_length`), computed once per minibatch. Not jitted:
  `jit_rl_update` closes it over its static arguments.
  """
  if shared_critic and critic_optimizer is None:
    raise ValueError("rl_update(shared_critic=True) needs a critic_optimizer for the value head.")
  b = batch.tokens.shape[0]
  if b % minibatches:
    raise ValueError(f"batch of {b} episodes does not split into {minibatches} minibatches.")
  data = _prepare(batch, inputs, loss)
  step = functools.partial(_minibatch_step, config=config, optimizer=optimizer,
                           critic_optimizer=critic_optimizer, loss=loss, temperature=temperature,
                           shared_critic=shared_critic, prefix_length=prefix_length)
  rng, perm_key = jax.random.split(state.rng)
  keys = jax.random.split(perm_key, epochs)
  order = jnp.concatenate([jax.random.permutation(k, b) for k in keys]).reshape(-1, b // minibatches)
  drop_keys = _dropout_keys(perm_key, order.shape[0], config)
  state, metrics = jax.lax.scan(
      lambda st, xs: step(st, dict(_slice_rows(data, xs[0]), dropout_rng=xs[1])), state,
      (order, drop_keys))
  metrics = jax.tree.map(jnp.mean, metrics)
  metrics["skipped_updates"] = state.skipped
  if loss.spec.anchor == "proximal":  # the rollout engine against the learner, before this update
    gap = jnp.abs(data["old_logp"] - jnp.where(data["mask"] > 0, batch.behavior_logprobs, 0.0))
    metrics["logp_mismatch_mean"] = losses.masked_mean(gap, data["mask"])
    metrics["logp_mismatch_max"] = jnp.max(jnp.where(data["mask"] > 0, gap, 0.0))
  if data["is_weights"] is not None:
    mask, old_logp = data["mask"], data["old_logp"]
    metrics["is_weight_mean"] = losses.masked_mean(data["is_weights"], mask)
    metrics["is_truncated_frac"] = losses.masked_mean(
        jnp.exp(jnp.clip(old_logp - batch.behavior_logprobs, -20.0, 20.0)) > loss.tis_threshold,
        mask)
  return state.replace(rng=rng, policy_version=state.policy_version + 1), metrics


def _dropout_keys(key, steps: int, config: ModelConfig):
  """One LoRA-dropout key per optimiser step (None without adapter dropout). Folded off `key` so
  runs without dropout keep their random streams."""
  if not (config.lora_rank and config.lora_dropout):
    return None
  return jax.random.split(jax.random.fold_in(key, 0x10_5A), steps)


def jit_rl_update(*, config: ModelConfig, optimizer, critic_optimizer, loss: LossOptions,
                  temperature: float = 1.0, epochs: int = 1, minibatches: int = 1,
                  shardings=None, shared_critic: bool = False, prefix_length: int = 0):
  """`rl_update` jitted with its static arguments closed over: `(state, batch, inputs) -> (state,
  metrics)`, the state donated. `shardings`, if given, is the `(state, batch, inputs, metrics)`
  shardings (each a `jax.sharding.Sharding` or a pytree of them): the first three are the update's
  `in_shardings`, the state's and the metrics' its `out_shardings`, so the layout is fixed rather
  than inferred and the state comes back laid out as it went in."""
  fn = functools.partial(rl_update, config=config, optimizer=optimizer,
                         critic_optimizer=critic_optimizer, loss=loss, temperature=temperature,
                         epochs=epochs, minibatches=minibatches, shared_critic=shared_critic,
                         prefix_length=prefix_length)
  if shardings is None:
    return jax.jit(fn, donate_argnums=0)
  state, batch, inputs, metrics = shardings
  return jax.jit(fn, donate_argnums=0, in_shardings=(state, batch, inputs),
                 out_shardings=(state, metrics))


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "minibatches",
                                             "prefix_length"),
                   donate_argnames=("state",))
def sft_update(state: TrainState, batch: EpisodeBatch, *, config: ModelConfig, optimizer,
               minibatches: int = 1, prefix_length: int = 0):
  """Supervised fine-tuning on (oracle) episodes: token-mean negative log-likelihood of the
  loss-mask tokens, the same masks the RL loss uses. Returns `(state, metrics)`. `prefix_length`:
  the batch's shared prefix (`shared_prefix_length`), computed once per minibatch."""
  b = batch.tokens.shape[0]
  mask = jnp.asarray(batch.loss_mask, jnp.float32)

  def loss_fn(trainable, frozen, mb, mb_mask, dropout_rng):
    logp = episode_logprobs(lora.combine(trainable, frozen), config, mb, dropout_rng=dropout_rng,
                            prefix_length=prefix_length)
    nll = -losses.masked_mean(logp, mb_mask)
    return nll, {"sft_nll": nll, "sft_token_accuracy": losses.masked_mean(
        (logp > jnp.log(0.5)).astype(jnp.float32), mb_mask)}

  def step(state, xs):
    rows, dropout_rng = xs
    return _trainable_step(state, loss_fn, (_slice_rows(batch, rows), mask[rows], dropout_rng),
                           config=config, optimizer=optimizer)

  return _scan_minibatches(state, step, b, minibatches, config)


def _trainable_step(state: TrainState, loss_fn, args, *, config: ModelConfig, optimizer):
  """One optimiser step of `loss_fn(trainable, frozen, *args) -> (loss, metrics)` on the trainable
  part of `state.params` (with LoRA the adapters), skipped (and counted) when the loss or the
  gradient is not finite. Returns `(state, metrics + loss, grad_norm)`."""
  trainable, frozen = lora.partition(state.params, config)
  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, *args)
  ok = jnp.isfinite(loss) & _finite(grads)
  trainable, opt_state = _apply(optimizer, trainable, state.opt_state, grads, ok)
  state = state.replace(params=lora.combine(trainable, frozen), opt_state=opt_state,
                        step=state.step + 1, skipped=state.skipped + (~ok).astype(jnp.int32))
  return state, dict(metrics, loss=loss, grad_norm=_norm(grads))


def _scan_minibatches(state: TrainState, step, n: int, minibatches: int, config: ModelConfig):
  """`step(state, (indices, dropout key))` over `minibatches` slices of a permutation of `range(n)`
  drawn from the state's rng; returns `(state, metrics averaged over the steps)`."""
  rng, key = jax.random.split(state.rng)
  order = jax.random.permutation(key, n).reshape(minibatches, n // minibatches)
  state, metrics = jax.lax.scan(step, state, (order, _dropout_keys(key, minibatches, config)))
  return state.replace(rng=rng), jax.tree.map(jnp.mean, metrics)


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "beta", "label_smoothing",
                                             "sft_weight", "minibatches", "temperature"),
                   donate_argnames=("state",))
def dpo_update(state: TrainState, batch: EpisodeBatch, masks, ref_logp, *, config: ModelConfig,
               optimizer, beta: float, label_smoothing: float = 0.0, sft_weight: float = 0.0,
               minibatches: int = 1, temperature: float = 1.0):
  """One pass of DPO over `P` preference pairs in `minibatches` optimiser steps (pair order drawn
  from the state's rng). Returns `(state, metrics)`.

  `batch` holds `2P` rows, the chosen episodes then the rejected ones (pair `i` is rows `i` and
  `P + i`); `masks` `[2P, L]` are the tokens each row is scored on (`core.preference.pair_masks`);
  `ref_logp` `[2P]` the reference policy's summed log-probs of those tokens. The loss is the mean
  over a minibatch's pairs of `core.preference.dpo_loss` plus `sft_weight` times the chosen
  episode's mean negative log-likelihood per scored token (RPO, Pang et al. 2024: DPO alone can
  lower the chosen episodes' likelihood too, only less than the rejected ones')."""
  p = batch.tokens.shape[0] // 2
  masks = jnp.asarray(masks, jnp.float32)

  def loss_fn(trainable, frozen, mb, mb_masks, ref, dropout_rng):
    logp = episode_logprobs(lora.combine(trainable, frozen), config, mb, temperature=temperature,
                            dropout_rng=dropout_rng)
    seq = jnp.sum(logp * mb_masks, axis=-1)
    n = seq.shape[0] // 2
    loss, margin = preference.dpo_loss(seq[:n], seq[n:], ref[:n], ref[n:], beta=beta,
                                       label_smoothing=label_smoothing)
    nll = -jnp.mean(seq[:n] / jnp.maximum(jnp.sum(mb_masks[:n], axis=-1), 1.0))
    total = jnp.mean(loss) + sft_weight * nll
    return total, {"dpo_loss": jnp.mean(loss), "dpo_margin": jnp.mean(margin), "dpo_nll": nll,
                            "dpo_accuracy": jnp.mean((margin > 0).astype(jnp.float32)),
                            "dpo_chosen_logratio": jnp.mean(seq[:n] - ref[:n]),
                            "dpo_rejected_logratio": jnp.mean(seq[n:] - ref[n:])}

  def step(state, xs):
    pairs, dropout_rng = xs
    rows = jnp.concatenate([pairs, pairs + p])
    return _trainable_step(
        state, loss_fn, (_slice_rows(batch, rows), masks[rows], ref_logp[rows], dropout_rng),
        config=config, optimizer=optimizer)

  return _scan_minibatches(state, step, p, minibatches, config)
