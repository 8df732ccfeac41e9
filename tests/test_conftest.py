"""The shared fixtures of tests/conftest.py check what they claim: `assert_no_retrace` passes for
repeated calls of one shape and fails when the jitted function is traced again; implicit rank
promotion raises; `LONGHORIZON_TEST_DEADLINE` skips the tests due after it and refuses a malformed
value."""

import functools
import os
import subprocess
import sys
import time

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


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TARGET = "tests/test_conftest.py::test_no_retrace_passes_for_repeated_shapes"


def _pytest_with_deadline(value: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, LONGHORIZON_TEST_DEADLINE=value)
  return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                         _TARGET], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_deadline_skips_tests_due_after_it_and_runs_those_before():
  past = _pytest_with_deadline(str(time.time() - 1))
  assert past.returncode == 0, past.stdout + past.stderr
  assert "1 skipped" in past.stdout and "passed" not in past.stdout, past.stdout
  assert "not started: past LONGHORIZON_TEST_DEADLINE" in past.stdout, past.stdout
  future = _pytest_with_deadline(str(time.time() + 3600))
  assert future.returncode == 0, future.stdout + future.stderr
  assert "1 passed" in future.stdout and "skipped" not in future.stdout, future.stdout


def test_malformed_deadline_stops_the_session_naming_the_variable():
  bad = _pytest_with_deadline("in an hour")
  assert bad.returncode == pytest.ExitCode.USAGE_ERROR, bad.stdout + bad.stderr
  assert "LONGHORIZON_TEST_DEADLINE='in an hour': not a Unix time" in bad.stdout + bad.stderr
  assert "passed" not in bad.stdout
