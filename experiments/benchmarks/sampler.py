r"""Sampler throughput on SmolLM2-135M-Instruct (float32) against HuggingFace and a matmul roofline.

  pip install torch==2.13.0   # optional (CPU wheel): enables the HuggingFace `generate` baseline
  python experiments/benchmarks/sampler.py --out=results/sampler.json
  python experiments/benchmarks/sampler.py --nohf --batch_sizes=1,16 --repeats=2   # quick, no torch

What is measured (all in one run, so the ratios share the machine's state; each JAX function is
called once to compile, then timed `--repeats` times ending in `jax.block_until_ready`; medians):

* **matmul dtype**: the roofline step below at batch 1 in float32 and in bfloat16 (why the model
  runs in float32 on this CPU).
* **decode** at each batch size: the model loaded by `checkpoint.load('smollm2')`, a short chat
  prompt (the same prompt on every row) prefilled (not timed), then one `sampling.decode` of exactly
  `--new_tokens` tokens (greedy, no stop tokens, so every row runs every step). Tokens/s = B * N /
  time; step time = time / N.
* **roofline**: the bare matmuls of one decode step on `[B, D]` activations, jitted, float32, with
  the real weights: for each of the 30 layers q/k/v/o, gate/up/down, then the unembedding `[V, D]`;
  no attention, cache, norms or sampling. Three layouts are timed: a `lax.scan` over stacked
  `[L, ...]` weights, an unrolled loop over per-layer buffers, and the same with q|k|v and gate|up
  concatenated (the layout `prepare_decode_params` gives the sampler); the fastest is the roofline. Decode and roofline runs alternate so load changes hit both. Target: decode step time /
  roofline step time <= 1.25.
* **HF generate** (when torch imports and `--hf`): transformers' LlamaForCausalLM from the same GGUF,
  float32, `do_sample=False`, `min_new_tokens = max_new_tokens = N` (cannot stop early), the same
  prompt batch; its prefill is removed by timing `N` and `1` new tokens and using the difference,
  so both sides count decode steps only. Targets: ours / HF >= 2 at batch 1, >= 1.5 at batch 16.
* **episode**: `--turns` turns, each `extend` with an observation of `--obs_tokens` tokens then
  `decode` of `--turn_tokens` tokens, against one `prefill` of the prompt and all observations then
  one `decode` of all turn tokens (same totals, same cache capacity). Target: ratio <= 1.3.
* **int8** (`--int8`): the same decode with `decode_quant="int8"` (weight-only int8, per-column
  scales, `models/quant.py`): its step time against float32 decode, the float32 roofline and HF.
  The rollout/learner mismatch this brings is measured by `experiments/quant_mismatch.py`.
* **compile**: trace + lower, and XLA compile, of the 30-layer `decode` (batch 1, N new tokens),
  measured before anything else is compiled.

The decode step's attention runs the CPU kernel `models.cpu_kernels.decode_attention` (reads each
row's filled cache prefix only) when it builds (`--decode_kernel=auto`, `ModelConfig.decode_kernel`);
`--decode_kernel=xla` measures the XLA path instead. The header line says which ran.

Prints one table; `--out` writes the rows (and the environment) as JSON.
"""

from __future__ import annotations

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
from longhorizon import sampling
from longhorizon.models import checkpoint
from longhorizon.models import cpu_kernels
from longhorizon.models import DECODE_KERNELS, prepare_decode_params
from longhorizon.text import render_chat

_OUT = flags.DEFINE_string("out", None, "Optional JSON path for the result rows (parents created).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "16", "64"], "Decode batch sizes.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens decoded per row (N).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per measurement (median reported).")
_HF = flags.DEFINE_bool("hf", True, "Time HuggingFace generate (PyTorch CPU) when torch imports.")
_HF_REPEATS = flags.DEFINE_integer("hf_repeats", 2, "Timed runs per HF measurement (median).")
_HF_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "hf_max_new_tokens_large", 64, "HF new tokens at batch sizes > 16 (fewer keeps HF time short).")
_TURNS = flags.DEFINE_integer("turns", 8, "Turns of the episode measurement.")
_OBS_TOKENS = flags.DEFINE_integer("obs_tokens", 16, "Observation tokens appended per turn.")
_TURN_TOKENS = flags.DEFINE_integer("turn_tokens", 16, "Tokens decoded per turn.")
_EPISODE_BATCH = flags.DEFINE_integer("episode_batch", 16, "Batch size of the episode measurement.")
_EPISODE_REPEATS = flags.DEFINE_integer("episode_repeats", 2, "Timed runs of each episode variant.")
_DECODE_KERNEL = flags.DEFINE_enum("decode_kernel", "auto", list(DECODE_KERNELS),
                                   "Decode-step attention (`ModelConfig.decode_kernel`): the CPU "
                                   "kernel where it builds ('auto'), always XLA ('xla') or always "
                                   "the kernel ('cpu').")

_INT8 = flags.DEFINE_bool("int8", True, "Also time weight-only int8 decoding "
                          "(`ModelConfig.decode_quant='int8'`) at each batch size.")

_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# DESIGN.md "Performance bars".
_TARGET_HF = {1: 2.0, 16: 1.5}
_TARGET_ROOFLINE = 1.25
_TARGET_EPISODE = 1.3


def _median_s(fn, repeats, setup=None):
  """Median wall seconds of `fn(setup())` over `repeats` runs (`setup` is not timed)."""
  times = []
  for _ in range(repeats):
    args = jax.block_until_ready(setup()) if setup is not None else None
    start = time.perf_counter()
    jax.block_until_ready(fn(args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


# ------------------------------------------------------------------------------------------ roofline

def _layer_matmuls(x, w):
  q = x @ w["q"]
  k = x @ w["k"]
  v = x @ w["v"]
  x = x + q @ w["o"]
  x = x + (x @ w["gate"] * (x @ w["up"])) @ w["down"]
  return x, (k, v)


@jax.jit
def _roofline_scan(x, layers, embedding):
  """Stacked `[L, ...]` weights under `lax.scan`."""
  x, kvs = jax.lax.scan(_layer_matmuls, x, layers)
  return jnp.einsum("bd,vd->bv", x, embedding), kvs


def _unrolled(layer_matmuls):
  """A jitted roofline step unrolled over a tuple of L per-layer weight dicts (separate buffers)."""
  def step(x, layers, embedding):
    kvs = []
    for w in layers:
      x, kv = layer_matmuls(x, w)
      kvs.append(kv)
    return jnp.einsum("bd,vd->bv", x, embedding), kvs
  return jax.jit(step)


def _fused_layer_matmuls(x, w):
  qkv = x @ w["qkv"]
  x = x + qkv[:, :w["o"].shape[0]] @ w["o"]
  gate, up = jnp.split(x @ w["gate_up"], 2, axis=-1)
  x = x + (gate * up) @ w["down"]
  return x, qkv


_roofline_unrolled = _unrolled(_layer_matmuls)  # seven matmuls per layer
_roofline_fused = _unrolled(_fused_layer_matmuls)  # q|k|v and gate|up fused, as the sampler runs


def roofline_inputs(params, dtype=jnp.float32):
  """`{variant: (fn, layers, embedding)}`: one decode step's bare matmuls, `x[B, D]` through every
  layer's 7 projections (q/k/v/o, gate/up/down) and the `[V, D]` unembedding. The residual carries
  through so nothing is dead code; k/v are returned. Real weights, cast to `dtype`."""
  attn, mlp = params["layers"]["self_attn"], params["layers"]["mlp"]
  stacked = {"q": attn["q_proj"]["kernel"], "k": attn["k_proj"]["kernel"],
             "v": attn["v_proj"]["kernel"], "o": attn["o_proj"]["kernel"],
             "gate": mlp["gate_proj"]["kernel"], "up": mlp["up_proj"]["kernel"],
             "down": mlp["down_proj"]["kernel"]}
  stacked = jax.tree.map(lambda a: jnp.asarray(a, dtype), stacked)
  per_layer = tuple(jax.tree.map(lambda a, i=i: jnp.array(a[i]), stacked)
                    for i in range(stacked["q"].shape[0]))
  fused = tuple({"qkv": jnp.concatenate([w["q"], w["k"], w["v"]], axis=1), "o": w["o"],
                 "gate_up": jnp.concatenate([w["gate"], w["up"]], axis=1), "down": w["down"]}
                for w in per_layer)
  embedding = jnp.asarray(params["embed_tokens"]["embedding"], dtype)
  return {"scan": (_roofline_scan, stacked, embedding),
          "unrolled": (_roofline_unrolled, per_layer, embedding),
          "fused": (_roofline_fused, fused, embedding)}


def roofline_step_s(inputs, batch, calls=5):
  """`{variant: median seconds}` of the bare-matmul decode step at `batch` (after compiling)."""
  out = {}
  for name, (fn, layers, embedding) in inputs.items():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, embedding.shape[1])) * 0.1,
                    embedding.dtype)
    jax.block_until_ready(fn(x, layers, embedding))
    out[name] = _median_s(lambda _, fn=fn, x=x, l=layers, e=embedding: fn(x, l, e), calls)
  return out


# -------------------------------------------------------------------------------------------- ours

def _prompt_batch(ids, batch):
  width = max(16, 1 << (len(ids) - 1).bit_length())
  tokens = np.full((batch, width), ids[-1], np.int32)
  tokens[:, :len(ids)] = ids
  return tokens, np.full((batch,), len(ids), np.int32)


def decode_runner(params, config, ids, batch, new_tokens):
  """A function returning the seconds of one `decode` of `new_tokens` tokens at `batch` (compiled
  and checked here; each run starts from a copy of the prefilled cache; prefill is not timed)."""
  tokens, lengths = _prompt_batch(ids, batch)
  rule = sampling.SamplingParams(temperature=0.0, max_new_tokens=new_tokens, stop_token_ids=())
  cache, logits = sampling.prefill(params, config, tokens, lengths, tokens.shape[1] + new_tokens)
  keys = sampling.per_row_keys(0, np.arange(batch))
  run = lambda state: sampling.decode(params, config, state[0], logits, keys, rule)
  setup = lambda: (_copy(cache),)
  out = jax.block_until_ready(run(setup()))
  assert int(out.lengths.min()) == new_tokens, "decode stopped early"
  return lambda: _median_s(run, 1, setup)


def compile_decode_s(params, config, ids, new_tokens):
  """(trace + lower seconds, compile seconds) of `decode` at batch 1."""
  tokens, lengths = _prompt_batch(ids, 1)
  rule = sampling.SamplingParams(temperature=0.0, max_new_tokens=new_tokens, stop_token_ids=())
  cache = jax.eval_shape(lambda: sampling.prefill(params, config, tokens, lengths,
                                                  tokens.shape[1] + new_tokens))
  cache, logits = cache
  keys = sampling.per_row_keys(0, np.arange(1))
  start = time.perf_counter()
  lowered = sampling.decode.lower(params, config, cache, logits, keys, rule)
  lower_s = time.perf_counter() - start
  start = time.perf_counter()
  lowered.compile()
  return lower_s, time.perf_counter() - start


def episode_s(params, config, ids, batch, turns, obs_tokens, turn_tokens, repeats):
  """(multi-turn seconds, single-turn seconds) for the same totals of observation/decoded tokens."""
  rng = np.random.default_rng(0)
  prompt, prompt_lengths = _prompt_batch(ids, batch)
  observations = rng.integers(100, config.vocab_size, size=(turns, batch, obs_tokens), dtype=np.int32)
  capacity = prompt.shape[1] + turns * (obs_tokens + turn_tokens)
  keys = sampling.per_row_keys(0, np.arange(batch))
  obs_lengths = np.full((batch,), obs_tokens, np.int32)
  turn_rule = sampling.SamplingParams(temperature=0.0, max_new_tokens=turn_tokens, stop_token_ids=())

  def multi(_):
    cache, logits = sampling.prefill(params, config, prompt, prompt_lengths, capacity)
    for t in range(turns):
      cache, logits = sampling.extend(params, config, cache, observations[t], obs_lengths, logits)
      out = sampling.decode(params, config, cache, logits, keys, turn_rule)
      cache, logits = out.cache, out.last_logits
    return out.tokens

  # One turn: the prompt followed by every observation, then all the decoded tokens at once.
  width = prompt.shape[1] + turns * obs_tokens
  single_prompt = np.zeros((batch, width), np.int32)
  single_prompt[:, :prompt.shape[1]] = prompt
  for b in range(batch):
    flat = np.concatenate([prompt[b, :prompt_lengths[b]], observations[:, b].reshape(-1)])
    single_prompt[b, :len(flat)] = flat
  single_lengths = prompt_lengths + turns * obs_tokens
  single_rule = turn_rule.replace(max_new_tokens=turns * turn_tokens)

  def single(_):
    cache, logits = sampling.prefill(params, config, single_prompt, single_lengths, capacity)
    return sampling.decode(params, config, cache, logits, keys, single_rule).tokens

  jax.block_until_ready((multi(None), single(None)))
  return _median_s(multi, repeats), _median_s(single, repeats)


def _attention_name(config):
  if config.decode_kernel == "xla":
    return "XLA (decode_kernel='xla')"
  # "auto" on this CPU / float32 / G = 3 model: the kernel if it built; "cpu" raised otherwise.
  return "CPU kernel" if cpu_kernels.available() else f"XLA ({cpu_kernels.build_error()})"


def _int8_rows(entry, params, config, ids, batch, n, repeats, f32_step, roof, hf_step):
  """Times int8 decode at `batch` (into `entry`) and returns its rows: against float32 decode,
  the float32 roofline and HF generate (the ratios are speed-ups: > 1 is faster)."""
  run = decode_runner(params, config, ids, batch, n)
  step = statistics.median(run() / n for _ in range(repeats))
  entry.update(int8_step_s=step, int8_tokens_per_s=batch / step)
  rows = [dict(name=f"int8 decode B={batch}: vs f32 decode", ours=f"{batch / step:.1f} tok/s",
               reference=f"{batch / f32_step:.1f} tok/s", ratio=f32_step / step),
          dict(name=f"int8 decode B={batch}: vs f32 roofline", ours=f"{1e3 * step:.1f} ms",
               reference=f"{1e3 * roof:.1f} ms", ratio=roof / step)]
  if hf_step is not None:
    rows.append(dict(name=f"int8 decode B={batch}: vs HF generate", ours=f"{batch / step:.1f} tok/s",
                     reference=f"{batch / hf_step:.1f} tok/s", ratio=hf_step / step))
  return rows


# ---------------------------------------------------------------------------------------------- HF

def hf_decode_s(ids, batch_sizes, new_tokens_of, repeats):
  """{batch: (seconds per decode step, new tokens)} of HF `generate`, or None without torch."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    logging.warning("torch/transformers not importable (%s): no HF baseline.", e)
    return None
  path = checkpoint.resolve("smollm2")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  model.eval()
  pad = model.generation_config.pad_token_id
  logging.info("HF: torch %s, %d threads", torch.__version__, torch.get_num_threads())

  def generate(x, n):
    with torch.no_grad():
      out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=pad)
    assert out.shape[1] == x.shape[1] + n
    return out

  results = {}
  for batch in batch_sizes:
    n = new_tokens_of(batch)
    x = torch.tensor([ids] * batch, dtype=torch.long)
    generate(x, n)  # warm-up
    full = _median_s(lambda _: generate(x, n), repeats)
    first = _median_s(lambda _: generate(x, 1), repeats)
    results[batch] = ((full - first) / (n - 1), n)
    logging.info("HF batch %d: %.1f ms/step (%d tokens)", batch, 1e3 * results[batch][0], n)
  return results


# ------------------------------------------------------------------------------------------- table

def _fmt(value, spec):
  return "-" if value is None else format(value, spec)


def print_table(rows):
  header = f"{'measurement':<34} {'ours':>14} {'reference':>22} {'ratio':>7} {'target':>8} {'ok':>4}"
  print(header)
  print("-" * len(header))
  for r in rows:
    ok = "-" if r.get("pass") is None else ("yes" if r["pass"] else "NO")
    print(f"{r['name']:<34} {r['ours']:>14} {r['reference']:>22} {_fmt(r.get('ratio'), '.2f'):>7} "
          f"{r.get('target') or '-':>8} {ok:>4}")


def main(argv):
  del argv
  logging.info("devices: %s", jax.devices())
  batch_sizes = [int(b) for b in _BATCH_SIZES.value]
  n, repeats = _NEW_TOKENS.value, _REPEATS.value
  config, params, tokenizer = checkpoint.load("smollm2")
  config = config.replace(decode_kernel=_DECODE_KERNEL.value)
  assert config.dtype == "float32" and config.param_dtype == "float32"
  params_raw = jax.device_put(params)
  params = prepare_decode_params(params_raw, config)  # once per policy version, as a rollout does
  config_q8 = config.replace(decode_quant="int8")
  params_q8 = prepare_decode_params(params_raw, config_q8) if _INT8.value else None
  ids = render_chat(tokenizer, _PROMPT)
  rows, record = [], {}

  logging.info("Compiling decode (batch 1, %d tokens)...", n)
  lower_s, compile_s = compile_decode_s(params, config, ids, n)
  rows.append(dict(name=f"compile decode (30 layers, B=1)", ours=f"{compile_s:.1f} s",
                   reference=f"trace+lower {lower_s:.1f} s"))
  record["compile"] = {"lower_s": lower_s, "compile_s": compile_s}

  logging.info("Matmul dtype at batch 1...")
  roof_inputs = roofline_inputs(params_raw, jnp.float32)
  f32 = min(roofline_step_s(roof_inputs, 1).values())
  bf16 = min(roofline_step_s(roofline_inputs(params_raw, jnp.bfloat16), 1).values())
  rows.append(dict(name="matmul step B=1: f32 vs bf16", ours=f"f32 {1e3 * f32:.1f} ms",
                   reference=f"bf16 {1e3 * bf16:.1f} ms", ratio=bf16 / f32))
  record["matmul_dtype"] = {"float32_s": f32, "bfloat16_s": bf16}

  hf_new = lambda b: n if b <= 16 else min(n, _HF_MAX_NEW_TOKENS.value)
  hf = hf_decode_s(ids, batch_sizes, hf_new, _HF_REPEATS.value) if _HF.value else None
  record["decode"] = {}
  for batch in batch_sizes:
    logging.info("Decode at batch %d...", batch)
    # Decode and roofline runs alternate, so a change in machine load hits both alike.
    run_decode = decode_runner(params, config, ids, batch, n)
    ours_runs, roof_runs = [], []
    for _ in range(repeats):
      ours_runs.append(run_decode() / n)
      roof_runs.append(roofline_step_s(roof_inputs, batch))
    ours = statistics.median(ours_runs)
    variants = {k: statistics.median(r[k] for r in roof_runs) for k in roof_runs[0]}
    roof = min(variants.values())
    entry = {"step_s": ours, "tokens_per_s": batch / ours, "roofline_step_s": roof,
             "roofline_variants_s": variants}
    if hf is not None:
      hf_step, hf_tokens = hf[batch]
      target = _TARGET_HF.get(batch)
      note = "" if hf_tokens == n else f", {hf_tokens} tok"
      rows.append(dict(name=f"decode B={batch}: vs HF generate", ours=f"{batch / ours:.1f} tok/s",
                       reference=f"{batch / hf_step:.1f} tok/s{note}", ratio=hf_step / ours,
                       target=None if target is None else f">={target}",
                       **{"pass": None if target is None else hf_step / ours >= target}))
      entry.update(hf_step_s=hf_step, hf_tokens_per_s=batch / hf_step, hf_new_tokens=hf_tokens)
    rows.append(dict(name=f"decode B={batch}: step vs roofline", ours=f"{1e3 * ours:.1f} ms",
                     reference=f"{1e3 * roof:.1f} ms ({batch / roof:.0f} t/s)", ratio=ours / roof,
                     target=f"<={_TARGET_ROOFLINE}", **{"pass": ours / roof <= _TARGET_ROOFLINE}))
    if params_q8 is not None:
      rows.extend(_int8_rows(entry, params_q8, config_q8, ids, batch, n, repeats, ours, roof,
                             None if hf is None else hf[batch][0]))
    record["decode"][batch] = entry

  k, obs, m, eb = _TURNS.value, _OBS_TOKENS.value, _TURN_TOKENS.value, _EPISODE_BATCH.value
  logging.info("Episode: %d turns x (extend %d, decode %d) at batch %d...", k, obs, m, eb)
  multi, single = episode_s(params, config, ids, eb, k, obs, m, _EPISODE_REPEATS.value)
  rows.append(dict(name=f"episode {k}x(+{obs} obs, {m} dec) B={eb}", ours=f"{1e3 * multi:.0f} ms",
                   reference=f"1 turn {1e3 * single:.0f} ms", ratio=multi / single,
                   target=f"<={_TARGET_EPISODE}", **{"pass": multi / single <= _TARGET_EPISODE}))
  record["episode"] = {"multi_s": multi, "single_s": single, "turns": k, "obs_tokens": obs,
                       "turn_tokens": m, "batch": eb}

  attention = _attention_name(config)
  print(f"SmolLM2-135M float32, prompt {len(ids)} tokens, {n} new tokens, jax {jax.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, decode attention: {attention}")
  record["attention"] = attention
  print_table(rows)
  if _OUT.value:
    results_io.write_json(_OUT.value, {"rows": rows, "measurements": record,
                                       "prompt_tokens": len(ids), "new_tokens": n})


if __name__ == "__main__":
  app.run(main)
