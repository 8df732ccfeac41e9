"""Asynchronous rollouts: the staleness rules by hand, the actor/learner protocol on a scripted
completion order (fake sampler), config errors, async with max_staleness=0 equal to the sync run
(through a resume), and learning with stale batches."""

import contextlib
import importlib.util
import json
import os
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.train import async_rollout, loop
from longhorizon.train import config as config_lib
from longhorizon.train.learner import Learner
from longhorizon.train.metrics import Timer, read_metrics
from longhorizon.train.options import RolloutOptions
from longhorizon.train.policy_losses import LossOptions

_spec = importlib.util.spec_from_file_location(
    "default_config", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "default.py"))
default_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(default_config)


def _config(tmp_path=None, **changes):
  config = default_config.get_config("smoke")
  config.unlock()
  if tmp_path is not None:
    config.tasks.data_dir = str(tmp_path / "tasks")
  for path, value in changes.items():
    config_lib.set_path(config, path, value)
  config.lock()
  return config


# ------------------------------------------------------------------------------ staleness rules

def test_staleness_weights_by_hand():
  lag = np.array([0, 1, 2, 3, 5])
  np.testing.assert_array_equal(async_rollout.staleness_weights(lag, 2, "drop", 0.5),
                                [1, 1, 1, 0, 0])
  np.testing.assert_allclose(async_rollout.staleness_weights(lag, 2, "downweight", 0.5),
                             [1, 1, 1, 0.5, 0.125])
  np.testing.assert_array_equal(async_rollout.staleness_weights(lag, 0, "drop", 0.5),
                                [1, 0, 0, 0, 0])
  with pytest.raises(ValueError, match="'drop' or 'downweight'"):
    async_rollout.staleness_weights(lag, 1, "discard", 0.5)


def test_lag_metrics_by_hand():
  m = async_rollout.lag_metrics([np.array([0, 0, 1]), np.array([3, 3])], 1)
  assert m == {"async/lag_mean": 1.4, "async/lag_max": 3.0, "async/lag_count/0": 2.0,
               "async/lag_count/1": 1.0, "async/lag_count/stale": 2.0}


@pytest.mark.parametrize("changes,message", [
    ({"rollout.stale_policy": "discard"}, "config.rollout.stale_policy='discard'"),
    ({"rollout.max_staleness": -1}, "config.rollout.max_staleness=-1"),
    ({"rollout.num_actors": 0}, "config.rollout.num_actors=0"),
    ({"rollout.queue_size": 0}, "config.rollout.queue_size=0"),
    ({"rollout.stale_weight": 0.0}, "config.rollout.stale_weight=0.0"),
    ({"loss.name": "vtrace"}, "config.loss.name='vtrace'"),
    ({"loss.name": "tis"}, "config.loss.tis_threshold=0.0"),
    ({"rollout.mode": "async", "curriculum.step_budgets": (2, 4)}, "with rollout.mode='async'"),
    ({"rollout.continue_partial": True}, "config.rollout.continue_partial=True"),
    ({"rollout.mode": "async", "rollout.partial_cache": "drop"},
     "config.rollout.partial_cache='drop'"),
])
def test_async_config_errors_name_the_field(changes, message):
  with pytest.raises(ValueError) as info:
    config_lib.validate(_config(**changes))
  assert message in str(info.value)


def test_default_config_keeps_sync_and_the_existing_loss():
  config = default_config.get_config()
  assert config.rollout.mode == "sync"
  options = LossOptions.from_config(config)
  assert options.name == "ppo_clip" and options.spec.anchor == "proximal"
  assert options.tis_threshold == 0


# --------------------------------------------------------------- protocol with a fake sampler

class FakeSampler:
  """Replaces `Learner.collect_batch`: batch `k` (B = 2 rows) is released when the test says so."""

  def __init__(self):
    self.started, self.released = {}, {}
    self.lock = threading.Lock()
    self.open = threading.Event()  # set at the end of a test: every batch is released

  def _event(self, table, k):
    with self.lock:
      return table.setdefault(k, threading.Event())

  def __call__(self, params, update, data_position, timer, task_indices=None, *,
               policy_version=None, on_env_step=None, params_source=None):
    self._event(self.started, update).set()
    released, deadline = self._event(self.released, update), time.time() + 30
    while not (released.wait(0.005) or self.open.is_set()):
      assert time.time() < deadline, f"batch {update} never released"
    # Each row: a first token sampled at the start, two more at release (with partial rollouts
    # by the version published by then), and one unsampled token.
    late = params_source()[1] if params_source is not None else policy_version
    batch = types.SimpleNamespace(policy_version=np.full((2,), policy_version, np.int32),
                                  loss_mask=np.tile([True, True, True, False], (2, 1)),
                                  token_version=np.tile([policy_version, late, late, -1], (2, 1)),
                                  index=update, data_position=data_position,
                                  params=float(params["w"]))
    return batch, None

  def wait_started(self, k):
    assert self._event(self.started, k).wait(30), f"batch {k} never started"

  def release(self, k, pipeline=None, queued=None):
    self._event(self.released, k).set()
    if pipeline is not None:  # wait until it is in the queue
      deadline = time.time() + 30
      while len(pipeline._queue) < queued:
        assert time.time() < deadline
        time.sleep(0.001)


def _fake_learner(config, collect_batch):
  """What `AsyncRollouts` uses of a `Learner`, with `collect_batch` replaced."""
  return types.SimpleNamespace(rollout=RolloutOptions.from_config(config),
                               loss=LossOptions.from_config(config), collect_batch=collect_batch,
                               in_mesh=contextlib.nullcontext)


@pytest.fixture
def make_pipeline():
  """`make(**rollout_fields) -> (FakeSampler, started AsyncRollouts)`; closed after the test."""
  made = []

  def make(**rollout):
    rollout.setdefault("mode", "async")
    fake = FakeSampler()
    s = _fake_learner(_config(**{f"rollout.{k}": v for k, v in rollout.items()}), fake)
    pipe = async_rollout.AsyncRollouts(s, {"w": jnp.float32(0.0)}, version=0, first_batch=5,
                                       data_position=40)
    made.append((fake, pipe))
    return fake, pipe.start()

  yield make
  for fake, pipe in made:
    fake.open.set()
    pipe.close()


def test_max_staleness_zero_samples_batch_u_with_version_u(make_pipeline):
  fake, pipe = make_pipeline(max_staleness=0, num_actors=2)
  for u in range(3):
    fake.release(5 + u)
    item, scale, m = pipe.take(u)
    # Batch u: index first_batch + u, its data position, sampled by version u's parameters.
    assert (item.index, item.version, item.batch.data_position) == (5 + u, u, 40 + 4 * u)
    assert item.batch.params == float(u)
    assert m["async/lag_max"] == 0 and m["async/dropped_episodes"] == 0
    np.testing.assert_array_equal(scale, 1.0)
    time.sleep(0.05)  # no actor may start batch u + 1 before version u + 1 is published
    assert (5 + u + 1) not in fake.started
    pipe.publish({"w": jnp.float32(u + 1)}, u + 1)
  assert (pipe.next_batch, pipe.data_position) == (8, 52)  # the checkpoint meta


@pytest.mark.parametrize("policy,weight", [("drop", 0.0), ("downweight", 0.5)])
def test_out_of_order_batch_is_dropped_or_downweighted(make_pipeline, policy, weight):
  # Two actors, max_staleness 1. Batch 5 (version 0) is slow: batches 6, 7, 8 overtake it.
  fake, pipe = make_pipeline(max_staleness=1, num_actors=2, stale_policy=policy, stale_weight=0.5,
                             queue_size=4)
  fake.wait_started(5)
  fake.wait_started(6)  # taken at update 1 at the latest: 1 version old at most
  time.sleep(0.05)
  assert 7 not in fake.started  # would be 2 versions old when taken in order
  fake.release(6, pipe, queued=1)
  item, _, m = pipe.take(0)
  assert (item.index, item.version, m["async/lag_max"]) == (6, 0, 0)
  pipe.publish({"w": jnp.float32(1)}, 1)
  fake.wait_started(7)  # version 1; batch 5 is still pending, so 7 is taken at update 2
  fake.release(7, pipe, queued=1)
  item, _, m = pipe.take(1)
  assert (item.index, item.version, m["async/lag_max"]) == (7, 1, 0)
  pipe.publish({"w": jnp.float32(2)}, 2)
  fake.wait_started(8)
  fake.release(5, pipe, queued=1)  # finally: version 0, taken at update 2 -> lag 2 > 1
  fake.release(8, pipe, queued=2)
  item, scale, m = pipe.take(2)
  if policy == "drop":  # discarded; the learner trains on batch 8 instead
    assert (item.index, item.version) == (8, 2)
    np.testing.assert_array_equal(scale, 1.0)
    assert m["async/dropped_episodes"] == 2 and m["async/dropped_episode_rate"] == 0.5
    assert m["async/lag_count/stale"] == 2 and m["async/lag_count/0"] == 2
    assert m["async/lag_max"] == 2 and m["async/lag_mean"] == 1.0
  else:  # kept at weight 0.5 ** (2 - 1)
    assert (item.index, item.version) == (5, 0)
    np.testing.assert_allclose(scale, weight)
    assert m["async/dropped_episodes"] == 0 and m["async/lag_count/stale"] == 2
    assert m["async/weight_mean"] == 0.5
  assert m["async/learner_idle_s"] >= 0 and m["async/queue_age_s"] >= 0
  assert pipe.next_batch == (9 if policy == "drop" else 8)  # after the newest batch taken


def test_partial_rollouts_keep_the_fresh_tokens_of_a_late_batch(make_pipeline):
  """The out-of-order case above with partial rollouts: batch 5 samples its first token with
  version 0 and the rest after version 2 is published; taken at update 2, only that first token
  is too stale (lag 2 > 1) and the batch is trained on, not dropped."""
  fake, pipe = make_pipeline(max_staleness=1, num_actors=2, stale_policy="drop", queue_size=4,
                             continue_partial=True)
  fake.wait_started(5)
  fake.wait_started(6)
  fake.release(6, pipe, queued=1)
  item, _, m = pipe.take(0)
  assert item.index == 6 and m["async/partial_episodes"] == 0  # no version published meanwhile
  pipe.publish({"w": jnp.float32(1)}, 1)
  fake.wait_started(7)
  fake.release(7, pipe, queued=1)
  item, _, _ = pipe.take(1)
  assert item.index == 7
  pipe.publish({"w": jnp.float32(2)}, 2)
  fake.wait_started(8)
  fake.release(5, pipe, queued=1)
  fake.release(8, pipe, queued=2)
  item, scale, m = pipe.take(2)
  assert (item.index, item.version) == (5, 0)
  np.testing.assert_array_equal(item.batch.token_version[0], [0, 2, 2, -1])
  np.testing.assert_array_equal(scale, np.tile([0.0, 1.0, 1.0, 1.0], (2, 1)))
  assert m["async/dropped_episodes"] == 0 and m["async/partial_episodes"] == 2
  assert m["async/token_lag_max"] == 2 and m["async/token_lag_mean"] == pytest.approx(2 / 3)
  assert m["async/lag_max"] == 2  # the episodes' start version is still 2 behind
  assert m["async/sampled_length_mean"] == m["async/admitted_length_mean"] == 3


def test_token_staleness_weights_by_hand():
  batch = types.SimpleNamespace(loss_mask=np.array([[0, 1, 1, 1], [0, 1, 1, 0]], bool),
                                token_version=np.array([[-1, 3, 4, 5], [-1, 5, 5, -1]]))
  np.testing.assert_array_equal(
      async_rollout.token_staleness_weights(batch, 5, 1, "downweight", 0.5),
      [[1, 0.5, 1, 1], [1, 1, 1, 1]])
  np.testing.assert_array_equal(
      async_rollout.token_staleness_weights(batch, 5, 0, "drop", 0.5),
      [[1, 0, 0, 1], [1, 1, 1, 1]])


def test_actor_errors_reach_the_learner():
  def broken(*args, **kwargs):
    raise OSError("tool server down")
  s = _fake_learner(_config(), broken)
  pipe = async_rollout.AsyncRollouts(s, {"w": jnp.float32(0)}, version=0, first_batch=0,
                                     data_position=0)
  with pipe:
    with pytest.raises(RuntimeError, match="actor 0 failed: OSError"):
      pipe.take(0)


# --------------------------------------------------------------------- real runs (tiny model)

def _comparable(rows):
  timing = lambda k: (k.startswith(("time", "memory", "rollout/", "async/")) or k.endswith("_s")
                      or "per_s" in k)
  return [{k: v for k, v in r.items() if not timing(k)} for r in rows]


@pytest.mark.slow
def test_async_with_max_staleness_zero_equals_sync_through_a_resume(tmp_path):
  """configs/default.py:smoke: every metric of every update (success, loss, KL, entropy, ratios,
  episode lengths, ...) equals the sync run's, also when the async run is stopped after update 2
  and resumed. A penalty for invalid actions makes the smoke run's rewards vary within groups, so
  its losses are not 0 and its parameters move (success alone is 0 at the smoke warm start)."""
  changes = {"reward.invalid": 0.1, "num_updates": 3, "checkpoint_every": 1,
             "eval.num_tasks": 8, "tensorboard": False}
  sync = _config(tmp_path, **changes)
  loop.train_and_evaluate(sync, str(tmp_path / "sync"))
  expected = read_metrics(str(tmp_path / "sync"))
  assert all(r["loss"] != 0 and r["grad_norm"] > 0 for r in expected)
  async_changes = dict(changes, **{"rollout.mode": "async", "rollout.max_staleness": 0})
  loop.train_and_evaluate(_config(tmp_path, **dict(async_changes, num_updates=2)),
                          str(tmp_path / "async"))
  result = loop.train_and_evaluate(_config(tmp_path, **async_changes), str(tmp_path / "async"))
  rows = read_metrics(str(tmp_path / "async"))
  assert [r["update"] for r in rows] == [1, 2, 3]
  assert _comparable(rows) == _comparable(expected)
  assert all(r["async/lag_max"] == 0 and r["async/dropped_episodes"] == 0 for r in rows)
  with open(tmp_path / "sync" / "eval.json") as f:
    assert json.load(f)["success_rate"] == result["success_rate"]


@pytest.mark.slow
def test_async_with_a_curriculum_equals_sync_through_a_resume(tmp_path):
  """The task curriculum with async rollouts: the actors draw each batch's tasks, the learner feeds
  the success back before publishing, and the checkpoint keeps the cursor of the newest batch
  taken, so with max_staleness 0 every update's tasks, metrics and curriculum state equal the
  synchronous run's, across a stop and resume."""
  changes = {"reward.invalid": 0.1, "num_updates": 3, "checkpoint_every": 1,
             "eval.num_tasks": 8, "tensorboard": False, "curriculum.num_buckets": 2,
             # gridworld: tasks of several shortest-path lengths, so both buckets have tasks
             "env.name": "gridworld", "env.max_steps": 6, "rollout.context_length": 256,
             "env.params": {"size": 4, "num_walls": 1, "num_holes": 0, "key_door": False}}
  loop.train_and_evaluate(_config(tmp_path, **changes), str(tmp_path / "sync"))
  expected = read_metrics(str(tmp_path / "sync"))
  assert all(0 < r["curriculum/prob_0"] < 1 for r in expected)
  async_changes = dict(changes, **{"rollout.mode": "async", "rollout.max_staleness": 0})
  loop.train_and_evaluate(_config(tmp_path, **dict(async_changes, num_updates=2)),
                          str(tmp_path / "async"))
  loop.train_and_evaluate(_config(tmp_path, **async_changes), str(tmp_path / "async"))
  assert _comparable(read_metrics(str(tmp_path / "async"))) == _comparable(expected)


@pytest.fixture(scope="module")
def warm(tmp_path_factory, one_hop_learning_changes):
  """The warm start of tests/train/test_learning.py (1-hop chains, sampled success ~0.45)."""
  tmp = tmp_path_factory.mktemp("async_learning")
  config = _config(tmp, **one_hop_learning_changes, **{
      "rollout.mode": "async", "rollout.max_staleness": 2, "rollout.queue_size": 2,
      "loss.tis_threshold": 2.0})
  s = Learner.build(config)
  state, _ = s.warm_start(s.initial_state())
  return s, jax.device_get(state)


def _sampled_success(s, params):
  return s.evaluate(params, "test", 64, temperature=1.0, seed=11)["success_rate"]


@pytest.mark.slow
def test_async_with_stale_batches_learns(warm):
  """max_staleness 2 from the warm start: batches two versions old, corrected by the decoupled
  PPO objective (proximal clip, truncated proximal/behaviour weight); sampled test success rises
  clearly within 36 updates. (The truncated-IS objective without a proximal policy learns
  on-policy but is unstable at lag 2: docs/notes/issue-07.md.)"""
  s, warm_state = warm
  assert s.loss.spec.anchor == "proximal" and s.loss.tis_threshold == 2.0
  state = s.initial_state()
  state = state.replace(params=jax.tree.map(jnp.array, warm_state.params))
  before = _sampled_success(s, state.params)
  assert 0.2 <= before <= 0.65, before
  pipe = async_rollout.AsyncRollouts(s, state.params, version=0, first_batch=0, data_position=0,
                                     last_update=36)
  rows = []
  with pipe:
    for update in range(36):  # 12 sufficed on the EPYCs; the model-167 Xeon gained 0.016 in 12
      time.sleep(0.3)  # a slower learner: the actor runs ahead, so batches arrive stale
      state, metrics = pipe.step(state, update, Timer())
      assert np.isfinite(metrics["loss"])
      rows.append(metrics)
  after = _sampled_success(s, state.params)
  lags = [r["async/lag_max"] for r in rows]
  assert max(lags) == 2 and np.mean([r["async/lag_mean"] for r in rows]) > 1, lags
  assert all(r["async/dropped_episodes"] == 0 for r in rows)  # one actor: admission bounds lag
  # The claim is the sampled test success (64 tasks); the training batches' success (4 x 64
  # episodes, thread-timed, so not reproducible) rose by only 0.078 on the model-167 Xeon.
  assert after >= before + 0.15, (before, after, [r["success_rate"] for r in rows])
