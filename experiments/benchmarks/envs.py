r"""Environment step throughput: jit + vmap at batch 4096 against plain Python, in one run.

    python experiments/benchmarks/envs.py [--batch=4096] [--steps=64] [--envs=pointer_chain,...]
        [--out=results/envs.json]

For every environment: B rows step through `steps` random well-formed actions (with auto-reset:
a finished row is reset to a fresh task, as in gymnax-style training loops; the reset is computed
for every row every step and selected, so its cost is included). The baseline is the same
environment written in plain Python (`plain_envs/`, one object per row, same actions, same
auto-reset) stepping the same batch in a Python loop. The table prints env steps/s for both and
the ratio. Targets (DESIGN.md): >= 100k steps/s and >= 20x the plain-Python implementation.
"""

from __future__ import annotations

import importlib
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

_OUT = flags.DEFINE_string("out", None, "Optional JSON path for the result rows.")
_BATCH = flags.DEFINE_integer("batch", 4096, "Rows stepped together.")
_STEPS = flags.DEFINE_integer("steps", 64, "Steps timed for the jitted environment.")
_PLAIN_STEPS = flags.DEFINE_integer("plain_steps", 4, "Steps timed for the plain-Python baseline.")
_ENVS = flags.DEFINE_list("envs", ["pointer_chain", "gridworld", "calculator", "retail"],
                          "Environments to measure.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs (the best is reported).")

TARGET_STEPS_PER_S = 100_000
TARGET_RATIO = 20.0
PLAIN = {"pointer_chain": "PlainPointerChain", "gridworld": "PlainGridWorld",
         "calculator": "PlainCalculator", "retail": "PlainRetail"}


def random_actions(env, rng: np.random.Generator, steps: int, batch: int):
  """`[T, B]` uniformly random well-formed actions (tool uniform, each argument uniform)."""
  tools = rng.integers(0, len(env.tools), (steps, batch)).astype(np.int32)
  args = np.zeros((steps, batch, env.num_args), np.int32)
  for t, spec in enumerate(env.tools):
    for a, arg in enumerate(spec.args):
      low, high = (0, len(arg.choices)) if arg.kind == "enum" else (arg.low, arg.high + 1)
      args[..., a] = np.where(tools == t, rng.integers(low, high, (steps, batch)), args[..., a])
  return envs.Action(tool=tools, args=args, error=np.zeros((steps, batch), np.int32))


def jax_runner(env, tasks, next_tasks, actions, keys):
  """Steps all rows through `actions` with auto-reset; returns a function timing one run."""

  def one_step(carry, xs):
    states, t = carry
    action = xs
    states, timesteps = jax.vmap(env.step)(states, action)
    fresh, _ = jax.vmap(env.reset)(jax.vmap(lambda k: jax.random.fold_in(k, t))(keys), next_tasks)
    states = jax.tree.map(lambda f, s: jnp.where(
        timesteps.done.reshape(timesteps.done.shape + (1,) * (s.ndim - 1)), f, s), fresh, states)
    return (states, t + 1), timesteps.reward.sum()

  @jax.jit
  def run(tasks, actions):
    states, _ = jax.vmap(env.reset)(keys, tasks)
    (_, _), rewards = jax.lax.scan(one_step, (states, jnp.int32(0)), actions)
    return rewards.sum()

  jax.block_until_ready(run(tasks, actions))

  def timed():
    start = time.perf_counter()
    jax.block_until_ready(run(tasks, actions))
    return time.perf_counter() - start

  return timed


def plain_run_s(plain_cls, params, tasks_np, next_np, actions, steps):
  """Seconds for the plain-Python implementation to step the batch through `steps` actions."""
  batch = len(tasks_np)
  rows = [plain_cls(**params) for _ in range(batch)]
  start = time.perf_counter()
  for b in range(batch):
    rows[b].reset(tasks_np[b])
  for t in range(steps):
    tools, args = actions.tool[t].tolist(), actions.args[t].tolist()
    for b in range(batch):
      out = rows[b].step(tools[b], args[b], 0)
      if out["terminated"] or out.get("truncated", False):
        rows[b].reset(next_np[b])
  return time.perf_counter() - start


def _rows_of(tasks):
  flat = jax.tree.map(np.asarray, tasks)
  batch = jax.tree.leaves(flat)[0].shape[0]
  return [jax.tree.map(lambda a, i=i: a[i], flat) for i in range(batch)]


def measure(name: str, batch: int, steps: int, plain_steps: int, repeats: int) -> dict:
  env = envs.make(name)
  keys = jax.random.split(jax.random.key(0), batch)
  gen = jax.jit(jax.vmap(lambda k: env.generate_task(k, "train")))
  tasks = gen(keys)
  next_tasks = gen(jax.random.split(jax.random.key(1), batch))
  actions = random_actions(env, np.random.default_rng(0), steps, batch)
  timed = jax_runner(env, tasks, next_tasks, actions, keys)
  jax_s = min(timed() for _ in range(repeats))
  jax_rate = batch * steps / jax_s
  module = importlib.import_module(f"plain_envs.{name}")
  plain_cls = getattr(module, PLAIN[name])
  tasks_np, next_np = _rows_of(tasks), _rows_of(next_tasks)
  plain_s = min(plain_run_s(plain_cls, {}, tasks_np, next_np, actions, plain_steps)
                for _ in range(max(1, repeats - 1)))
  plain_rate = batch * plain_steps / plain_s
  return {"env": name, "batch": batch, "jax_steps_per_s": jax_rate,
          "plain_steps_per_s": plain_rate, "ratio": jax_rate / plain_rate,
          "pass": bool(jax_rate >= TARGET_STEPS_PER_S and jax_rate / plain_rate >= TARGET_RATIO)}


def main(argv):
  del argv
  logging.info("devices: %s", jax.devices())
  rows = []
  for name in _ENVS.value:
    logging.info("Measuring %s...", name)
    rows.append(measure(name, _BATCH.value, _STEPS.value, _PLAIN_STEPS.value, _REPEATS.value))
  print(f"{'environment':<16} {'jit+vmap steps/s':>18} {'plain Python steps/s':>22} {'ratio':>8} "
        f"{'targets':>18} {'ok':>4}")
  for r in rows:
    print(f"{r['env']:<16} {r['jax_steps_per_s']:>18,.0f} {r['plain_steps_per_s']:>22,.0f} "
          f"{r['ratio']:>7.1f}x {'>=100k, >=20x':>18} {'yes' if r['pass'] else 'NO':>4}")
  if _OUT.value:
    results_io.write_json(_OUT.value, {"batch": _BATCH.value, "rows": rows})


if __name__ == "__main__":
  app.run(main)
