r"""Memory of vocabulary-chunked log-probs vs. full logits, forward + backward, with XLA's own numbers.

  python experiments/benchmarks/logprobs_memory.py --out=results/logprobs_memory.json
  python experiments/benchmarks/logprobs_memory.py --smoke        # B=2, T=128, V=4096, D=64, chunk 1024

Both paths compute `value_and_grad` of the summed token log-probs with respect to the hidden states and
the unembedding `W[D, V]`, jitted:
  * full:    `token_logprobs(hidden @ W, targets)`, materialising `[B, T, V]` float32 logits;
  * chunked: `token_logprobs_from_hidden(hidden, W, targets, chunk_size)`, an online log-sum-exp over
    vocabulary chunks with a rematerialised scan body.
For each, XLA's compiled memory analysis (`jit(f).lower(...).compile().memory_analysis()`) gives the
temporary buffer size (the working memory beyond arguments and outputs), argument and output sizes;
the table sets them beside the size of the full logits (`B*T*V*4` bytes). Both are then run once:
max |difference| of the log-probs and of both gradients, and the wall time of one compiled call.
Defaults are SmolLM2-135M's vocabulary and width at a 2048-token context.
"""

from __future__ import annotations

import math
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

import results_io
from longhorizon.core import logprobs as logprobs_lib

_B = flags.DEFINE_integer("B", 4, "Rows.")
_T = flags.DEFINE_integer("T", 2048, "Token positions per row.")
_V = flags.DEFINE_integer("V", 49152, "Vocabulary size.")
_D = flags.DEFINE_integer("D", 576, "Hidden width.")
_CHUNK = flags.DEFINE_integer("chunk_size", 4096, "Vocabulary columns per scan step of the chunked path.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random hidden states, unembedding and targets.")
_SMOKE = flags.DEFINE_bool("smoke", False,
                           "Quick run: B=2, T=128, V=4096, D=64, chunk_size=1024 (overrides those flags).")
_OUT = flags.DEFINE_string("out", None, "Optional JSON path for the results (parents created).")

_MIB = 2.0**20


def _full_loss(hidden, unembed, targets):
  logits = jnp.einsum("btd,dv->btv", hidden, unembed)
  return jnp.sum(logprobs_lib.token_logprobs(logits, targets))


def _chunked_loss(hidden, unembed, targets, chunk_size):
  return jnp.sum(logprobs_lib.token_logprobs_from_hidden(hidden, unembed, targets,
                                                         chunk_size=chunk_size))


def _memory(compiled):
  """Sizes (bytes) from XLA's compiled memory analysis; None where the backend reports none."""
  # Not `peak_memory_in_bytes`: XLA:CPU reports only arguments + outputs there (no temporaries).
  keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
          "alias_size_in_bytes")
  try:
    stats = compiled.memory_analysis()
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("memory_analysis() failed: %s", e)
    stats = None
  if stats is None:
    return {k: None for k in keys}
  out = {}
  for k in keys:
    value = getattr(stats, k, None)
    out[k] = None if value is None or value < 0 else int(value)
  return out


def _measure(name, loss_fn, args):
  """Compiles value_and_grad of `loss_fn` (logged), runs it once; returns sizes, time and outputs."""
  logging.info("Compiling %s forward + backward...", name)
  fwd_bwd = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
  start = time.perf_counter()
  compiled = fwd_bwd.lower(*args).compile()
  compile_s = time.perf_counter() - start
  memory = _memory(compiled)
  logging.info("Running %s once...", name)
  start = time.perf_counter()
  value, grads = jax.block_until_ready(compiled(*args))
  run_s = time.perf_counter() - start
  return {"name": name, "compile_s": compile_s, "run_s": run_s, **memory}, (value, grads)


def _mib(x):
  return "n/a" if x is None else f"{x / _MIB:,.1f}"


def _format_table(rows, logits_bytes):
  header = ["path", "temp MiB", "args MiB", "output MiB", "temp / logits", "compile s", "run s"]
  body = []
  for r in rows:
    ratio = "n/a" if r["temp_size_in_bytes"] is None else f"{r['temp_size_in_bytes'] / logits_bytes:.3f}"
    body.append([r["name"], _mib(r["temp_size_in_bytes"]), _mib(r["argument_size_in_bytes"]),
                 _mib(r["output_size_in_bytes"]), ratio, f"{r['compile_s']:.2f}", f"{r['run_s']:.3f}"])
  widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
  lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
  lines += [" | ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _SMOKE.value:
    b, t, v, d, chunk = 2, 128, 4096, 64, 1024
  else:
    b, t, v, d, chunk = _B.value, _T.value, _V.value, _D.value, _CHUNK.value
  devices = jax.devices()
  logging.info("jax %s, backend %s, %d device(s): %s", jax.__version__, jax.default_backend(),
               len(devices), devices)
  rng = np.random.default_rng(_SEED.value)
  hidden = jnp.asarray(rng.normal(size=(b, t, d)).astype(np.float32))
  unembed = jnp.asarray((rng.normal(size=(d, v)) / math.sqrt(d)).astype(np.float32))
  targets = jnp.asarray(rng.integers(0, v, size=(b, t)).astype(np.int32))
  args = (hidden, unembed, targets)
  logits_bytes = b * t * v * 4

  rows, outputs = [], {}
  for name, fn in (("full logits", _full_loss),
                   (f"chunked (chunk {chunk})", lambda h, w, y: _chunked_loss(h, w, y, chunk))):
    row, outputs[name] = _measure(name, fn, args)
    rows.append(row)

  logging.info("Comparing log-probs and gradients...")
  full_lp = jax.jit(lambda h, w, y: logprobs_lib.token_logprobs(jnp.einsum("btd,dv->btv", h, w), y))
  chunk_lp = jax.jit(lambda h, w, y: logprobs_lib.token_logprobs_from_hidden(h, w, y, chunk_size=chunk))
  (value_full, (gh_full, gw_full)), (value_chunk, (gh_chunk, gw_chunk)) = outputs.values()
  diffs = {
      "logprobs_max_abs_diff": float(jnp.max(jnp.abs(full_lp(*args) - chunk_lp(*args)))),
      "grad_hidden_max_abs_diff": float(jnp.max(jnp.abs(gh_full - gh_chunk))),
      "grad_unembed_max_abs_diff": float(jnp.max(jnp.abs(gw_full - gw_chunk))),
      "sum_logprobs_full": float(value_full),
      "sum_logprobs_chunked": float(value_chunk),
      "grad_hidden_max_abs": float(jnp.max(jnp.abs(gh_full))),
      "grad_unembed_max_abs": float(jnp.max(jnp.abs(gw_full))),
  }

  print(f"jax {jax.__version__} | backend {jax.default_backend()} | devices {jax.device_count()} "
        f"({devices[0].device_kind}) | B={b} T={t} V={v} D={d} chunk_size={chunk}")
  print(f"full [B,T,V] float32 logits: {logits_bytes / _MIB:,.1f} MiB; one [B*T, chunk] block: "
        f"{b * t * min(chunk, v) * 4 / _MIB:,.1f} MiB")
  print(_format_table(rows, logits_bytes))
  print(f"max |diff| log-probs {diffs['logprobs_max_abs_diff']:.3e} | grad hidden "
        f"{diffs['grad_hidden_max_abs_diff']:.3e} (max |grad| {diffs['grad_hidden_max_abs']:.3e}) | "
        f"grad W {diffs['grad_unembed_max_abs_diff']:.3e} (max |grad| {diffs['grad_unembed_max_abs']:.3e})"
        f" | sum log-probs {diffs['sum_logprobs_full']:.6e} vs {diffs['sum_logprobs_chunked']:.6e}",
        flush=True)

  if _OUT.value:
    out = results_io.write_json(_OUT.value, {
        "shape": {"B": b, "T": t, "V": v, "D": d, "chunk_size": chunk},
        "logits_bytes": logits_bytes,
        "rows": rows,
        **diffs,
    })
    logging.info("Wrote %s", out)


if __name__ == "__main__":
  app.run(main)
