"""experiments/benchmarks/branch_rollouts.py --smoke: the three variants run and are reported with
consistent ratios (the bar itself is measured on the SmolLM2-shaped model, not in a test)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


def test_branch_rollouts_benchmark_smoke(tmp_path):
  out = tmp_path / "branch.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "benchmarks" / "branch_rollouts.py"), "--smoke",
       f"--out={out}"], env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  seconds = result["seconds"]
  assert set(seconds) == {"fork", "continuation_only", "reprefill"}
  assert all(len(v) == 3 and min(v) > 0 for v in result["all_seconds"].values())
  assert result["fork_over_continuation"] == pytest.approx(seconds["fork"]
                                                           / seconds["continuation_only"])
  assert result["reprefill_over_fork"] == pytest.approx(seconds["reprefill"] / seconds["fork"])
  assert "fork (ours)" in proc.stdout
