r"""Throughput of asynchronous against synchronous rollouts under heavy-tailed tool latency, in one run.

    python experiments/benchmarks/async_vs_sync.py [--updates=10] [--modes=sync,async:1:1,...]
        [--latency=lognormal|pareto] [--latency_ms=40] [--latency_shape=1.0]
        [--out=results/async_vs_sync.json] [--config=configs/default.py:smoke] [--config.x=...]

Setup: the config's environment, model and update (default `configs/default.py:smoke`: pointer
chain, the 2-layer d=128 decoder, 4 tasks x 4 rollouts, 2 epochs x 2 minibatches; no SFT warm
start, and a 0.1 penalty per invalid action, so rewards vary within groups and every update
moves the parameters, i.e. stale batches really are off-policy). Everything is compiled first by
untimed synchronous updates on other batches.

Tool latency: after every batched environment step, every row that stepped draws a latency
(`lognormal`: median `latency_ms`, log-sd `latency_shape`; `pareto`: minimum `latency_ms`, tail
index `latency_shape`) and the batch sleeps for the largest (a batched tool call waits for its
slowest call). Draws are seeded by (batch index, step), so every mode meets the same latencies.

Modes (`--modes`), each from the same initial parameters for `--updates` updates of batches
0, 1, ...: `sync` (`Learner.step`: sample, then learn), `async:A:S` (`AsyncRollouts` with `A`
actor threads and `max_staleness` `S`, drop policy), and `partial:A:S` / `partial-reprefill:A:S`
(the same with partial rollouts across updates, `rollout.continue_partial`, the KV cache kept or
recomputed at a switch). Measured per mode: wall time, trained episodes/s and updates/s, speed-up
over `sync`, mean and max policy lag, dropped-episode rate, learner idle share (waiting for a
batch; for sync, the rollout share), actor idle share (actors waiting for admission or queue
space; for sync, the update share), and the episode-length bias of the staleness filter: the mean
policy tokens per episode over the episodes received, over those the filter kept any token of
and over those it dropped whole (episode-weighted over the run), with the mean token lag and the
count of episodes that spanned versions. `--warm_start` starts every mode from the config's SFT
warm start: with `configs/async_lengths.py` (one gridworld task of a 2-8 move route per batch)
batches differ in length, so the filter's length bias shows. Prints one table;
`--out` writes the rows as JSON.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import results_io  # noqa: E402
from latency import Latency, parse_mode  # noqa: E402  (flag-free, importable by tests)
from longhorizon.train.learner import Learner  # noqa: E402
from longhorizon.train.async_rollout import AsyncRollouts  # noqa: E402
from longhorizon.train.metrics import Timer  # noqa: E402

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(_ROOT, "configs", "default.py") + ":smoke",
    "Training config whose environment, model and update are measured.")
_OUT = flags.DEFINE_string("out", None, "Optional JSON path for the result rows.")
_UPDATES = flags.DEFINE_integer("updates", 10, "Timed updates per mode.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed sync updates first (compilation).")
_MODES = flags.DEFINE_list("modes", ["sync", "async:1:1", "async:2:2", "async:4:4"],
                           "sync, or KIND:ACTORS:MAX_STALENESS with KIND async, partial "
                           "(partial rollouts, cache kept) or partial-reprefill.")
_LATENCY = flags.DEFINE_enum("latency", "lognormal", ["lognormal", "pareto", "none"],
                             "Per-call tool latency distribution.")
_LATENCY_MS = flags.DEFINE_float("latency_ms", 40.0,
                                 "lognormal: median; pareto: minimum (milliseconds).")
_LATENCY_SHAPE = flags.DEFINE_float("latency_shape", 1.0,
                                    "lognormal: sigma of log-latency; pareto: tail index alpha.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the latency draws.")
_WARM_START = flags.DEFINE_bool(
    "warm_start", False, "Start every mode from the config's SFT warm start (sft.steps) instead of "
    "fresh parameters: a policy whose episodes end at different lengths (configs/async_lengths.py).")


def _fresh_state(s, host_state):
  return jax.tree.map(jnp.array, host_state)  # new device buffers (the update donates them)


def run_sync(s, host_state, updates: int, latency: Latency) -> dict:
  state = _fresh_state(s, host_state)
  n = s.config.rollout.num_tasks
  rollout_s = update_s = 0.0
  start = time.perf_counter()
  for u in range(updates):
    timer = Timer()
    batch, stats = s.collect_batch(state.params, u, u * n, timer, on_env_step=latency.hook(u))
    state, metrics = s.learn(state, batch, stats, timer)
    split = timer.split()
    rollout_s += split["time/rollout"]
    update_s += split["time/update"]
  wall = time.perf_counter() - start
  return {"wall_s": wall, "lag_mean": 0.0, "lag_max": 0.0, "dropped_episode_rate": 0.0,
          "learner_idle_frac": rollout_s / wall, "actor_idle_frac": update_s / wall,
          "final_loss": metrics["loss"], "sampled_length_mean": float("nan"),
          "admitted_length_mean": float("nan"), "dropped_length_mean": float("nan"),
          "token_lag_mean": 0.0, "partial_episodes": 0.0}


def run_async(s, host_state, updates: int, latency: Latency, actors: int, staleness: int,
              kind: str = "async") -> dict:
  config = s.config.copy_and_resolve_references()
  config.unlock()
  config.rollout.mode = "async"
  config.rollout.continue_partial = kind != "async"
  config.rollout.partial_cache = "reprefill" if kind == "partial-reprefill" else "keep"
  config.rollout.num_actors = actors
  config.rollout.max_staleness = staleness
  config.rollout.queue_size = max(staleness, 1) + actors
  config.lock()
  s = s.with_config(config)
  # Compile this learner's update outside the timing (batch 10^6: not one of the timed ones).
  warm = _fresh_state(s, host_state)
  batch, stats = s.collect_batch(warm.params, 10**6, 10**6 * config.rollout.num_tasks, Timer())
  s.learn(warm, batch, stats, Timer())
  state = _fresh_state(s, host_state)
  rows = []
  start = time.perf_counter()
  pipeline = AsyncRollouts(s, state.params, version=0, first_batch=0, data_position=0,
                           last_update=updates, env_step_hook=latency.hook).start()
  try:
    for u in range(updates):
      state, metrics = pipeline.step(state, u, Timer())
      rows.append(metrics)
    wall = time.perf_counter() - start
  finally:
    pipeline.close()
  total = lambda k: float(sum(r[k] for r in rows))
  received = total("async/lag_count/stale") + sum(
      total(f"async/lag_count/{i}") for i in range(staleness + 1))
  idle, busy = total("async/actor_idle_s"), total("async/actor_busy_s")
  # Episode-weighted lengths over the whole run (each update's means are over the episodes it
  # received / kept; kept = received - dropped), and the mean length of the dropped episodes.
  got = [sum(r[f"async/lag_count/{i}"] for i in range(staleness + 1))
         + r["async/lag_count/stale"] for r in rows]
  kept = [g - r["async/dropped_episodes"] for g, r in zip(got, rows)]
  sampled_sum = sum(r["async/sampled_length_mean"] * g for r, g in zip(rows, got))
  admitted_sum = sum(r["async/admitted_length_mean"] * k for r, k in zip(rows, kept))
  dropped = total("async/dropped_episodes")
  return {"wall_s": wall,
          "lag_mean": float(np.mean([r["async/lag_mean"] for r in rows])),
          "lag_max": max(r["async/lag_max"] for r in rows),
          "dropped_episode_rate": total("async/dropped_episodes") / max(received, 1),
          "learner_idle_frac": total("async/learner_idle_s") / wall,
          "actor_idle_frac": idle / max(idle + busy, 1e-9),
          "final_loss": rows[-1]["loss"],
          "sampled_length_mean": sampled_sum / max(sum(got), 1),
          "admitted_length_mean": admitted_sum / max(sum(kept), 1),
          "dropped_length_mean": ((sampled_sum - admitted_sum) / dropped if dropped
                                  else float("nan")),
          "token_lag_mean": float(np.mean([r["async/token_lag_mean"] for r in rows])),
          "partial_episodes": total("async/partial_episodes")}


def print_table(rows):
  header = (f"{'mode':<24} {'actors':>6} {'stale':>5} {'wall s':>8} {'episodes/s':>10} "
            f"{'updates/s':>9} {'speed-up':>8} {'lag mean':>8} {'lag max':>7} {'dropped':>7} "
            f"{'learner idle':>12} {'actor idle':>10} {'len sampled':>11} {'len admitted':>12} "
            f"{'len dropped':>11} "
            f"{'token lag':>9} {'partial':>7}")
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['mode']:<24} {r['actors']:>6} {r['max_staleness']:>5} {r['wall_s']:>8.1f} "
          f"{r['episodes_per_s']:>10.2f} {r['updates_per_s']:>9.3f} {r['speedup']:>7.2f}x "
          f"{r['lag_mean']:>8.2f} {r['lag_max']:>7.0f} {r['dropped_episode_rate']:>7.2f} "
          f"{r['learner_idle_frac']:>12.2f} {r['actor_idle_frac']:>10.2f} "
          f"{r['sampled_length_mean']:>11.1f} {r['admitted_length_mean']:>12.1f} "
          f"{r['dropped_length_mean']:>11.1f} "
          f"{r['token_lag_mean']:>9.2f} {r['partial_episodes']:>7.0f}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  modes = [parse_mode(m) for m in _MODES.value]
  config = _CONFIG.value.copy_and_resolve_references()
  config.unlock()
  if not _WARM_START.value:
    config.sft.steps = 0  # throughput only: no warm start
  config.reward.invalid = 0.1  # rewards vary within groups: every update moves the parameters
  config.rollout.mode = "sync"
  config.tensorboard = config.progress = False
  config.lock()
  logging.info("devices: %s", jax.devices())
  s = Learner.build(config)
  latency = Latency(_LATENCY.value, _LATENCY_MS.value, _LATENCY_SHAPE.value, _SEED.value)
  with s.in_mesh():
    initial, sft = s.initial_state(), {}
    if _WARM_START.value:  # one warm start, every mode from it (as a run's RL starts)
      initial, sft = s.warm_start(initial)
      initial = s.with_reference(initial)
    host_state = jax.device_get(initial)
    state = _fresh_state(s, host_state)
    n = config.rollout.num_tasks
    for u in range(_WARMUP.value):  # compile sampler buckets and the update (batches 10^6 + u)
      state, _ = s.step(state, 10**6 + u, (10**6 + u) * n, Timer())
    jax.block_until_ready(jax.tree.map(jnp.copy, state.params))  # the publishing copy, compiled
    rows = []
    episodes = config.rollout.num_tasks * config.rollout.group_size
    for name, actors, staleness in modes:
      logging.info("mode %s (actors %d, max_staleness %d)", name, actors, staleness)
      if name == "sync":
        result = run_sync(s, host_state, _UPDATES.value, latency)
      else:
        result = run_async(s, host_state, _UPDATES.value, latency, actors, staleness, name)
      result.update(mode=name if name == "sync" else f"{name}:{actors}:{staleness}",
                    actors=actors, max_staleness=staleness,
                    updates_per_s=_UPDATES.value / result["wall_s"],
                    episodes_per_s=_UPDATES.value * episodes / result["wall_s"])
      rows.append(result)
  base = next((r for r in rows if r["mode"] == "sync"), rows[0])
  for r in rows:
    r["speedup"] = r["updates_per_s"] / base["updates_per_s"]
  print(f"async vs sync: {config.env.name}, {config.rollout.num_tasks} tasks x "
        f"{config.rollout.group_size} rollouts per update, {_UPDATES.value} updates per mode; "
        f"tool latency {latency.kind} ({latency.ms:g} ms, shape {latency.shape:g}), the batch "
        f"waits for its slowest call")
  print_table(rows)
  if _OUT.value:
    settings = {"updates": _UPDATES.value, "latency": dataclasses.asdict(latency),
                "env": config.env.name, "num_tasks": config.rollout.num_tasks,
                "group_size": config.rollout.group_size, "episodes_per_update": episodes,
                "warm_start": {"sft_steps": config.sft.steps if _WARM_START.value else 0,
                               **{k: float(v) for k, v in sft.items()
                                  if isinstance(v, (int, float))}}}
    out = results_io.write_json(_OUT.value, {"settings": settings, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
