"""experiments/evaluate.py end to end: baselines give the ceiling and the floor; eval.json holds every
metric; bad --faults names the problem."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
KEYS = ("success_rate", "success_ci", "pass_at_k", "pass_hat_k", "milestone_success",
        "cost_per_success", "recovery_rate", "env_error_rate", "violation_rate",
        "collateral_damage_rate", "loop_rate", "truncation_rate", "attack_success_rate", "by_bucket")


def _evaluate(tmp_path, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", LONGHORIZON_DATA=str(tmp_path / "data"))
  return subprocess.run([sys.executable, "experiments/evaluate.py", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


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
