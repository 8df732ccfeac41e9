"""Token log-probabilities and entropies of a policy's logits.

Everything here computes in float32 whatever the input dtype (bf16 logits or hidden states in, float32
log-probs out): importance ratios are differences of log-probs, and a bf16 log-softmax over a 50k
vocabulary loses the digits those differences live in.

Shapes: `B` rows, `T` positions, `V` vocabulary, `D` hidden width. Leading dimensions other than
`[B, T]` are accepted as long as `targets.shape == logits.shape[:-1]`.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

__all__ = ["token_logprobs", "entropy", "token_logprobs_from_hidden"]

_PAD_LOGIT = -1e30


def _check_logits_targets(logits, targets):
  chex.assert_rank(targets, logits.ndim - 1)
  chex.assert_equal_shape_prefix([logits, targets], targets.ndim)
  chex.assert_type(targets, int)


@functools.partial(jax.jit, static_argnames=())
def token_logprobs(logits: chex.Array, targets: chex.Array, temperature=1.0) -> jax.Array:
  """Log-probability of each target token, `log softmax(logits / temperature)[targets]`.

  Args:
    logits: `[B, T, V]` unnormalised scores (any float dtype).
    targets: `[B, T]` int token ids; position `t` scores `targets[:, t]` under `logits[:, t]` (callers
      shift: logits of position `t` predict token `t + 1`).
    temperature: scalar > 0 the sampler divided the logits by; log-probs for importance ratios must use
      the sampling temperature.

  Returns:
    `[B, T]` float32 log-probabilities (`<= 0`). Masking is the caller's business: every position is
    computed.
  """
  logits = jnp.asarray(logits)
  targets = jnp.asarray(targets)
  _check_logits_targets(logits, targets)
  logits = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return target_logits - jax.nn.logsumexp(logits, axis=-1)


@jax.jit
def entropy(logits: chex.Array, temperature=1.0) -> jax.Array:
  """Entropy of the softmax distribution, `H = -sum_v p_v log p_v`, `p = softmax(logits / temperature)`.

  Args:
    logits: `[B, T, V]` unnormalised scores.
    temperature: scalar > 0.

  Returns:
    `[B, T]` float32 entropies in nats, in `[0, log V]`.
  """
  logits = jnp.asarray(logits)
  chex.assert_rank(logits, {2, 3, 4})
  logits = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  # p = 0 (a -inf logit, e.g. a masked token) contributes 0, not 0 * -inf; the inner `where` keeps the
  # gradient of the unselected branch finite too.
  finite = jnp.isfinite(logp)
  safe_logp = jnp.where(finite, logp, 0.0)
  return -jnp.sum(jnp.where(finite, jnp.exp(safe_logp) * safe_logp, 0.0), axis=-1)


def _unembed_as_dv(unembed: jax.Array, d: int, vocab_axis: int | None) -> jax.Array:
  """Returns the unembedding as `[D, V]`, accepting `[D, V]` (Flax Dense kernel) or `[V, D]` (tied
  embedding table / HF `lm_head.weight`)."""
  chex.assert_rank(unembed, 2)
  if vocab_axis is None:
    if unembed.shape[0] == unembed.shape[1]:
      raise ValueError(
          f"unembed has square shape {unembed.shape}: cannot tell [D, V] from [V, D]; pass vocab_axis=1 "
          "for a [D, V] kernel or vocab_axis=0 for a [V, D] embedding table.")
    if unembed.shape[0] == d:
      vocab_axis = 1
    elif unembed.shape[1] == d:
      vocab_axis = 0
    else:
      raise ValueError(
          f"unembed shape {unembed.shape} does not match hidden width D={d}: expected [D, V] or [V, D].")
  if vocab_axis not in (0, 1):
    raise ValueError(f"vocab_axis must be 0, 1 or None, got {vocab_axis!r}.")
  if unembed.shape[1 - vocab_axis] != d:
    raise ValueError(
        f"unembed shape {unembed.shape} with vocab_axis={vocab_axis} has hidden width "
        f"{unembed.shape[1 - vocab_axis]}, but hidden has D={d}.")
  return unembed if vocab_axis == 1 else unembed.T


def _check_from_hidden(hidden, targets, chunk_size):
  hidden, targets = jnp.asarray(hidden), jnp.asarray(targets)
  chex.assert_rank(hidden, 3)
  chex.assert_rank(targets, 2)
  chex.assert_equal_shape_prefix([hidden, targets], 2)
  chex.assert_type(targets, int)
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
  return hidden, targets


@functools.partial(jax.jit, static_argnames=("chunk_size", "return_entropy", "vocab_axis",
                                             "softcap"))
def token_logprobs_from_hidden(hidden: chex.Array,
                               unembed: chex.Array,
                               targets: chex.Array,
                               chunk_size: int = 4096,
                               temperature=1.0,
                               return_entropy: bool = False,
                               vocab_axis: int | None = None,
                               softcap: float = 0.0):
  """Token log-probs (and optionally entropies) straight from the last hidden state.

  Equal to `token_logprobs(hidden @ unembed, targets)` but never materialises the `[B, T, V]` logits:
  a `lax.scan` walks the vocabulary in chunks of `chunk_size` columns and keeps an online
  log-sum-exp (running max `m`, `s = sum exp(l - m)`, and for the entropy `u = sum exp(l - m) * l`),
  so `log p(y) = l_y - (m + log s)` and `H = m + log s - u / s`. The scan body is rematerialised
  (`jax.checkpoint`), so the backward pass recomputes each `[B*T, chunk_size]` block instead of
  storing it: peak memory is `O(B*T*chunk_size)` rather than `O(B*T*V)` in both passes.

  Args:
    hidden: `[B, T, D]` final hidden states (after the final norm), any float dtype.
    unembed: `[D, V]` output kernel or `[V, D]` (tied) embedding table; the layout is inferred from
      `D`, or given by `vocab_axis` (1 for `[D, V]`, 0 for `[V, D]`) when the matrix is square.
    targets: `[B, T]` int token ids.
    chunk_size: vocabulary columns per scan step (static); `V` need not be a multiple of it.
    temperature: scalar > 0 dividing the logits.
    return_entropy: also return the `[B, T]` entropies.
    softcap: static; when > 0 the logits are first soft-capped, `softcap * tanh(l / softcap)`
      (Gemma 2's final-logit capping), then divided by the temperature.

  Returns:
    `[B, T]` float32 log-probs, or `(logprobs, entropy)` when `return_entropy`.
  """
  hidden, targets = _check_from_hidden(hidden, targets, chunk_size)
  b, t, d = hidden.shape
  w = _unembed_as_dv(jnp.asarray(unembed), d, vocab_axis)
  vocab = w.shape[1]
  chunk = min(chunk_size, vocab)
  num_chunks = -(-vocab // chunk)
  w = jnp.pad(w, ((0, 0), (0, num_chunks * chunk - vocab)))
  w_chunks = w.reshape(d, num_chunks, chunk).transpose(1, 0, 2)  # [C, D, chunk]
  h = hidden.reshape(b * t, d)
  y = targets.reshape(b * t)
  inv_temp = 1.0 / jnp.asarray(temperature, jnp.float32)

  @jax.checkpoint
  def body(carry, xs):
    m, s, u, target_logit = carry
    w_c, c = xs
    logits = jnp.dot(h, w_c, preferred_element_type=jnp.float32)  # [N, chunk]
    if softcap:
      logits = softcap * jnp.tanh(logits / softcap)
    logits = logits * inv_temp
    cols = c * chunk + jnp.arange(chunk)
    # Padding columns get a huge finite negative logit (not -inf, whose 0 * -inf products poison the
    # backward pass); every chunk holds at least one real column, so they never set the max.
    logits = jnp.where(cols[None, :] < vocab, logits, _PAD_LOGIT)
    # The max only shifts for stability; its gradient cancels exactly, so it is stopped.
    m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(logits, axis=-1)))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(logits - m_new[:, None])
    s = s * scale + jnp.sum(e, axis=-1)
    u = u * scale + jnp.sum(e * logits, axis=-1)
    local = y - c * chunk
    in_chunk = (local >= 0) & (local < chunk)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, chunk - 1)[:, None], axis=-1)[:, 0]
    target_logit = jnp.where(in_chunk, picked, target_logit)
    return (m_new, s, u, target_logit), None

  n = b * t
  init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32),
          jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
  (m, s, u, target_logit), _ = jax.lax.scan(body, init, (w_chunks, jnp.arange(num_chunks)))
  lse = m + jnp.log(s)
  logprobs = (target_logit - lse).reshape(b, t)
  if not return_entropy:
    return logprobs
  ent = (lse - u / s).reshape(b, t)
  return logprobs, ent
