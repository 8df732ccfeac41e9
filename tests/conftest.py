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


@pytest.fixture(scope="session")
def one_hop_learning_changes():
  """Config changes (dotted paths) of the learning tests' setup: 1-hop pointer_chain, 60 SFT steps on
  128 noisy-demonstrator episodes, tuned so the warm start is competent but unreliable (sampled
  success ~0.45 on 64 test tasks), then small RL updates of 8 tasks x 8 rollouts."""
  return {"env.params": {"horizon": 1}, "env.max_steps": 3, "sft.steps": 60, "sft.episodes": 128,
          "sft.learning_rate": 3e-3, "tasks.test_size": 64, "rollout.num_tasks": 8,
          "rollout.group_size": 8, "rollout.context_length": 96, "optim.learning_rate": 3e-4,
          "optim.minibatches": 2, "optim.epochs": 2}
