"""Shared test utilities.

`assert_no_retrace(fn, *calls)`: calls the jitted `fn` once per entry of `calls` (each an
`(args, kwargs)` pair with the same shapes/dtypes/static arguments but different values) and asserts
that after the first call JAX neither traces, lowers nor compiles anything again, i.e. repeated calls
of the same shapes are traced and compiled once. It counts JAX's public compile-pipeline monitoring
events (`jax.monitoring`, names under `/jax/core/compile/`: one `jaxpr_trace_duration` per top-level
trace, one `backend_compile_duration` per XLA compile) rather than reading jit's private cache.
`chex.assert_max_traces` cannot be used here: it must wrap the Python function before `jax.jit`, and
the functions under test are the library's own module-level jitted functions.

Compiled executables go to JAX's persistent compilation cache, `.cache/jax-tests/` under the repository
(set `LONGHORIZON_TEST_JAX_CACHE` to another directory, or to an empty string to turn it off). Many
tests and the subprocesses they start compile the same tiny models and steps; the cache keys on the
lowered program, the compile options, the devices and the jax/jaxlib versions, so a hit is the same
executable a compile would give. It changes no test's meaning: the compile checks count traces and
jit's in-memory cache entries, and a hit still traces.

The tests compile with `--xla_backend_optimization_level=0` (LLVM's cheapest code generation; XLA's
own HLO passes and the Eigen/oneDNN library calls are unchanged). On this project's 2-core CPUs the
suite is dominated by compiling many tiny programs: -O0 made `tests/core/test_advantages.py` 1.75x
and a set of training tests 1.3x faster (2-core AMD EPYC). The library, the main job and the
benchmarks keep XLA's default; `LONGHORIZON_TEST_FAST_COMPILE=0` runs the tests with it too.

JAX runs with `jax_numpy_rank_promotion='raise'` in tests (also exported to the environment, so the
subprocesses tests start inherit it): a broadcast between arrays of different ranks must be written
out (`x[:, None]`, `jnp.broadcast_to`).
"""

import contextlib
import os

# Tests run on the CPU; a fixed device count keeps sharded tests meaningful where they run in-process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"  # no implicit broadcasts between ranks (docstring)
# JAX's persistent compilation cache (docstring): exported before jax is imported, so both xdist
# workers and every subprocess a test starts share one cache directory.
_JAX_CACHE = os.environ.get("LONGHORIZON_TEST_JAX_CACHE", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax-tests"))
if _JAX_CACHE:  # an empty LONGHORIZON_TEST_JAX_CACHE turns it off
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# LLVM at -O0 for the tests' compiles (docstring); LONGHORIZON_TEST_FAST_COMPILE=0 keeps XLA's default.
if os.environ.get("LONGHORIZON_TEST_FAST_COMPILE", "1") != "0" and (
    "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")  # in case jax was imported before this file

# Prefix of the duration events JAX records for each trace, lowering and backend compile of a jit.
_COMPILE_EVENTS = "/jax/core/compile/"


@contextlib.contextmanager
def _recording_compiles():
  """Yields a list that collects `(event, fun_name)` for every trace/lowering/compile in the block."""
  events = []

  def listener(event, duration_secs, **kwargs):
    del duration_secs
    if event.startswith(_COMPILE_EVENTS):
      events.append((event, kwargs.get("fun_name", "?")))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _assert_no_retrace(fn, *calls):
  assert hasattr(fn, "lower"), f"{fn} is not a jax.jit-wrapped function"
  assert len(calls) >= 2, "need at least two calls to check for retracing"
  args, kwargs = calls[0]
  jax.block_until_ready(fn(*args, **kwargs))
  for i, (args, kwargs) in enumerate(calls[1:], start=1):
    with _recording_compiles() as events:
      jax.block_until_ready(fn(*args, **kwargs))
    assert not events, (
        f"{getattr(fn, '__name__', fn)} was traced/compiled again by call {i}, whose arguments have "
        f"the same shapes as call 0: {events}")


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


@pytest.fixture(scope="session")
def smoke_learner():
  """`smoke_learner(tmp_path, changes)`: a `Learner` (see `_smoke_learner`)."""
  return _smoke_learner


@pytest.fixture(scope="session")
def smoke_config():
  """`smoke_config(tmp_path, **changes)`: configs/default.py:smoke with `changes` (dotted paths)
  applied and its task data under `tmp_path`, locked."""
  return _smoke_config


def _smoke_config(tmp_path, **changes):
  from configs import default as default_config  # pylint: disable=g-import-not-at-top
  from longhorizon.train import config as config_lib  # pylint: disable=g-import-not-at-top
  config = default_config.get_config("smoke")
  config.unlock()
  config.tasks.data_dir = str(tmp_path / "tasks")
  for path, value in changes.items():
    config_lib.set_path(config, path, value)
  config.lock()
  return config


def _smoke_learner(tmp_path, changes):
  """A `Learner` of configs/default.py:smoke with `changes` (dotted paths) applied and its task
  data under `tmp_path`."""
  from longhorizon.train.learner import Learner  # pylint: disable=g-import-not-at-top
  return Learner.build(_smoke_config(tmp_path, **changes))
