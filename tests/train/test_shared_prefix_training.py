"""`optim.share_prefix` in the learner: SFT and RL updates with the batch's shared prefix computed
once give the per-row updates' parameters, compile once per prefix length, and are refused where
the flat layout does not apply."""

import os

import importlib.util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.core import episode as episode_lib
from longhorizon.train import config as config_lib
from longhorizon.train.learner import Learner
from longhorizon.train.metrics import Timer

_spec = importlib.util.spec_from_file_location(
    "default_config", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "default.py"))
default_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(default_config)


def _config(tmp_path, **changes):
  config = default_config.get_config("smoke")
  config.unlock()
  config.tasks.data_dir = str(tmp_path / "tasks")
  # An entropy bonus: the smoke run's groups all fail, so without it the RL updates move nothing.
  changes = {"sft.steps": 2, "optim.epochs": 2, "optim.minibatches": 2, "loss.entropy_coef": 0.01,
             **changes}
  for path, value in changes.items():
    config_lib.set_path(config, path, value)
  config.lock()
  return config


def _close(a, b, start):
  """`a` and `b` agree to float rounding, which Adam's per-parameter normalisation can blow up to
  ~1e-5 where a gradient is near 0, while the updates moved parameters by far more than that."""
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-3,
                                                       atol=5e-5), a, b)
  moved = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(start)))
  assert moved > 1e-3, moved


@pytest.fixture(scope="module")
def learners(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("share_prefix")
  return Learner.build(_config(tmp)), Learner.build(_config(tmp, **{"optim.share_prefix": 4}))


@pytest.mark.slow
def test_sft_and_rl_updates_equal_the_per_row_ones(learners, assert_no_retrace):
  """The main job's smoke setting: every prompt starts with the same system text. SFT from the same
  start, then two RL updates on the same batches, give the same parameters and metrics either way;
  the shared-prefix update compiles once for the two batches."""
  per_row, shared = learners
  start = per_row.initial_state()
  a, _ = per_row.warm_start(jax.tree.map(jnp.array, start))
  b, _ = shared.warm_start(jax.tree.map(jnp.array, start))
  _close(a.params, b.params, start.params)
  batches = [per_row.collect_batch(a.params, u, u * 4, Timer()) for u in (0, 1)]
  rows = per_row.trimmed(batches[0][0])
  prefix = episode_lib.shared_prefix_length(rows, 4)
  used = np.asarray(rows.attention_mask).sum(-1)
  assert 4 <= prefix < used.min()  # a real shared prefix, and not the whole of any row
  first_trained = np.argmax(np.asarray(rows.loss_mask).any(0))
  assert prefix <= first_trained
  for batch, stats in batches:
    before = jax.device_get(a.params)
    a, ma = per_row.learn(a, batch, stats, Timer())
    b, mb = shared.learn(b, batch, stats, Timer())
    _close(a.params, b.params, before)
    np.testing.assert_allclose(mb["loss"], ma["loss"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(mb["entropy"], ma["entropy"], rtol=1e-4, atol=1e-6)
  assert list(shared._jitted) == [(prefix, None)]
  calls = []
  for batch, _ in batches:
    db = episode_lib.to_device(shared.trimmed(batch))
    calls.append(((jax.tree.map(jnp.array, b), db, shared.learn_inputs(b, db)), {}))
  assert_no_retrace(shared.update_fn(*calls[0][0], prefix), *calls)


@pytest.mark.parametrize("changes,message", [
    ({"algorithm.name": "ppo", "algorithm.critic": "shared"},
     "config.algorithm.critic='shared' is not allowed; expected 'separate'"),
    ({"model.moe.num_experts": 4}, "config.model.moe.num_experts=4 is not allowed; expected 0"),
    ({"mesh.data": 2}, "config.mesh.data=2 is not allowed; expected 1"),
])
def test_refused_where_the_flat_layout_does_not_apply(tmp_path, changes, message):
  config = default_config.get_config("smoke")
  config.unlock()
  for path, value in {"optim.share_prefix": 8, **changes}.items():
    config_lib.set_path(config, path, value)
  if changes.get("mesh.data"):
    if jax.local_device_count() < 2:
      pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(config)
  assert message in str(info.value) and "with optim.share_prefix=8" in str(info.value)
