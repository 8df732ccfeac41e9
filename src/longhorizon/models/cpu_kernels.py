"""CPU kernels reached through `jax.ffi`: the decode-step attention over each row's filled cache prefix.

`decode_attention(q, k, v, n)` is what `llama._cached_attention` runs for a one-token step on CPU
with float32 caches. The kernel (`decode_attention.cc`, next to this file) is compiled with the system
C++ compiler the first time it is needed and cached under `$LONGHORIZON_KERNEL_CACHE` (default
`~/.cache/longhorizon/kernels`), keyed by the source, the jaxlib version and the CPU. Where it cannot
be built (no compiler, no FFI headers) or is switched off (`LONGHORIZON_CPU_KERNELS=0`, or
`use_cpu_kernels(False)` around tracing), `available()` is False and the model keeps its XLA path;
results agree to float32 rounding (tested).

Why: XLA:CPU reads the whole KV cache every decode step, and no XLA formulation that reads only the
filled prefix was faster (measurements in docs/notes/issue-03.md); at batch 64 that read was the gap
between the sampler and its matmul roofline.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib

__all__ = ["available", "decode_attention", "use_cpu_kernels", "build_error", "MAX_GROUP"]

MAX_GROUP = 8  # query heads per kv head the kernel is compiled for (GQA groups of 1 to 8)

_SOURCE = pathlib.Path(__file__).with_name("decode_attention.cc")
_TARGET = "longhorizon_decode_attention"
# Not -ffast-math: linking with it sets flush-to-zero for the whole process (crtfastmath.o), which
# changed float results elsewhere (a hypothesis float strategy failed). Reassociation is enough to
# vectorise the reductions.
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")

_lock = threading.Lock()
_state = {"loaded": False, "error": None}
_enabled = threading.local()


def _cpu_id() -> str:
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
    lines = [l for l in text.splitlines() if l.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))
  except OSError:
    return platform.processor() or platform.machine()


def _library_path(compiler: str) -> pathlib.Path:
  key = hashlib.sha256()
  for part in (_SOURCE.read_bytes(), jaxlib.__version__.encode(), _cpu_id().encode(),
               compiler.encode(), " ".join(_FLAGS).encode()):
    key.update(part)
    key.update(b"\0")
  root = pathlib.Path(os.environ.get("LONGHORIZON_KERNEL_CACHE",
                                     pathlib.Path.home() / ".cache" / "longhorizon" / "kernels"))
  return root / key.hexdigest()[:16] / "liblh_decode_attention.so"


def _build(path: pathlib.Path, compiler: str) -> None:
  """Compiles the kernel into `path` (atomically: concurrent builders each write a temporary file)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
  os.close(fd)
  cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
  result = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if result.returncode != 0:
    os.unlink(tmp)
    raise RuntimeError(f"compiling {_SOURCE.name} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
  os.replace(tmp, path)


def _load() -> bool:
  """Builds (once per machine) and registers the kernel; False, with `build_error()` set, if not."""
  with _lock:
    if _state["loaded"] or _state["error"] is not None:
      return _state["loaded"]
    try:
      compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
      if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
      path = _library_path(compiler)
      if not path.exists():
        _build(path, compiler)
      library = ctypes.cdll.LoadLibrary(str(path))
      jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.LhDecodeAttention),
                                  platform="cpu")
      _state["loaded"] = True
    except Exception as e:  # pylint: disable=broad-except
      _state["error"] = f"{type(e).__name__}: {e}"
      logging.warning("longhorizon CPU decode-attention kernel unavailable, using XLA: %s",
                      _state["error"])
    return _state["loaded"]


def build_error() -> str | None:
  """Why the kernel is unavailable (None if it loaded or was not tried)."""
  return _state["error"]


@contextlib.contextmanager
def use_cpu_kernels(enabled: bool):
  """Within this context (at trace time), `available()` is `enabled and <kernel loads>`."""
  previous = getattr(_enabled, "value", None)
  _enabled.value = enabled
  try:
    yield
  finally:
    _enabled.value = previous


def available() -> bool:
  """True if `decode_attention` may be used by code traced now (see module docstring)."""
  enabled = getattr(_enabled, "value", None)
  if enabled is None:
    enabled = os.environ.get("LONGHORIZON_CPU_KERNELS", "1") != "0"
  return bool(enabled) and _load()


def decode_attention(q, k, v, n):
  """Attention of one new query per row over the first `n[b]` cache slots (CPU kernel).

  Args:
    q: `[B, KV, G, hd]` float32 queries, already scaled by `1/sqrt(hd)`.
    k: `[B, KV, S, hd]` float32 keys.
    v: `[B, KV, S, hd]` float32 values.
    n: `[B]` int32 visible slots per row, in `[0, S]` (zeros out for `n == 0`).

  Returns:
    `[B, KV, G, hd]` float32.
  """
  if not _load():
    raise RuntimeError(f"the CPU decode-attention kernel is unavailable: {build_error()}")
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or n.ndim != 1:
    raise ValueError(f"decode_attention expects q[B,KV,G,hd], k and v [B,KV,S,hd], n[B]; got "
                     f"q{q.shape}, k{k.shape}, v{v.shape}, n{n.shape}.")
  b, kv, g, hd = q.shape
  if k.shape != v.shape or k.shape[:2] != (b, kv) or k.shape[3] != hd or n.shape != (b,):
    raise ValueError(f"decode_attention: inconsistent shapes q{q.shape}, k{k.shape}, v{v.shape}, "
                     f"n{n.shape} (k and v must be [B={b}, KV={kv}, S, hd={hd}], n [B]).")
  if not 1 <= g <= MAX_GROUP:
    raise ValueError(f"decode_attention supports 1 to {MAX_GROUP} query heads per kv head; got {g} "
                     f"query heads per kv head.")
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  return jax.ffi.ffi_call(_TARGET, out)(q.astype(jnp.float32), k.astype(jnp.float32),
                                        v.astype(jnp.float32), n.astype(jnp.int32))
