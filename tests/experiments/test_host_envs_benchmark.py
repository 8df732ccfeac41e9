"""The host-environment benchmark at tiny sizes: its seeded latency environment, the result
structure of its latency and overhead measurements, and that the pooled turn beats the serial loop.

Run in a subprocess: the benchmark script defines absl flags (`--out`, ...) that other benchmark
scripts imported by tests in the same process also define."""

import json
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).parents[2]
SCRIPT = ROOT / "experiments" / "benchmarks" / "host_envs.py"

_CHECK = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import host_envs as hb

    # Latencies are a function of (seed, task, episode seed, step) only.
    env = hb.LatencyEnv(median_ms=20.0, sigma=0.5, seed=3, horizon=2)
    assert env.latency_s(1, 7, 0) == hb.call_latency_s(20.0, 0.5, 3, 1, 7, 0) > 0
    assert env.latency_s(1, 7, 0) != env.latency_s(1, 7, 1)
    env.reset({"id": 1}, 7)
    assert not env.step("no").terminated and env.step("no").terminated  # horizon 2
    assert env.reset({"id": 1}, 7).text == "say go" and env.step("go").success
    assert hb.TrivialEnv().step("x").observation == "ok"

    kw = dict(median_ms=20.0, sigma=0.5, seed=0)
    thread = hb.measure_latency("thread", 8, 2, **kw)
    serial = hb.measure_latency("serial", 8, 2, **kw)
    for r in (thread, serial):
      assert r["batch"] == 8 and r["turns"] == 2
      assert len(r["wall_s"]) == len(r["slowest_call_s"]) == len(r["sum_calls_s"]) == 2
      assert r["ratio_mean"] <= r["ratio_max"]
      assert all(w >= 0.95 * m for w, m in zip(r["wall_s"], r["slowest_call_s"]))
    assert thread["slowest_call_s"] == serial["slowest_call_s"]  # the same latencies
    assert sum(thread["wall_s"]) < sum(serial["wall_s"])  # concurrent beats one after another
    assert thread["ratio_mean"] < 3.0 and serial["ratio_mean"] > 2.0

    over = hb.measure_overhead("thread", 4, 2)
    assert over["batch"] == 4 and over["per_step_ms_mean"] > 0 and over["direct_ms"] > 0
    table = hb.format_tables([thread, serial], [over], [])
    assert "| thread | 8 | 2 |" in table and "| serial | 8 | 2 |" in table
    assert "ms per step" in table and "training" not in table
    print("HOST_ENVS_OK")
""")


def test_measurements_at_tiny_sizes():
  result = subprocess.run([sys.executable, "-c", _CHECK, str(SCRIPT.parent)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "HOST_ENVS_OK" in result.stdout


def test_script_writes_json_without_the_training_part(tmp_path):
  out = tmp_path / "host_envs.json"
  result = subprocess.run(
      [sys.executable, str(SCRIPT), "--batch=4", "--turns=2", "--serial_turns=1",
       "--latency_ms=5", "--overhead_batch=8", "--overhead_turns=2",
       "--overhead_backends=thread,serial", "--updates=0", f"--out={out}"],
      capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "host environments through EnvPool" in result.stdout
  assert "| thread | 4 | 2 |" in result.stdout
  payload = json.loads(out.read_text())
  assert payload["settings"]["batch"] == 4 and payload["training"] == []
  assert payload["cpu_count"] >= 1 and payload["cpu_model"]
  assert [r["backend"] for r in payload["latency"]] == ["thread", "serial"]
  assert [r["backend"] for r in payload["overhead"]] == ["thread", "serial"]
  assert payload["latency"][1]["turns"] == 1
