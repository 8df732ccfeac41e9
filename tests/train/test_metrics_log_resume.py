"""experiments/train.py resuming over a damaged metrics log and over damaged checkpoints (real
subprocesses): the lost updates are named once, a corrupt line is quarantined, and a failed orbax
restore ends the output with its error."""

import json
import os
import subprocess
import sys

import pytest

from longhorizon.train.metrics import read_metrics

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SMOKE = ["--config=configs/default.py:smoke", "--config.num_updates=2", "--config.checkpoint_every=1",
         "--config.eval.num_tasks=8", "--config.tensorboard=False"]


def _train(workdir, data_dir):
  env = dict(os.environ, JAX_PLATFORMS="cpu", LONGHORIZON_DATA=str(data_dir))
  env.pop("LONGHORIZON_CRASH_AT", None)
  return subprocess.run([sys.executable, "experiments/train.py", f"--workdir={workdir}", *SMOKE],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_resume_over_a_damaged_log_and_damaged_checkpoints(tmp_path):
  work, data = tmp_path / "run", tmp_path / "data"
  first = _train(work, data)
  assert first.returncode == 0, first.stderr[-3000:]
  log = work / "metrics.jsonl"
  line_1, line_2 = log.read_text().splitlines()
  # Update 2's line is lost (its checkpoint survives), update 1's is damaged.
  log.write_text(line_1[:40] + "\x00\x00\n")

  second = _train(work, data)
  assert second.returncode == 0, second.stderr[-3000:]
  err = second.stderr
  assert err.count("is behind the checkpoint") == 1, err[-3000:]
  assert "no record of update(s) 1-2 " in err and "cannot be recomputed" in err
  assert err.count("line 1 is not a JSON object") == 1
  assert read_metrics(work) == []
  [quarantined] = (work / "metrics.jsonl.corrupt").read_text().splitlines()
  assert json.loads(quarantined) == {"line": 1, "text": line_1[:40] + "\x00\x00"}

  for step in (0, 1, 2):
    (work / "checkpoints" / str(step) / "state" / "manifest.ocdbt").write_bytes(b"damaged")
  third = _train(work, data)
  assert third.returncode == 2
  assert "Event loop is closed" not in third.stderr, third.stderr[-3000:]
  lines = third.stderr.strip().splitlines()
  [error] = [i for i, line in enumerate(lines) if "none of the checkpoints in" in line]
  assert not any("Traceback" in line or "Warning" in line for line in lines[error:]), lines[error:]
