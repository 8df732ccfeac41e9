"""Dense products with their own backward pass: float32 accumulation, and operands in the order
XLA:CPU runs without transposing the large one.

`einsum(spec, a, b)` contracts two operands with float32 accumulation and returns the result in
their dtype (or `out_dtype`). Unbatched specs (every dense projection) have their own VJP, for two
reasons:

* **Operand order (any dtype).** JAX's transpose of `x [T, D] @ W [D, F]` emits the weight
  gradient as a product whose left operand is the cotangent `g [T, F]`, contracted over `T`; XLA:CPU
  (jax 0.10) then materialises `g` transposed, `[F, T]`, fused with whatever produced `g` (the
  SwiGLU backward), at a fraction of memory speed. Our backward writes `einsum(x, g)`, so the
  transposed operand is the activation `x [T, D]`, `F / D` times smaller. A SwiGLU MLP's gradient
  at T = 4096, D = 512, F = 2048 (float32, 2 cores of a 4th-gen Xeon): 710 ms with JAX's backward,
  385 ms with this one, equal to float rounding (`tests/core/test_matmul.py`).
* **bf16 compute.** JAX's own transpose of a `preferred_element_type=float32` product receives a
  float32 cotangent and so runs float32 x float32 products (the bf16 operand widened), which on a
  CPU without bf16 units costs the same and on one with them (AMX) gives up most of the speed:

  `[2048, 576] @ [576, 1536]` on 2 cores of a 4th-gen Xeon (AMX), jax 0.10.2:
  float32: 0.33 TFLOP/s; bf16 -> bf16: 0.27; bf16 -> float32 accumulation: 1.7.

  Here the cotangent is rounded to the operands' dtype before the backward products (the usual
  bf16 training recipe: activation gradients in bf16, accumulation in float32); parameters keep
  float32 master copies elsewhere (`ModelConfig.param_dtype`) and log-softmax math stays float32.
  One exception, XLA's rather than ours: XLA:CPU (jax 0.10) widens a bf16 product that contracts
  the leading dimension of both operands (the weight gradient `x^T g`) to float32, whatever the
  operand order; with LoRA the base weights take no gradient, so only the small adapter
  gradients pay it.

Batched products (an index in both operands and the output: attention, the MoE experts) are
left to JAX (`preferred_element_type=out_dtype` when it differs): XLA:CPU executes some batched
bf16 x bf16 -> float32 products outside its fast path and fails at run time ("Unsupported element
type for DotThunk::Execute: BF16 x BF16 = F32", jax 0.10.2, e.g. `btef,efd->bted` at
`[4, 32, 16, 8] x [16, 8, 16]`).

Used by every dense projection of the models (`llama._dense`, `LoraDense`).

Specs: two operands, plain letters or one leading `...`, no repeated letter within an operand, and
every letter of an operand present in the other operand or the output (no letter summed over one
operand alone), which is what the transposes below need.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["einsum"]

_F32 = jnp.float32


def _parse(spec: str) -> tuple[str, str, str]:
  inputs, out = spec.replace(" ", "").split("->")
  a, b = inputs.split(",")
  for term in (a, b):
    letters = term.replace("...", "")
    if len(set(letters)) != len(letters):
      raise ValueError(f"einsum {spec!r}: a repeated index within an operand is not supported.")
  la, lb, lo = (t.replace("...", "") for t in (a, b, out))
  if set(la) - set(lb) - set(lo) or set(lb) - set(la) - set(lo):
    raise ValueError(f"einsum {spec!r}: every index of an operand must appear in the other operand "
                     "or the output.")
  return a, b, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _mixed(spec: str, a, b, out_dtype):
  return jnp.einsum(spec, a, b, preferred_element_type=_F32).astype(out_dtype)


def _mixed_fwd(spec, a, b, out_dtype):
  return _mixed(spec, a, b, out_dtype), (a, b)


def _mixed_bwd(spec, out_dtype, residuals, g):
  del out_dtype
  a, b = residuals
  sa, sb, so = _parse(spec)
  g = g.astype(jnp.result_type(a, b))
  ga = jnp.einsum(f"{so},{sb}->{sa}", g, b, preferred_element_type=_F32).astype(a.dtype)
  gb = jnp.einsum(f"{sa},{so}->{sb}", a, g, preferred_element_type=_F32).astype(b.dtype)
  return ga, gb


_mixed.defvjp(_mixed_fwd, _mixed_bwd)


def einsum(spec: str, a, b, out_dtype=None):
  """`jnp.einsum(spec, a, b)` accumulated in float32, returned in `out_dtype` (default: the
  operands' promoted dtype); unbatched specs take this module's backward pass (the operand order
  XLA:CPU runs fast; bf16 x bf16 -> float32 products for bf16 operands; module docstring)."""
  a, b = jnp.asarray(a), jnp.asarray(b)
  dtype = jnp.result_type(a, b)
  out_dtype = jnp.dtype(out_dtype or dtype)
  sa, sb, so = _parse(spec)
  if set(sa) & set(sb) & set(so) - {"."}:  # batched: JAX's own products (see the docstring)
    preferred = out_dtype if out_dtype != dtype else None
    return jnp.einsum(spec, a, b, preferred_element_type=preferred).astype(out_dtype)
  return _mixed(spec, a.astype(dtype), b.astype(dtype), out_dtype)
