"""A training process killed mid-update and mid-checkpoint resumes with no lost or repeated update
and the same metrics as an uninterrupted run (real subprocesses of experiments/train.py)."""

import json
import os
import subprocess
import sys

import pytest

from longhorizon.train.metrics import read_metrics

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SMOKE = ["--config=configs/default.py:smoke", "--config.num_updates=4", "--config.checkpoint_every=1",
         "--config.eval.num_tasks=8", "--config.tensorboard=False"]


def _train(workdir, data_dir, cache, crash_at=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", LONGHORIZON_DATA=str(data_dir))
  env.pop("LONGHORIZON_CRASH_AT", None)
  if crash_at:
    env["LONGHORIZON_CRASH_AT"] = crash_at
  return subprocess.run([sys.executable, "experiments/train.py", f"--workdir={workdir}", *SMOKE],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _comparable(rows):
  timing = lambda k: (k.startswith(("time", "memory", "rollout/")) or k.endswith("_s")
                      or "per_s" in k)
  return [{k: v for k, v in r.items() if not timing(k)} for r in rows]


@pytest.mark.slow
def test_killed_mid_update_and_mid_checkpoint_resumes_exactly(tmp_path):
  data, cache = tmp_path / "data", tmp_path / "cache"
  straight = _train(tmp_path / "straight", data, cache)
  assert straight.returncode == 0, straight.stderr[-3000:]

  work = tmp_path / "killed"
  first = _train(work, data, cache, crash_at="update:1")  # dies after update 1's rollout
  assert first.returncode == 137, first.stderr[-3000:]
  assert [r["update"] for r in read_metrics(str(work))] == [1]
  second = _train(work, data, cache, crash_at="checkpoint:2")  # dies while saving update 3
  assert second.returncode == 137, second.stderr[-3000:]
  third = _train(work, data, cache)
  assert third.returncode == 0, third.stderr[-3000:]

  rows = read_metrics(str(work))
  assert [r["update"] for r in rows] == [1, 2, 3, 4]  # none lost, none repeated
  assert _comparable(rows) == _comparable(read_metrics(str(tmp_path / "straight")))
  with open(work / "eval.json") as f, open(tmp_path / "straight" / "eval.json") as g:
    assert json.load(f)["success_rate"] == json.load(g)["success_rate"]
