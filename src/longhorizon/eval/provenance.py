"""What a committed result ran on: the source commit (and whether the tree had uncommitted
changes), the versions of the packages that set its numerics, and the machine.

`provenance()` is written into `eval.json` (training runs) and each session of a study's
`sweep.json`, so a committed number says which code produced it; a rerun on another commit or
another jax is then a different result by construction, not a mystery.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys

__all__ = ["provenance", "cpu_model", "cpu_id", "PACKAGES", "ISA_FLAGS"]

# The packages whose versions can change a run's numbers.
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "ml-collections")


def _git(*args: str, cwd: str | None = None) -> tuple[str | None, str | None]:
  """`(stdout, None)` of `git ARGS` run in `cwd` (default: beside this file), or `(None, why)` when
  it fails (outside a checkout, no git, a timeout): a result without its commit says why."""
  here = cwd or os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=30,
                         check=True)
  except subprocess.CalledProcessError as e:
    return None, f"git {' '.join(args)} exited {e.returncode}: {(e.stderr or '').strip()[:300]}"
  except (OSError, subprocess.SubprocessError) as e:
    return None, f"git {' '.join(args)}: {type(e).__name__}: {e}"
  return out.stdout.strip(), None


def _version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def cpu_model() -> str:
  """The CPU's model name (`/proc/cpuinfo`), else what `platform` knows."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


# Instruction-set extensions that change which kernels XLA:CPU emits, and so a run's float
# rounding: the same code on two CPUs of one model name but different ISAs gives other numbers.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
             "asimd", "sve")


def cpu_id(cpuinfo: str | None = None) -> dict:
  """`{"vendor", "family", "model", "stepping", "isa"}` of the first CPU in `/proc/cpuinfo` (or
  `cpuinfo`'s text), with `isa` the `ISA_FLAGS` it has: the model name alone ("AMD EPYC") does
  not tell a Zen 3 from a Zen 4. `{}` where `/proc/cpuinfo` cannot be read."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpuinfo = f.read()
    except OSError:
      return {}
  fields: dict = {}
  for line in cpuinfo.splitlines():
    if not line.strip():
      if fields:
        break  # the first processor's block
      continue
    key, _, value = line.partition(":")
    fields.setdefault(key.strip(), value.strip())
  flags = set((fields.get("flags") or fields.get("Features") or "").split())
  return {"vendor": fields.get("vendor_id") or fields.get("CPU implementer"),
          "family": fields.get("cpu family") or fields.get("CPU architecture"),
          "model": fields.get("model") or fields.get("CPU part"),
          "stepping": fields.get("stepping") or fields.get("CPU revision"),
          "isa": [f for f in ISA_FLAGS if f in flags]}


def provenance() -> dict:
  """`{"commit", "dirty", "python", "packages", "platform", "cpu", "cpu_id", "cpus"}`, and
  `git_error` when the commit is unknown.

  `commit` is None outside a git checkout (an installed wheel) or when git fails, and `git_error`
  then says why; `dirty` is True when tracked files differ from that commit (None when unknown):
  a dirty result cannot be reproduced from the commit alone."""
  commit, error = _git("rev-parse", "HEAD")
  status = _git("status", "--porcelain", "--untracked-files=no")[0] if commit else None
  out = {"commit": commit, "dirty": None if status is None else bool(status),
         "python": sys.version.split()[0],
         "packages": {name: _version(name) for name in PACKAGES},
         "platform": platform.platform(), "cpu": cpu_model(), "cpu_id": cpu_id(),
         "cpus": os.cpu_count()}
  if commit is None:
    out["git_error"] = error
  return out
