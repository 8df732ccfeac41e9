"""A new user's environment in its own folder (not in src/, not registered, not imported by the
config): `experiments/train.py --config.env.name=mymod:Keypad` trains it, `experiments/evaluate.py`
evaluates the run's workdir on the run's own (small) task suite and the oracle baseline by
`--env=mymod:Keypad`. The keypad has 100 distinct codes, fewer than the default suite sizes."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
USER_ENV = os.path.join(os.path.dirname(__file__), "..", "data", "user_env_keypad.py")


def _run(tmp_path, script, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", LONGHORIZON_DATA=str(tmp_path / "data"),
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "user"),
                                                      os.environ.get("PYTHONPATH")])))
  return subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


def _report(path):
  with open(path) as f:
    return json.load(f)


@pytest.mark.slow
def test_user_environment_trains_and_evaluates_by_import_path(tmp_path):
  (tmp_path / "user").mkdir()
  shutil.copy(USER_ENV, tmp_path / "user" / "mymod.py")
  work = tmp_path / "run"
  train = _run(tmp_path, "experiments/train.py", "--config=configs/default.py:smoke",
               f"--workdir={work}", "--config.env.name=mymod:Keypad",
               '--config.env.params={"length": 2}', "--config.num_updates=1",
               "--config.tensorboard=False", "--config.tasks.train_size=48",
               "--config.tasks.test_size=8", "--config.tasks.ood_size=8")
  assert train.returncode == 0, train.stderr[-3000:]
  (suite,) = os.listdir(tmp_path / "data" / "longhorizon_tasks")
  assert suite.startswith("keypad_s0_")

  # The workdir, with no evaluation flags: the run's tasks and settings, so its eval.json's numbers.
  run = _run(tmp_path, "experiments/evaluate.py", f"--checkpoint={work}", f"--out={tmp_path / 'a'}")
  assert run.returncode == 0, run.stderr[-3000:]
  expected, report = _report(work / "eval.json"), _report(tmp_path / "a" / "eval.json")
  assert report["env"] == "mymod:Keypad" and report["num_tasks"] == 8
  shared = sorted(set(expected) & set(report))
  assert {k: report[k] for k in shared} == {k: expected[k] for k in shared}

  # Explicit flags override the run's settings.
  run = _run(tmp_path, "experiments/evaluate.py", f"--checkpoint={work}", f"--out={tmp_path / 'b'}",
             "--k=1", "--num_tasks=4", "--faults=timeout:0.5", "--temperature=0")
  assert run.returncode == 0, run.stderr[-3000:]
  report = _report(tmp_path / "b" / "eval.json")
  assert (report["k"], report["num_tasks"], report["num_episodes"]) == (1, 4, 4)
  assert report["faults"] == {"timeout": 0.5} and report["temperature"] == 0.0
  assert report["recovery_rate"] is not None  # the faults were injected

  # The oracle baseline on the same suite (same sizes and seed): the ceiling.
  run = _run(tmp_path, "experiments/evaluate.py", "--checkpoint=oracle", "--env=mymod:Keypad",
             '--env_params={"length": 2}', '--task_sizes={"train": 48, "test": 8, "ood": 8}',
             "--k=1", f"--out={tmp_path / 'c'}")
  assert run.returncode == 0, run.stderr[-3000:]
  assert _report(tmp_path / "c" / "eval.json")["success_rate"] == 1.0
  assert os.listdir(tmp_path / "data" / "longhorizon_tasks") == [suite]  # no other suite built
