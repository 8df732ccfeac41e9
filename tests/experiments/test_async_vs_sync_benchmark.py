"""The async-vs-sync throughput benchmark: its latency model and mode parsing, and a smoke run of the
script end to end (output structure and internal consistency)."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parents[2]
SCRIPT = ROOT / "experiments" / "benchmarks" / "async_vs_sync.py"
sys.path.insert(0, str(SCRIPT.parent))
import latency as async_vs_sync  # noqa: E402  (the script's flag-free part; flags are global)


def test_latency_is_the_slowest_call_and_seeded_by_batch_and_step():
  lat = async_vs_sync.Latency("lognormal", ms=40.0, shape=1.0, seed=3)
  rng = np.random.default_rng([3, 7, 2])
  np.testing.assert_allclose(lat.draw(7, 2, 16), rng.lognormal(np.log(40.0), 1.0, 16).max() / 1000)
  assert lat.draw(7, 2, 16) == lat.draw(7, 2, 16) != lat.draw(7, 3, 16)
  assert lat.draw(7, 2, 0) == 0.0  # no row stepped: no call
  pareto = async_vs_sync.Latency("pareto", ms=10.0, shape=1.5)
  draws = [pareto.draw(i, 0, 4) for i in range(200)]
  assert min(draws) >= 0.010  # Pareto: never below the minimum
  assert max(draws) > 5 * np.median(draws)  # heavy tail
  assert async_vs_sync.Latency("none").draw(0, 0, 8) == 0.0


def test_parse_mode():
  assert async_vs_sync.parse_mode("sync") == ("sync", 1, 0)
  assert async_vs_sync.parse_mode("async:2:3") == ("async", 2, 3)
  assert async_vs_sync.parse_mode("partial:2:1") == ("partial", 2, 1)
  assert async_vs_sync.parse_mode("partial-reprefill:1:0") == ("partial-reprefill", 1, 0)
  for bad in ("async", "async:0:1", "async:1", "sync:1:1", "async:a:1", "partial:1"):
    with pytest.raises(ValueError, match="--modes"):
      async_vs_sync.parse_mode(bad)


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_smoke_run_writes_consistent_json(tmp_path):
  out = tmp_path / "async_vs_sync.json"
  result = subprocess.run(
      [sys.executable, str(SCRIPT), "--updates=2", "--warmup=1", "--modes=sync,async:2:1,partial:2:1",
       "--latency_ms=5", "--warm_start", "--config.sft.steps=1", "--config.sft.episodes=4",
       f"--out={out}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "episodes/s" in result.stdout and "async:2:1" in result.stdout
  payload = json.loads(out.read_text())
  assert payload["settings"]["updates"] == 2
  assert payload["settings"]["warm_start"]["sft_steps"] == 1  # every mode from one SFT warm start
  assert payload["settings"]["latency"] == {"kind": "lognormal", "ms": 5.0, "shape": 1.0, "seed": 0}
  sync, run, partial = payload["rows"]
  assert partial["mode"] == "partial:2:1" and partial["admitted_length_mean"] > 0
  # The run's episode-weighted means: received = kept and dropped, in proportion.
  kept_share = 1 - run["dropped_episode_rate"]
  if run["dropped_episode_rate"]:
    np.testing.assert_allclose(
        run["sampled_length_mean"], kept_share * run["admitted_length_mean"]
        + run["dropped_episode_rate"] * run["dropped_length_mean"], rtol=1e-6)
  else:
    assert np.isnan(run["dropped_length_mean"])
  assert (sync["mode"], run["mode"], run["actors"], run["max_staleness"]) == (
      "sync", "async:2:1", 2, 1)
  assert sync["speedup"] == 1.0 and sync["lag_mean"] == 0.0
  per_update = payload["settings"]["episodes_per_update"]
  for r in (sync, run):
    assert r["wall_s"] > 0 and np.isfinite(r["final_loss"])
    np.testing.assert_allclose(r["updates_per_s"], 2 / r["wall_s"])
    np.testing.assert_allclose(r["episodes_per_s"], r["updates_per_s"] * per_update)
    assert 0 <= r["learner_idle_frac"] <= 1 and 0 <= r["actor_idle_frac"] <= 1
    assert 0 <= r["dropped_episode_rate"] <= 1
  np.testing.assert_allclose(run["speedup"], run["updates_per_s"] / sync["updates_per_s"])
  assert 0 <= run["lag_mean"] <= run["lag_max"]
