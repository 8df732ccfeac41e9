"""Tests for `longhorizon.core.matmul.einsum`: a hand case, a float64 NumPy reference for the values
and both gradients, the backward products' dtypes, bad specs, no retracing."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.core import matmul

# (spec, shape of a, shape of b): every spec the models use.
SPECS = [
    ("...d,df->...f", (2, 3, 5), (5, 4)),
    ("...r,rf->...f", (3, 2), (2, 6)),
    ("btkgd,bksd->bkgts", (2, 3, 2, 2, 4), (2, 2, 5, 4)),
    ("bkgts,bksd->btkgd", (2, 2, 2, 3, 5), (2, 2, 5, 4)),
    ("btd,edf->btef", (2, 3, 4), (3, 4, 5)),
    ("bte,bted->btd", (2, 3, 4), (2, 3, 4, 5)),
    ("nd,dc->nc", (6, 4), (4, 7)),
]


def _rand(shape, seed):
  return np.random.default_rng(seed).normal(size=shape)


def _np_grads(spec, a, b, g):
  """float64 reference: value and the two gradients of `sum(g * einsum(spec, a, b))`, by finite
  linearity (the product is bilinear, so d/da is einsum(spec, e_i, b) for each unit e_i)."""
  value = np.einsum(spec, a, b)
  ga, gb = np.zeros_like(a), np.zeros_like(b)
  for idx in np.ndindex(a.shape):
    e = np.zeros_like(a)
    e[idx] = 1.0
    ga[idx] = np.sum(g * np.einsum(spec, e, b))
  for idx in np.ndindex(b.shape):
    e = np.zeros_like(b)
    e[idx] = 1.0
    gb[idx] = np.sum(g * np.einsum(spec, a, e))
  return value, ga, gb


def test_hand_case():
  a = jnp.asarray([[1.0, 2.0], [3.0, 4.0]], jnp.bfloat16)
  b = jnp.asarray([[5.0, 6.0], [7.0, 8.0]], jnp.bfloat16)
  out = matmul.einsum("ij,jk->ik", a, b)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), [[19.0, 22.0], [43.0, 50.0]])
  # d/da sum(out) = ones @ b.T: rows [11, 15]; d/db = a.T @ ones: columns [4, 6].
  ga, gb = jax.grad(lambda a, b: jnp.sum(matmul.einsum("ij,jk->ik", a, b).astype(jnp.float32)),
                    argnums=(0, 1))(a, b)
  assert ga.dtype == gb.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(ga, np.float32), [[11.0, 15.0], [11.0, 15.0]])
  np.testing.assert_array_equal(np.asarray(gb, np.float32), [[4.0, 4.0], [6.0, 6.0]])


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
@pytest.mark.parametrize("spec,shape_a,shape_b", SPECS)
def test_matches_numpy_reference(spec, shape_a, shape_b, dtype, tol):
  a, b = _rand(shape_a, 0), _rand(shape_b, 1)
  # Round the inputs to the tested dtype first, so the reference sees the same operands.
  a = np.asarray(jnp.asarray(a, dtype), np.float64)
  b = np.asarray(jnp.asarray(b, dtype), np.float64)
  out_shape = np.einsum(spec, a, b).shape
  g = np.asarray(jnp.asarray(_rand(out_shape, 2), dtype), np.float64)
  want, want_ga, want_gb = _np_grads(spec, a, b, g)

  def f(a, b):
    return jnp.sum(matmul.einsum(spec, a, b, out_dtype=jnp.float32) * jnp.asarray(g, jnp.float32))

  got = matmul.einsum(spec, jnp.asarray(a, dtype), jnp.asarray(b, dtype), out_dtype=jnp.float32)
  ga, gb = jax.grad(f, argnums=(0, 1))(jnp.asarray(a, dtype), jnp.asarray(b, dtype))
  scale = lambda x: tol * max(1.0, float(np.max(np.abs(x))))
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=scale(want))
  np.testing.assert_allclose(np.asarray(ga, np.float64), want_ga, atol=scale(want_ga))
  np.testing.assert_allclose(np.asarray(gb, np.float64), want_gb, atol=scale(want_gb))


def _dot_operand_types(hlo: str) -> list[tuple[str, str]]:
  """(lhs dtype, rhs dtype) of every dot in the optimised HLO, looking operands up in their
  computation's parameter list or instruction definitions."""
  pairs = []
  for comp in re.split(r"\n(?=\S)", hlo):
    head = comp.split("\n")[0]
    for m in re.finditer(r"\bdot\(%([\w.\-]+), %([\w.\-]+)\)", comp):
      types = []
      for name in m.groups():
        found = (re.search(re.escape(name) + r": (\w+)\[", head)
                 or re.search("%" + re.escape(name) + r" = (\w+)\[", comp))
        types.append(found.group(1) if found else "?")
      pairs.append(tuple(types))
  return pairs


def test_bf16_backward_products_stay_bf16():
  """The reason the module exists: without its VJP, JAX's transpose of a float32-accumulating
  product gets a float32 cotangent and runs float32 x float32 dots in the backward pass."""
  a = jnp.ones((8, 16), jnp.bfloat16)
  w = jnp.ones((16, 32), jnp.bfloat16)
  loss = lambda a, w: jnp.sum(matmul.einsum("nd,df->nf", a, w).astype(jnp.float32) ** 2)
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a, w).compile().as_text()
  pairs = _dot_operand_types(hlo)
  assert len(pairs) == 3, pairs  # forward, d/da, d/dw
  # The forward and the activation gradient (d/da: contracting the last dims) run bf16 x bf16.
  # XLA:CPU (jax 0.10) itself widens a bf16 product that contracts both operands' leading
  # dimension (d/dw = a^T g) to float32; that one is the weight gradient, which LoRA never takes of
  # the base weights (docs/notes/issue-18.md).
  assert sorted(pairs).count(("bf16", "bf16")) >= 2, pairs
  # What JAX does on its own (the regression the VJP fixes): float32 products in the backward.
  plain = lambda a, w: jnp.sum(jnp.einsum("nd,df->nf", a, w, preferred_element_type=jnp.float32)
                               .astype(jnp.bfloat16).astype(jnp.float32) ** 2)
  hlo = jax.jit(jax.grad(plain, argnums=(0, 1))).lower(a, w).compile().as_text()
  assert any("f32" in p for p in _dot_operand_types(hlo))


def test_float32_forward_is_plain_einsum():
  a, b = jnp.asarray(_rand((3, 4), 0), jnp.float32), jnp.asarray(_rand((4, 5), 1), jnp.float32)
  np.testing.assert_array_equal(matmul.einsum("ij,jk->ik", a, b), jnp.einsum("ij,jk->ik", a, b))


def _weight_gradient_lhs(einsum):
  """The left operand's shape of the product that makes the weight gradient of `x @ w` (the one
  whose output has w's shape), in the jaxpr of the gradient."""
  x, w = jnp.ones((16, 3), jnp.float32), jnp.ones((3, 8), jnp.float32)
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(einsum("td,df->tf", x, w) ** 2),
                                  argnums=1))(x, w)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  shapes = [tuple(e.invars[0].aval.shape) for e in dots
            if tuple(e.outvars[0].aval.shape) in ((3, 8), (8, 3))]
  assert len(shapes) == 1, shapes
  return shapes[0]


def test_float32_weight_gradient_takes_the_activation_as_left_operand():
  """The operand order of the module docstring: JAX's own backward contracts the cotangent g
  [T, F] as the left operand (XLA:CPU then transposes it, the large one); ours puts the
  activation x [T, D] there. Values are checked by the NumPy-reference test above."""
  assert _weight_gradient_lhs(jnp.einsum) == (16, 8)  # JAX: g first (what this module avoids)
  assert _weight_gradient_lhs(matmul.einsum) == (16, 3)  # ours: x first


@pytest.mark.parametrize("spec,match", [("ii,ij->j", "repeated"), ("ij,jk->i", "must appear")])
def test_bad_specs_are_named(spec, match):
  a = jnp.ones((3, 3), jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    matmul.einsum(spec, a, a)


def test_no_retrace():
  traces = []

  @jax.jit
  def f(a, b):
    traces.append(1)
    return jax.grad(lambda a: jnp.sum(matmul.einsum("ij,jk->ik", a, b).astype(jnp.float32)))(a)

  for seed in range(3):
    f(jnp.asarray(_rand((2, 3), seed), jnp.bfloat16), jnp.asarray(_rand((3, 4), 9), jnp.bfloat16))
  assert len(traces) == 1


@pytest.mark.parametrize("spec,shape_a,shape_b", [
    ("btef,efd->bted", (4, 32, 16, 8), (16, 8, 16)),  # failed at run time through the VJP path
    ("bkgts,bksd->btkgd", (4, 2, 2, 1, 32), (4, 2, 32, 8)),
])
def test_batched_bf16_products_run(spec, shape_a, shape_b):
  """Batched specs go to JAX's own products: XLA:CPU cannot execute some of them as
  bf16 x bf16 -> float32 (module docstring)."""
  a, b = jnp.ones(shape_a, jnp.bfloat16), jnp.ones(shape_b, jnp.bfloat16)
  out = jax.jit(lambda a, b: matmul.einsum(spec, a, b))(a, b)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.einsum(spec, np.ones(shape_a),
                                                                    np.ones(shape_b)))
