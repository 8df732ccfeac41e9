"""experiments/benchmarks/update_variants.py --smoke: the four comparisons run end to end, the
trimmed batch is cut to its bucket and keeps the padded batch's loss, and the shared-prefix update
keeps the per-row one's (the script raises if not)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_update_variants_smoke(tmp_path):
  out = tmp_path / "variants.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "benchmarks" / "update_variants.py"), "--smoke",
       f"--out={out}"], env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  buckets = result["results"]["buckets"]
  assert (buckets["used"], buckets["bucket"], buckets["length"]) == (32, 32, 64)
  assert buckets["loss"]["base"] == pytest.approx(buckets["loss"]["variant"], rel=1e-4, abs=1e-6)
  prefix = result["results"]["prefix"]
  assert (prefix["shared"], prefix["prefix"]) == (34, 32)  # 0.53 of 64, down to a multiple of 8
  assert prefix["loss"]["base"] == pytest.approx(prefix["loss"]["variant"], rel=1e-4, abs=1e-6)
  assert [r["name"].split()[0] for r in result["rows"]] == ["length", "shared", "LoRA", "bf16"]
  for r in result["rows"]:
    assert r["base"] > 0 and r["variant"] > 0 and r["speedup"] == pytest.approx(r["base"] / r["variant"])
  peaks = result["results"]["bf16"]["peak_flops_per_s"]
  assert peaks["float32"] > 0 and peaks["bfloat16"] > 0
