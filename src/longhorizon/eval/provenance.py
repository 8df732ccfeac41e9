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

__all__ = ["provenance", "cpu_model", "PACKAGES"]

# The packages whose versions can change a run's numbers.
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "ml-collections")


def _git(*args: str) -> str | None:
  """`git ARGS` run beside this file; None outside a checkout or without git. A call that times
  out (a loaded machine) is tried once more with a longer limit before giving up."""
  here = os.path.dirname(os.path.abspath(__file__))
  for timeout in (15, 60):
    try:
      out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True,
                           timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
      continue
    except (OSError, subprocess.SubprocessError):
      return None
    return out.stdout.strip()
  return None


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


def provenance() -> dict:
  """`{"commit", "dirty", "python", "packages", "platform", "cpu", "cpus"}`.

  `commit` is None outside a git checkout (an installed wheel); `dirty` is True when tracked files
  differ from that commit (None when unknown): a dirty result cannot be reproduced from the
  commit alone."""
  commit = _git("rev-parse", "HEAD")
  status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
  return {"commit": commit, "dirty": None if status is None else bool(status),
          "python": sys.version.split()[0],
          "packages": {name: _version(name) for name in PACKAGES},
          "platform": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count()}
