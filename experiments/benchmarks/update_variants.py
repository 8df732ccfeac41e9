r"""What the RL update's options buy: length buckets, a shared prefix, LoRA against full fine-tuning,
bf16 compute.

  python experiments/benchmarks/update_variants.py --out=results/update_variants.json
  python experiments/benchmarks/update_variants.py --smollm2     # SmolLM2-135M shapes, random weights
  python experiments/benchmarks/update_variants.py --smoke       # tiny model, runs in seconds

Every row is a ratio of two `rl_update` timings in the same process (the same synthetic GRPO batch
as `train_step.py`: one epoch, one minibatch, AdamW, every importance ratio 1), the two variants
timed alternately `--repeats` times (default 3) and compared by their medians, so a change of machine load hits
both alike:

* **length buckets**: the batch's episodes fill `--used` of the `--length` context (the rest is
  right padding, as collected). Baseline: the update on the full padded batch (what every update
  did before `optim.length_buckets`); variant: the same batch cut by `Learner.trimmed`'s rule
  (`episode.bucket_length` with `--buckets` buckets, then `episode.trim`). The losses are checked
  equal (Dr.GRPO's constant is `loss.norm_length`, not the batch's width).
* **shared prefix** (`optim.share_prefix`): every row's first `--shared` of the context is the
  same prompt (a system prompt and tool schemas; nothing trained there). Baseline: the per-row
  update; variant: the same batch with that prefix computed once (`Transformer(prefix_length=P)`,
  `P = episode.shared_prefix_length(batch, 64)`). The losses are checked equal.
* **LoRA**: baseline full fine-tuning (AdamW over every parameter); variant rank `--lora_rank`
  adapters on every projection (AdamW over the adapters; the base frozen). Same float32 compute.
* **bf16**: baseline float32 compute; variant bf16 compute with float32 master weights and float32
  log-prob math (`ModelConfig.dtype`) (JAX's own products; the numbers in docs/notes/issue-18.md were taken with `core/matmul.py` wired in). The
  row also gives each dtype's peak matmul rate measured in the same process (float32 `N^3`, and
  bf16 x bf16 -> float32), since on CPUs with AMX the two differ by about 5x.

Prints one table; `--out` writes the rows and every timing as JSON.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

import results_io
from train_step import Shape, synthetic_batch
from longhorizon.core import episode as episode_lib
from longhorizon.models import init_params, lora
from longhorizon.train.policy_losses import LossOptions
from longhorizon.train.update import (LearnInputs, TrainState, episode_logprobs, jit_rl_update,
                                      make_optimizer)

# The shape, seed, repeats, --smoke and --out flags are train_step.py's (defined on its import):
# --hidden_size --layers --heads --kv_heads --intermediate --vocab --batch --length --repeats
# --seed --smoke --out.
_USED = flags.DEFINE_float("used", 0.5, "Share of the context the longest episode fills.")
_BUCKETS = flags.DEFINE_integer("buckets", 4, "optim.length_buckets of the bucket row.")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 16, "Adapter rank of the LoRA row.")
_SHARED = flags.DEFINE_float("shared", 0.53, "Share of the context all rows share in the prefix "
                             "row (SmolLM2 on calculator: ~440 of ~830 tokens).")
_ROWS = flags.DEFINE_list("rows", ["buckets", "prefix", "lora", "bf16"],
                          "Which comparisons to run.")
_SMOLLM2 = flags.DEFINE_bool("smollm2", False, "SmolLM2-135M shapes (D=576, 30 layers, 9/3 heads, "
                             "F=1536, V=49152), random weights; B=4, L=832 unless given.")
FLAGS = flags.FLAGS

_SMOLLM2_SHAPE = dict(hidden_size=576, layers=30, heads=9, kv_heads=3, intermediate=1536,
                      vocab=49152)


def _shape() -> Shape:
  if FLAGS.smoke:
    return Shape(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256,
                 batch=2, length=64, steps=2)
  dims = {name: FLAGS[name].value for name in ("hidden_size", "layers", "heads", "kv_heads",
                                                "intermediate", "vocab", "batch", "length")}
  if _SMOLLM2.value:
    dims.update(_SMOLLM2_SHAPE)
    for name, value in (("batch", 4), ("length", 832)):
      if not flags.FLAGS[name].present:
        dims[name] = value
  return Shape(**dims, steps=3)


def padded_batch(shape: Shape, used: int, rng) -> episode_lib.EpisodeBatch:
  """`synthetic_batch` of `used` tokens per row, right-padded to `shape.length` (host arrays)."""
  short = synthetic_batch(dataclasses.replace(shape, length=used), rng)
  pad = shape.length - used

  def widen(x):
    x = np.asarray(x)
    if x.ndim >= 2 and x.shape[1] == used:  # the token axis
      return np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x

  return jax.tree.map(widen, short)


class Update:
  """One variant's compiled update, its inputs, and a fresh state per call (the state is donated)."""

  def __init__(self, config, params, batch, seed: int, prefix_length: int = 0):
    self.config, self.batch = config, episode_lib.to_device(batch)
    self.optimizer = make_optimizer(1e-4)
    logp = jax.jit(episode_logprobs, static_argnames=("config",))(params, config, self.batch)
    mask = jnp.asarray(self.batch.loss_mask)
    self.batch = self.batch.replace(behavior_logprobs=jnp.where(mask, logp, 0.0))
    # Advantages drawn at a fixed width and cut, so a trimmed batch gets its padded twin's values.
    draw = np.random.default_rng(seed).normal(size=(mask.shape[0], 8192))[:, :mask.shape[1]]
    adv = jnp.asarray(draw, jnp.float32) * mask
    self.inputs = LearnInputs(adv, None, jnp.ones((mask.shape[0],), jnp.float32), logp, None, None)
    trainable = lora.partition(params, config)[0]
    self.state0 = TrainState(params=params, opt_state=self.optimizer.init(trainable),
                             critic_params=None, critic_opt_state=None,
                             step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32),
                             rng=jax.random.key(seed + 1), skipped=jnp.zeros((), jnp.int32))
    # norm_length: the padded width, so a trimmed batch keeps the same Dr.GRPO-style constant.
    loss = LossOptions(agg="token-mean", chunk_size=4096)
    start = time.perf_counter()
    self.fn = jit_rl_update(config=config, optimizer=self.optimizer, critic_optimizer=None,
                            loss=loss, prefix_length=prefix_length).lower(self.state0, self.batch, self.inputs).compile()
    self.compile_s = time.perf_counter() - start
    self.loss = self()[1]  # warm-up (first-run allocations); keeps the first update's loss

  def __call__(self) -> tuple[float, float]:
    state = jax.block_until_ready(jax.tree.map(jnp.copy, self.state0))
    start = time.perf_counter()
    _, metrics = jax.block_until_ready(self.fn(state, self.batch, self.inputs))
    return time.perf_counter() - start, float(metrics["loss"])


def compare(base: Update, variant: Update, repeats: int) -> dict:
  """Alternating timings of two updates: medians, their ratio, every time."""
  times = {"base": [], "variant": []}
  for _ in range(repeats):
    times["base"].append(base()[0])
    times["variant"].append(variant()[0])
  b, v = statistics.median(times["base"]), statistics.median(times["variant"])
  return {"base_s": b, "variant_s": v, "speedup": b / v, "times_s": times,
          "compile_s": {"base": base.compile_s, "variant": variant.compile_s},
          "loss": {"base": base.loss, "variant": variant.loss}}


def peak_rates(size: int = 2048, calls: int = 3) -> dict:
  """Best `size^3` matmul rate in float32 and in bf16 x bf16 -> float32 accumulation."""
  rates = {}
  for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
    a = jnp.asarray(np.random.default_rng(0).normal(size=(size, size)), dtype)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    jax.block_until_ready(mm(a, a))
    best = min(_seconds(mm, a) for _ in range(calls))
    rates[name] = 2.0 * size**3 / best
  return rates


def _seconds(fn, a) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(a, a))
  return time.perf_counter() - start


def run_rows(shape: Shape, rows, repeats: int, seed: int) -> dict:
  config = shape.model_config()
  params = init_params(config, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  used = max(8, int(round(_USED.value * shape.length)))
  out = {}
  if "buckets" in rows:
    batch = padded_batch(shape, used, rng)
    cut = episode_lib.bucket_length(episode_lib.used_length(batch), shape.length, _BUCKETS.value)
    out["buckets"] = compare(Update(config, params, batch, seed),
                             Update(config, params, episode_lib.trim(batch, cut), seed), repeats)
    out["buckets"].update(used=used, bucket=cut, length=shape.length)
  full = synthetic_batch(shape, rng)
  if "prefix" in rows:
    shared = int(round(_SHARED.value * shape.length))
    tokens, loss = np.array(full.tokens), np.array(full.loss_mask)
    tokens[:, :shared] = tokens[:1, :shared]
    loss[:, :shared] = False  # the shared part is prompt
    batch = full.replace(tokens=tokens, loss_mask=loss)
    p = episode_lib.shared_prefix_length(batch, 64 if shape.length >= 256 else 8)
    out["prefix"] = compare(Update(config, params, batch, seed),
                            Update(config, params, batch, seed, prefix_length=p), repeats)
    out["prefix"].update(shared=shared, prefix=p, length=shape.length)
  if "lora" in rows:
    lcfg = dataclasses.replace(config, lora_rank=_LORA_RANK.value, lora_alpha=2.0 * _LORA_RANK.value)
    lparams = lora.add_adapters(params, lcfg, jax.random.key(seed + 7))
    out["lora"] = compare(Update(config, params, full, seed), Update(lcfg, lparams, full, seed),
                          repeats)
    out["lora"]["rank"] = _LORA_RANK.value
  if "bf16" in rows:
    out["bf16"] = compare(Update(config, params, full, seed),
                          Update(dataclasses.replace(config, dtype="bfloat16"), params, full, seed),
                          repeats)
    out["bf16"]["peak_flops_per_s"] = peak_rates()
  return out


def table(shape: Shape, results: dict) -> list[dict]:
  rows = []
  if "buckets" in results:
    r = results["buckets"]
    rows.append(dict(name=f"length buckets ({r['used']}/{r['length']} used -> {r['bucket']})",
                     base=r["base_s"], variant=r["variant_s"], speedup=r["speedup"]))
  if "prefix" in results:
    r = results["prefix"]
    rows.append(dict(name=f"shared prefix ({r['prefix']} of {r['length']} once)",
                     base=r["base_s"], variant=r["variant_s"], speedup=r["speedup"]))
  if "lora" in results:
    r = results["lora"]
    rows.append(dict(name=f"LoRA rank {r['rank']} vs full fine-tuning", base=r["base_s"],
                     variant=r["variant_s"], speedup=r["speedup"]))
  if "bf16" in results:
    r = results["bf16"]
    peaks = r["peak_flops_per_s"]
    rows.append(dict(name="bf16 compute vs float32", base=r["base_s"], variant=r["variant_s"],
                     speedup=r["speedup"],
                     note=f"peak f32 {peaks['float32'] / 1e9:,.0f}, bf16 "
                          f"{peaks['bfloat16'] / 1e9:,.0f} GFLOP/s"))
  print(f"rl_update variants, B={shape.batch} L={shape.length} D={shape.hidden_size} "
        f"layers={shape.layers} V={shape.vocab}, jax {jax.__version__}, {os.cpu_count()} CPUs")
  header = f"{'comparison':<44} {'base s':>9} {'variant s':>10} {'speedup':>8}  note"
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['name']:<44} {r['base']:>9.3f} {r['variant']:>10.3f} {r['speedup']:>7.2f}x  "
          f"{r.get('note', '')}")
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  shape = _shape()
  repeats = 2 if FLAGS.smoke else FLAGS.repeats if FLAGS["repeats"].present else 3
  unknown = set(_ROWS.value) - {"buckets", "prefix", "lora", "bf16"}
  if unknown:
    raise app.UsageError(f"--rows: unknown {sorted(unknown)}; choose from buckets, prefix, lora, "
                         f"bf16.")
  results = run_rows(shape, _ROWS.value, repeats, FLAGS.seed)
  rows = table(shape, results)
  for name, what in (("buckets", "the trimmed batch's loss differs from the padded one's"),
                     ("prefix", "the shared-prefix update's loss differs from the per-row one's")):
    losses = results.get(name, {}).get("loss")
    if losses and not np.isclose(losses["base"], losses["variant"], rtol=1e-4, atol=1e-6):
      raise RuntimeError(f"{what}: {losses}")
  if FLAGS.out:
    path = results_io.write_json(FLAGS.out, {
        "rows": rows, "results": results, "shape": dataclasses.asdict(shape),
        "load_average": os.getloadavg(), "jax": jax.__version__})
    logging.info("Wrote %s", path)


if __name__ == "__main__":
  app.run(main)
