"""experiments/evaluate.py end to end: baselines give the ceiling and the floor; eval.json holds every
metric; a training workdir is evaluated on the run's own tasks and settings (its eval.json comes
back); bad flags are usage errors naming the flag, raised before anything is loaded."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
KEYS = ("success_rate", "success_ci", "pass_at_k", "pass_hat_k", "milestone_success",
        "cost_per_success", "recovery_rate", "env_error_rate", "violation_rate",
        "collateral_damage_rate", "loop_rate", "truncation_rate", "attack_success_rate", "by_bucket")


def _run(tmp_path, script, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", LONGHORIZON_DATA=str(tmp_path / "data"),
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


def _evaluate(tmp_path, *args):
  return _run(tmp_path, "experiments/evaluate.py", *args)


@pytest.mark.slow
def test_oracle_and_random_baselines(tmp_path):
  reports = {}
  for policy in ("oracle", "random"):
    out = tmp_path / policy
    run = _evaluate(tmp_path, f"--checkpoint={policy}", "--env=retail",
                    '--env_params={"injection_rate": 0.5}', "--k=2", "--num_tasks=8",
                    "--faults=timeout:0.2", f"--out={out}")
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out / "eval.json") as f:
      reports[policy] = json.load(f)
    assert all(k in reports[policy] for k in KEYS)
    assert os.path.getsize(out / "eval.png") > 1000
  oracle, random = reports["oracle"], reports["random"]
  assert oracle["success_rate"] == 1.0 and oracle["attack_success_rate"] == 0.0
  assert oracle["recovery_rate"] == 1.0  # timeouts were retried to success
  assert random["success_rate"] < 0.2 and random["violation_rate"] > 0.2
  assert oracle["pass_hat_k"]["2"] <= oracle["pass_at_k"]["1"] <= oracle["pass_at_k"]["2"]


def test_bad_faults_flag_names_the_problem(tmp_path):
  run = _evaluate(tmp_path, "--checkpoint=oracle", "--env=pointer_chain", "--faults=meteor:0.1",
                  f"--out={tmp_path / 'x'}")
  assert run.returncode != 0 and "--faults kind 'meteor' is unknown" in run.stderr


@pytest.mark.parametrize("flag,message", [
    ("--k=0", "--k=0 is not allowed; expected a number >= 1"),
    ("--num_tasks=0", "--num_tasks=0 is not allowed; expected a number >= 1"),
    ("--max_steps=0", "--max_steps=0 is not allowed; expected a number >= 1"),
    ("--temperature=-1", "--temperature=-1.0 is not allowed; expected a number >= 0"),
    ("--env_params={bad", "--env_params='{bad' is not valid JSON"),
    ("--env_params=[1]", "--env_params='[1]' is a JSON list; pass a JSON object"),
    ('--task_sizes={"test": 0}', "--task_sizes: {'test': 0} are not allowed"),
    ("--faults=timeout:2", "--faults rate '2' of 'timeout' is not a probability in [0, 1]"),
    ("--env_error_kinds=meteor", "--env_error_kinds ['meteor'] are unknown"),
    ("--env=no_such_user_module:Env", "--env=no_such_user_module:Env: environment "
     "'no_such_user_module:Env': cannot import module 'no_such_user_module'"),
])
@pytest.mark.slow  # over 10 s on a 2-core AMD EPYC with the test compile settings (BUILD_NOTES)
def test_bad_flags_are_usage_errors_before_anything_loads(tmp_path, flag, message):
  # A model checkpoint that does not exist: loading it would fail with another message.
  run = _evaluate(tmp_path, f"--checkpoint={tmp_path / 'no_model'}", "--env=pointer_chain", flag,
                  f"--out={tmp_path / 'x'}")
  assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
  assert "Traceback" not in run.stderr
  assert not (tmp_path / "data").exists()  # no task suite was built


@pytest.mark.slow
def test_workdir_is_evaluated_on_the_runs_own_tasks_and_settings(tmp_path):
  """A run with non-default suite sizes and a faulty environment: evaluate.py on its workdir builds
  no other task suite and, with the defaults (the run's final-evaluation settings), reproduces
  every number of the run's eval.json."""
  work = tmp_path / "run"
  train = _run(tmp_path, "experiments/train.py", "--config=configs/default.py:smoke",
               f"--workdir={work}", "--config.num_updates=1", "--config.tensorboard=False",
               "--config.tasks.train_size=96", "--config.tasks.test_size=12",
               "--config.eval.num_tasks=12", '--config.env.faults={"timeout": 0.3}')
  assert train.returncode == 0, train.stderr[-3000:]
  suites = sorted(os.listdir(tmp_path / "data" / "longhorizon_tasks"))
  assert len(suites) == 1
  run = _evaluate(tmp_path, f"--checkpoint={work}", f"--out={tmp_path / 'eval'}")
  assert run.returncode == 0, run.stderr[-3000:]
  assert sorted(os.listdir(tmp_path / "data" / "longhorizon_tasks")) == suites
  with open(work / "eval.json") as f, open(tmp_path / "eval" / "eval.json") as g:
    expected, report = json.load(f), json.load(g)
  assert report["faults"] == {"timeout": 0.3} and report["seed"] == 17 and report["k"] == 2
  assert report["num_tasks"] == 12 and report["recovery_rate"] is not None
  shared = sorted(set(expected) & set(report))
  assert {"success_rate", "milestone_success", "tokens", "tool_calls", "steps",
          "recovery_rate", "temperature", "split"} <= set(shared)
  assert {k: report[k] for k in shared} == {k: expected[k] for k in shared}
