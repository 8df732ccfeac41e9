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


def provenance() -> dict:
  """`{"commit", "dirty", "python", "packages", "platform", "cpu", "cpus"}`, and `git_error` when
  the commit is unknown.

  `commit` is None outside a git checkout (an installed wheel) or when git fails, and `git_error`
  then says why; `dirty` is True when tracked files differ from that commit (None when unknown):
  a dirty result cannot be reproduced from the commit alone."""
  commit, error = _git("rev-parse", "HEAD")
  status = _git("status", "--porcelain", "--untracked-files=no")[0] if commit else None
  out = {"commit": commit, "dirty": None if status is None else bool(status),
         "python": sys.version.split()[0],
         "packages": {name: _version(name) for name in PACKAGES},
         "platform": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count()}
  if commit is None:
    out["git_error"] = error
  return out
