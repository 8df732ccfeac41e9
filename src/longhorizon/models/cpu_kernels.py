"""CPU kernels reached through `jax.ffi`: the decode-step attention over each row's filled cache prefix.

`decode_attention(q, k, v, n)` is what `llama._cached_attention` runs for a one-token step on CPU
with float32 caches, as `ModelConfig.decode_kernel` chooses (`use_kernel`): "auto" where the kernel
applies and builds, "cpu" always (an error if it cannot be built), "xla" never. The kernel
(`decode_attention.cc`, next to this file) is compiled with the system C++ compiler (`$CXX`, else
`c++` / `g++`) the first time it is needed and cached under `$LONGHORIZON_KERNEL_CACHE` (default
`~/.cache/longhorizon/kernels`), keyed by the source, the jaxlib version and the CPU. Where it cannot
be built (no compiler, no FFI headers) `available()` is False and "auto" keeps the XLA path; results
agree to float32 rounding (tested).

Why: XLA:CPU reads the whole KV cache every decode step, and no XLA formulation that reads only the
filled prefix was faster (measurements in docs/notes/issue-03.md); at batch 64 that read was the gap
between the sampler and its matmul roofline.
"""

from __future__ import annotations

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

__all__ = ["available", "applies", "decode_attention", "use_kernel", "build_error", "MAX_GROUP",
           "int8_matmul"]

MAX_GROUP = 8  # query heads per kv head the kernel is compiled for (GQA groups of 1 to 8)

_SOURCE = pathlib.Path(__file__).with_name("decode_attention.cc")
_TARGET = "longhorizon_decode_attention"
_INT8_TARGET = "longhorizon_int8_matmul"
# Not -ffast-math: linking with it sets flush-to-zero for the whole process (crtfastmath.o), which
# changed float results elsewhere (a hypothesis float strategy failed). Reassociation is enough to
# vectorise the reductions.
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")

_lock = threading.Lock()
_state = {"loaded": False, "error": None}


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
      jax.ffi.register_ffi_target(_INT8_TARGET, jax.ffi.pycapsule(library.LhInt8Matmul),
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


def available() -> bool:
  """True if the kernel is built and registered (building it on the first call)."""
  return _load()


def applies(cache_dtype, group: int) -> bool:
  """Whether the kernel handles a `cache_dtype` cache with `group` query heads per kv head."""
  return jnp.dtype(cache_dtype) == jnp.float32 and 1 <= group <= MAX_GROUP


def use_kernel(decode_kernel: str, cache_dtype, group: int) -> bool:
  """Whether a decode step traced now runs `decode_attention` (`ModelConfig.decode_kernel`).

  Args:
    decode_kernel: "auto" (the kernel where it applies and builds), "xla" (never) or "cpu" (always;
      raises if it cannot be built or does not apply).
    cache_dtype: the KV cache's dtype (the kernel reads float32 only).
    group: query heads per kv head (the kernel handles 1 to `MAX_GROUP`).
  """
  if decode_kernel == "xla":
    return False
  if decode_kernel == "auto":
    return applies(cache_dtype, group) and _load()
  if decode_kernel != "cpu":
    raise ValueError(f"decode_kernel must be 'auto', 'xla' or 'cpu', got {decode_kernel!r}.")
  if not applies(cache_dtype, group):
    raise ValueError(f"decode_kernel='cpu' needs a float32 cache and 1 to {MAX_GROUP} query heads "
                     f"per kv head; got {jnp.dtype(cache_dtype)} and {group}. Use 'auto' or 'xla'.")
  if not _load():
    raise RuntimeError(f"decode_kernel='cpu' but the CPU decode-attention kernel cannot be built: "
                       f"{build_error()}. Install a C++ compiler (or set CXX), or use "
                       f"decode_kernel='auto' (falls back to XLA) or 'xla'.")
  return True


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


def int8_matmul(x, q, s):
  """`(x @ q) * s` with int8 weights widened in registers (CPU kernel; `models/quant.py` calls it).

  Args:
    x: `[M, I]` float32 activations.
    q: `[I, O]` int8 weights.
    s: `[O]` float32 per-output-column scales.

  Returns:
    `[M, O]` float32.
  """
  if not _load():
    raise RuntimeError(f"the CPU int8 matmul kernel is unavailable: {build_error()}")
  if x.ndim != 2 or q.ndim != 2 or s.ndim != 1 or x.shape[1] != q.shape[0] or s.shape[0] != q.shape[1]:
    raise ValueError(f"int8_matmul expects x[M, I], q[I, O], s[O]; got x{x.shape}, q{q.shape}, "
                     f"s{s.shape}.")
  out = jax.ShapeDtypeStruct((x.shape[0], q.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(_INT8_TARGET, out)(x.astype(jnp.float32), q.astype(jnp.int8),
                                             s.astype(jnp.float32))
