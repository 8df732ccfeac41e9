"""`eval.provenance`: the commit, the tree's state and the package versions a result ran on."""

import subprocess

import jax
import numpy as np

from longhorizon.eval import provenance as provenance_lib


def _git(*args):
  return subprocess.run(["git", *args], cwd=provenance_lib.__file__.rsplit("/", 1)[0],
                        capture_output=True, text=True, check=True).stdout.strip()


def test_commit_dirty_and_versions_are_this_checkouts():
  p = provenance_lib.provenance()
  assert p["commit"] == _git("rev-parse", "HEAD") and len(p["commit"]) == 40
  assert p["dirty"] == bool(_git("status", "--porcelain", "--untracked-files=no"))
  assert p["packages"]["jax"] == jax.__version__ and p["packages"]["numpy"] == np.__version__
  assert set(p["packages"]) == set(provenance_lib.PACKAGES) and p["cpus"] >= 1 and p["cpu"]
  assert "git_error" not in p


def test_outside_a_checkout_the_commit_is_unknown_not_invented(monkeypatch):
  monkeypatch.setattr(provenance_lib, "_git", lambda *args: (None, "no checkout here"))
  p = provenance_lib.provenance()
  assert p["commit"] is None and p["dirty"] is None and p["packages"]["jax"] == jax.__version__
  assert p["git_error"] == "no checkout here"  # a missing commit says why


def test_a_failing_git_call_is_reported_with_its_message(tmp_path):
  out, error = provenance_lib._git("rev-parse", "HEAD", cwd=str(tmp_path))  # no checkout there
  assert out is None and "rev-parse HEAD exited 128" in error and "not a git repository" in error


_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512ifma

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 99
flags\t\t: avx2
"""


def test_cpu_id_tells_cpus_of_one_model_name_apart():
  # Two machines named "AMD EPYC" gave other SFT parameters from the same code (docs/
  # credit_study.md); family, model and ISA tell them apart. The first processor's block is read.
  assert provenance_lib.cpu_id(_CPUINFO) == {
      "vendor": "AuthenticAMD", "family": "25", "model": "17", "stepping": "1",
      "isa": ["avx2", "fma", "avx512f", "avx512_bf16"]}
  assert provenance_lib.cpu_id(_CPUINFO.replace(" avx512f avx512_bf16", ""))["isa"] == [
      "avx2", "fma"]
  here = provenance_lib.provenance()["cpu_id"]
  assert here == provenance_lib.cpu_id() and (here == {} or here["family"] is not None)
