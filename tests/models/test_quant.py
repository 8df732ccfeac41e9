"""Weight-only int8 decoding (`models/quant.py`): the quantiser by hand, the C++ int8 matmul
against NumPy, the kernel and XLA paths agreeing, and the quantised sampler close to (but not
equal to) the float model, compiled once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import sampling
from longhorizon.models import (Transformer, cached_forward, cpu_kernels, init_cache, init_params,
                                prepare_decode_params, quant, tiny_config)


def test_quantize_by_hand():
  # Column 0: max |w| = 1, scale 1/127: 1 -> 127, 0.5 -> 63.5 -> 64 (round half to even).
  # Column 1: max |w| = 4, scale 4/127: -2 -> -63.5 -> -64, 4 -> 127. A zero column gets scale 1.
  w = np.array([[1.0, -2.0, 0.0], [0.5, 4.0, 0.0]], np.float32)
  qw = quant.quantize_int8(w)
  np.testing.assert_array_equal(np.asarray(qw.q), [[127, -64, 0], [64, 127, 0]])
  np.testing.assert_allclose(np.asarray(qw.scale), [1 / 127, 4 / 127, 1.0], rtol=1e-7)
  back = np.asarray(quant.dequantize(qw))
  assert (np.abs(back - w) <= np.asarray(qw.scale) / 2 + 1e-7).all()


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernel library does not build here")
@pytest.mark.parametrize("m, i, o", [(1, 5, 3), (3, 70, 200), (40, 64, 130), (2, 33, 256)])
def test_int8_kernel_matches_numpy(m, i, o):
  """Ragged column blocks (O not a multiple of 128) and row tiles (M > 32)."""
  rng = np.random.default_rng(m * 1000 + o)
  x = rng.standard_normal((m, i)).astype(np.float32)
  q = rng.integers(-127, 128, (i, o)).astype(np.int8)
  s = rng.random(o).astype(np.float32)
  got = np.asarray(jax.jit(cpu_kernels.int8_matmul)(x, q, s))
  want = (x.astype(np.float64) @ q.astype(np.float64)) * s
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_kernel_and_xla_paths_agree():
  rng = np.random.default_rng(0)
  w = quant.quantize_int8(rng.standard_normal((48, 96)).astype(np.float32))
  x = jnp.asarray(rng.standard_normal((2, 1, 48)).astype(np.float32))
  auto = jax.jit(lambda x, w: quant.matmul(x, w, "auto"))(x, w)
  xla = jax.jit(lambda x, w: quant.matmul(x, w, "xla"))(x, w)
  np.testing.assert_allclose(np.asarray(auto), np.asarray(xla), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(xla), np.asarray(x) @ np.asarray(quant.dequantize(w)),
                             rtol=1e-5, atol=1e-5)


def test_quantised_decode_params_hold_int8_matrices():
  config = tiny_config(vocab_size=97, decode_quant="int8")
  params = init_params(config, jax.random.key(0))
  dp = prepare_decode_params(params, config)
  layer = dp.layers[0]
  for name in ("qkv", "o", "gate_up", "down"):
    assert isinstance(layer[name], quant.Int8Weight) and layer[name].q.dtype == jnp.int8
  assert dp.lm_head.q.shape == (config.hidden_size, config.vocab_size)  # tied: the transposed table
  with pytest.raises(ValueError, match="int8 for dense models only"):
    tiny_config(decode_quant="int8", model_type="qwen3_moe", qk_norm=True, num_experts=4,
                moe_intermediate_size=32)
  with pytest.raises(ValueError, match="decode_quant must be one of"):
    tiny_config(decode_quant="int4")


@pytest.mark.parametrize("tied", [True, False])
def test_quantised_cache_path_is_close_to_the_float_model(tied):
  """Prefill (XLA, dequantised) then one-token steps (the kernel): log-probs within 0.05 of the
  float model's full pass, and not equal to them (the weights really are int8)."""
  config = tiny_config(vocab_size=97, tie_word_embeddings=tied, attention_bias=not tied,
                       model_type="llama" if tied else "qwen2")
  params = init_params(config, jax.random.key(1))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 9)))
  full = jax.nn.log_softmax(Transformer(config).apply({"params": params}, tokens).logits)
  q8 = config.replace(decode_quant="int8")
  out = cached_forward(params, q8, tokens[:, :6], init_cache(q8, 2, 16), compute_logits=True)
  steps, cache = [out.logits], out.cache
  for t in range(6, 9):
    out = cached_forward(params, q8, tokens[:, t:t + 1], cache, compute_logits=True)
    steps.append(out.logits)
    cache = out.cache
  gap = np.abs(np.asarray(jax.nn.log_softmax(jnp.concatenate(steps, 1))) - np.asarray(full))
  assert 1e-4 < gap.max() < 0.05


def test_quantised_sampler_decodes_and_is_traced_once(assert_no_retrace):
  config = tiny_config(vocab_size=97, decode_quant="int8")
  params = prepare_decode_params(init_params(config, jax.random.key(3)), config)
  rule = sampling.SamplingParams(temperature=1.0, max_new_tokens=6)
  cache, last = sampling.prefill(params, config, jnp.ones((2, 4), jnp.int32),
                                 jnp.array([4, 2], jnp.int32), 16)
  keys = sampling.per_row_keys(0, jnp.arange(2))
  result = sampling.decode(params, config, cache, last, keys, rule)
  assert (np.asarray(result.lengths) == 6).all() and np.isfinite(np.asarray(result.logprobs)).all()
  calls = []
  for seed in (1, 2):
    cache, last = sampling.prefill(params, config, jnp.ones((2, 4), jnp.int32),
                                   jnp.array([4, 3], jnp.int32), 16)
    calls.append(((params, config, cache, last, sampling.per_row_keys(seed, jnp.arange(2)), rule),
                  {}))
  assert_no_retrace(sampling.decode, *calls)


@pytest.mark.slow
def test_learner_with_int8_rollouts_measures_the_mismatch(tmp_path, smoke_learner):
  """Int8 rollouts, float32 learner: the update reports the rollout/learner log-prob gap (about
  1e-6 with float32 rollouts, clearly more with int8) and the TIS weights that correct it."""
  from longhorizon.train.metrics import Timer  # pylint: disable=g-import-not-at-top
  gaps = {}
  for quant_name in ("none", "int8"):
    s = smoke_learner(tmp_path, {"model.decode_quant": quant_name, "loss.tis_threshold": 2.0,
                                 "rollout.context_length": 96, "env.max_steps": 3})
    assert s.model_config.decode_quant == quant_name
    _, m = s.step(s.initial_state(), 0, 0, Timer())
    assert 0.9 < m["is_weight_mean"] < 1.1
    gaps[quant_name] = (m["logp_mismatch_mean"], m["logp_mismatch_max"])
  assert gaps["none"][1] < 1e-4
  assert gaps["int8"][0] > 10 * max(gaps["none"][0], 1e-7) and gaps["int8"][1] < 0.5
