"""`config.eval.greedy` (sampled-only evaluations), `Learner.warm_start(on_step=...)` and the
script built on it, experiments/sft_calibration.py."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from longhorizon.train import loop
from longhorizon.train.learner import Learner

ROOT = pathlib.Path(__file__).parents[2]


def _record_temperatures(monkeypatch):
  """Records `(learner, temperature)` of every `Learner.evaluate` call (the real method runs)."""
  seen, evaluate = [], Learner.evaluate

  def recording(self, *args, **kwargs):
    seen.append((self, kwargs["temperature"]))
    return evaluate(self, *args, **kwargs)

  monkeypatch.setattr(Learner, "evaluate", recording)
  return seen


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_eval_greedy_off_runs_sampled_only(tmp_path, smoke_learner, monkeypatch):
  changes = {"eval.num_tasks": 4, "eval.k": 1}
  on = smoke_learner(tmp_path, changes)
  off = smoke_learner(tmp_path, {**changes, "eval.greedy": False})
  params = on.initial_state().params
  calls = _record_temperatures(monkeypatch)
  with_greedy = loop._evaluate_both(on, params, 5)
  without = loop._evaluate_both(off, params, 5)
  temperatures = lambda s: [t for learner, t in calls if learner is s]
  assert sorted(temperatures(on)) == [0.0, on.rollout.temperature]
  assert temperatures(off) == [off.rollout.temperature]  # no greedy pass
  assert with_greedy["greedy_success_rate"] is not None and without["greedy_success_rate"] is None
  assert without["success_rate"] == with_greedy["success_rate"]  # the same sampled evaluation
  assert loop._evaluate_both(off, params, 5, full=True)["greedy_success_rate"] is None
  assert temperatures(off) == [off.rollout.temperature]


def test_warm_start_reports_every_step(tmp_path, smoke_learner):
  s = smoke_learner(tmp_path, {"sft.steps": 3})
  seen = []

  def on_step(step, params, metrics):
    seen.append((step, jax.tree.map(np.asarray, params), float(metrics["sft_nll"])))

  state, metrics = s.warm_start(s.initial_state(), on_step=on_step)
  assert [step for step, _, _ in seen] == [1, 2, 3]
  last = jax.tree.leaves(seen[-1][1])
  for got, want in zip(last, jax.tree.leaves(jax.device_get(state.params))):
    np.testing.assert_array_equal(got, want)  # the last call saw the warm start's parameters
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(seen[0][1]), last))
  assert seen[-1][2] == pytest.approx(metrics["sft_nll"])


@pytest.mark.slow
def test_sft_calibration_script(tmp_path):
  out = tmp_path / "calibration.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "sft_calibration.py"),
       f"--config={ROOT / 'configs' / 'default.py'}:smoke",
       f"--config.tasks.data_dir={tmp_path / 'tasks'}", "--eval_at=1,2", "--eval_tasks=4",
       f"--out={out}"], env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [r["sft_step"] for r in rows] == [1, 2]
  assert all(0.0 <= r["success_rate"] <= 1.0 and r["sft_nll"] > 0 for r in rows)
  assert rows[0]["elapsed_seconds"] < rows[1]["elapsed_seconds"]
  assert "sft step" in proc.stdout
