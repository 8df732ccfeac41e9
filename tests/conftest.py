"""Shared test utilities.

`assert_no_retrace(fn, *call_args)`: calls the jitted `fn` once per entry of `call_args` (each a
`(args, kwargs)` pair with the same shapes/dtypes/static arguments but different values) and asserts
that after the first call the jit cache of `fn` does not grow, i.e. repeated calls of the same shapes
are traced and compiled once.
"""

import os

# Tests run on the CPU; a fixed device count keeps sharded tests meaningful where they run in-process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest


def _assert_no_retrace(fn, *calls):
  assert hasattr(fn, "_cache_size"), f"{fn} is not a jax.jit-wrapped function"
  assert len(calls) >= 2, "need at least two calls to check for retracing"
  args, kwargs = calls[0]
  fn(*args, **kwargs)
  size = fn._cache_size()
  for args, kwargs in calls[1:]:
    fn(*args, **kwargs)
    assert fn._cache_size() == size, (
        f"{getattr(fn, '__name__', fn)} was traced again for a call with the same shapes")


@pytest.fixture
def assert_no_retrace():
  return _assert_no_retrace


@pytest.fixture
def rng():
  return np.random.default_rng(0)
