"""The Llama-family decoder: NumPy reference forward, cache, masks, RoPE, scan/remat, critics, sharding."""

import functools
import json
import math
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import models
from longhorizon.models import llama
from longhorizon.models.config import ModelConfig, RopeScaling


@pytest.fixture(scope="module")
def tiny():
  config = models.tiny_config(vocab_size=97, rope_theta=1e5)
  params = models.init_params(config, jax.random.key(0))
  # Non-trivial norm scales so a wrong norm cannot hide behind scale = 1.
  # Non-trivial norm scales so a wrong norm cannot hide behind scale = 1, and larger query/key
  # weights so attention is sharp (at init scale it is nearly uniform and position-blind).
  def perturb(path, x):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return x * (1.0 + 0.1 * np.sin(np.arange(x.size).reshape(x.shape)))
    if "q_proj" in name or "k_proj" in name:
      return x * 8.0
    return x
  return config, jax.tree_util.tree_map_with_path(perturb, params)


@functools.lru_cache(maxsize=None)
def _jitted_forward(config):
  # One jitted function per config: eager `apply` re-traces (and recompiles) the layer scan every call.
  def forward(params, tokens, positions, lengths, cache):
    if cache is None:
      return models.Transformer(config).apply({"params": params}, tokens, positions=positions,
                                              lengths=lengths)
    return models.cached_forward(params, config, tokens, cache, positions=positions,
                                 lengths=lengths, compute_logits=True)
  return jax.jit(forward)


def _forward(config, params, tokens, positions=None, lengths=None, cache=None):
  return _jitted_forward(config)(params, jnp.asarray(tokens), positions, lengths, cache)


# ----------------------------------------------------------------------------------------------------
# A slow, obviously correct NumPy forward pass (float64), written from the Llama definition.


def _np_rope(x, positions, theta, inv_freq=None):
  # x [T, N, hd]; HF "rotate half" layout.
  hd = x.shape[-1]
  if inv_freq is None:
    inv_freq = 1.0 / theta**(np.arange(0, hd, 2) / hd)
  out = np.empty_like(x)
  for t, pos in enumerate(positions):
    for i, f in enumerate(inv_freq):
      c, s = math.cos(pos * f), math.sin(pos * f)
      a, b = x[t, :, i], x[t, :, i + hd // 2]
      out[t, :, i] = a * c - b * s
      out[t, :, i + hd // 2] = b * c + a * s
  return out


def _np_rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _np_forward(config, params, tokens):
  """Logits [T, V] of one unpadded row."""
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  h, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.dims_per_head
  t = len(tokens)
  x = p["embed_tokens"]["embedding"][np.asarray(tokens)]
  for layer in range(config.num_hidden_layers):
    lp = jax.tree_util.tree_map(lambda a: a[layer], p["layers"])
    a = _np_rms(x, lp["input_layernorm"]["scale"], config.rms_norm_eps)
    q = (a @ lp["self_attn"]["q_proj"]["kernel"]).reshape(t, h, hd)
    k = (a @ lp["self_attn"]["k_proj"]["kernel"]).reshape(t, kv, hd)
    v = (a @ lp["self_attn"]["v_proj"]["kernel"]).reshape(t, kv, hd)
    q, k = _np_rope(q, range(t), config.rope_theta), _np_rope(k, range(t), config.rope_theta)
    out = np.zeros((t, h, hd))
    for head in range(h):
      kvh = head // (h // kv)
      for i in range(t):
        scores = np.array([q[i, head] @ k[j, kvh] / math.sqrt(hd) for j in range(i + 1)])
        w = np.exp(scores - scores.max())
        w /= w.sum()
        out[i, head] = sum(w[j] * v[j, kvh] for j in range(i + 1))
    x = x + out.reshape(t, h * hd) @ lp["self_attn"]["o_proj"]["kernel"]
    a = _np_rms(x, lp["post_attention_layernorm"]["scale"], config.rms_norm_eps)
    gate = a @ lp["mlp"]["gate_proj"]["kernel"]
    up = a @ lp["mlp"]["up_proj"]["kernel"]
    x = x + (gate / (1 + np.exp(-gate)) * up) @ lp["mlp"]["down_proj"]["kernel"]
  x = _np_rms(x, p["norm"]["scale"], config.rms_norm_eps)
  return x @ p["embed_tokens"]["embedding"].T


def test_forward_matches_numpy_reference(tiny):
  config, params = tiny
  tokens = [5, 17, 2, 96, 0, 33, 2, 41]
  logits = np.asarray(_forward(config, params, [tokens]).logits[0])
  np.testing.assert_allclose(logits, _np_forward(config, params, tokens), atol=2e-4, rtol=1e-4)
  assert logits.dtype == np.float32


def test_output_shapes_and_float32_logits_with_bf16_compute(tiny):
  config, params = tiny
  out = _forward(config.replace(dtype="bfloat16"), params, np.zeros((3, 5), np.int32))
  assert out.logits.shape == (3, 5, 97) and out.logits.dtype == jnp.float32
  assert out.hidden.dtype == jnp.bfloat16 and out.cache is None
  ref = _forward(config, params, np.zeros((3, 5), np.int32)).logits
  assert float(jnp.max(jnp.abs(out.logits - ref))) < 0.05


# ----------------------------------------------------------------------------------------------------
# Masks come from lengths and slots, never from token values.


def test_right_padding_does_not_change_real_positions(tiny):
  config, params = tiny
  row = np.array([7, 2, 9, 2, 11], np.int32)  # id 2 (a pad id in SmolLM2) inside the row
  alone = _forward(config, params, row[None]).logits[0]
  padded = np.concatenate([row, [2, 2, 50]])[None]
  out = _forward(config, params, padded, lengths=np.array([5])).logits[0, :5]
  np.testing.assert_allclose(np.asarray(out), np.asarray(alone), atol=1e-5)
  # What sits in the padding does not matter...
  other = padded.copy()
  other[0, 5:] = [1, 3, 4]
  np.testing.assert_allclose(np.asarray(_forward(config, params, other, lengths=np.array([5])).logits[0, :5]),
                             np.asarray(out), atol=1e-6)
  # ...but a real token equal to the pad id does: dropping the inner 2 changes the last logits.
  without = _forward(config, params, np.array([[7, 9, 2, 11]], np.int32)).logits[0, -1]
  assert float(jnp.max(jnp.abs(without - alone[-1]))) > 1e-3


def test_batch_composition_invariance(tiny):
  config, params = tiny
  rng = np.random.default_rng(0)
  rows = [rng.integers(0, 97, n).astype(np.int32) for n in (6, 3, 8)]
  batch = np.zeros((3, 8), np.int32)
  for i, r in enumerate(rows):
    batch[i, :len(r)] = r
  out = _forward(config, params, batch, lengths=np.array([6, 3, 8])).logits
  for i, r in enumerate(rows):
    alone = _forward(config, params, r[None]).logits[0]
    np.testing.assert_allclose(np.asarray(out[i, :len(r)]), np.asarray(alone), atol=1e-5)


def test_cache_prefill_decode_and_extend_match_full_recompute(tiny):
  config, params = tiny
  rng = np.random.default_rng(1)
  seq = rng.integers(0, 97, (2, 14)).astype(np.int32)
  full = np.asarray(_forward(config, params, seq).logits)
  cache = models.init_cache(config, 2, 16)
  out = _forward(config, params, seq[:, :5], cache=cache)
  pieces = [np.asarray(out.logits)]
  cache = out.cache
  for t in range(5, 9):  # decode one token at a time (one shape: compiled once)
    out = _forward(config, params, seq[:, t:t + 1], cache=cache)
    cache = out.cache
    pieces.append(np.asarray(out.logits))
  out = _forward(config, params, seq[:, 9:14], cache=cache)  # extend with a 5-token observation
  pieces.append(np.asarray(out.logits))
  np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(out.cache.end), [14, 14])


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_cache_path_with_qkv_bias_untied_head_and_bf16_matches_full_recompute():
  # `cached_forward` runs fused q|k|v (with bias) and gate|up weights; the scanned Linen blocks run
  # the separate projections: the two must agree, decode step by step, in float32 and bfloat16.
  config = models.tiny_config(tie_word_embeddings=False, attention_bias=True)
  params = models.init_params(config, jax.random.key(3))
  params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(4), a.shape, a.dtype),
                        params)  # non-zero biases
  seq = np.random.default_rng(2).integers(0, 256, (2, 9)).astype(np.int32)
  for cfg, atol in ((config, 1e-4), (config.replace(dtype="bfloat16"), 0.1)):
    full = np.asarray(_forward(cfg, params, seq).logits)
    out = _forward(cfg, params, seq[:, :4], cache=models.init_cache(cfg, 2, 12))
    pieces, cache = [np.asarray(out.logits)], out.cache
    for t in range(4, 9):
      out = _forward(cfg, params, seq[:, t:t + 1], cache=cache)
      pieces.append(np.asarray(out.logits))
      cache = out.cache
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=atol)


def test_prepared_decode_params_give_the_same_results(tiny):
  config, params = tiny
  prepared = models.prepare_decode_params(params, config)
  assert len(prepared.layers) == config.num_hidden_layers
  assert models.prepare_decode_params(prepared, config) is prepared
  tokens = np.array([[5, 6, 7, 8]], np.int32)
  raw = _forward(config, params, tokens, cache=models.init_cache(config, 1, 6)).logits
  fast = _forward(config, prepared, tokens, cache=models.init_cache(config, 1, 6)).logits
  np.testing.assert_array_equal(np.asarray(raw), np.asarray(fast))
  bf16 = models.prepare_decode_params(params, config.replace(dtype="bfloat16"))
  assert bf16.layers[0]["gate_up"].dtype == jnp.bfloat16


def test_cache_with_ragged_rows_matches_each_row_alone(tiny):
  config, params = tiny
  prompts = [np.array([3, 4, 5, 6], np.int32), np.array([9, 2], np.int32)]
  tokens = np.array([[3, 4, 5, 6], [9, 2, 0, 0]], np.int32)
  cache = models.init_cache(config, 2, 10)
  out = _forward(config, params, tokens, lengths=np.array([4, 2]), cache=cache)
  np.testing.assert_array_equal(np.asarray(out.cache.end), [4, 2])
  step = _forward(config, params, np.array([[7], [8]], np.int32), cache=out.cache)
  for i, (prompt, nxt) in enumerate(zip(prompts, (7, 8))):
    alone = _forward(config, params, np.concatenate([prompt, [nxt]])[None]).logits[0, -1]
    np.testing.assert_allclose(np.asarray(step.logits[i, 0]), np.asarray(alone), atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# RoPE.


def test_rope_theta_is_honoured(tiny):
  config, params = tiny
  tokens = np.arange(1, 12, dtype=np.int32)[None]
  base = _forward(config, params, tokens).logits
  other = _forward(config.replace(rope_theta=1e4), params, tokens).logits
  assert float(jnp.max(jnp.abs(base - other))) > 1e-2
  np.testing.assert_allclose(np.asarray(base[0]), _np_forward(config, params, tokens[0]), atol=2e-4)


def test_rope_rotation_matches_reference_at_large_positions():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(1, 3, 2, 8)).astype(np.float32)
  positions = np.array([[0, 1000, 7999]])
  config = models.tiny_config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                              rope_theta=1e5)
  got = np.asarray(llama._apply_rope(jnp.asarray(x), llama.rope_tables(jnp.asarray(positions), config)))
  want = _np_rope(x[0].astype(np.float64), positions[0], 1e5)
  np.testing.assert_allclose(got[0], want, atol=2e-3)


def test_llama3_rope_scaling_matches_formula():
  scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)
  config = models.tiny_config(hidden_size=128, num_attention_heads=1, num_key_value_heads=1,
                              rope_theta=5e5, rope_scaling=scaling)
  got = llama.rope_frequencies(config)
  hd = 128
  want = []
  for i in range(0, hd, 2):
    f = 1.0 / 5e5**(i / hd)
    wavelen = 2 * math.pi / f
    if wavelen < 8192 / 4.0:  # high frequency: unchanged
      want.append(f)
    elif wavelen > 8192 / 1.0:  # low frequency: divided by the factor
      want.append(f / 8.0)
    else:  # in between: interpolate
      smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
      want.append((1 - smooth) * f / 8.0 + smooth * f)
  np.testing.assert_allclose(got, np.array(want), rtol=1e-5)
  assert got[0] == pytest.approx(1.0) and got[-1] < 1.0 / 5e5**(126 / 128)


# ----------------------------------------------------------------------------------------------------
# Structure: logical axes, scan over layers, remat, critics, config errors.


def test_every_parameter_has_logical_axis_names():
  config = models.tiny_config(tie_word_embeddings=False, attention_bias=True)
  boxed = models.Transformer(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
  leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
  for leaf in leaves:
    assert len(leaf.names) == leaf.value.ndim
  layer_names = [leaf.names for leaf in leaves if leaf.value.ndim and leaf.names[0] == "layers"]
  assert len(layer_names) == 2 + 7 + 3  # norms, projections (+3 q/k/v biases) under the scan


def test_layers_are_scanned_so_the_program_does_not_grow_with_depth():
  def program_size(layers):
    config = models.tiny_config(num_hidden_layers=layers)
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.key(0)))
    apply = lambda p: models.Transformer(config).apply({"params": p}, jnp.zeros((1, 4), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda p: apply(p).logits)(params)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == layers
    return len(jaxpr.jaxpr.eqns)
  assert program_size(12) == program_size(2)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_policies_give_the_same_gradients(tiny, remat):
  config, params = tiny
  tokens = jnp.asarray(np.arange(10, dtype=np.int32)[None] % 97)

  def loss(p, cfg):
    return jnp.mean(_forward(cfg, p, tokens).logits ** 2)
  g_ref = jax.grad(loss)(params, config)
  g = jax.grad(loss)(params, config.replace(remat=remat))
  for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_untied_embeddings_and_qkv_bias():
  config = models.tiny_config(tie_word_embeddings=False, attention_bias=True)
  params = models.init_params(config, jax.random.key(1))
  assert params["lm_head"]["kernel"].shape == (64, 256)
  assert params["layers"]["self_attn"]["q_proj"]["bias"].shape == (2, 64)
  params["layers"]["self_attn"]["k_proj"]["bias"] = params["layers"]["self_attn"]["k_proj"]["bias"] + 0.5
  out = _forward(config, params, np.array([[1, 2, 3]]))
  assert out.logits.shape == (1, 3, 256)
  np.testing.assert_allclose(
      np.asarray(out.logits),
      np.asarray(jnp.einsum("btd,dv->btv", out.hidden, params["lm_head"]["kernel"])), atol=1e-5)
  assert models.unembedding(params, config).shape == (64, 256)


def test_critics_return_one_float32_value_per_token():
  config = models.tiny_config()
  tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6))
  critic = models.Critic(config)
  variables = critic.init(jax.random.key(0), tokens)
  values = critic.apply(variables, tokens)
  assert values.shape == (2, 6) and values.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(values), 0.0)  # value head starts at zero
  shared = models.PolicyWithValue(config)
  v2 = shared.init(jax.random.key(0), tokens)
  out, values = shared.apply(v2, tokens)
  assert values.shape == (2, 6) and out.logits.shape == (2, 6, 256)
  assert set(nn.meta.unbox(v2["params"])) == {"trunk", "value_head"}


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="num_attention_heads=6 is not a multiple of num_key_value_heads=4"):
    models.tiny_config(num_attention_heads=6, num_key_value_heads=4)
  with pytest.raises(ValueError, match="remat must be"):
    models.tiny_config(remat="sometimes")
  with pytest.raises(ValueError, match="unknown architecture"):
    ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "vocab_size": 1})
  with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
    ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                         "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                         "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_hf_config_round_trip():
  config = models.tiny_config(rope_scaling=RopeScaling(), tie_word_embeddings=False)
  again = ModelConfig.from_hf(json.loads(json.dumps(config.to_hf())))
  assert again == config


def test_jitted_forward_is_traced_once(tiny, assert_no_retrace):
  config, params = tiny
  fwd = jax.jit(lambda p, t: _forward(config, p, t).logits)
  assert_no_retrace(fwd, ((params, np.zeros((2, 5), np.int32)), {}),
                    ((params, np.ones((2, 5), np.int32)), {}))


# ----------------------------------------------------------------------------------------------------
# Sharding on 8 emulated devices (a separate process: the device count is fixed at jax start-up).

_SHARDED_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from longhorizon import models
from longhorizon.models import sharding
assert jax.device_count() == 8, jax.devices()
config = models.tiny_config(vocab_size=96, tie_word_embeddings=False, attention_bias=True)
module = models.Transformer(config)
mesh = sharding.make_mesh(2, 2, 2)
sample = jnp.zeros((1, 1), jnp.int32)
params = sharding.init_sharded_params(module, sample, jax.random.key(0), mesh)
spec = params["layers"]["mlp"]["gate_proj"]["kernel"].sharding.spec
assert tuple(spec) == (None, "fsdp", "tensor"), spec
host = jax.device_get(params)
tokens = np.random.default_rng(0).integers(0, 96, (4, 12)).astype(np.int32)
lengths = np.array([12, 7, 9, 1], np.int32)
ref = module.apply({"params": host}, tokens, lengths=lengths).logits
fwd = jax.jit(lambda p, t, l: module.apply({"params": p}, t, lengths=l).logits)
out = sharding.with_rules(lambda: fwd(params, jax.device_put(tokens, sharding.batch_sharding(mesh)),
                                      lengths), mesh)
diff = float(jnp.max(jnp.abs(out - ref)))
per_device = params["embed_tokens"]["embedding"].addressable_shards[0].data.size
placed = sharding.shard_batch({"tokens": tokens, "odd": np.zeros((3, 2)), "step": np.int32(1)}, mesh)
assert placed["tokens"].sharding.spec[0] == ("data", "fsdp"), placed["tokens"].sharding
assert placed["tokens"].addressable_shards[0].data.shape == (1, 12)  # 4 rows over 4 ways
assert placed["odd"].sharding.spec[0] is None  # 3 rows do not split 4 ways: kept whole
print("DIFF", diff, "SHARD", per_device, host["embed_tokens"]["embedding"].size)
"""


_SHARDED_MOE_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from longhorizon import models
from longhorizon.models import sharding
config = models.tiny_config(vocab_size=96, model_type="qwen3_moe", qk_norm=True, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
module = models.Transformer(config)
mesh = sharding.make_mesh(2, 2, 2)
params = sharding.init_sharded_params(module, jnp.zeros((1, 1), jnp.int32), jax.random.key(0), mesh)
mlp = params["layers"]["mlp"]
assert tuple(mlp["gate_proj"].sharding.spec) == (None, "tensor", "fsdp", None), mlp["gate_proj"].sharding
assert tuple(mlp["down_proj"].sharding.spec) == (None, "tensor", None, "fsdp")
assert tuple(mlp["gate"]["kernel"].sharding.spec) == (None, "fsdp", "tensor")
assert mlp["gate_proj"].addressable_shards[0].data.shape[1] == 2  # 4 experts over tensor (2)
host = jax.device_get(params)
tokens = np.random.default_rng(0).integers(0, 96, (4, 12)).astype(np.int32)
ref = module.apply({"params": host}, tokens)
fwd = jax.jit(lambda p, t: module.apply({"params": p}, t))
out = sharding.with_rules(lambda: fwd(params, jax.device_put(tokens, sharding.batch_sharding(mesh))),
                          mesh)
np.testing.assert_array_equal(np.asarray(out.routing), np.asarray(ref.routing))
print("DIFF", float(jnp.max(jnp.abs(out.logits - ref.logits))), float(out.aux_loss - ref.aux_loss))
"""


@pytest.mark.slow
def test_moe_experts_shard_over_the_tensor_axis():
  """The "experts" rule: expert stacks split over the tensor axis (each device holds whole
  experts), the router over (fsdp, tensor); the sharded forward equals one device's."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SHARDED_MOE_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=300, cwd=pathlib.Path(__file__).parents[2])
  assert result.returncode == 0, result.stderr[-3000:]
  line = [l for l in result.stdout.splitlines() if l.startswith("DIFF")][0].split()
  assert float(line[1]) < 1e-5 and abs(float(line[2])) < 1e-5


@pytest.mark.slow
def test_sharded_forward_equals_single_device():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300, cwd=pathlib.Path(__file__).parents[2])
  assert result.returncode == 0, result.stderr[-3000:]
  line = [l for l in result.stdout.splitlines() if l.startswith("DIFF")][0].split()
  assert float(line[1]) < 1e-5
  assert int(line[3]) == int(line[4]) // 4  # vocab over tensor (2) x embed over fsdp (2)
