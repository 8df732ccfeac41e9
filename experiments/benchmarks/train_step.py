r"""Model-FLOPs utilisation (MFU) of the RL update (`train.rl_update`) against a float32 matmul peak.

  python experiments/benchmarks/train_step.py --out=results/train_step.json
  python experiments/benchmarks/train_step.py --smoke          # tiny model, runs in seconds
  python experiments/benchmarks/train_step.py --batch=16 --length=256   # same tokens, less attention

What is measured (all in one process, so the ratio shares the machine's state):

* **update**: one `rl_update` (GRPO-style inputs: advantages `[B, L]`, no returns, row weights 1,
  old log-probs, no reference, no critic) with one epoch of one minibatch (`jit_rl_update`'s defaults) and
  `make_optimizer(1e-4)` (AdamW + global-norm clipping) on a Llama-style float32 decoder
  (`tiny_config()` with the width/depth flags; tied embeddings). The batch is a synthetic but valid
  `EpisodeBatch` (`validate()` passes): full rows, positions `arange(L)`, a prompt span then
  `--steps` turns of action (loss mask on) and observation tokens, about 60% of positions on the loss
  mask, behaviour and old log-probs equal to the model's own (every importance ratio is 1), random
  advantages on the loss mask. The update is compiled ahead of time (`lower(...).compile()`, timed);
  every timed call starts from a fresh copy of the same initial state (the state is donated; the copy
  is not timed), so each call computes the same thing; the median of `--repeats` calls is reported.
* **peak**: a jitted `N x N @ N x N` float32 matmul (`--peak_size`), `--peak_calls` calls after
  each timed update (so a change in machine load hits both); peak FLOP/s is the best call.
* **model FLOPs** of one update, analytic (PaLM-style MFU, arXiv:2204.02311 app. B):

      6 * N_layers * B * L            (q/k/v/o, gate/up/down of every block: forward 2N, backward 4N)
    + 6 * N_unembed * B * (L - 1)     (the unembedding inside the fused log-prob kernel; L - 1 scored)
    + 3 * 4 * B * P(L) * H * hd * n_layers  (scores and values of the P(L) query-key pairs
                                              computed: `llama.causal_attention` skips the tiles
                                              above the diagonal, P(512) = 0.625 * 512^2)

  times `epochs` (each epoch passes every row once, whatever `minibatches`). `N` comes from the actual
  parameter shapes (every `kernel`, plus the unembedding); the embedding gather, norms, softmax and the
  optimiser are not counted. The fused log-prob kernel's body is rematerialised (`jax.checkpoint`), so
  the backward pass recomputes the unembedding forward, `2 * N_unembed * B * (L - 1)`: that is
  implementation work, not model work, so it enters the hardware-FLOPs utilisation (HFU) row only.
  XLA's own count (`compiled.cost_analysis()['flops']`) is the cross-check. XLA counts a while
  loop's body once, whatever its trip count, so on the benchmarked update (layers under `nn.scan`,
  the vocabulary-chunk and minibatch scans) it sees about one layer. So a twin of the update with a
  single layer and a single vocabulary chunk (every loop runs once; same B, L, widths) is compiled
  too, and its XLA count is set beside the analytic hardware count of that twin: XLA also counts
  elementwise work (softmax, norms, AdamW), so it should be a little above, not below.

MFU = model FLOPs / median update seconds / peak FLOP/s. Target (at d_model >= 512): MFU >= 35%.
On a shared machine the best peak may catch a quiet moment the median update did not (MFU biased
low; a warning is logged when update times spread over 1.2x), so the table also gives the best
update against the best peak (both the machine at its quietest), and each round's MFU against the
peak measured right after that update (median [min-max]; biased high under load, where the
two-thread matmul loses more to a competing process than the update does).
Prints one table; `--out` writes the rows and the measurements as JSON.
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
from longhorizon.core import episode as episode_lib
from longhorizon.models import ModelConfig, init_params, llama, tiny_config, unembedding
from longhorizon.train.policy_losses import LossOptions
from longhorizon.train.update import (LearnInputs, TrainState, episode_logprobs, jit_rl_update,
                                      make_optimizer)

_HIDDEN = flags.DEFINE_integer("hidden_size", 512, "Model width D (the MFU target applies at >= 512).")
_LAYERS = flags.DEFINE_integer("layers", 4, "Decoder blocks.")
_HEADS = flags.DEFINE_integer("heads", 8, "Query heads H (head_dim = D / H).")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 8, "Key/value heads (H % kv_heads == 0).")
_INTERMEDIATE = flags.DEFINE_integer("intermediate", 2048, "SwiGLU hidden width F.")
_VOCAB = flags.DEFINE_integer("vocab", 1024, "Vocabulary size V (tied embeddings).")
_BATCH = flags.DEFINE_integer("batch", 8, "Episodes per update B.")
_LENGTH = flags.DEFINE_integer("length", 512, "Context length L (tokens per episode).")
_STEPS = flags.DEFINE_integer("steps", 4, "Environment steps (turns) per synthetic episode.")
_CHUNK = flags.DEFINE_integer("chunk_size", 4096,
                              "LossOptions.chunk_size: vocabulary chunk of the fused log-prob kernel.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed updates (median reported).")
_PEAK_SIZE = flags.DEFINE_integer("peak_size", 2048, "N of the N x N @ N x N float32 peak matmul.")
_PEAK_CALLS = flags.DEFINE_integer("peak_calls", 3, "Peak matmuls after each timed update (best kept).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the parameters, tokens and advantages.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Quick run: D=64, 2 layers, 4/2 heads, F=128, V=256, B=2, "
                           "L=64, 2 repeats, 256^3 peak (overrides those flags).")
_OUT = flags.DEFINE_string("out", None, "Optional JSON path for the result rows (parents created).")

# DESIGN.md-style performance bar: MFU of the RL update at d_model >= _TARGET_WIDTH.
_TARGET_MFU = 0.35
_TARGET_WIDTH = 512
_LOSS_FRACTION = 0.6  # share of positions on the loss mask (policy-sampled tokens)
_PROMPT_FRACTION = 0.1  # share of positions in the prompt span


@dataclasses.dataclass(frozen=True)
class Shape:
  """Everything the benchmark's size depends on."""
  hidden_size: int
  layers: int
  heads: int
  kv_heads: int
  intermediate: int
  vocab: int
  batch: int  # B episodes
  length: int  # L tokens per episode
  steps: int  # S environment steps per episode

  def model_config(self) -> ModelConfig:
    return dataclasses.replace(
        tiny_config(), vocab_size=self.vocab, hidden_size=self.hidden_size,
        intermediate_size=self.intermediate, num_hidden_layers=self.layers,
        num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=None,
        max_position_embeddings=max(4096, self.length), dtype="float32", param_dtype="float32")


_SMOKE_SHAPE = Shape(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256,
                     batch=2, length=64, steps=2)


# -------------------------------------------------------------------------------------------- FLOPs

def attention_pairs(length: int, block: int | None = None) -> int:
  """(query, key) pairs `llama.causal_attention` scores for one row and head: query block `i` (of
  `block` queries) scores the keys up to its last query, so the tiles above the diagonal are
  skipped and those on it are computed whole."""
  block = block or llama.ATTENTION_BLOCK
  return sum((min(s + block, length) - s) * min(s + block, length) for s in range(0, length, block))


def update_flops(params, config: ModelConfig, batch: int, length: int, epochs: int = 1) -> dict:
  """Analytic FLOPs of one `rl_update` (see the module docstring), counted from parameter shapes.

  Args:
    params: `Transformer(config)` parameters (arrays or `jax.ShapeDtypeStruct`s).
    config: the model config (`num_attention_heads * head_dim` is the attention width).
    batch: `B` episodes; length: `L` tokens per episode; epochs: passes over the batch.

  Returns:
    dict of `layer_params` (matmul parameters of all blocks), `unembed_params`, and FLOPs: `layers`,
    `unembed`, `attention`, `model` (their sum, times `epochs`), `recompute` (the unembedding forward
    the rematerialised log-prob kernel repeats in the backward pass) and `hardware` (model +
    recompute).
  """
  kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params["layers"])
             if getattr(path[-1], "key", None) == "kernel"]
  layer_params = sum(int(np.prod(k.shape)) for k in kernels)  # [n_layers, in, out] each
  unembed_params = int(np.prod(unembedding(params, config).shape))
  tokens, scored = batch * length, batch * (length - 1)
  attention_width = config.num_attention_heads * config.dims_per_head
  flops = {
      "layers": 6 * layer_params * tokens,
      "unembed": 6 * unembed_params * scored,
      # Forward: q.k^T and p.v, 2 * width FLOPs per (query, key) pair each, over the pairs the
      # block-causal attention computes (the tiles on and below the diagonal).
      "attention": 3 * 4 * batch * attention_pairs(length) * attention_width
                   * config.num_hidden_layers,
  }
  flops = {k: v * epochs for k, v in flops.items()}
  model = sum(flops.values())
  recompute = 2 * unembed_params * scored * epochs
  return dict(layer_params=layer_params, unembed_params=unembed_params, **flops, model=model,
              recompute=recompute, hardware=model + recompute)


def xla_flops(compiled) -> float | None:
  """`cost_analysis()['flops']` of a compiled function, or None where the backend gives none."""
  try:
    cost = compiled.cost_analysis()
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("cost_analysis() failed: %s", e)
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return None
  return float(cost["flops"])


def xla_twin_check(config: ModelConfig, args, optimizer, options: LossOptions, seed: int) -> dict:
  """XLA's and the analytic count of a one-layer, one-vocabulary-chunk twin of the update.

  Compiled from abstract shapes (nothing runs): every loop of the twin has one trip, so XLA's count
  covers all of its work. Returns `xla` (None where the backend gives no count) and `analytic` (the
  twin's hardware FLOPs: model FLOPs plus the log-prob kernel's recompute)."""
  twin = config.replace(num_hidden_layers=1)
  twin_options = dataclasses.replace(options, chunk_size=twin.vocab_size)
  params = jax.eval_shape(lambda: init_params(twin, jax.random.key(seed)))
  state = jax.eval_shape(lambda p: initial_state(p, optimizer, seed), params)
  compiled = jit_rl_update(config=twin, optimizer=optimizer, critic_optimizer=None,
                           loss=twin_options).lower(state, *args).compile()
  b, l = args[0].tokens.shape
  return {"xla": xla_flops(compiled), "analytic": update_flops(params, twin, b, l)["hardware"]}


# -------------------------------------------------------------------------------------------- batch

def synthetic_batch(shape: Shape, rng: np.random.Generator) -> episode_lib.EpisodeBatch:
  """A valid, full-length `EpisodeBatch` (host arrays): a prompt span (turn -1), then `steps` turns
  of action tokens (loss mask on, turn `s`) followed by observation tokens (turn `s`, loss mask off),
  about `_LOSS_FRACTION` of positions on the loss mask. Log-probs are left 0 (filled by the caller)."""
  b, l, s = shape.batch, shape.length, shape.steps
  prompt = max(1, int(round(_PROMPT_FRACTION * l)))
  span = (l - prompt) // s  # one turn: action then observation
  action = max(1, int(round(_LOSS_FRACTION * l / s)))
  if span < action + 1:
    raise ValueError(f"length={l} leaves {span} tokens per turn for steps={s}; need more than "
                     f"{action} (the action span). Use a longer --length or fewer --steps.")
  batch = episode_lib.empty(b, l, s)
  tokens = rng.integers(0, shape.vocab, size=(b, l), dtype=np.int32)
  turn = np.full((l,), -1, np.int32)
  loss = np.zeros((l,), bool)
  for step in range(s):  # host-side layout of one row (shared by all rows)
    start = prompt + step * span
    end = l if step == s - 1 else start + span
    turn[start:end] = step
    loss[start:start + action] = True
  success = rng.random(b) < 0.5
  return batch.replace(
      tokens=tokens, positions=np.broadcast_to(np.arange(l, dtype=np.int32), (b, l)).copy(),
      attention_mask=np.ones((b, l), bool), loss_mask=np.broadcast_to(loss, (b, l)).copy(),
      turn=np.broadcast_to(turn, (b, l)).copy(), step_mask=np.ones((b, s), bool),
      num_steps=np.full((b,), s, np.int32),
      rewards=np.where(np.arange(s)[None] == s - 1, success[:, None], 0.0).astype(np.float32),
      success=success, terminated=np.ones((b,), bool),
      termination=np.where(success, episode_lib.Termination.SUCCESS,
                           episode_lib.Termination.FAILURE).astype(np.int32),
      score=success.astype(np.float32), group=np.arange(b, dtype=np.int32) // 4,
      anchor=rng.integers(0, 2**32, size=(b, s), dtype=np.uint32))


def update_inputs(shape: Shape, seed: int):
  """`(config, state, args)`: the model config, an initial `TrainState` and the dynamic arguments of
  `rl_update` (the batch, and its `LearnInputs`: advantages, row weights, old log-probs) on device."""
  config = shape.model_config()
  params = init_params(config, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  batch = episode_lib.to_device(synthetic_batch(shape, rng))
  logprobs = jax.jit(episode_logprobs, static_argnames=("config",))
  logp = logprobs(params, config, batch)
  loss_mask = jnp.asarray(batch.loss_mask)
  batch = batch.replace(behavior_logprobs=jnp.where(loss_mask, logp, 0.0))
  jax.tree.map(np.asarray, batch).validate()
  advantages = jnp.asarray(rng.normal(size=loss_mask.shape).astype(np.float32)) * loss_mask
  row_weight = jnp.ones((shape.batch,), jnp.float32)
  return config, params, (batch, LearnInputs(advantages, None, row_weight, logp, None, None))


def initial_state(params, optimizer, seed: int) -> TrainState:
  return TrainState(params=params, opt_state=optimizer.init(params), critic_params=None,
                    critic_opt_state=None, step=jnp.zeros((), jnp.int32),
                    policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(seed + 1),
                    skipped=jnp.zeros((), jnp.int32))


# ------------------------------------------------------------------------------------------- timing

def _timed(fn, *args):
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, out


def peak_runner(size: int, seed: int):
  """A function returning the seconds of each of `calls` jitted `size^3` float32 matmuls."""
  rng = np.random.default_rng(seed)
  a, b = (jnp.asarray(rng.normal(size=(size, size)).astype(np.float32)) for _ in range(2))
  matmul = jax.jit(jnp.matmul)
  jax.block_until_ready(matmul(a, b))
  return lambda calls: [_timed(matmul, a, b)[0] for _ in range(calls)]


# -------------------------------------------------------------------------------------------- table

def print_table(rows):
  header = f"{'measurement':<38} {'value':>22} {'reference':>36} {'target':>8} {'ok':>4}"
  print(header)
  print("-" * len(header))
  for r in rows:
    ok = "-" if r.get("pass") is None else ("yes" if r["pass"] else "NO")
    print(f"{r['name']:<38} {r['value']:>22} {r.get('reference') or '-':>36} "
          f"{r.get('target') or '-':>8} {ok:>4}")


def _fmt(value, spec):
  return "n/a" if value is None else format(value, spec)


def _g(flops):
  return "n/a" if flops is None else f"{flops / 1e9:,.4g} GFLOP"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _SMOKE.value:
    shape, repeats, peak_size, peak_calls = _SMOKE_SHAPE, 2, 256, 2
  else:
    shape = Shape(hidden_size=_HIDDEN.value, layers=_LAYERS.value, heads=_HEADS.value,
                  kv_heads=_KV_HEADS.value, intermediate=_INTERMEDIATE.value, vocab=_VOCAB.value,
                  batch=_BATCH.value, length=_LENGTH.value, steps=_STEPS.value)
    repeats, peak_size, peak_calls = _REPEATS.value, _PEAK_SIZE.value, _PEAK_CALLS.value
  devices = jax.devices()
  logging.info("jax %s, backend %s, devices %s, XLA_FLAGS=%r", jax.__version__,
               jax.default_backend(), devices, os.environ.get("XLA_FLAGS", ""))

  config, params, args = update_inputs(shape, _SEED.value)
  optimizer = make_optimizer(1e-4)
  options = LossOptions(agg="token-mean", chunk_size=_CHUNK.value)
  state0 = initial_state(params, optimizer, _SEED.value)

  logging.info("Compiling rl_update (B=%d, L=%d, D=%d, %d layers)...", shape.batch, shape.length,
               shape.hidden_size, shape.layers)
  start = time.perf_counter()
  update = jit_rl_update(config=config, optimizer=optimizer, critic_optimizer=None,
                         loss=options).lower(state0, *args).compile()  # one epoch, one minibatch
  compile_s = time.perf_counter() - start
  counted = update_flops(params, config, shape.batch, shape.length, 1)
  xla = xla_flops(update)
  logging.info("Compiling the one-layer twin for XLA's FLOP count...")
  twin = xla_twin_check(config, args, optimizer, options, _SEED.value)

  fresh = lambda: jax.block_until_ready(jax.tree.map(jnp.copy, state0))
  _, (_, metrics) = _timed(update, fresh(), *args)  # warm-up: first-run allocations
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  if metrics["skipped_updates"] or abs(metrics["ratio_mean"] - 1.0) > 1e-3:
    raise RuntimeError(f"the benchmark update is not a plain first step: {metrics}")

  peak = peak_runner(peak_size, _SEED.value)
  peak_flops = 2.0 * peak_size**3
  step_times, peak_times, round_mfu = [], [], []
  for i in range(repeats):  # updates and peak matmuls alternate, so load changes hit both alike
    seconds, _ = _timed(update, fresh(), *args)
    round_peak = peak(peak_calls)
    step_times.append(seconds)
    peak_times.extend(round_peak)
    round_mfu.append(counted["model"] / seconds / (peak_flops / min(round_peak)))
    logging.info("update %d: %.3f s, peak %.1f GFLOP/s", i, seconds,
                 peak_flops / min(round_peak) / 1e9)

  step_s = statistics.median(step_times)
  peak_rate = peak_flops / min(peak_times)
  model_rate = counted["model"] / step_s
  mfu = model_rate / peak_rate
  hfu = counted["hardware"] / step_s / peak_rate
  best_mfu = counted["model"] / min(step_times) / peak_rate
  spread = max(step_times) / min(step_times)
  if spread > 1.2:
    logging.warning("update times vary %.2fx (%s s): the machine's load changed during the run, and "
                    "median-update / best-peak MFU is biased low; rerun on a quiet machine or compare "
                    "the best-update MFU row.", spread, ", ".join(f"{t:.2f}" for t in step_times))
  tokens = shape.batch * shape.length  # one epoch
  applies = shape.hidden_size >= _TARGET_WIDTH
  twin_ratio = None if twin["xla"] is None else twin["xla"] / twin["analytic"]
  rows = [
      dict(name=f"rl_update step (median of {repeats})", value=f"{step_s:.3f} s",
           reference=f"min {min(step_times):.3f} max {max(step_times):.3f}"),
      dict(name="compile rl_update", value=f"{compile_s:.1f} s"),
      dict(name="model FLOPs / update (analytic)", value=_g(counted["model"]),
           reference=f"XLA {_g(xla)} (scans once)"),
      dict(name="  dense layers (6 N_layers B L)", value=_g(counted["layers"])),
      dict(name="  attention (12 B P(L) H hd n_layers)", value=_g(counted["attention"])),
      dict(name="  unembedding (6 N_unembed B (L-1))", value=_g(counted["unembed"])),
      dict(name="  remat recompute (HFU only)", value=_g(counted["recompute"])),
      dict(name="1-layer twin: XLA vs analytic HW", value=f"XLA {_g(twin['xla'])}",
           reference=f"analytic {_g(twin['analytic'])} x{_fmt(twin_ratio, '.3f')}"),
      dict(name="model GFLOP/s", value=f"{model_rate / 1e9:,.1f}"),
      dict(name=f"peak f32 matmul {peak_size}^3 (best)", value=f"{peak_rate / 1e9:,.1f} GFLOP/s",
           reference=f"median {peak_flops / statistics.median(peak_times) / 1e9:,.1f} GFLOP/s"),
      dict(name=f"MFU (D={shape.hidden_size})", value=f"{100 * mfu:.1f}%",
           reference=f"HFU {100 * hfu:.1f}%", target=f">={100 * _TARGET_MFU:.0f}%",
           **{"pass": (mfu >= _TARGET_MFU) if applies else None}),
      dict(name="MFU (best update / best peak)", value=f"{100 * best_mfu:.1f}%",
           reference=f"per round {100 * statistics.median(round_mfu):.1f}% "
                     f"[{100 * min(round_mfu):.0f}-{100 * max(round_mfu):.0f}%]"),
      dict(name="update tokens/s", value=f"{tokens / step_s:,.0f}",
           reference=f"{tokens} tokens/update"),
  ]
  record = {
      "shape": dataclasses.asdict(shape), "chunk_size": options.chunk_size,
      "model_config": dataclasses.asdict(config), "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "step_s": step_s, "step_times_s": step_times, "compile_s": compile_s,
      "flops": counted, "xla_flops": xla, "xla_twin": twin, "model_flops_per_s": model_rate,
      "peak_size": peak_size, "peak_flops_per_s": peak_rate, "peak_times_s": peak_times,
      "mfu": mfu, "hfu": hfu, "best_mfu": best_mfu, "round_mfu": round_mfu, "target_mfu": _TARGET_MFU,
      "target_applies": applies, "pass": (mfu >= _TARGET_MFU) if applies else None,
      "tokens_per_update": tokens,
      "tokens_per_s": tokens / step_s, "first_update_metrics": metrics,
      "load_average": os.getloadavg(),
  }

  print(f"rl_update float32, B={shape.batch} L={shape.length} D={shape.hidden_size} "
        f"layers={shape.layers} H={shape.heads}/{shape.kv_heads} F={shape.intermediate} "
        f"V={shape.vocab} chunk={min(options.chunk_size, shape.vocab)}, jax {jax.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
  print_table(rows)
  if _OUT.value:
    out = results_io.write_json(_OUT.value, {"rows": rows, "measurements": record})
    logging.info("Wrote %s", out)


if __name__ == "__main__":
  app.run(main)
