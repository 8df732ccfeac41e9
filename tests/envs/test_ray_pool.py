"""EnvPool backend "ray" (envs/ray_pool.py): environment workers as Ray actors on a local Ray
instance (started once for the module, shut down at its end). The ray backend gives the episodes
of the thread backend for the same seeds, runs a turn's calls concurrently across actors, and
replaces an actor that crashed or timed out, the episodes going on."""

import os
import sys
import time

import jax
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray backend is optional: install the [ray] extra: "
                          "pip install -e .[ray]")

from longhorizon import envs, rollout  # noqa: E402
from longhorizon.envs.host import (HostEnvironment, Observation, StepResult,  # noqa: E402
                                   invalid_action)
from longhorizon.envs.pool import EnvPool, close_pools, configure_pool, factory_of  # noqa: E402
from longhorizon.envs.types import ErrorCode  # noqa: E402

pytestmark = pytest.mark.slow  # starts Ray and its actors (~20-30 s)

# The actors cannot import this test module: its classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Walk(HostEnvironment):
  """A line walk: start at `seed % 4`, reach the task's goal with `up` / `down`, then `done`.
  `fail_dir` (a folder) makes step `fail_at` of each (task, seed) fail once, detected by a marker
  file there: `fail="exit"` kills the worker process, `fail="sleep"` hangs for `sleep_s`."""

  name, milestone_names = "walk", ("moved", "arrived")

  def __init__(self, fail_dir: str = "", fail: str = "exit", fail_at: int = 2,
               sleep_s: float = 0.0, reward=None):
    super().__init__(reward=reward)
    self.fail_dir, self.fail, self.fail_at, self.sleep_s = fail_dir, fail, fail_at, sleep_s

  def tasks(self, split, num, seed):
    return [{"id": i, "goal": (seed + 3 * i) % 7} for i in range(num)]

  def vocabulary(self):
    return ["at", "goal", "up", "down", "done", "error", ":", "pid"] + [str(i) for i in range(12)]

  def reset(self, task, seed):
    self._task, self._seed, self._pos, self._steps = task, seed, seed % 4, 0
    return Observation(f"at {self._pos} goal {task['goal']}")

  def step(self, action):
    self._steps += 1
    self._maybe_fail()
    if self.sleep_s:
      time.sleep(self.sleep_s)
    word = action.strip()
    if word not in ("up", "down", "done"):
      return invalid_action(ErrorCode.UNKNOWN_TOOL)
    if word == "done":
      ok = self._pos == self._task["goal"]
      return StepResult("done", terminated=True, success=ok, info={"pid": os.getpid()})
    self._pos += 1 if word == "up" else -1
    hits = ("moved",) + (("arrived",) if self._pos == self._task["goal"] else ())
    return StepResult(f"at {self._pos} goal {self._task['goal']}", milestones=hits,
                      info={"pid": os.getpid()})

  def _maybe_fail(self):
    if not self.fail_dir or self._steps != self.fail_at:
      return
    marker = os.path.join(self.fail_dir, f"{self.fail}-{self._task['id']}-{self._seed}")
    if os.path.exists(marker):
      return
    open(marker, "w").close()
    if self.fail == "exit":
      os._exit(1)
    time.sleep(60)

  def oracle(self):
    goal = self._task["goal"]
    return "done" if self._pos == goal else ("up" if self._pos < goal else "down")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
           object_store_memory=128 * 2**20)
  yield
  ray.shutdown()


def _collect(env, *, n: int = 3, seed: int = 0, max_steps: int = 12, context_length: int = 256,
             turn_tokens: int = 4, **pool):
  """The oracle's episodes of `n` tasks x 2 through `env`'s pool with `pool` options."""
  configure_pool(env, **pool)
  codec = env.codec(None, "compact")
  config = rollout.RolloutConfig(group_size=2, context_length=context_length,
                                 max_steps=max_steps, turn_tokens=turn_tokens)
  try:
    batch, stats = rollout.collect(None, None, env, codec, env.tasks("test", n, seed),
                                   jax.random.split(jax.random.key(seed), n), config,
                                   sampling_seed=0, scripted=rollout.oracle_turns(env, codec))
  finally:
    close_pools(env)
  return batch, stats


def _assert_same_episodes(a, b):
  for field in ("tokens", "loss_mask", "rewards", "success", "termination", "num_steps", "score"):
    np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)),
                                  err_msg=field)


def test_ray_backend_gives_the_thread_backend_episodes():
  ray_batch, ray_stats = _collect(Walk(), backend="ray", workers=2)
  thread_batch, _ = _collect(Walk(), backend="thread")
  _assert_same_episodes(ray_batch, thread_batch)
  assert np.asarray(ray_batch.success).all()
  assert ray_stats.extra["pool/env_errors"] == 0 and ray_stats.extra["pool/crashes"] == 0


def test_ray_backend_on_back_office_matches_threads():
  a, _ = _collect(envs.make("back_office", style="compact"), n=2, max_steps=16, context_length=4096,
                  turn_tokens=64, backend="ray", workers=2)
  b, _ = _collect(envs.make("back_office", style="compact"), n=2, max_steps=16, context_length=4096,
                  turn_tokens=64, backend="thread")
  _assert_same_episodes(a, b)
  assert np.asarray(a.success).any()


def test_rows_map_to_actors_and_a_turn_runs_concurrently():
  env = Walk(sleep_s=0.5)
  with EnvPool(factory_of(env), backend="ray", workers=2, timeout_s=20) as pool:
    tasks = env.tasks("test", 4, 0)
    pool.reset(tasks, [0, 1, 2, 3])
    pids = [ray.get(pool.backend.actor_of(r).pid.remote()) for r in range(4)]
    assert pids[0] == pids[2] and pids[1] == pids[3] and pids[0] != pids[1]
    assert pids[0] != os.getpid()
    start = time.perf_counter()
    out = pool.step({0: "up", 1: "up"})  # one row per actor: the two sleeps overlap
    elapsed = time.perf_counter() - start
    assert [out[r].info["pid"] for r in (0, 1)] == pids[:2]
    assert elapsed < 0.9, elapsed


def test_a_crashed_actor_is_replaced_and_the_episodes_go_on(tmp_path):
  crashy = Walk(fail_dir=str(tmp_path), fail="exit", fail_at=2)
  batch, stats = _collect(crashy, backend="ray", workers=2)
  reference, _ = _collect(Walk(), backend="thread")
  assert sorted(os.listdir(tmp_path))  # the actors did exit
  assert stats.extra["pool/crashes"] >= 1 and stats.extra["pool/env_errors"] == 0
  _assert_same_episodes(batch, reference)


def test_a_timed_out_call_kills_the_actor_and_the_row_is_rebuilt(tmp_path):
  slow = Walk(fail_dir=str(tmp_path), fail="sleep", fail_at=2)
  batch, stats = _collect(slow, n=1, backend="ray", workers=2, timeout_s=2.0)
  reference, _ = _collect(Walk(), n=1, backend="thread")
  assert stats.extra["pool/timeouts"] >= 1 and stats.extra["pool/env_errors"] == 0
  _assert_same_episodes(batch, reference)


def test_missing_ray_names_the_extra(monkeypatch):
  import builtins
  from longhorizon.envs import ray_pool

  real_import = builtins.__import__

  def no_ray(name, *args, **kwargs):
    if name == "ray" or name.startswith("ray."):
      raise ImportError("No module named 'ray'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_ray)
  with pytest.raises(ImportError, match=r"pip install -e \.\[ray\]"):
    ray_pool.import_ray()
