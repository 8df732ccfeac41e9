"""The shared fixtures of tests/conftest.py check what they claim: `assert_no_retrace` passes for
repeated calls of one shape and fails when the jitted function is traced again; implicit rank
promotion raises."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@functools.partial(jax.jit, static_argnames="power")
def _scaled(x, power=1):
  return x ** power * 2.0


def test_no_retrace_passes_for_repeated_shapes(assert_no_retrace):
  assert_no_retrace(_scaled, *[((np.full((2, 3), v, np.float32),), {"power": 2}) for v in (1, 2, 3)])


def test_no_retrace_fails_for_a_new_static_argument(assert_no_retrace):
  x = np.ones((4,), np.float32)
  with pytest.raises(AssertionError, match="traced/compiled again by call 2"):
    assert_no_retrace(_scaled, ((x,), {"power": 3}), ((x + 1,), {"power": 3}), ((x,), {"power": 4}))


def test_no_retrace_fails_for_a_new_shape(assert_no_retrace):
  with pytest.raises(AssertionError, match="_scaled was traced/compiled again by call 1"):
    assert_no_retrace(_scaled, ((np.ones((5,), np.float32),), {}), ((np.ones((6,), np.float32),), {}))


def test_no_retrace_fails_for_a_new_dtype(assert_no_retrace):
  f = jax.jit(lambda x: jnp.sum(x))
  with pytest.raises(AssertionError, match="jaxpr_trace_duration"):
    assert_no_retrace(f, ((np.ones(3, np.float32),), {}), ((np.ones(3, np.int32),), {}))


def test_no_retrace_rejects_a_function_that_is_not_jitted(assert_no_retrace):
  with pytest.raises(AssertionError, match="is not a jax.jit-wrapped function"):
    assert_no_retrace(lambda x: x, ((1,), {}), ((2,), {}))


def test_implicit_rank_promotion_raises_here_and_in_subprocesses():
  with pytest.raises(ValueError, match="jax_numpy_rank_promotion='raise'"):
    jnp.ones((3,)) + jnp.ones((2, 3))
  np.testing.assert_array_equal(jnp.ones((3,))[None, :] + jnp.ones((2, 3)), np.full((2, 3), 2.0))
  assert os.environ["JAX_NUMPY_RANK_PROMOTION"] == "raise"  # what subprocesses of tests inherit
