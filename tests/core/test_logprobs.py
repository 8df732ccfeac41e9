"""Tests for `longhorizon.core.logprobs`: hand-checked cases, a float64 NumPy reference, no retracing."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.core import logprobs as lp

# ----------------------------------------------------------------------------------------------------
# Slow, obviously-correct NumPy reference (float64, loops over positions).


def np_log_softmax(z):
  z = np.asarray(z, np.float64)
  z = z - np.max(z)
  return z - np.log(np.sum(np.exp(z)))


def ref_token_logprobs(logits, targets, temperature=1.0):
  logits = np.asarray(logits, np.float64)
  b, t, _ = logits.shape
  out = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      out[i, j] = np_log_softmax(logits[i, j] / temperature)[targets[i, j]]
  return out


def ref_entropy(logits, temperature=1.0):
  logits = np.asarray(logits, np.float64)
  b, t, _ = logits.shape
  out = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      logp = np_log_softmax(logits[i, j] / temperature)
      p = np.exp(logp)
      out[i, j] = -sum(pv * lv for pv, lv in zip(p, logp) if pv > 0)
  return out


def ref_logits_from_hidden(hidden, w_dv):
  hidden = np.asarray(hidden, np.float64)
  w_dv = np.asarray(w_dv, np.float64)
  b, t, _ = hidden.shape
  out = np.zeros((b, t, w_dv.shape[1]))
  for i in range(b):
    for j in range(t):
      out[i, j] = hidden[i, j] @ w_dv
  return out


def ref_grad_weighted_logprobs(hidden, w_dv, targets, weights, temperature=1.0):
  """Analytic gradient of `sum_{b,t} c_bt log softmax(h_bt W / tau)[y_bt]` w.r.t. h and W:
  d/dz = c (onehot(y) - p) / tau, dh = W dz, dW = h outer dz."""
  hidden = np.asarray(hidden, np.float64)
  w_dv = np.asarray(w_dv, np.float64)
  b, t, _ = hidden.shape
  dh = np.zeros_like(hidden)
  dw = np.zeros_like(w_dv)
  for i in range(b):
    for j in range(t):
      p = np.exp(np_log_softmax(hidden[i, j] @ w_dv / temperature))
      onehot = np.zeros_like(p)
      onehot[targets[i, j]] = 1.0
      dz = weights[i, j] * (onehot - p) / temperature
      dh[i, j] = w_dv @ dz
      dw += np.outer(hidden[i, j], dz)
  return dh, dw


def random_case(seed, b=3, t=5, v=37, d=8):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(b, t, d)).astype(np.float32)
  w_dv = (rng.normal(size=(d, v)) / math.sqrt(d) * 2.0).astype(np.float32)
  targets = rng.integers(0, v, size=(b, t)).astype(np.int32)
  return hidden, w_dv, targets


# ----------------------------------------------------------------------------------------------------
# token_logprobs


def test_token_logprobs_by_hand():
  # logits [0, ln 3] -> p = [1/4, 3/4]: log p = [ln 0.25, ln 0.75] = [-1.3862944, -0.2876821].
  # logits [0, ln 9] at temperature 2 -> [0, ln 3]: the same probabilities.
  logits = np.array([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]], np.float32)
  targets = np.array([[0, 1]], np.int32)
  np.testing.assert_allclose(lp.token_logprobs(logits, targets), [[-1.3862944, -0.2876821]], atol=1e-6)
  hot = np.array([[[0.0, math.log(9.0)], [0.0, math.log(9.0)]]], np.float32)
  np.testing.assert_allclose(lp.token_logprobs(hot, targets, 2.0), [[-1.3862944, -0.2876821]],
                             atol=1e-6)
  # Without the temperature the hot logits give [ln 0.1, ln 0.9] = [-2.3025851, -0.1053605].
  np.testing.assert_allclose(lp.token_logprobs(hot, targets), [[-2.3025851, -0.1053605]], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_reference(seed, temperature):
  rng = np.random.default_rng(seed)
  logits = (rng.normal(size=(4, 6, 50)) * 3.0).astype(np.float32)
  targets = rng.integers(0, 50, size=(4, 6)).astype(np.int32)
  out = lp.token_logprobs(logits, targets, temperature)
  assert out.dtype == jnp.float32 and out.shape == (4, 6)
  np.testing.assert_allclose(out, ref_token_logprobs(logits, targets, temperature), rtol=1e-5,
                             atol=1e-5)
  assert np.all(np.asarray(out) <= 0.0)


def test_token_logprobs_numpy_jax_and_bf16_inputs():
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(2, 4, 11)).astype(np.float32)
  targets = rng.integers(0, 11, size=(2, 4)).astype(np.int32)
  from_np = lp.token_logprobs(logits, targets)
  from_jax = lp.token_logprobs(jnp.asarray(logits), jnp.asarray(targets))
  assert from_np.dtype == from_jax.dtype == jnp.float32
  np.testing.assert_array_equal(from_np, from_jax)
  bf16 = jnp.asarray(logits, jnp.bfloat16)
  out = lp.token_logprobs(bf16, targets)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref_token_logprobs(np.asarray(bf16.astype(jnp.float32)), targets),
                             atol=1e-5)


def test_token_logprobs_gradient_matches_analytic():
  # d log softmax(z/tau)[y] / dz = (onehot(y) - p) / tau; identity unembed gives z = h.
  hidden, _, targets = random_case(4, b=2, t=3, v=9, d=9)
  weights = np.random.default_rng(5).normal(size=(2, 3))
  f = lambda z: jnp.sum(weights * lp.token_logprobs(z, targets, 0.8))
  got = jax.grad(f)(jnp.asarray(hidden))
  want, _ = ref_grad_weighted_logprobs(hidden, np.eye(9), targets, weights, 0.8)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_token_logprobs_traced_once(assert_no_retrace):
  rng = np.random.default_rng(6)
  calls = []
  for temperature in (1.0, 0.6, 1.3):
    logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 7, size=(2, 3)), jnp.int32)
    calls.append(((logits, targets), {"temperature": temperature}))
  assert_no_retrace(lp.token_logprobs, *calls)


# ----------------------------------------------------------------------------------------------------
# entropy


def test_entropy_by_hand():
  # [0, 0, -inf] -> the masked token has p = 0 and adds nothing: ln 2 = 0.6931472;
  # [0, ln 3, -inf] -> -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.3465736 + 0.2157616 = 0.5623351;
  # [1, 1, 1] -> ln 3 = 1.0986123.
  logits = np.array([[[0.0, 0.0, -np.inf], [0.0, math.log(3.0), -np.inf], [1.0, 1.0, 1.0]]],
                    np.float32)
  np.testing.assert_allclose(lp.entropy(logits), [[0.6931472, 0.5623351, 1.0986123]], atol=1e-6)
  # Temperature 2 on [0, ln 9] gives [0, ln 3] again.
  np.testing.assert_allclose(
      lp.entropy(np.array([[[0.0, math.log(9.0)]]], np.float32), 2.0), [[0.5623351]], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_entropy_matches_reference(seed, temperature):
  rng = np.random.default_rng(seed)
  logits = (rng.normal(size=(3, 5, 40)) * 2.0).astype(np.float32)
  logits[0, 1, :20] = -np.inf  # a masked half-vocabulary
  out = lp.entropy(logits, temperature)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref_entropy(logits, temperature), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out) >= -1e-6) and np.all(np.asarray(out) <= math.log(40) + 1e-5)
  np.testing.assert_array_equal(out, lp.entropy(jnp.asarray(logits), temperature))


def test_entropy_gradient_finite_with_neg_inf_logits():
  logits = jnp.array([[[0.3, -1.0, -jnp.inf, 2.0], [-jnp.inf, -jnp.inf, 1.0, 0.0]]], jnp.float32)
  grad = jax.grad(lambda z: jnp.sum(lp.entropy(z)))(logits)
  assert np.all(np.isfinite(grad))
  # The -inf entries get no gradient; the finite ones match dH/dz = -p (log p + H).
  finite = np.asarray(logits[0, :, :])
  for j in range(2):
    z = finite[j]
    keep = np.isfinite(z)
    logp = np_log_softmax(z[keep])
    p = np.exp(logp)
    h = -np.sum(p * logp)
    np.testing.assert_allclose(np.asarray(grad)[0, j][keep], -p * (logp + h), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad)[0, j][~keep], 0.0)


def test_entropy_traced_once(assert_no_retrace):
  rng = np.random.default_rng(7)
  calls = [((jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32),), {"temperature": tau})
           for tau in (1.0, 0.5, 2.0)]
  assert_no_retrace(lp.entropy, *calls)


# ----------------------------------------------------------------------------------------------------
# token_logprobs_from_hidden


def test_from_hidden_by_hand():
  # h = [1, 0] picks row 0 of W = [[0, 0, ln 2], [5, -3, 1]]: logits [0, 0, ln 2], p = [1/4, 1/4, 1/2].
  # log p(2) = ln 0.5 = -0.6931472; H = 2 * (1/4 ln 4) + 1/2 ln 2 = 0.6931472 + 0.3465736 = 1.0397208.
  # h = [0, 1]: logits [5, -3, 1]; log p(0) = 5 - ln(e^5 + e^-3 + e^1) = -0.0184793.
  hidden = np.array([[[1.0, 0.0], [0.0, 1.0]]], np.float32)
  w = np.array([[0.0, 0.0, math.log(2.0)], [5.0, -3.0, 1.0]], np.float32)
  targets = np.array([[2, 0]], np.int32)
  logp, ent = lp.token_logprobs_from_hidden(hidden, w, targets, chunk_size=2, return_entropy=True)
  np.testing.assert_allclose(logp, [[-0.6931472, -0.0184793]], atol=1e-6)
  np.testing.assert_allclose(ent[0, 0], 1.0397208, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("chunk_size", [16, 37, 64, 1000])  # V = 37: ragged, exact, larger than V
def test_from_hidden_matches_reference(seed, layout, chunk_size):
  hidden, w_dv, targets = random_case(seed, v=37)
  unembed = w_dv if layout == "dv" else np.ascontiguousarray(w_dv.T)
  logp = lp.token_logprobs_from_hidden(hidden, unembed, targets, chunk_size=chunk_size)
  assert logp.dtype == jnp.float32 and logp.shape == targets.shape
  logits = ref_logits_from_hidden(hidden, w_dv)
  np.testing.assert_allclose(logp, ref_token_logprobs(logits, targets), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("chunk_size", [7, 300])
def test_from_hidden_entropy_and_temperature(seed, chunk_size):
  hidden, w_dv, targets = random_case(seed, b=2, t=4, v=250, d=16)
  for temperature in (1.0, 0.6):
    logp, ent = lp.token_logprobs_from_hidden(hidden, w_dv, targets, chunk_size=chunk_size,
                                              temperature=temperature, return_entropy=True)
    assert logp.dtype == ent.dtype == jnp.float32
    logits = ref_logits_from_hidden(hidden, w_dv)
    np.testing.assert_allclose(logp, ref_token_logprobs(logits, targets, temperature), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(ent, ref_entropy(logits, temperature), rtol=1e-5, atol=1e-5)


def test_from_hidden_softcap_by_hand():
  # Gemma 2 caps logits at c * tanh(l / c). With c = 1, logits [0, 0, ln 2] become [0, 0, t],
  # t = tanh(ln 2) = (2 - 1/2) / (2 + 1/2) = 0.6: log p(2) = 0.6 - ln(2 + e^0.6) = -0.7645007.
  hidden = np.array([[[1.0, 0.0]]], np.float32)
  w = np.array([[0.0, 0.0, math.log(2.0)], [5.0, -3.0, 1.0]], np.float32)
  logp = lp.token_logprobs_from_hidden(hidden, w, np.array([[2]], np.int32), chunk_size=2,
                                       softcap=1.0)
  np.testing.assert_allclose(logp, [[0.6 - math.log(2.0 + math.exp(0.6))]], atol=1e-6)


@pytest.mark.parametrize("chunk_size", [7, 300])
def test_from_hidden_softcap_and_temperature_match_reference(chunk_size):
  hidden, w_dv, targets = random_case(3, b=2, t=4, v=250, d=16)
  capped = 2.0 * np.tanh(ref_logits_from_hidden(hidden, w_dv) / 2.0)  # the cap binds: |l| up to ~10
  assert np.abs(ref_logits_from_hidden(hidden, w_dv)).max() > 4.0
  logp, ent = lp.token_logprobs_from_hidden(hidden, w_dv, targets, chunk_size=chunk_size,
                                            temperature=0.7, return_entropy=True, softcap=2.0)
  np.testing.assert_allclose(logp, ref_token_logprobs(capped, targets, 0.7), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ref_entropy(capped, 0.7), rtol=1e-5, atol=1e-5)


def test_from_hidden_accepts_numpy_and_jax():
  hidden, w_dv, targets = random_case(8)
  from_np = lp.token_logprobs_from_hidden(hidden, w_dv, targets, chunk_size=8)
  from_jax = lp.token_logprobs_from_hidden(jnp.asarray(hidden), jnp.asarray(w_dv),
                                           jnp.asarray(targets), chunk_size=8)
  assert from_np.dtype == from_jax.dtype == jnp.float32
  np.testing.assert_allclose(from_np, from_jax, atol=1e-6)


def test_from_hidden_bf16_hidden_gives_float32():
  hidden, w_dv, targets = random_case(9, b=2, t=4, v=60, d=16)
  h16 = jnp.asarray(hidden, jnp.bfloat16)
  out = lp.token_logprobs_from_hidden(h16, w_dv, targets, chunk_size=16)
  assert out.dtype == jnp.float32
  # Exact up to float32 rounding against the reference on the same (bf16-rounded) hidden states ...
  rounded = np.asarray(h16.astype(jnp.float32))
  np.testing.assert_allclose(out, ref_token_logprobs(ref_logits_from_hidden(rounded, w_dv), targets),
                             rtol=1e-5, atol=1e-5)
  # ... and close to the float32 result on the unrounded ones.
  full = lp.token_logprobs_from_hidden(hidden, w_dv, targets, chunk_size=16)
  np.testing.assert_allclose(out, full, atol=0.1)
  # Both operands in bf16 still give float32 log-probs.
  both = lp.token_logprobs_from_hidden(h16, jnp.asarray(w_dv, jnp.bfloat16), targets, chunk_size=16)
  assert both.dtype == jnp.float32
  np.testing.assert_allclose(both, full, atol=0.15)


@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_from_hidden_gradients_match_full_logits_path(layout):
  hidden, w_dv, targets = random_case(10, b=2, t=3, v=45, d=8)
  rng = np.random.default_rng(11)
  c_logp = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
  c_ent = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
  unembed = jnp.asarray(w_dv if layout == "dv" else w_dv.T)
  as_dv = (lambda w: w) if layout == "dv" else (lambda w: w.T)
  tau = 0.9

  def chunked(h, w):
    logp, ent = lp.token_logprobs_from_hidden(h, w, targets, chunk_size=10, temperature=tau,
                                              return_entropy=True)
    return jnp.sum(c_logp * logp) + jnp.sum(c_ent * ent)

  def full(h, w):
    logits = h @ as_dv(w)
    return (jnp.sum(c_logp * lp.token_logprobs(logits, targets, tau)) +
            jnp.sum(c_ent * lp.entropy(logits, tau)))

  h = jnp.asarray(hidden)
  got_h, got_w = jax.grad(chunked, argnums=(0, 1))(h, unembed)
  want_h, want_w = jax.grad(full, argnums=(0, 1))(h, unembed)
  assert got_w.shape == unembed.shape
  np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got_w, want_w, rtol=1e-4, atol=1e-5)

  # The log-prob part also against the analytic NumPy gradient.
  logp_only = lambda h, w: jnp.sum(c_logp * lp.token_logprobs_from_hidden(
      h, w, targets, chunk_size=10, temperature=tau))
  got_h, got_w = jax.grad(logp_only, argnums=(0, 1))(h, unembed)
  ref_h, ref_w = ref_grad_weighted_logprobs(hidden, w_dv, targets, np.asarray(c_logp), tau)
  np.testing.assert_allclose(got_h, ref_h, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(as_dv(got_w), ref_w, rtol=1e-4, atol=1e-5)


def test_from_hidden_square_unembed_needs_vocab_axis():
  hidden, _, targets = random_case(12, v=8, d=8)
  w = np.random.default_rng(13).normal(size=(8, 8)).astype(np.float32)
  with pytest.raises(ValueError, match=r"square.*vocab_axis"):
    lp.token_logprobs_from_hidden(hidden, w, targets)
  logits = ref_logits_from_hidden(hidden, w)
  np.testing.assert_allclose(lp.token_logprobs_from_hidden(hidden, w, targets, vocab_axis=1),
                             ref_token_logprobs(logits, targets), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lp.token_logprobs_from_hidden(hidden, w.T, targets, vocab_axis=0),
                             ref_token_logprobs(logits, targets), rtol=1e-5, atol=1e-5)


def test_from_hidden_wrong_width_raises():
  hidden, _, targets = random_case(14, d=8)
  with pytest.raises(ValueError, match=r"D=8"):
    lp.token_logprobs_from_hidden(hidden, np.zeros((6, 20), np.float32), targets)
  with pytest.raises(ValueError, match=r"D=8"):
    lp.token_logprobs_from_hidden(hidden, np.zeros((20, 6), np.float32), targets, vocab_axis=0)


def test_from_hidden_traced_once(assert_no_retrace):
  rng = np.random.default_rng(15)
  calls = []
  for tau in (1.0, 0.7, 1.2):
    hidden, w_dv, targets = random_case(int(rng.integers(1 << 20)), b=2, t=3, v=30, d=8)
    calls.append(((jnp.asarray(hidden), jnp.asarray(w_dv), jnp.asarray(targets)),
                  {"chunk_size": 8, "temperature": tau, "return_entropy": True}))
  assert_no_retrace(lp.token_logprobs_from_hidden, *calls)
