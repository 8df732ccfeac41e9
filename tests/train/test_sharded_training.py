"""Sharded training on 8 emulated CPU devices: a (2, 2, 2) data x fsdp x tensor mesh gives the same
losses as one device for the first updates, and per-device parameter bytes fall with fsdp.
(Subprocesses: the device count is fixed when JAX starts.)"""

import os
import subprocess
import sys

import numpy as np
import pytest

from longhorizon.train.metrics import read_metrics

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SMOKE = ["--config=configs/default.py:smoke", "--config.num_updates=2", "--config.tensorboard=False",
         "--config.eval.num_tasks=8", "--config.checkpoint_every=2"]


def _train(workdir, data_dir, mesh=(1, 1, 1)):
  env = dict(os.environ, JAX_PLATFORMS="cpu", LONGHORIZON_DATA=str(data_dir),
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  env.pop("LONGHORIZON_CRASH_AT", None)
  flags = [f"--config.mesh.data={mesh[0]}", f"--config.mesh.fsdp={mesh[1]}",
           f"--config.mesh.tensor={mesh[2]}"]
  run = subprocess.run([sys.executable, "experiments/train.py", f"--workdir={workdir}", *SMOKE,
                        *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-4000:]
  return read_metrics(str(workdir))


@pytest.mark.slow
def test_mesh_2x2x2_matches_single_device(tmp_path):
  single = _train(tmp_path / "single", tmp_path / "data")
  sharded = _train(tmp_path / "sharded", tmp_path / "data", mesh=(2, 2, 2))
  assert [r["update"] for r in sharded] == [1, 2]
  for a, b in zip(single, sharded):
    np.testing.assert_allclose(b["loss"], a["loss"], atol=1e-4)
    assert b["success_rate"] == a["success_rate"]
  # fsdp x tensor = 4 shards of every large matrix: far fewer bytes per device.
  assert sharded[0]["params/bytes_per_device"] < 0.5 * single[0]["params/bytes_per_device"]
