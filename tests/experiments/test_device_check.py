"""scripts/device_check.sh --dry: the accelerator check runs end to end on the CPU with tiny shapes
(so the script cannot rot between the rare runs on a GPU machine), and its wheel list covers what
the check imports."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.slow
def test_device_check_dry_run(tmp_path):
  env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
  proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--dry"], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for row in ("memory bandwidth", "matmul peak", "decode tiny-a B=1", "decode tiny-b B=4",
              "rl_update bf16"):
    assert row in proc.stdout, proc.stdout
  result = json.loads((tmp_path / "device_check_dry.json").read_text())
  assert result["dry"] and result["bandwidth_bytes_per_s"] > 0 and result["matmul_peak_flops"] > 0
  assert [(r["model"], r["batch"]) for r in result["sampler"]] == [
      ("tiny-a", 1), ("tiny-a", 4), ("tiny-b", 1), ("tiny-b", 4)]
  for r in result["sampler"]:
    assert r["tokens_per_s"] > 0 and r["roofline_tokens_per_s"] > 0
    assert r["fraction_of_roofline"] == pytest.approx(r["tokens_per_s"] / r["roofline_tokens_per_s"])
  train = result["train_step"]
  assert train["mfu"] > 0 and train["model_flops"] > 0 and train["step_s"] > 0


def test_device_requirements_cover_the_imports_of_the_check():
  """Every third-party module the check and its test subset import is either in the GPU image
  (jax, flax, optax, orbax, chex, numpy and their dependencies) or in the wheel list."""
  sys.path.insert(0, str(ROOT / "scripts"))
  try:
    import device_requirements  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  code = ("import sys; sys.path[:0] = ['src', 'experiments/benchmarks']; "
          "import longhorizon.sampling.sampler, longhorizon.train.update, device_check, pytest, "
          "hypothesis; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  loaded = set(proc.stdout.split())
  listed = set(device_requirements.REQUIREMENTS)
  for module in ("safetensors", "ml_collections", "gguf", "tokenizers", "transformers", "pytest"):
    assert module in loaded and module in listed, module
