"""Shared-prefix passes (`Transformer(prefix_length=P)`, `optim.share_prefix`): the tokens every row
of a batch shares go through the model once, and the outputs, log-probs and gradients are the
per-row pass's. The reference is the ordinary forward pass (itself held to NumPy and to
`transformers` in test_causal_attention.py / test_hf_parity.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import models
from longhorizon.core import episode as episode_lib
from longhorizon.models import llama
from longhorizon.models.config import ModelConfig
from longhorizon.train import update as update_lib

_GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=97,
               hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               rope_theta=1e6, rope_local_base_freq=1e4)


def _config(name):
  if name == "gemma3":  # sliding-window layers (window 4 < the prefix), q/k norms, sandwich norms
    return ModelConfig.from_hf(_GEMMA3)
  if name == "lora":
    return models.tiny_config(lora_rank=4, lora_alpha=8.0)
  return models.tiny_config()


def _batch(config, b=3, t=13, p=5, lengths=(13, 9, 7), seed=0):
  """`b` right-padded rows whose first `p` tokens are equal; positions `arange`."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, (b, t)).astype(np.int32)
  tokens[:, :p] = tokens[0, :p]
  attention = (np.arange(t)[None, :] < np.asarray(lengths)[:, None])
  tokens = np.where(attention, tokens, 0)
  loss = attention & (np.arange(t)[None, :] >= p)
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  return tokens, positions, attention, loss


def _params(config, seed=1):
  """Random parameters, every one (LoRA's zero-initialised B matrices too) moved by noise so that
  no gradient is trivially zero."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: x + 0.02 * rng.normal(size=x.shape).astype(x.dtype),
                      models.init_params(config, jax.random.key(seed)))


class _Rows:
  """The fields `episode_logprobs` and `shared_prefix_length` read."""

  def __init__(self, tokens, positions, attention, loss):
    self.tokens, self.positions = tokens, positions
    self.attention_mask, self.loss_mask = attention, loss
    self.routing = None


def test_shared_prefix_length_by_hand():
  """Rows agree on tokens 0-5 and positions 0-6, all attend to 4 or more tokens; the first trained
  token is at 4: P = min(6, 4) = 4, rounded down to multiples."""
  tokens = np.array([[7, 7, 3, 9, 4, 1, 2, 0], [7, 7, 3, 9, 4, 1, 5, 6]], np.int32)
  positions = np.broadcast_to(np.arange(8), (2, 8))
  attention = np.array([[1] * 7 + [0], [1] * 8], bool)
  loss = np.zeros((2, 8), bool)
  loss[1, 4:] = True
  rows = _Rows(tokens, positions, attention, loss)
  assert [episode_lib.shared_prefix_length(rows, m) for m in (1, 2, 3, 4, 5, 0)] == [4, 4, 3, 4,
                                                                                      0, 0]
  loss[:] = False  # nothing trained: the common tokens, 6
  assert episode_lib.shared_prefix_length(rows, 1) == 6
  rows.positions = positions.copy()
  rows.positions[1, 2:] += 1  # a row whose positions differ from slot 2 on (a context segment)
  assert episode_lib.shared_prefix_length(rows, 1) == 2
  rows.tokens = np.tile(tokens[:1], (2, 1))
  rows.positions, rows.attention_mask = positions, np.ones((2, 8), bool)
  assert episode_lib.shared_prefix_length(rows, 1) == 7  # identical rows: never the whole length
  assert episode_lib.shared_prefix_length(_Rows(*(x[:1] for x in (tokens, positions, attention,
                                                                   loss))), 1) == 0  # one row


@pytest.mark.parametrize("name", ["llama", pytest.param("gemma3", marks=pytest.mark.slow),
                                  pytest.param("lora", marks=pytest.mark.slow)])
def test_hidden_states_equal_the_per_row_pass(name):
  """Positions P-1 .. T-1 of every row (padding rows too) equal the ordinary forward pass's."""
  config = _config(name)
  tokens, positions, attention, _ = _batch(config)
  params = _params(config)
  lengths = jnp.asarray(attention.sum(-1), jnp.int32)
  apply = jax.jit(llama.Transformer(config).apply, static_argnames="prefix_length")
  full = apply({"params": params}, jnp.asarray(tokens), jnp.asarray(positions), lengths)
  shared = apply({"params": params}, jnp.asarray(tokens), jnp.asarray(positions), lengths,
                 prefix_length=5)
  assert shared.hidden.shape == (3, 13 - 5 + 1, config.hidden_size)
  for r, n in enumerate(np.asarray(lengths)):
    np.testing.assert_allclose(np.asarray(shared.hidden[r, :n - 4]), np.asarray(full.hidden[r, 4:n]),
                               atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(shared.logits[0]), np.asarray(full.logits[0, 4:]),
                             atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", pytest.param("gemma3", marks=pytest.mark.slow),
                                  pytest.param("lora", marks=pytest.mark.slow)])
def test_logprobs_and_gradients_equal_the_per_row_pass(name):
  """`episode_logprobs(prefix_length=P)`: the same log-probs and entropies from token P on (0
  before), and the same gradient of a masked loss, for every parameter (with LoRA, the adapters'
  and the frozen base's alike)."""
  config = _config(name)
  tokens, positions, attention, loss = _batch(config)
  params = _params(config)
  rows = _Rows(*(jnp.asarray(x) for x in (tokens, positions, attention, loss)))
  weights = jnp.asarray(np.random.default_rng(2).normal(size=tokens.shape), jnp.float32) * loss

  def objective(params, prefix):
    logp, ent = update_lib.episode_logprobs(params, config, rows, return_entropy=True,
                                            prefix_length=prefix)
    return jnp.sum(weights * logp) + 0.1 * jnp.sum(weights * ent), (logp, ent)

  grad = jax.jit(jax.value_and_grad(objective, has_aux=True), static_argnums=1)
  (v0, (logp0, ent0)), g0 = grad(params, 0)
  (v1, (logp1, ent1)), g1 = grad(params, 5)
  on = np.asarray(attention) & (np.arange(13)[None, :] >= 5)
  np.testing.assert_allclose(np.asarray(logp1)[on], np.asarray(logp0)[on], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(ent1)[on], np.asarray(ent0)[on], atol=2e-5, rtol=1e-5)
  assert not np.asarray(logp1)[:, :5].any() and not np.asarray(ent1)[:, :5].any()
  np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
  for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g0),
                        jax.tree.leaves(g1)):
    scale = float(jnp.max(jnp.abs(a))) + 1e-6
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale, rtol=1e-4,
                               err_msg=jax.tree_util.keystr(path[0]))
    assert float(jnp.max(jnp.abs(a))) > 0  # every parameter gets a gradient here


def test_attention_with_key_offset_equals_the_full_sequence_attention():
  """`causal_attention(key_offset=P)` on the last T - P queries equals those rows of the
  attention over all T queries (the blocked kernel is held to NumPy in test_causal_attention)."""
  config = models.tiny_config()
  rng = np.random.default_rng(3)
  b, t, kv, g, hd, p = 2, 11, 2, 2, 4, 6
  q = jnp.asarray(rng.normal(size=(b, t, kv, g, hd)), jnp.float32)
  keys = jnp.asarray(rng.normal(size=(b, kv, t, hd)), jnp.float32)
  values = jnp.asarray(rng.normal(size=(b, kv, t, hd)), jnp.float32)
  slots = np.arange(t)
  mask = jnp.asarray((slots[None, None, :] <= slots[None, :, None])
                     & (slots[None, None, :] < np.array([11, 8])[:, None, None]))
  full = llama.causal_attention(q, keys, values, mask, config, block=4)
  for block in (2, 3, 128):
    part = llama.causal_attention(q[:, p:], keys, values, mask[:, p:], config, block=block,
                                  key_offset=p)
    np.testing.assert_allclose(np.asarray(part), np.asarray(full[:, p:]), atol=1e-6)


def test_bad_prefix_lengths_are_refused():
  config = models.tiny_config()
  tokens, positions, attention, _ = _batch(config)
  params = _params(config)
  model = llama.Transformer(config)
  for p in (13, 20):
    with pytest.raises(ValueError, match=r"prefix_length must be in \(0, 13\)"):
      model.apply({"params": params}, jnp.asarray(tokens), prefix_length=p)
