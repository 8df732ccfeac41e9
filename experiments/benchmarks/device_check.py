r"""Accelerator readiness: memory bandwidth, matmul peak, sampler tokens/s against the bandwidth
roofline, and the RL update's MFU, in bfloat16, in one run. `scripts/device_check.sh` runs it (after
the GPU test subset) and passes that subset's result in with `--tests`.

    python experiments/benchmarks/device_check.py [--out=FILE.json] [--tests="123 passed"] [--repeats=5]
    python experiments/benchmarks/device_check.py --dry      # tiny shapes, seconds, any backend (CI)

What is measured (median of `--repeats` timed calls after one compiling call, all in this process):

* **bandwidth**: a jitted `x * 2` over a bf16 array of `--bandwidth_mib` MiB (reads and writes it
  once): bytes moved / time. This is the roofline's denominator.
* **matmul peak**: a jitted bf16 `N x N @ N x N` (`--matmul_n`), float32 accumulation; 2 N^3 / time.
* **sampler**: `sampling.prefill` of a `--prompt`-token prompt (not timed), then one greedy
  `sampling.decode` of exactly `--new_tokens` tokens (no stop token, every row runs every step), for
  a SmolLM2-135M-shaped and a ~1.2B (Llama-3.2-1B-shaped) decoder with random weights in bfloat16
  (`decode_kernel="xla"`: the CPU attention kernel does not apply), at each `--batch_sizes`.
  Tokens/s = B N / time. Roofline: each decode step must read every weight once (bf16, embedding
  table included for the tied unembedding) and each row's filled KV-cache prefix (mean length
  prompt + N / 2); roofline tokens/s = B / (bytes per step / bandwidth). The ratio measured /
  roofline is how far the XLA decode path is from the memory bound.
* **train step**: one `rl_update` (one epoch, one minibatch; `experiments/benchmarks/train_step.py`'s
  synthetic batch and analytic model FLOPs) of the SmolLM2-135M-shaped decoder in bfloat16 compute
  with float32 master weights, `--train_batch` episodes of `--train_length` tokens; MFU = model
  FLOPs / median step time / the bf16 matmul peak above.

Prints one table (and `--out` writes it with the raw measurements as JSON).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import results_io
import train_step
from longhorizon.models import ModelConfig, init_params, prepare_decode_params, tiny_config
from longhorizon.sampling import sampler
from longhorizon.train.policy_losses import LossOptions
from longhorizon.train.update import jit_rl_update, make_optimizer

_DRY = flags.DEFINE_bool("dry", False, "Tiny shapes and sizes: checks the script on any backend.")
_TESTS = flags.DEFINE_string("tests", "not run", "The GPU test subset's result line (from the .sh).")
# --out (JSON path) and --repeats (timed calls per measurement) are train_step.py's flags.
FLAGS = flags.FLAGS
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "16", "64", "256"], "Sampler batch sizes.")
_PROMPT = flags.DEFINE_integer("prompt", 128, "Prompt tokens per row (prefilled, not timed).")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Decoded tokens per row (timed).")
_BANDWIDTH_MIB = flags.DEFINE_integer("bandwidth_mib", 4096, "Array size of the bandwidth probe.")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 8192, "N of the bf16 peak matmul.")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch", 32, "Episodes per timed RL update.")
_TRAIN_LENGTH = flags.DEFINE_integer("train_length", 1024, "Tokens per episode of the RL update.")

# Real shapes with random weights (the real files are over the 64 MiB the device machine receives).
MODELS = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1.2b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=500000.0, tie_word_embeddings=True),
}
_DRY_MODELS = {
    "tiny-a": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny-b": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
}


def _median_seconds(fn, setup=None, repeats: int = 3) -> float:
  """Median wall time of `fn(*setup())` over `repeats` calls after one untimed (compiling) call;
  `setup` (untimed) makes fresh arguments for each call (for donated inputs)."""
  setup = setup or (lambda: ())
  jax.block_until_ready(fn(*setup()))
  times = []
  for _ in range(repeats):
    args = jax.block_until_ready(setup())
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def bandwidth(mib: int, repeats: int) -> float:
  """Bytes per second of a jitted bf16 `x * 2` (reads and writes the array once)."""
  x = jnp.ones((mib * 2**20 // 2,), jnp.bfloat16)
  seconds = _median_seconds(jax.jit(lambda a: a * 2), lambda: (x,), repeats)
  return 2 * x.nbytes / seconds


def matmul_peak(n: int, repeats: int) -> float:
  """FLOP/s of a jitted bf16 `n x n @ n x n` with float32 accumulation."""
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.normal(size=(n, n)), jnp.bfloat16) for _ in range(2))
  mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
  return 2 * n**3 / _median_seconds(mm, lambda: (a, b), repeats)


def model_config(shape: dict) -> ModelConfig:
  return dataclasses.replace(tiny_config(), head_dim=None, max_position_embeddings=8192,
                             dtype="bfloat16", decode_kernel="xla", **shape)


def decode_bytes(config: ModelConfig, params, batch: int, cache_len: float) -> float:
  """Bytes one decode step must read: every weight in bf16, each row's KV prefix of `cache_len`."""
  weights = sum(int(np.size(x)) for x in jax.tree.leaves(params)) * 2
  kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.dims_per_head * 2
  return weights + batch * cache_len * kv


def sampler_row(name: str, config: ModelConfig, params, batch: int, prompt: int, new: int,
                bytes_per_s: float, repeats: int) -> dict:
  """Decode tokens/s of `batch` rows and the bandwidth roofline's."""
  tokens = jnp.asarray(np.random.default_rng(batch).integers(0, config.vocab_size, (batch, prompt)),
                       jnp.int32)
  lengths = jnp.full((batch,), prompt, jnp.int32)
  rule = sampler.SamplingParams(temperature=0.0, max_new_tokens=new)

  def setup():
    return sampler.prefill(params, config, tokens, lengths, prompt + new)  # (cache, last logits)

  seconds = _median_seconds(
      lambda cache, last: sampler.decode(params, config, cache, last, None, rule).tokens, setup,
      repeats)
  measured = batch * new / seconds
  roofline = batch / (decode_bytes(config, params, batch, prompt + new / 2) / bytes_per_s)
  return dict(model=name, batch=batch, tokens_per_s=measured, roofline_tokens_per_s=roofline,
              fraction_of_roofline=measured / roofline, step_ms=1e3 * seconds / new)


def train_row(shape: dict, batch: int, length: int, peak: float, repeats: int) -> dict:
  """MFU of one bf16-compute `rl_update` (float32 master weights) against the bf16 peak."""
  s = train_step.Shape(hidden_size=shape["hidden_size"], layers=shape["num_hidden_layers"],
                       heads=shape["num_attention_heads"], kv_heads=shape["num_key_value_heads"],
                       intermediate=shape["intermediate_size"], vocab=shape["vocab_size"],
                       batch=batch, length=length, steps=4)
  config, params, args = train_step.update_inputs(s, 0)
  config = config.replace(dtype="bfloat16")
  optimizer = make_optimizer(1e-4)
  update = jit_rl_update(config=config, optimizer=optimizer, critic_optimizer=None,
                         loss=LossOptions(agg="token-mean"))
  state0 = train_step.initial_state(params, optimizer, 0)
  seconds = _median_seconds(update, lambda: (jax.tree.map(jnp.copy, state0), *args), repeats)
  flops = train_step.update_flops(params, config, batch, length)["model"]
  return dict(batch=batch, length=length, step_s=seconds, model_flops=flops,
              mfu=flops / seconds / peak, tokens_per_s=batch * length / seconds)


def _rows(tests, bw, peak, samples, train) -> list[tuple[str, str]]:
  rows = [("device", f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"),
          ("GPU test subset", tests),
          ("memory bandwidth (bf16 x*2)", f"{bw / 1e9:,.0f} GB/s"),
          ("matmul peak (bf16, f32 accumulate)", f"{peak / 1e12:,.2f} TFLOP/s")]
  for r in samples:
    rows.append((f"decode {r['model']} B={r['batch']}",
                 f"{r['tokens_per_s']:,.0f} tok/s = {100 * r['fraction_of_roofline']:.0f}% of "
                 f"roofline {r['roofline_tokens_per_s']:,.0f} ({r['step_ms']:.2f} ms/step)"))
  rows.append((f"rl_update bf16 B={train['batch']} L={train['length']}",
               f"{train['step_s']:.3f} s, {train['tokens_per_s']:,.0f} tok/s, "
               f"MFU {100 * train['mfu']:.1f}%"))
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  dry = _DRY.value
  models = _DRY_MODELS if dry else MODELS
  batches = [1, 4] if dry else [int(b) for b in _BATCHES.value]
  prompt, new = (16, 8) if dry else (_PROMPT.value, _NEW.value)
  repeats = 2 if dry else FLAGS.repeats
  started = time.perf_counter()
  bw = bandwidth(32 if dry else _BANDWIDTH_MIB.value, repeats)
  peak = matmul_peak(256 if dry else _MATMUL_N.value, repeats)
  samples = []
  for name, shape in models.items():
    config = model_config(shape)
    params = prepare_decode_params(init_params(config, jax.random.key(0)), config)
    for batch in batches:
      samples.append(sampler_row(name, config, params, batch, prompt, new, bw, repeats))
    del params
  first = next(iter(models.values()))
  train = train_row(first, 4 if dry else _TRAIN_BATCH.value, 64 if dry else _TRAIN_LENGTH.value,
                    peak, repeats)
  rows = _rows(_TESTS.value, bw, peak, samples, train)
  width = max(len(k) for k, _ in rows)
  print(f"device check{' (dry run: tiny shapes)' if dry else ''}, {time.perf_counter() - started:.0f} s")
  for key, value in rows:
    print(f"{key:<{width}}  {value}")
  if FLAGS.out:
    results_io.write_json(FLAGS.out, {
        "rows": [{"name": k, "value": v} for k, v in rows], "dry": dry,
        "bandwidth_bytes_per_s": bw, "matmul_peak_flops": peak, "sampler": samples,
        "train_step": train, "devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", "")})


if __name__ == "__main__":
  app.run(main)
