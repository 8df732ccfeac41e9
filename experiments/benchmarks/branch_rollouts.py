r"""Branch rollouts cost their continuation tokens only: K continuations of one P-token prefix.

  python experiments/benchmarks/branch_rollouts.py --out=experiments/results/branch_rollouts/branch.json
  python experiments/benchmarks/branch_rollouts.py --smoke   # seconds, a tiny model (CI)

What is measured (one process; each jitted function called once to compile, then the three
variants timed in turn `--repeats` times, ending in `jax.block_until_ready`; medians):

* **fork** (what `rollout.collect` does for branch rows): `sampler.fork_cache` copies the parent's
  row K times cut to its first P - 1 slots, `extend` appends the prefix's last token (one token per
  row, to get the next-token logits), then `decode` samples C tokens in each of the K rows.
* **continuation only** (the bar): the same `decode` of C tokens in K rows from a cache that already
  holds the P-token prefix in every row (made before the timer starts): the cost of the
  continuation tokens alone.
* **re-prefill** (what forking avoids): `prefill` of the P-token prefix in all K rows, then the same
  `decode`.

Target (issue 19, acceptance 3): fork / continuation-only <= 1.2. The model is random weights of
the SmolLM2-135M shape (float32; `--smoke`: the 2-layer test model); sampling at temperature 1
with no stop token, so every row decodes exactly C tokens.
"""

from __future__ import annotations

import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import results_io
from longhorizon.eval.provenance import cpu_model
from longhorizon.models import init_params, prepare_decode_params, tiny_config
from longhorizon.models.config import ModelConfig
from longhorizon.sampling import sampler

_SMOKE = flags.DEFINE_bool("smoke", False, "a tiny model and short lengths (seconds; CI)")
_PREFIX = flags.DEFINE_integer("prefix", 512, "P: tokens of the shared prefix")
_K = flags.DEFINE_integer("k", 8, "K: continuations")
_CONTINUATION = flags.DEFINE_integer("continuation", 32, "C: tokens sampled per continuation")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed repeats of each variant")
_OUT = flags.DEFINE_string("out", "", "JSON file for the results")


def smollm2_shape() -> ModelConfig:
  """SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 key-value heads, vocab 49152)."""
  return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     rope_theta=100000.0, tie_word_embeddings=True)


def _timed(fn, repeats: int) -> list[float]:
  out = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - start)
  return out


def measure(config: ModelConfig, prefix: int, k: int, continuation: int, repeats: int) -> dict:
  """Seconds (median) of the three variants and their ratios (see the module docstring)."""
  params = prepare_decode_params(init_params(config, jax.random.key(0)), config)
  capacity = prefix + continuation + 8
  ids = np.random.default_rng(0).integers(1, config.vocab_size, size=(1, prefix)).astype(np.int32)
  rule = sampler.SamplingParams(temperature=1.0, max_new_tokens=continuation)
  keys = sampler.per_row_keys(0, np.arange(k))
  parent, _ = sampler.prefill(params, config, ids, np.array([prefix], np.int32), capacity)
  rows, ends = jnp.zeros((k,), jnp.int32), jnp.full((k,), prefix - 1, jnp.int32)
  last = jnp.full((k, 1), int(ids[0, -1]), jnp.int32)
  ones = jnp.ones((k,), jnp.int32)
  many, many_lengths = np.repeat(ids, k, axis=0), np.full((k,), prefix, np.int32)
  full, full_logits = sampler.prefill(params, config, many, many_lengths, capacity)
  copy = lambda tree: jax.tree.map(jnp.copy, tree)

  def fork():
    cache = sampler.fork_cache(parent, rows, ends)
    cache, logits = sampler.extend(params, config, cache, last, ones)
    return sampler.decode(params, config, cache, logits, keys, rule).tokens

  def continuation_only(cache):
    return sampler.decode(params, config, cache, full_logits, keys, rule).tokens

  def reprefill():
    cache, logits = sampler.prefill(params, config, many, many_lengths, capacity)
    return sampler.decode(params, config, cache, logits, keys, rule).tokens

  caches = [copy(full) for _ in range(repeats + 1)]  # decode donates its cache: one per call
  for fn in (fork, lambda: continuation_only(caches.pop()), reprefill):
    jax.block_until_ready(fn())  # compile
  times = {"fork": [], "continuation_only": [], "reprefill": []}
  for _ in range(repeats):  # interleaved, so load changes hit all three
    times["fork"] += _timed(fork, 1)
    times["continuation_only"] += _timed(lambda: continuation_only(caches.pop()), 1)
    times["reprefill"] += _timed(reprefill, 1)
  med = {name: statistics.median(ts) for name, ts in times.items()}
  return {"seconds": med, "all_seconds": times,
          "fork_over_continuation": med["fork"] / med["continuation_only"],
          "reprefill_over_fork": med["reprefill"] / med["fork"]}


def main(argv):
  del argv
  if _SMOKE.value:
    config, prefix, k, cont, repeats = tiny_config(), 64, 4, 8, 3
  else:
    config, prefix, k, cont, repeats = (smollm2_shape(), _PREFIX.value, _K.value,
                                        _CONTINUATION.value, _REPEATS.value)
  result = measure(config, prefix, k, cont, repeats)
  s = result["seconds"]
  print(f"branch rollouts: K={k} continuations of C={cont} tokens from a P={prefix}-token prefix "
        f"({'tiny model' if _SMOKE.value else 'SmolLM2-135M shape, float32'}; {cpu_model()})")
  print(f"  continuation only  {s['continuation_only'] * 1e3:9.1f} ms")
  print(f"  fork (ours)        {s['fork'] * 1e3:9.1f} ms   "
        f"{result['fork_over_continuation']:.3f}x the continuation (target <= 1.2)")
  print(f"  re-prefill         {s['reprefill'] * 1e3:9.1f} ms   "
        f"{result['reprefill_over_fork']:.2f}x fork")
  if _OUT.value:
    results_io.write_json(_OUT.value, {"cpu": cpu_model(), "prefix": prefix, "k": k,
                                       "continuation": cont, "smoke": _SMOKE.value, **result})



if __name__ == "__main__":
  app.run(main)
