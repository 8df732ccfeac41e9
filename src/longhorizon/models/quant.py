"""Weight-only int8 quantisation for the sampler (`ModelConfig.decode_quant = "int8"`).

Decoding at small batch reads every weight once per token, so on CPU its speed is the bytes of
the weights (memory bandwidth); int8 weights are a quarter of float32's. `prepare_decode_params`
quantises the decode copy of each dense matrix (q|k|v, o, gate|up, down and the unembedding) to
int8 with one float32 scale per output column (symmetric, `scale = max |w| / 127`); the learner's
parameters stay float32, so the rollout policy differs slightly from the trained one and the
off-policy correction (truncated IS against the sampler's log-probs) measures and corrects it.

`matmul` runs a one-token decode step through the C++ kernel (`cpu_kernels.int8_matmul`: the int8
weights are widened in registers, never in memory) on CPU with float32 compute, and elsewhere, or
for longer appends (prefill, observations), XLA's dot of the dequantised matrix.
"""

from __future__ import annotations

import math

import flax
import jax
import jax.numpy as jnp

from longhorizon.models import cpu_kernels

__all__ = ["Int8Weight", "quantize_int8", "dequantize", "matmul", "KERNEL_MAX_ROWS"]

# A kernel call keeps `kRows` (32) output rows in L1 per pass over the weights, so each further 32
# rows re-read them; calls with more rows than this (prefill, observation appends) use XLA's dot of
# the dequantised matrix instead (not measured against the kernel at those sizes).
KERNEL_MAX_ROWS = 64


@flax.struct.dataclass
class Int8Weight:
  """A `[..., I, O]` matrix as int8 `q` and per-output-column float32 `scale` (`w ~ q * scale`)."""
  q: jax.Array  # [..., I, O] int8
  scale: jax.Array  # [..., O] float32

  @property
  def shape(self):
    return self.q.shape


def quantize_int8(w) -> Int8Weight:
  """Symmetric per-output-column int8: `q = round(w / scale)`, `scale = max_i |w[i, o]| / 127`
  (columns of zeros get scale 1)."""
  w = jnp.asarray(w, jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=-2)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w / scale[..., None, :]), -127, 127).astype(jnp.int8)
  return Int8Weight(q=q, scale=scale.astype(jnp.float32))


def dequantize(w: Int8Weight, dtype=jnp.float32):
  return (w.q.astype(jnp.float32) * w.scale[..., None, :]).astype(dtype)


def _xla(x, w: Int8Weight):
  y = jnp.dot(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)
  return (y * w.scale.reshape((1,) * (y.ndim - 1) + (-1,))).astype(x.dtype)


def matmul(x, w, decode_kernel: str = "auto"):
  """`x [..., I] @ w` for a float matrix or an `Int8Weight` (see the module docstring); the
  kernel runs where `decode_kernel` is not "xla", the compute is float32 and it builds."""
  if not isinstance(w, Int8Weight):
    return jnp.dot(x, w)
  rows = math.prod(x.shape[:-1])
  if (decode_kernel == "xla" or x.dtype != jnp.float32 or rows > KERNEL_MAX_ROWS
      or not cpu_kernels.available()):
    return _xla(x, w)
  flat = x.reshape(rows, x.shape[-1])

  def kernel(flat, q, scale):
    return cpu_kernels.int8_matmul(flat, q, scale)

  def fallback(flat, q, scale):
    return _xla(flat, Int8Weight(q=q, scale=scale))

  y = jax.lax.platform_dependent(flat, w.q, w.scale, cpu=kernel, default=fallback)
  return y.reshape(*x.shape[:-1], w.q.shape[-1])
