"""`llama.causal_attention`: the block-causal training attention against a slow NumPy reference,
its gradients against one unblocked softmax, and the claim that blocks above the diagonal are never
computed."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import models
from longhorizon.models import llama


def _reference(q, keys, values, mask, scale, cap=None):
  """Loops over rows, heads and queries: softmax over the visible keys, float64."""
  b, t, kv, g, hd = q.shape
  out = np.zeros((b, t, kv, g, hd))
  for r in range(b):
    for k in range(kv):
      for j in range(g):
        for i in range(t):
          scores = np.array([q[r, i, k, j] @ keys[r, k, s] * scale for s in range(t)], np.float64)
          if cap:
            scores = cap * np.tanh(scores / cap)
          visible = mask[r, i]
          if not visible.any():
            continue  # a row with no visible key: not compared (its output is never used)
          w = np.where(visible, np.exp(scores - scores[visible].max()), 0.0)
          out[r, i, k, j] = (w / w.sum()) @ values[r, k]
  return out.reshape(b, t, kv * g * hd)


def _inputs(b=2, t=11, kv=2, g=2, hd=3, seed=0, window=None, lengths=(11, 7)):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, t, kv, g, hd)).astype(np.float32)
  keys = rng.normal(size=(b, kv, t, hd)).astype(np.float32)
  values = rng.normal(size=(b, kv, t, hd)).astype(np.float32)
  slots = np.arange(t)
  mask = (slots[None, None, :] <= slots[None, :, None]) & (
      slots[None, None, :] < np.asarray(lengths)[:, None, None])
  if window:
    mask = mask & (slots[None, None, :] > slots[None, :, None] - window)
  return q, keys, values, mask


def _config(**overrides):
  return models.tiny_config(**overrides)


def _scaling(cap=0.0, pre_attn_scalar=None):
  """The three fields `causal_attention` reads of a `ModelConfig` (soft-capping and Gemma's
  query_pre_attn_scalar belong to Gemma configs, whose other fields do not matter here)."""
  scale = (pre_attn_scalar or 3) ** -0.5
  return types.SimpleNamespace(attn_logit_softcapping=cap, query_pre_attn_scalar=pre_attn_scalar,
                               attention_scale=scale)


def test_hand_checked_two_tokens():
  """T = 2, one head, hd = 1, scale 1: token 0 sees only itself; token 1 weighs v0, v1 by
  softmax(q1 k0, q1 k1) = softmax(0, log 3) = (1/4, 3/4)."""
  config = _config(num_attention_heads=1, num_key_value_heads=1, head_dim=1, hidden_size=1)
  q = np.array([1.0, math.log(3.0)], np.float32).reshape(1, 2, 1, 1, 1)
  keys = np.array([0.0, 1.0], np.float32).reshape(1, 1, 2, 1)
  values = np.array([2.0, 6.0], np.float32).reshape(1, 1, 2, 1)
  mask = np.tril(np.ones((2, 2), bool))[None]
  for block in (1, 2):
    out = llama.causal_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values),
                                 jnp.asarray(mask), config, block=block)
    np.testing.assert_allclose(np.asarray(out).ravel(), [2.0, 0.25 * 2.0 + 0.75 * 6.0], rtol=1e-6)


@pytest.mark.parametrize("block", [3, 4, 128])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "gemma_scale"])
def test_matches_the_numpy_reference(block, variant):
  """Every block size (one that divides T, one that does not, T itself and one above T) gives the
  reference's masked softmax, with padding rows, grouped heads, a sliding window, soft-capping and
  Gemma's query scale. (A query with no visible key, a padding query past a window, is left out:
  its output is never used.)"""
  config = _scaling(cap=2.0 if variant == "softcap" else 0.0,
                    pre_attn_scalar=16 if variant == "gemma_scale" else None)
  q, keys, values, mask = _inputs(window=4 if variant == "window" else None)
  out = llama.causal_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values),
                               jnp.asarray(mask), config, block=block)
  want = _reference(q.astype(np.float64), keys.astype(np.float64), values.astype(np.float64),
                    mask, config.attention_scale, cap=config.attn_logit_softcapping)
  seen = mask.any(axis=-1)
  assert (~seen).sum() == (1 if variant == "window" else 0)
  np.testing.assert_allclose(np.asarray(out)[seen], want[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_gradients_equal_one_unblocked_softmax():
  """The cotangents of queries, keys and values through the blocks equal those of a single block
  (one softmax over the full masked matrix)."""
  config = _scaling()
  q, keys, values, mask = _inputs(seed=1)
  w = np.random.default_rng(2).normal(size=(2, 11, 12)).astype(np.float32)

  def loss(block):
    return lambda *a: jnp.sum(llama.causal_attention(*a, jnp.asarray(mask), config, block=block) * w)

  args = tuple(map(jnp.asarray, (q, keys, values)))
  want = jax.grad(loss(11), argnums=(0, 1, 2))(*args)
  for block in (2, 5):
    got = jax.grad(loss(block), argnums=(0, 1, 2))(*args)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _score_elements(block, t=512):
  """Elements of every query-key product's output in the compiled-to-be program."""
  config = _scaling()
  q, keys, values, mask = (jnp.zeros((1, t, 2, 1, 4)), jnp.zeros((1, 2, t, 4)),
                           jnp.zeros((1, 2, t, 4)), jnp.ones((1, t, t), bool))
  jaxpr = jax.make_jaxpr(lambda *a: llama.causal_attention(*a, config, block=block))(
      q, keys, values, mask)
  return sum(int(np.prod(e.outvars[0].aval.shape)) for e in jaxpr.jaxpr.eqns
             if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] != 4)


def test_blocks_above_the_diagonal_are_never_computed():
  """At T = 512 in blocks of 128 the score products cover 10 of the 16 (128 x 128) tiles."""
  full = _score_elements(512)
  assert full == 2 * 512 * 512
  assert _score_elements(128) == full * 10 // 16
  assert _score_elements(64) == full * 36 // 64


def test_transformer_forward_does_not_depend_on_the_block(monkeypatch):
  """The whole decoder's logits are the same whatever `ATTENTION_BLOCK` is (a 40-token sequence in
  blocks of 8 against one block), with right padding."""
  config = _config(vocab_size=53)
  params = models.init_params(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 53)
  lengths = jnp.array([40, 23])
  forward = lambda: llama.Transformer(config).apply({"params": params}, tokens,
                                                     lengths=lengths).logits
  one = forward()
  monkeypatch.setattr(llama, "ATTENTION_BLOCK", 8)
  blocked = forward()
  np.testing.assert_allclose(np.asarray(blocked)[0], np.asarray(one)[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(blocked)[1, :23], np.asarray(one)[1, :23], rtol=1e-5,
                             atol=1e-5)
