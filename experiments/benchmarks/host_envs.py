r"""Host (plain-Python) environments through `EnvPool`: concurrency under tool latency, the pool's
per-step overhead, and the async pipeline against sync, in one run.

    python experiments/benchmarks/host_envs.py [--batch=64] [--turns=10] [--serial_turns=2]
        [--overhead_batch=256] [--overhead_turns=20] [--updates=6] [--out=results/host_envs.json]

Three measurements, each against a baseline measured in the same process:

1. Latency (`LatencyEnv`: every `step` sleeps a lognormal latency, median `--latency_ms`, log-sd
   `--latency_sigma`, drawn from a RNG seeded by (env seed, task, episode seed, step), so every
   backend meets the same latencies). `--batch` rows step `--turns` turns through the pool; per
   turn, the pool's `step` wall time over the slowest call of that turn (1.0 is ideal: a turn of B
   concurrent calls takes max(L), not sum(L)). Mean and max over turns, per backend; the `serial`
   backend (one call after another: about sum(L) / max(L)) is the contrast, over `--serial_turns`
   turns (it takes B x L per turn). Target: thread backend, mean ratio <= 1.5 at B = 64.
2. Overhead (`TrivialEnv`: `step` returns at once). `--overhead_batch` rows, `--overhead_turns`
   turns; the pool's `step` time per turn divided by the rows: the pool's cost per env step, for
   the thread backend (target < 1 ms at B = 256), the process backend (for information) and the
   serial backend (the pool's bookkeeping without threads); `direct ms` is the floor, the same
   instances' `step` called in a plain loop.
3. Training throughput with a host environment: `configs/default.py:smoke` with `LatencyEnv`
   (registered as `bench_latency`), `--updates` timed updates with `rollout.mode` sync
   (`Learner.step`) and async (`AsyncRollouts`, `--actors` actor threads, max staleness
   `--max_staleness`), from the same initial parameters after untimed compilation updates;
   updates/s of each and the ratio async / sync (`--updates=0` skips it).

Prints a markdown table, the CPU model and core count; `--out` writes the results as JSON.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import results_io  # noqa: E402
from longhorizon import envs  # noqa: E402
from longhorizon.envs.host import HostEnvironment, Observation, StepResult  # noqa: E402
from longhorizon.envs.pool import EnvPool, factory_of  # noqa: E402
from longhorizon.eval.provenance import cpu_model  # noqa: E402
from longhorizon.train.async_rollout import AsyncRollouts  # noqa: E402
from longhorizon.train.learner import Learner  # noqa: E402
from longhorizon.train.metrics import Timer  # noqa: E402

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
_OUT = flags.DEFINE_string("out", None, "Optional JSON path for the results.")
_BATCH = flags.DEFINE_integer("batch", 64, "Rows of the latency measurement.")
_TURNS = flags.DEFINE_integer("turns", 10, "Timed turns of the latency measurement per backend.")
_SERIAL_TURNS = flags.DEFINE_integer("serial_turns", 2, "Timed turns of the serial backend.")
_LATENCY_MS = flags.DEFINE_float("latency_ms", 40.0, "Median tool latency (milliseconds).")
_LATENCY_SIGMA = flags.DEFINE_float("latency_sigma", 1.0, "Log-sd of the tool latency.")
_OVERHEAD_BATCH = flags.DEFINE_integer("overhead_batch", 256, "Rows of the overhead measurement.")
_OVERHEAD_TURNS = flags.DEFINE_integer("overhead_turns", 20, "Timed turns of the overhead one.")
_LATENCY_BACKENDS = flags.DEFINE_list("latency_backends", ["thread"],
                                       "Pooled backends of the latency measurement.")
_OVERHEAD_BACKENDS = flags.DEFINE_list("overhead_backends", ["thread", "process", "serial"],
                                       "Backends of the overhead measurement.")
_UPDATES = flags.DEFINE_integer("updates", 6, "Timed updates per mode (0: skip the training part).")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed sync updates first (compilation).")
_ACTORS = flags.DEFINE_integer("actors", 2, "Actor threads of the async mode.")
_STALENESS = flags.DEFINE_integer("max_staleness", 2, "max_staleness of the async mode.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the latency draws.")

TARGET_LATENCY_RATIO = 1.5  # pool step time / slowest call of the turn, mean over turns
TARGET_OVERHEAD_MS = 1.0  # pool time per row-step with a trivial environment
REGISTERED_NAME = "bench_latency"


# ---------------------------------------------------------------------------------- environments
def call_latency_s(median_ms: float, sigma: float, seed: int, task: int, episode_seed: int,
                   step: int) -> float:
  """The seconds step `step` of episode (`task`, `episode_seed`) sleeps (a pure function)."""
  rng = np.random.default_rng([seed, task, episode_seed, step])
  return float(rng.lognormal(np.log(median_ms / 1000.0), sigma)) if sigma or median_ms else 0.0


class LatencyEnv(HostEnvironment):
  """A tool whose every call sleeps a seeded lognormal latency; the episode lasts `horizon` steps.
  The action `go` succeeds (so rewards vary within groups when a policy trains on it)."""

  name = "bench_latency"
  version = "1"

  def __init__(self, median_ms: float = 40.0, sigma: float = 1.0, seed: int = 0,
               horizon: int = 4, reward=None):
    super().__init__(reward=reward)
    self.median_ms, self.sigma, self.seed, self.horizon = median_ms, sigma, seed, horizon
    self._task, self._episode_seed, self._t = 0, 0, 0

  def tasks(self, split, num, seed):
    offset = {"train": 0, "test": 10**6, "ood": 2 * 10**6}[split]
    return [{"id": offset + seed * 10**4 + i} for i in range(num)]

  def reset(self, task, seed):
    self._task, self._episode_seed, self._t = int(task["id"]), int(seed), 0
    return Observation("say go")

  def latency_s(self, task: int, episode_seed: int, step: int) -> float:
    return call_latency_s(self.median_ms, self.sigma, self.seed, task, episode_seed, step)

  def step(self, action):
    time.sleep(self.latency_s(self._task, self._episode_seed, self._t))
    self._t += 1
    ok = action.strip() == "go"
    return StepResult("yes" if ok else "no say go", terminated=ok or self._t >= self.horizon,
                      success=ok)

  def oracle(self):
    return "go"

  def vocabulary(self):
    return ["say", "go", "yes", "no"]


class TrivialEnv(HostEnvironment):
  """`step` returns at once (and never ends the episode): the pool's own cost per call."""

  name = "bench_trivial"

  def tasks(self, split, num, seed):
    return [{"id": i} for i in range(num)]

  def reset(self, task, seed):
    return Observation("ok")

  def step(self, action):
    return StepResult("ok")


# ---------------------------------------------------------------------------------- measurements
def _tasks(batch: int) -> tuple[list[dict], list[int]]:
  return [{"id": r} for r in range(batch)], [1000 + r for r in range(batch)]


def measure_latency(backend: str, batch: int, turns: int, median_ms: float = 40.0,
                    sigma: float = 1.0, seed: int = 0, timeout_s: float = 60.0) -> dict:
  """`batch` rows of `LatencyEnv` stepped `turns` turns through a pool of `backend`: per turn the
  pool's step time and the slowest call's latency (the same latencies for every backend)."""
  env = LatencyEnv(median_ms=median_ms, sigma=sigma, seed=seed, horizon=10**9)
  tasks, seeds = _tasks(batch)
  walls, slowest, sums = [], [], []
  with EnvPool(factory_of(env), backend=backend, timeout_s=timeout_s, retries=0) as pool:
    pool.reset(tasks, seeds)
    for t in range(turns):
      draws = [env.latency_s(task["id"], s, t) for task, s in zip(tasks, seeds)]
      start = time.perf_counter()
      out = pool.step({r: "go" for r in range(batch)})
      walls.append(time.perf_counter() - start)
      slowest.append(max(draws))
      sums.append(sum(draws))
      errors = sum(result.env_error for result in out.values())
      if errors:
        raise RuntimeError(f"{backend}: {errors} environment errors at turn {t}: "
                           f"{next(r for r in out.values() if r.env_error).observation}")
  ratios = np.asarray(walls) / np.asarray(slowest)
  return {"backend": backend, "batch": batch, "turns": turns, "wall_s": walls,
          "slowest_call_s": slowest, "sum_calls_s": sums,
          "ratio_mean": float(ratios.mean()), "ratio_max": float(ratios.max()),
          "turn_s_mean": float(np.mean(walls)), "slowest_s_mean": float(np.mean(slowest))}


def measure_overhead(backend: str, batch: int, turns: int, timeout_s: float = 60.0) -> dict:
  """`batch` rows of `TrivialEnv` through a pool of `backend`: pool step time per row-step (ms),
  after one untimed turn (threads and worker processes started, instances built)."""
  tasks, seeds = _tasks(batch)
  walls = []
  direct = [TrivialEnv() for _ in range(batch)]
  start = time.perf_counter()
  for _ in range(turns):
    for env in direct:
      env.step("x")
  direct_ms = (time.perf_counter() - start) / (turns * batch) * 1000
  with EnvPool(TrivialEnv, backend=backend, timeout_s=timeout_s, retries=0) as pool:
    pool.reset(tasks, seeds)
    pool.step({r: "x" for r in range(batch)})
    for _ in range(turns):
      start = time.perf_counter()
      pool.step({r: "x" for r in range(batch)})
      walls.append(time.perf_counter() - start)
  per_step_ms = np.asarray(walls) / batch * 1000
  return {"backend": backend, "batch": batch, "turns": turns, "turn_s_mean": float(np.mean(walls)),
          "per_step_ms_mean": float(per_step_ms.mean()),
          "per_step_ms_median": float(np.median(per_step_ms)),
          "per_step_ms_max": float(per_step_ms.max()), "direct_ms": direct_ms}


def measure_training(updates: int, warmup: int = 1, actors: int = 2, max_staleness: int = 2,
                     median_ms: float = 40.0, sigma: float = 1.0, seed: int = 0,
                     num_tasks: int = 4, group_size: int = 4) -> list[dict]:
  """Updates/s of sync and async training on `LatencyEnv` (configs/default.py:smoke otherwise;
  the same approach as `async_vs_sync.py`, the latency inside the environment's own calls)."""
  envs.register(REGISTERED_NAME, LatencyEnv, overwrite=True)
  spec = importlib.util.spec_from_file_location("_lh_default_config",
                                                os.path.join(_ROOT, "configs", "default.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("smoke")
  config.unlock()
  config.env.name = REGISTERED_NAME
  config.env.params = {"median_ms": median_ms, "sigma": sigma, "seed": seed, "horizon": 4}
  config.env.max_steps = 4
  config.sft.steps = 0
  config.rollout.num_tasks, config.rollout.group_size = num_tasks, group_size
  config.rollout.mode = "sync"
  config.pool.backend = "thread"
  config.tensorboard = config.progress = False
  config.lock()

  s = Learner.build(config)
  fresh = lambda host: jax.tree.map(jnp.array, host)  # new buffers (the update donates them)
  n = config.rollout.num_tasks
  episodes = n * config.rollout.group_size
  rows = []
  with s.in_mesh():
    host_state = jax.device_get(s.initial_state())
    state = fresh(host_state)
    for u in range(warmup):  # compile sampler buckets and the update (batches 10^6 + u)
      state, _ = s.step(state, 10**6 + u, (10**6 + u) * n, Timer())
    jax.block_until_ready(jax.tree.map(jnp.copy, state.params))

    state = fresh(host_state)
    env_s = 0.0
    start = time.perf_counter()
    for u in range(updates):
      state, metrics = s.step(state, u, u * n, Timer())
      env_s += float(metrics.get("rollout/env_s", 0.0))
    jax.block_until_ready(state.params)
    wall = time.perf_counter() - start
    rows.append({"mode": "sync", "actors": 1, "max_staleness": 0, "wall_s": wall,
                 "lag_mean": 0.0, "env_s": env_s, "final_loss": float(metrics["loss"])})

    async_config = config.copy_and_resolve_references()
    async_config.unlock()
    async_config.rollout.mode = "async"
    async_config.rollout.num_actors = actors
    async_config.rollout.max_staleness = max_staleness
    async_config.rollout.queue_size = max(max_staleness, 1) + actors
    async_config.lock()
    a = s.with_config(async_config)
    warm = fresh(host_state)  # compile this learner's update outside the timing
    batch, stats = a.collect_batch(warm.params, 2 * 10**6, 2 * 10**6 * n, Timer())
    a.learn(warm, batch, stats, Timer())
    state = fresh(host_state)
    lags, env_s = [], 0.0
    start = time.perf_counter()
    pipeline = AsyncRollouts(a, state.params, version=0, first_batch=0, data_position=0,
                             last_update=updates).start()
    try:
      for u in range(updates):
        state, metrics = pipeline.step(state, u, Timer())
        lags.append(float(metrics["async/lag_mean"]))
        env_s += float(metrics.get("rollout/env_s", 0.0))
      jax.block_until_ready(state.params)
      wall = time.perf_counter() - start
    finally:
      pipeline.close()
    rows.append({"mode": f"async:{actors}:{max_staleness}", "actors": actors,
                 "max_staleness": max_staleness, "wall_s": wall, "lag_mean": float(np.mean(lags)),
                 "env_s": env_s, "final_loss": float(metrics["loss"])})
  for r in rows:
    r["updates"] = updates
    r["updates_per_s"] = updates / r["wall_s"]
    r["episodes_per_s"] = updates * episodes / r["wall_s"]
    r["speedup"] = r["updates_per_s"] / rows[0]["updates_per_s"]
  return rows


# ---------------------------------------------------------------------------------------- report
def format_tables(latency: list[dict], overhead: list[dict], training: list[dict]) -> str:
  lines = []
  if latency:
    lines += ["| latency env: backend | B | turns | turn s (mean) | slowest call s (mean) | "
              "turn / slowest (mean) | turn / slowest (max) | target |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in latency:
      target = ("" if r["backend"] == "serial" else
                f"<= {TARGET_LATENCY_RATIO:g} " +
                ("ok" if r["ratio_mean"] <= TARGET_LATENCY_RATIO else "MISSED"))
      lines.append(f"| {r['backend']} | {r['batch']} | {r['turns']} | {r['turn_s_mean']:.3f} | "
                   f"{r['slowest_s_mean']:.3f} | {r['ratio_mean']:.2f} | {r['ratio_max']:.2f} | "
                   f"{target} |")
    lines.append("")
  if overhead:
    lines += ["| trivial env: backend | B | turns | turn ms (mean) | ms per step (mean) | "
              "ms per step (median) | direct ms | target |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in overhead:
      target = (f"< {TARGET_OVERHEAD_MS:g} " + ("ok" if r["per_step_ms_mean"] < TARGET_OVERHEAD_MS
                                                 else "MISSED")) if r["backend"] == "thread" else ""
      lines.append(f"| {r['backend']} | {r['batch']} | {r['turns']} | "
                   f"{r['turn_s_mean'] * 1000:.2f} | {r['per_step_ms_mean']:.4f} | "
                   f"{r['per_step_ms_median']:.4f} | {r['direct_ms']:.4f} | {target} |")
    lines.append("")
  if training:
    lines += ["| training: mode | actors | max staleness | updates | wall s | env s | lag mean | "
              "updates/s | episodes/s | vs sync |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in training:
      lines.append(f"| {r['mode']} | {r['actors']} | {r['max_staleness']} | {r['updates']} | "
                   f"{r['wall_s']:.2f} | {r['env_s']:.2f} | {r['lag_mean']:.2f} | "
                   f"{r['updates_per_s']:.3f} | {r['episodes_per_s']:.2f} | "
                   f"{r['speedup']:.2f}x |")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  kw = dict(median_ms=_LATENCY_MS.value, sigma=_LATENCY_SIGMA.value, seed=_SEED.value)
  latency = []
  for backend in _LATENCY_BACKENDS.value:
    logging.info("latency: %s", backend)
    latency.append(measure_latency(backend, _BATCH.value, _TURNS.value, **kw))
  if _SERIAL_TURNS.value:
    logging.info("latency: serial")
    latency.append(measure_latency("serial", _BATCH.value, _SERIAL_TURNS.value, **kw))
  overhead = []
  for backend in _OVERHEAD_BACKENDS.value:
    logging.info("overhead: %s", backend)
    overhead.append(measure_overhead(backend, _OVERHEAD_BATCH.value, _OVERHEAD_TURNS.value))
  training = []
  if _UPDATES.value:
    training = measure_training(_UPDATES.value, _WARMUP.value, _ACTORS.value, _STALENESS.value,
                                **kw)
  cpu = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count()}
  print(f"host environments through EnvPool on {cpu['cpu_model']} ({cpu['cpu_count']} cores); "
        f"tool latency lognormal (median {_LATENCY_MS.value:g} ms, sigma "
        f"{_LATENCY_SIGMA.value:g})")
  print()
  print(format_tables(latency, overhead, training))
  if _OUT.value:
    settings = {flag: flags.FLAGS[flag].value for flag in (
        "batch", "turns", "serial_turns", "latency_ms", "latency_sigma", "overhead_batch",
        "overhead_turns", "latency_backends", "overhead_backends", "updates", "warmup", "actors",
        "max_staleness", "seed")}
    out = results_io.write_json(_OUT.value, {"settings": settings, **cpu, "latency": latency,
                                             "overhead": overhead, "training": training})
    print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
