"""Writing benchmark results: one JSON file with the rows and the environment they were measured in."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax


def environment() -> dict[str, Any]:
  """The jax version and devices a measurement ran on."""
  devices = jax.devices()
  return {"jax_version": jax.__version__, "backend": jax.default_backend(),
          "device_count": len(devices), "device_kind": devices[0].device_kind}


def write_json(path: str, payload: dict[str, Any]) -> pathlib.Path:
  """Writes `environment()` plus `payload` to `path` (parent folders created)."""
  out = pathlib.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({**environment(), **payload}, indent=2, default=str) + "\n")
  return out
