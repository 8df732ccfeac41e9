"""The CPU decode-attention kernel (`models.cpu_kernels`): NumPy reference, prefix-only reads, the
model path it replaces, its choice by `ModelConfig.decode_kernel`, and the fallback when it cannot be
built."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import models
from longhorizon import sampling
from longhorizon.models import cpu_kernels
from longhorizon.models import llama

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"kernel unavailable: {cpu_kernels.build_error()}")


def _reference(q, k, v, n):
  """float64 softmax(q . k_s / 1) v_s over s < n[b], per (row, kv head, query head); zeros if n=0."""
  b, kv, g, hd = q.shape
  out = np.zeros((b, kv, g, hd))
  for r in range(b):
    for h in range(kv):
      if n[r] == 0:
        continue
      keys = k[r, h, :n[r]].astype(np.float64)
      values = v[r, h, :n[r]].astype(np.float64)
      for j in range(g):
        s = keys @ q[r, h, j].astype(np.float64)
        p = np.exp(s - s.max())
        out[r, h, j] = (p / p.sum()) @ values
  return out


def _inputs(rng, b, kv, g, hd, s):
  q = rng.normal(size=(b, kv, g, hd)).astype(np.float32)
  k = rng.normal(size=(b, kv, s, hd)).astype(np.float32)
  v = rng.normal(size=(b, kv, s, hd)).astype(np.float32)
  return q, k, v


# (G, hd): hd 64 and 128 take the register-blocked path, others the generic one.
@pytest.mark.parametrize("g, hd", [(1, 64), (3, 64), (4, 128), (2, 16), (3, 24), (8, 40)])
def test_kernel_matches_numpy_reference(g, hd):
  rng = np.random.default_rng(hd + g)
  b, kv, s = 6, 2, 37
  q, k, v = _inputs(rng, b, kv, g, hd, s)
  n = np.array([0, 1, 2, 17, 36, 37], np.int32)
  out = np.asarray(jax.jit(cpu_kernels.decode_attention)(q, k, v, n))
  # float32 sums in another order than the float64 reference: 3.7e-6 measured at hd = 128 (AMD EPYC)
  np.testing.assert_allclose(out, _reference(q, k, v, n), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(out[0], 0.0)  # n = 0: no visible slot


def test_hand_checkable_cases():
  b, kv, g, hd, s = 2, 1, 1, 64, 8
  q = np.ones((b, kv, g, hd), np.float32)
  k = np.zeros((b, kv, s, hd), np.float32)
  v = np.arange(b * kv * s * hd, dtype=np.float32).reshape(b, kv, s, hd)
  # Row 0 sees one slot: the output is that slot's value. Row 1 sees three slots with equal keys:
  # uniform weights, the mean of the three values.
  out = np.asarray(cpu_kernels.decode_attention(q, k, v, np.array([1, 3], np.int32)))
  np.testing.assert_array_equal(out[0, 0, 0], v[0, 0, 0])
  np.testing.assert_allclose(out[1, 0, 0], v[1, 0, :3].mean(0), rtol=1e-6)


def test_kernel_reads_only_the_visible_prefix():
  # NaN in every slot past n[b]: any read of them would poison the output.
  rng = np.random.default_rng(0)
  q, k, v = _inputs(rng, 3, 3, 3, 64, 32)
  n = np.array([5, 20, 31], np.int32)
  for r in range(3):
    k[r, :, n[r]:] = np.nan
    v[r, :, n[r]:] = np.nan
  out = np.asarray(cpu_kernels.decode_attention(q, k, v, n))
  assert np.isfinite(out).all()
  # float32 sums in another order than the float64 reference: 3.7e-6 measured at hd = 128 (AMD EPYC)
  np.testing.assert_allclose(out, _reference(q, k, v, n), atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_named():
  rng = np.random.default_rng(0)
  q, k, v = _inputs(rng, 2, 1, 9, 64, 8)
  with pytest.raises(ValueError, match="9 query heads per kv head"):
    cpu_kernels.decode_attention(q, k, v, np.array([1, 2], np.int32))
  q, k, v = _inputs(rng, 2, 1, 2, 64, 8)
  with pytest.raises(ValueError, match="inconsistent"):
    cpu_kernels.decode_attention(q, k[:, :, :5], v, np.array([1, 2], np.int32))


def _decode(config, params, prompts, lengths, n, seed):
  cache, logits = sampling.prefill(params, config, prompts, lengths, prompts.shape[1] + n)
  rule = sampling.SamplingParams(temperature=1.0, max_new_tokens=n, stop_token_ids=())
  keys = sampling.per_row_keys(seed, np.arange(prompts.shape[0]))
  return sampling.decode(params, config, cache, logits, keys, rule)


def _lowered_decode(config, params, prompts, lengths):
  return sampling.decode.lower(
      params, config, *sampling.prefill(params, config, prompts, lengths, 20), None,
      sampling.SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=())).as_text()


@pytest.mark.parametrize("heads, kv_heads, hidden", [(4, 2, 64), (9, 3, 576)])
@pytest.mark.slow  # over 10 s on a 2-core AMD EPYC with the test compile settings (BUILD_NOTES)
def test_decode_with_kernel_equals_the_xla_path(heads, kv_heads, hidden):
  # Same sampled tokens and log-probs, logits to float32 rounding, with ragged prompt lengths (each
  # row sees a different prefix). The second shape is SmolLM2's head layout (hd 64, G 3).
  config = models.tiny_config(vocab_size=61, hidden_size=hidden, num_attention_heads=heads,
                              num_key_value_heads=kv_heads, intermediate_size=96)
  params = models.prepare_decode_params(models.init_params(config, jax.random.key(3)), config)
  rng = np.random.default_rng(2)
  prompts = rng.integers(0, 61, (4, 8)).astype(np.int32)
  lengths = np.array([8, 1, 5, 3], np.int32)
  results = {}
  # No `jax.clear_caches()` between choices: the choice is a field of the static config, so the
  # tracing cache keys on it (a stale program would show as the wrong custom-call presence).
  for choice in ("cpu", "xla", "auto"):
    chosen = config.replace(decode_kernel=choice)
    uses_kernel = "longhorizon_decode_attention" in _lowered_decode(chosen, params, prompts, lengths)
    assert uses_kernel == (choice != "xla"), choice
    results[choice] = _decode(chosen, params, prompts, lengths, 12, seed=5)
  on, off = results["cpu"], results["xla"]
  np.testing.assert_array_equal(np.asarray(on.tokens), np.asarray(off.tokens))
  np.testing.assert_allclose(np.asarray(on.logprobs), np.asarray(off.logprobs), atol=1e-5)
  np.testing.assert_allclose(np.asarray(on.last_logits), np.asarray(off.last_logits), atol=1e-5)
  for field in ("tokens", "logprobs", "last_logits"):  # "auto" on CPU is the kernel, bit for bit
    np.testing.assert_array_equal(np.asarray(getattr(results["auto"], field)),
                                  np.asarray(getattr(on, field)))


def test_auto_keeps_xla_where_the_kernel_does_not_apply():
  # bfloat16 caches and more than MAX_GROUP query heads per kv head: "auto" lowers XLA's einsums.
  rng = np.random.default_rng(0)
  prompts, lengths = rng.integers(0, 61, (2, 8)).astype(np.int32), np.array([8, 3], np.int32)
  for overrides in (dict(dtype="bfloat16"),
                    dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=1)):
    config = models.tiny_config(vocab_size=61, **overrides)
    params = models.prepare_decode_params(models.init_params(config, jax.random.key(0)), config)
    assert "longhorizon_decode_attention" not in _lowered_decode(config, params, prompts, lengths)


def test_unbuildable_kernel_falls_back_with_the_reason(monkeypatch, tmp_path):
  monkeypatch.setattr(cpu_kernels, "_state", {"loaded": False, "error": None})
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  monkeypatch.setenv("LONGHORIZON_KERNEL_CACHE", str(tmp_path / "cache"))
  assert not cpu_kernels.available()
  assert "no-such-compiler" in cpu_kernels.build_error()
  # "auto" still decodes, on the XLA path; "cpu" refuses, naming the reason and the fix.
  config = models.tiny_config(vocab_size=31)
  params = models.init_params(config, jax.random.key(0))
  jax.clear_caches()
  out = llama.cached_forward(params, config, jnp.ones((2, 1), jnp.int32),
                             models.init_cache(config, 2, 4))
  assert np.isfinite(np.asarray(out.hidden)).all()
  with pytest.raises(RuntimeError, match="decode_kernel='cpu'.*no-such-compiler.*'auto'"):
    llama.cached_forward(params, config.replace(decode_kernel="cpu"), jnp.ones((2, 1), jnp.int32),
                         models.init_cache(config, 2, 4))
  jax.clear_caches()


def test_loading_the_kernel_keeps_subnormal_floats():
  # A library linked with -ffast-math switches the process to flush-to-zero when it loads.
  assert cpu_kernels.available()
  tiny = np.finfo(np.float64).smallest_subnormal
  assert tiny > 0.0 and tiny / 2.0 == 0.0 and tiny * 2.0 > tiny
  assert np.float32(1e-45) > 0  # float32 subnormal


_SHARDED_DECODE = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from longhorizon import models, sampling
from longhorizon.models import cpu_kernels
assert cpu_kernels.available() and len(jax.devices()) == 8
config = models.tiny_config(vocab_size=61, hidden_size=576, num_attention_heads=9,
                            num_key_value_heads=3, intermediate_size=96)
params = models.prepare_decode_params(models.init_params(config, jax.random.key(3)), config)
prompts = np.random.default_rng(2).integers(0, 61, (8, 8)).astype(np.int32)
lengths = np.array([8, 1, 5, 3, 2, 7, 6, 4], np.int32)
rule = sampling.SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=())
mesh = Mesh(np.array(jax.devices()), ("data",))
def run(shard):
  cache, logits = sampling.prefill(params, config, prompts, lengths, 16)
  if shard:  # rows over 8 devices
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data") if x.ndim else P()))
    cache, logits = jax.tree.map(put, cache), put(logits)
  out = sampling.decode(params, config, cache, logits, None, rule)
  assert "longhorizon_decode_attention" in sampling.decode.lower(
      params, config, cache, logits, None, rule).as_text()
  return np.asarray(out.tokens), np.asarray(out.last_logits)
(t0, l0), (t1, l1) = run(False), run(True)
print("RESULT", int((t0 == t1).all()), float(np.abs(l0 - l1).max()))
"""


def test_decode_with_rows_sharded_over_eight_devices_equals_one_device():
  # The custom call has no sharding rule of its own; XLA's partitioner must still give the same
  # tokens when the cache's rows are sharded over the `data` axis.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SHARDED_DECODE], capture_output=True, text=True,
                          env=env, timeout=300, cwd=pathlib.Path(__file__).parents[2])
  assert result.returncode == 0, result.stderr[-3000:]
  _, same, diff = [l for l in result.stdout.splitlines() if l.startswith("RESULT")][0].split()
  assert same == "1" and float(diff) < 1e-5
