"""`train_and_evaluate(config, workdir)`: SFT warm start, RL updates, evaluation, checkpoints, logs.

Phases (each resumable from `workdir`):

1. set-up: environment (+ wrappers from the config), codec, task suites (TFDS), policy (a fresh tiny
   decoder with the codec's tokenizer, or a checkpoint), optimiser, and the checkpoint manager;
2. warm start (no checkpoint yet): SFT on oracle episodes of train tasks, then the warm-start
   evaluation (sampled at the rollout temperature, and greedy); checkpoint at update 0;
3. RL: per update, the next `num_tasks` train tasks (the data position is checkpointed), `G`
   rollouts each, advantages by the configured algorithm, one jitted update; metrics to
   `metrics.jsonl` and TensorBoard, a progress bar, checkpoints every `checkpoint_every` updates;
4. final evaluation on `eval.split`: `eval.json` and `learning_curve.png`.

Determinism: every random stream of update `u` is derived from `(config.seed, u)` and the
checkpointed state, so a run killed and resumed reproduces the uninterrupted run's metrics.

Asynchronous rollouts (`config.rollout.mode='async'`): actor threads run `collect_batch` with
published copies of the parameters while the learner runs `learn_from_batch` (see
`train/async_rollout.py`: bounded queue, `max_staleness`, per-update `async/*` metrics); with
`max_staleness=0` the run equals the synchronous one.

Multi-host (`jax.distributed.initialize` called first, this function run on every process): each
process collects its share of an update's tasks and of the evaluation tasks
(`rollout.collect_across_processes`, which gathers the episodes back), so every process trains on
the same batch and keeps the same parameters, and the run gives the single-process run's numbers.
The SFT warm start (scripted, cheap) runs whole on every process. A `config.mesh` of more than one
device is built from each process's own devices. Only process 0 writes files besides the
checkpoints (which every process writes together, see `Checkpointer`); process 0 also generates
missing task files while the others wait.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from typing import Any

from absl import logging
import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from matplotlib.figure import Figure  # pyplot-free: no global backend switch (notebooks)
import numpy as np

from longhorizon import envs
from longhorizon import rollout
from longhorizon.core.episode import Termination, to_device
from longhorizon.envs import tasks as task_suites
from longhorizon.eval import metrics as metrics_lib
from longhorizon.eval import runner
from longhorizon.models import Critic, ModelConfig, Transformer, init_params, sharding, tiny_config
from longhorizon.models import checkpoint as checkpoint_lib
from longhorizon.train import algorithms
from longhorizon.train import config as config_lib
from longhorizon.train import workdir as workdir_lib
from longhorizon.train.async_rollout import AsyncRollouts
from longhorizon.train.checkpoints import Checkpointer
from longhorizon.train.curriculum import Curriculum, bucket_indices, draw_tasks
from longhorizon.train.metrics import MetricsWriter, Progress, Timer, read_metrics
from longhorizon.train.update import (TrainState, critic_values, episode_logprobs, make_optimizer,
                                      rl_update, sft_update)

__all__ = ["train_and_evaluate", "Setup", "setup", "evaluate_policy", "eval_seed"]


@dataclasses.dataclass
class Setup:
  """Everything a run builds from its config (no mutable training state)."""
  config: Any
  env: envs.Environment
  codec: Any
  model_config: ModelConfig
  init_params: Any
  train_tasks: Any
  eval_tasks: dict
  optimizer: Any
  critic_optimizer: Any
  mesh: Any = None  # jax.sharding.Mesh when config.mesh has more than one device


def in_mesh(s: "Setup"):
  """A context with the run's mesh and logical-axis rules active (a no-op on one device), so
  jitted functions traced inside it honour the models' logical sharding constraints."""
  if s.mesh is None:
    return contextlib.nullcontext()
  return sharding.mesh_context(s.mesh)


def _key(seed: int, *path: int):
  key = jax.random.key(seed)
  for p in path:
    key = jax.random.fold_in(key, p)
  return key


def make_env(config) -> envs.Environment:
  """The configured environment with its wrappers (TimeLimit innermost)."""
  env = envs.make(config.env.name, **dict(config.env.params))
  env = envs.TimeLimit(env, config.env.max_steps)
  if config.env.faults and sum(config.env.faults.values()) > 0:
    env = envs.FaultInjection(env, dict(config.env.faults), tuple(config.env.env_error_kinds))
  if config.env.tool_costs:
    env = envs.ToolCost(env, dict(config.env.tool_costs))
  if config.env.loop_k:
    env = envs.LoopDetector(env, config.env.loop_k)
  return env


def check_process_split(config, eval_size: int, process_count: int | None = None):
  """Multi-host runs split each update's tasks, and the `eval_size` evaluation tasks, evenly
  over the processes: raises a ValueError naming the field when they cannot be."""
  count = jax.process_count() if process_count is None else process_count
  for field, n in (("rollout.num_tasks", config.rollout.num_tasks), ("eval.num_tasks", eval_size)):
    if n % count:
      raise ValueError(
          f"config.{field}={n} cannot be split evenly over {count} JAX processes (each collects "
          f"an equal share of the tasks); use a multiple of {count}, e.g. "
          f"--config.{field}={-(-n // count) * count}.")


def setup(config) -> Setup:
  config_lib.validate(config)
  env = make_env(config)
  if config.model.checkpoint:
    model_config, params, tokenizer = checkpoint_lib.load(config.model.checkpoint)
    codec = env.codec(tokenizer, config.env.style)
  else:
    codec = env.codec(None, config.env.style)
    m = config.model
    heads = m.num_attention_heads
    model_config = dataclasses.replace(
        tiny_config(), vocab_size=len(codec.tokenizer), hidden_size=m.hidden_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=m.num_key_value_heads, intermediate_size=m.intermediate_size,
        head_dim=m.hidden_size // heads, dtype=m.dtype)
    params = init_params(model_config, _key(config.seed, 1))
  sizes = {"train": config.tasks.train_size, "test": config.tasks.test_size,
           "ood": config.tasks.ood_size}
  data_dir = config.tasks.data_dir or None
  load = functools.partial(task_suites.load, config.env.name, env_params=dict(config.env.params),
                           seed=config.tasks.seed, sizes=sizes, data_dir=data_dir)
  if jax.process_count() > 1:
    # Task files are generated on first use: process 0 writes them while the others wait.
    if jax.process_index() == 0:
      task_suites.build(config.env.name, dict(config.env.params), config.tasks.seed, sizes,
                        data_dir)
    multihost_utils.sync_global_devices("longhorizon.setup.task_suites")
  train_tasks = load("train")
  eval_tasks = {split: load(split) for split in ("test", "ood")}
  eval_source = eval_tasks.get(config.eval.split, train_tasks)
  check_process_split(config, min(config.eval.num_tasks, len(eval_source)))
  o = config.optim
  optimizer = make_optimizer(o.learning_rate, warmup_steps=o.warmup_steps,
                             total_steps=max(config.num_updates * o.epochs * o.minibatches, 1),
                             schedule=o.schedule, max_grad_norm=o.max_grad_norm,
                             weight_decay=o.weight_decay)
  critic_optimizer = None
  if algorithms.ALGORITHMS[config.algorithm.name].needs_critic:
    critic_optimizer = make_optimizer(o.critic_learning_rate, max_grad_norm=o.max_grad_norm)
  mesh = None
  if config.mesh.data * config.mesh.fsdp * config.mesh.tensor > 1:
    # Parameters (and so optimiser state) are placed by the logical-axis rules: fsdp shards the
    # model width, tensor the heads / MLP / vocabulary; jit propagates the shardings through the
    # rollout and the update.
    # Each process's own devices: in a multi-host run the parameters are replicated across hosts.
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                              devices=jax.local_devices())
    params = sharding.shard_params(params, Transformer(model_config), jnp.zeros((1, 1), jnp.int32),
                                   mesh)
  return Setup(config, env, codec, model_config, params, train_tasks, eval_tasks, optimizer,
               critic_optimizer, mesh)


def initial_state(s: Setup) -> TrainState:
  critic_params = critic_opt = None
  if s.critic_optimizer is not None:
    critic_params = Critic(s.model_config).init(
        _key(s.config.seed, 2), jnp.zeros((1, 1), jnp.int32))["params"]
    critic_params = nn.meta.unbox(critic_params)
    critic_opt = s.critic_optimizer.init(critic_params)
  return TrainState(params=s.init_params, opt_state=s.optimizer.init(s.init_params),
                    critic_params=critic_params, critic_opt_state=critic_opt,
                    step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32),
                    rng=_key(s.config.seed, 3), skipped=jnp.zeros((), jnp.int32))


def _tasks_at(source, start: int, count: int):
  n = len(source)
  return task_suites.stack(source, [(start + i) % n for i in range(count)])


# ------------------------------------------------------------------------------------- evaluation

def evaluate_policy(s: Setup, params, split: str, num_tasks: int, *, temperature: float,
                    seed: int, group_size: int = 1) -> dict:
  """Success rate (and episode stats) of `params` on the first `num_tasks` tasks of `split`."""
  source = s.eval_tasks[split] if split in s.eval_tasks else s.train_tasks
  n = min(num_tasks, len(source))
  tasks = task_suites.stack(source, range(n))
  keys = jax.random.split(_key(seed, 7), n)
  rc = config_lib.rollout_config(s.config, group_size=group_size, temperature=temperature)
  batch, _ = rollout.collect_across_processes(params, s.model_config, s.env, s.codec, tasks, keys,
                                              rc, sampling_seed=seed,
                                              reward=config_lib.reward_config(s.config))
  return {"success_rate": float(np.mean(batch.success)),
          "mean_steps": float(np.mean(batch.num_steps)),
          "truncation_rate": float(np.mean(batch.truncated)),
          "env_error_rate": float(np.mean(np.asarray(batch.env_error).any(-1)))}


def eval_seed(config) -> int:
  """The seed of a run's evaluations (warm start, `eval.every`, final); evaluate.py reuses it."""
  return config.seed + 17


def _evaluate_both(s: Setup, params, seed: int, full: bool = False) -> dict:
  """Sampled (training temperature) and greedy success on `eval.split`; with `full`, the whole
  evaluation report (`eval.k` attempts per task: pass@k, pass^k, milestones, rates, buckets)."""
  c = s.config
  greedy = evaluate_policy(s, params, c.eval.split, c.eval.num_tasks, temperature=0.0, seed=seed)
  if not full:
    sampled = evaluate_policy(s, params, c.eval.split, c.eval.num_tasks,
                              temperature=c.rollout.temperature, seed=seed)
    return {"success_rate": sampled["success_rate"], "greedy_success_rate": greedy["success_rate"],
            "mean_steps": sampled["mean_steps"], "truncation_rate": sampled["truncation_rate"]}
  source = s.eval_tasks[c.eval.split] if c.eval.split in s.eval_tasks else s.train_tasks
  tasks = task_suites.stack(source, range(min(c.eval.num_tasks, len(source))))
  report, _ = runner.evaluate(s.env, s.codec, tasks, attempts=c.eval.k,
                              rollout_config=config_lib.rollout_config(c), policy="model",
                              params=params, model_config=s.model_config, seed=seed,
                              reward=config_lib.reward_config(c))
  report["greedy_success_rate"] = greedy["success_rate"]
  return report


# ------------------------------------------------------------------------------------------- SFT

def warm_start(s: Setup, state: TrainState) -> tuple[TrainState, dict]:
  """SFT on oracle episodes of train tasks (the same masks as RL)."""
  c = s.config
  if not c.sft.steps:
    return state, {}
  n = c.sft.episodes
  tasks = _tasks_at(s.train_tasks, 0, n)
  keys = jax.random.split(_key(c.seed, 4), n)
  rc = config_lib.rollout_config(c, group_size=1)
  batch, _ = rollout.collect(None, None, s.env, s.codec, tasks, keys, rc, sampling_seed=0,
                             scripted=rollout.oracle_turns(s.env, s.codec, c.sft.demo_epsilon,
                                                           seed=c.seed))
  if not c.sft.demo_epsilon and not batch.success.all():
    logging.warning("oracle SFT episodes: only %.2f succeed (context budget or step limit too "
                    "small?)", float(batch.success.mean()))
  batch = to_device(batch)
  sft_opt = make_optimizer(c.sft.learning_rate, max_grad_norm=c.optim.max_grad_norm)
  sft_state = state.replace(opt_state=sft_opt.init(state.params))
  metrics = {}
  for _ in range(c.sft.steps):
    sft_state, metrics = sft_update(sft_state, batch, config=s.model_config, optimizer=sft_opt,
                                    minibatches=c.sft.minibatches)
    # One step in flight: on a multi-device mesh the CPU client deadlocks once a device has 32
    # queued computations with collectives (BUILD_NOTES.md, issue 15, "sharded SFT deadlock").
    jax.block_until_ready(sft_state)
  metrics = {k: float(v) for k, v in metrics.items()}
  # `sft_update` donated `sft_state` (and the buffers it shared with `state`): continue from it.
  state = sft_state.replace(opt_state=s.optimizer.init(sft_state.params))
  return state, metrics


def with_reference(s: Setup, state: TrainState) -> TrainState:
  """Freezes a copy of the current (warm-start) policy as the KL reference when the KL is on."""
  if s.config.algorithm.kl_coef > 0:
    return state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
  return state


# -------------------------------------------------------------------------------------------- RL

@functools.partial(jax.jit, static_argnames=("config", "temperature", "with_entropy"))
def _logprobs(params, batch, *, config, temperature, with_entropy=False):
  return episode_logprobs(params, config, batch, temperature=temperature,
                          return_entropy=with_entropy)


_critic_values = jax.jit(critic_values, static_argnames=("config",))


def rl_step(s: Setup, state: TrainState, update: int, data_position: int, timer: Timer,
            hook=None, task_indices=None):
  """One synchronous RL update: rollouts with the current parameters (`collect_batch`), then
  advantages and the jitted update (`learn_from_batch`). Returns `(state, metrics)`."""
  batch, stats = collect_batch(s, state.params, update, data_position, timer, task_indices)
  if hook is not None:
    hook("update", update)
  return learn_from_batch(s, state, batch, stats, timer)


def collect_batch(s: Setup, params, update: int, data_position: int, timer: Timer,
                  task_indices=None, *, policy_version: int | None = None, on_env_step=None):
  """The rollout half of RL update `update`: `(EpisodeBatch, RolloutStats)` sampled with `params`.

  Tasks are the next `num_tasks` train tasks from `data_position`, or `task_indices` (curriculum).
  In a multi-host run each process collects its share of them and all update on the whole batch.
  Environment keys, sampling seed and group labels derive from `update`; `policy_version` (default
  `update`) is recorded on every episode. `on_env_step` is passed to `rollout.collect`. The async
  actors (`train/async_rollout.py`) call it from their threads with a copy of the parameters."""
  c = s.config
  n = c.rollout.num_tasks
  if task_indices is None:
    tasks = _tasks_at(s.train_tasks, data_position, n)
  else:
    tasks = task_suites.stack(s.train_tasks, task_indices)
  env_keys = jax.random.split(_key(c.seed, 5, update), n)
  extra = {} if on_env_step is None else {"on_env_step": on_env_step}
  with timer("rollout"):
    batch, stats = rollout.collect_across_processes(
        params, s.model_config, s.env, s.codec, tasks, env_keys,
        config_lib.rollout_config(c), sampling_seed=c.seed * 1_000_003 + update,
        reward=config_lib.reward_config(c),
        policy_version=update if policy_version is None else policy_version,
        task_seed=c.tasks.seed, group_offset=update * n, **extra)
  return batch, stats


def learn_from_batch(s: Setup, state: TrainState, batch, stats, timer: Timer, row_scale=None):
  """The learning half of an RL update: advantages and the jitted update on `batch` (from
  `collect_batch`). Returns `(state, metrics)`; `state` is donated.

  `row_scale` (`[B]`, optional) multiplies the algorithm's row weights: the async learner's
  staleness filter (0 drops an episode, < 1 down-weights it). The clipping anchor `old_logp` is
  the proximal policy (`state.params` before the update) for `algorithm.off_policy='decoupled'`,
  the behaviour log-probs for `'tis'` (no proximal pass)."""
  c = s.config
  n = c.rollout.num_tasks
  with timer("update"):
    db = to_device(batch)
    if s.mesh is not None:  # data-parallel inputs: rows split over (data, fsdp)
      db = sharding.shard_batch(db, s.mesh)
    options = config_lib.loss_options(c)
    if options.off_policy == "tis":
      old_logp = db.behavior_logprobs
    else:
      old_logp = _logprobs(state.params, db, config=s.model_config,
                           temperature=options.temperature)
    values = None
    if s.critic_optimizer is not None:
      values = _critic_values(state.critic_params, s.model_config, db)
    adv = algorithms.compute_advantages(c.algorithm.name, db, values, config_lib.algorithm_options(c))
    if row_scale is not None:
      adv = adv._replace(row_weight=adv.row_weight * jnp.asarray(row_scale, adv.row_weight.dtype))
    ref_logp = None
    if state.ref_params is not None:
      ref_logp = _logprobs(state.ref_params, db, config=s.model_config,
                           temperature=options.temperature)
    state, m = rl_update(state, db, adv.advantages, adv.returns, adv.row_weight, old_logp, ref_logp,
                         values, config=s.model_config, optimizer=s.optimizer,
                         critic_optimizer=s.critic_optimizer, options=options)
    m = jax.device_get(m)
  metrics = {k: float(np.asarray(v)) for k, v in m.items()}
  metrics.update(episode_metrics(batch, adv.row_weight))
  metrics["_task_success"] = np.asarray(batch.success).reshape(n, -1).mean(-1)
  metrics.update({k: float(v) for k, v in stats.as_dict().items()})
  return state, metrics


def episode_metrics(batch, row_weight) -> dict:
  """Success, reward components, lengths, termination kinds and the zero-advantage group rate."""
  steps = np.asarray(batch.num_steps)
  out = {"success_rate": float(np.mean(batch.success)), "score": float(np.mean(batch.score)),
         "episode_steps": float(steps.mean()), "tool_calls": float(steps.mean()),
         "episode_tokens": float(np.asarray(batch.attention_mask).sum(-1).mean()),
         "sampled_tokens_per_episode": float(np.asarray(batch.loss_mask).sum(-1).mean()),
         "env_error_rate": float(np.mean(np.asarray(batch.env_error).any(-1))),
         "truncation_rate": float(np.mean(batch.truncated)),
         "violation_rate": float(np.mean(np.asarray(batch.violation).any(-1))),
         "trained_fraction": float(np.mean(np.asarray(row_weight) > 0))}
  kinds = np.asarray(batch.termination)
  for kind in Termination:
    if kind != Termination.RUNNING:
      out[f"termination/{kind.name.lower()}"] = float(np.mean(kinds == kind))
  for name, value in batch.reward_components.items():
    out[name] = float(np.mean(value))
  groups, scores = np.asarray(batch.group), np.asarray(batch.score)
  flat = [np.ptp(scores[groups == g]) == 0 for g in np.unique(groups)]
  out["zero_advantage_group_rate"] = float(np.mean(flat))
  return out


def make_curriculum(s: Setup, state_dict=None):
  """`(Curriculum, bucket index arrays)` over the train split's difficulty buckets, or `(None,
  None)` when `config.curriculum.num_buckets` is 0. Its state lives in the checkpoint meta."""
  c = s.config.curriculum
  if not c.num_buckets:
    return None, None
  n = len(s.train_tasks)
  difficulty = jax.jit(jax.vmap(s.env.task_difficulty))
  levels = np.concatenate([np.asarray(difficulty(task_suites.stack(s.train_tasks, range(i, min(i + 1024, n)))))
                           for i in range(0, n, 1024)])
  curriculum = Curriculum(c.num_buckets, alpha=c.alpha, floor=c.floor or None, ema=c.ema)
  if state_dict:
    curriculum.load_state_dict(state_dict)
  return curriculum, bucket_indices(levels, c.num_buckets)


def params_bytes_per_device(params) -> int:
  """The largest number of parameter bytes any one device holds (falls with fsdp / tensor)."""
  per_device = {}
  for leaf in jax.tree.leaves(params):
    for shard in getattr(leaf, "addressable_shards", []):
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values()) if per_device else 0


def collapse_alarms(config, metrics: dict) -> dict:
  """RAGEN's Echo-Trap signals: token entropy collapsing, or in-group reward variance vanishing
  while the policy is still failing (every group all-fail or all-identical: no learning signal)."""
  entropy_low = metrics["entropy"] < config.alarm.min_entropy and metrics["success_rate"] < 0.99
  std_low = (metrics["zero_advantage_group_rate"] > config.alarm.max_zero_advantage_rate
             and metrics["success_rate"] < config.alarm.success_ceiling)
  return {"alarm/entropy_collapse": float(entropy_low), "alarm/reward_std_collapse": float(std_low),
          "alarm/collapse": float(entropy_low or std_low)}


# ------------------------------------------------------------------------------------------ main

def train_and_evaluate(config, workdir: str, *, hook=None, init_from: str | None = None) -> dict:
  """Runs (or resumes) the configured experiment in `workdir` (see `_train_and_evaluate`).

  `workdir` may be relative or start with `~`; it is made absolute first. The run holds the
  workdir's lock (`train/workdir.py`) from before set-up to the end, so a second run on the same
  workdir refuses at once. `init_from` (another run's workdir) starts a new run from that run's
  newest restorable checkpoint (see `start_from`); it is ignored on resume when it names the run
  the workdir was started from, and refused otherwise.
  """
  config_lib.validate(config)
  workdir = workdir_lib.resolve(workdir)
  with workdir_lib.WorkdirLock(workdir):
    s = setup(config)
    with in_mesh(s):
      return _train_and_evaluate(s, config, workdir, hook=hook, init_from=init_from)


def new_run(s: Setup, state: TrainState, config) -> tuple[TrainState, dict]:
  """The warm start of a new run: SFT on oracle episodes, then its evaluation. `(state, meta)`."""
  logging.info("New run: warm start by SFT for %d steps on %d oracle episodes.", config.sft.steps,
               config.sft.episodes)
  state, sft_metrics = warm_start(s, state)
  state = with_reference(s, state)
  warm = _evaluate_both(s, state.params, eval_seed(config), full=True)
  # RL tasks start after the SFT tasks, so the first updates do not replay the demonstrations.
  meta = {"update": 0, "data_position": config.sft.episodes if config.sft.steps else 0,
          "warm_start": warm, "sft": sft_metrics}
  logging.info("Warm start: sampled success %.3f, greedy %.3f.", warm["success_rate"],
               warm["greedy_success_rate"])
  return state, meta


# Fields that decide the policy's parameter shapes and vocabulary: a run started from another run's
# checkpoint (`start_from`) must agree with it on these.
_PARAMETER_FIELDS = ("model.", "env.name", "env.style")


def start_from(s: Setup, state: TrainState, source: str) -> tuple[TrainState, dict]:
  """A new run from another run's checkpoint: its parameters, this run's everything else.

  The policy parameters come from the newest restorable checkpoint of the workdir `source`; the
  optimiser state, critic, PRNG streams and update count start fresh from this config (so one warm
  start can be trained on by several algorithms, each in its own workdir). The KL reference is the
  loaded policy. The data position continues from the source's (RL tasks after its SFT tasks).
  The starting policy is evaluated as this run's warm start; `meta["init_from"]` records the source.
  """
  src = workdir_lib.resolve(source)
  src_config = os.path.join(src, workdir_lib.CONFIG_FILE)
  if not os.path.exists(src_config):
    raise workdir_lib.WorkdirError(f"--init_from={source}: {src_config} does not exist; give the workdir "
                            f"of a training run (it holds config.json and checkpoints/).")
  with open(src_config, encoding="utf-8") as f:
    saved = json.load(f)
  diff = {k: v for k, v in workdir_lib.config_diff(saved, s.config).items()
          if any(k == f or (f.endswith(".") and k.startswith(f)) for f in _PARAMETER_FIELDS)}
  if diff:
    lines = "\n".join(f"  {k}: {a!r} (source) -> {b!r} (now)" for k, (a, b) in diff.items())
    raise workdir_lib.WorkdirError(f"--init_from={source}: the source run's model or tokenizer differs from this "
                     f"config's:\n{lines}\nUse the source's values for these fields.")
  checkpointer = Checkpointer(os.path.join(src, "checkpoints"))
  if checkpointer.latest_step() is None:
    raise workdir_lib.WorkdirError(f"--init_from={source}: no checkpoint in {src}/checkpoints yet.")
  saved_state, src_meta = checkpointer.restore()
  step = checkpointer.restored_step
  checkpointer.close()
  params = saved_state["params"]
  expected = jax.tree_util.tree_flatten_with_path(state.params)[0]
  got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, leaf in expected:
    if path not in got or np.shape(got[path]) != leaf.shape:
      raise workdir_lib.WorkdirError(f"--init_from={source}: parameter {jax.tree_util.keystr(path)} has shape "
                       f"{np.shape(got.get(path))} in step {step} of {src}, this config builds "
                       f"{leaf.shape}.")
  params = jax.tree.map(lambda t, x: jax.device_put(jnp.asarray(x, t.dtype), t.sharding),
                        state.params, params)
  state = with_reference(s, state.replace(params=params, opt_state=s.optimizer.init(params)))
  origin = {"workdir": src, "step": step, "update": src_meta.get("update"),
            "algorithm": saved.get("algorithm", {}).get("name")}
  logging.info("New run from %s (checkpoint step %d, %s): evaluating the starting policy.", src,
               step, origin["algorithm"])
  warm = _evaluate_both(s, state.params, eval_seed(s.config), full=True)
  meta = {"update": 0, "data_position": int(src_meta.get("data_position", 0)),
          "warm_start": warm, "sft": src_meta.get("sft", {}), "init_from": origin}
  return state, meta


def _check_init_from(workdir: str, init_from: str | None, meta: dict):
  """On resume, `init_from` must name the run this workdir was started from (or be absent)."""
  if init_from is None:
    return
  origin = (meta.get("init_from") or {}).get("workdir")
  if origin != workdir_lib.resolve(init_from):
    raise workdir_lib.WorkdirError(f"--init_from={init_from}: {workdir} already holds checkpoints of a run "
                     f"started from {origin or 'its own warm start'}; --init_from only starts a new "
                     f"run. Drop the flag to resume it, or use a new --workdir.")


def _resume_message(checkpointer: Checkpointer, latest: int, meta: dict, config) -> str:
  start = int(meta["update"])
  text = f"Resuming from checkpoint step {checkpointer.restored_step} (update {start} of " \
         f"{config.num_updates})"
  if checkpointer.restored_step != latest:
    text += (f"; the newest step {latest} could not be restored and was set aside, so updates "
             f"{start + 1}..{latest} are computed again")
  if start >= config.num_updates:
    text += "; every update is done: only the final evaluation runs"
  return text + "."


def _train_and_evaluate(s: Setup, config, workdir: str, *, hook=None, init_from=None) -> dict:
  """Runs (or resumes) the configured experiment in `workdir`; returns the final `eval.json` dict.

  `hook(point, update)`, if given, is called at `"rollout"`, `"update"` and `"checkpoint"` (after a
  save has started) of every update; the process-kill tests use it to die at a chosen point.
  """
  hook = hook or (lambda point, update: None)
  primary = jax.process_index() == 0
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                              max_to_keep=config.keep_checkpoints)
  state, meta = _start_or_resume(s, config, workdir, checkpointer, init_from)
  start, data_position = int(meta["update"]), int(meta["data_position"])
  # metrics.jsonl numbers updates from 1: drop lines after the checkpoint (updates > start).
  writer = MetricsWriter(workdir, tensorboard=config.tensorboard, is_primary=primary,
                         resume_from=start + 1)
  progress = Progress(config.num_updates, initial=start, enabled=config.progress and primary)
  timer = Timer()
  skipped_before = int(jax.device_get(state.skipped))
  param_bytes = params_bytes_per_device(state.params)
  curriculum, buckets = make_curriculum(s, meta.get("curriculum"))
  pipeline = None
  if config.rollout.mode == "async" and start < config.num_updates:
    # Actor threads sample with published copies of the parameters (train/async_rollout.py); a
    # resumed run restarts them from the checkpointed parameters at the checkpointed batch.
    pipeline = AsyncRollouts(s, state.params, version=start,
                             first_batch=int(meta.get("next_batch", start)),
                             data_position=data_position, last_update=config.num_updates).start()
  for update in range(start, config.num_updates):
    timer.reset()
    started = time.perf_counter()
    hook("rollout", update)
    task_indices = task_buckets = None
    if curriculum is not None:
      task_indices, task_buckets, curriculum.cursor = draw_tasks(
          curriculum, buckets, np.random.default_rng([config.seed, update]),
          config.rollout.num_tasks, curriculum.cursor)
    if pipeline is None:
      state, metrics = rl_step(s, state, update, data_position, timer, hook, task_indices)
    else:
      state, metrics = pipeline.step(state, update, timer, hook)
    task_success = metrics.pop("_task_success")
    if curriculum is not None:
      curriculum.update(task_buckets, task_success)
      metrics.update(curriculum.metrics())
      meta = dict(meta, curriculum=curriculum.state_dict())
    if pipeline is None:
      data_position += config.rollout.num_tasks
    else:
      data_position = pipeline.data_position  # after the newest batch taken (dropped ones too)
    metrics.update(timer.split())
    metrics["update_s"] = time.perf_counter() - started
    metrics["params/bytes_per_device"] = param_bytes
    metrics.update(collapse_alarms(config, metrics))
    skipped_before = _warn_about(update, metrics, skipped_before)
    if config.eval.every and (update + 1) % config.eval.every == 0:
      for k, v in _evaluate_both(s, state.params, eval_seed(config)).items():
        metrics[f"eval/{k}"] = v
    writer.write(update + 1, metrics)
    progress.update(1, success=metrics["success_rate"], loss=metrics["loss"])
    meta = dict(meta, update=update + 1, data_position=data_position,
                next_batch=update + 1 if pipeline is None else pipeline.next_batch)
    if (update + 1) % config.checkpoint_every == 0 or update + 1 == config.num_updates:
      checkpointer.save(update + 1, state, meta)
      hook("checkpoint", update)
      checkpointer.wait()  # the next update donates the state's buffers; finish reading them first
  if pipeline is not None:
    pipeline.close()
  progress.close()
  checkpointer.wait()
  writer.close()

  result = _final_evaluation(s, config, workdir, state.params, meta)
  checkpointer.close()
  return result


def _warn_about(update: int, metrics: dict, skipped_before: int) -> int:
  """Logs a policy-collapse alarm and newly skipped optimiser steps; returns the skipped count."""
  if metrics["alarm/collapse"]:
    logging.warning("update %d: policy-collapse alarm (entropy %.4f, zero-advantage group rate "
                    "%.2f at success %.2f)", update + 1, metrics["entropy"],
                    metrics["zero_advantage_group_rate"], metrics["success_rate"])
  if metrics.get("skipped_updates", 0) > skipped_before:
    logging.warning("update %d: %d optimiser step(s) skipped for a non-finite loss or gradient",
                    update + 1, int(metrics["skipped_updates"] - skipped_before))
  return metrics.get("skipped_updates", skipped_before)


def _start_or_resume(s: Setup, config, workdir: str, checkpointer: Checkpointer, init_from
                     ) -> tuple[TrainState, dict]:
  """`(state, meta)` to continue from: the workdir's checkpoint, else a new run (a warm start, or
  another run's checkpoint with `init_from`) saved as step 0. The config is checked against the
  saved one before anything is written, and recorded."""
  state = initial_state(s)
  latest = checkpointer.latest_step()
  # Compared before anything is written: an incompatible config is refused with the diff.
  changes = workdir_lib.check_config(workdir, config, resuming=latest is not None)
  if latest is not None:
    state, meta = checkpointer.restore(template=with_reference(s, state))
    _check_init_from(workdir, init_from, meta)
    logging.warning("%s", _resume_message(checkpointer, latest, meta, config))
    workdir_lib.save_config(workdir, config, int(meta["update"]), changes)
    return state, meta
  workdir_lib.save_config(workdir, config, 0)
  if init_from is None:
    state, meta = new_run(s, state, config)
  else:
    state, meta = start_from(s, state, init_from)
    if jax.process_index() == 0:
      with open(os.path.join(workdir, "init_from.json"), "w") as f:
        json.dump(meta["init_from"], f, indent=2, sort_keys=True)
  checkpointer.save(0, state, meta, force=True)
  checkpointer.wait()
  return state, meta


def _final_evaluation(s: Setup, config, workdir: str, params, meta: dict) -> dict:
  """The final evaluation beside the warm start's; writes `eval.json`, `learning_curve.png` and
  `eval.png` (process 0) and returns the `eval.json` dict."""
  final = _evaluate_both(s, params, eval_seed(config), full=True)
  warm = meta["warm_start"]
  result = dict(final)
  result.update({"warm_start_success_rate": warm["success_rate"],
                 "warm_start_greedy_success_rate": warm["greedy_success_rate"],
                 "warm_start_pass_at_k": warm.get("pass_at_k"),
                 "split": config.eval.split, "eval_tasks": config.eval.num_tasks,
                 "attempts_per_task": config.eval.k, "temperature": config.rollout.temperature,
                 "num_updates": config.num_updates, "env": config.env.name,
                 "algorithm": config.algorithm.name, "init_from": meta.get("init_from")})
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "eval.json"), "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)
    plot_learning_curve(workdir, result)
    metrics_lib.plot_report([("warm start", warm), ("final", final)],
                            os.path.join(workdir, "eval.png"))
  return result


def plot_learning_curve(workdir: str, result: dict) -> str:
  """`learning_curve.png`: training success per update, warm-start and final evaluations."""
  rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  fig = Figure(figsize=(6, 4))
  ax = fig.subplots()
  if rows:
    ax.plot([r["update"] for r in rows], [r["success_rate"] for r in rows], label="train rollouts")
  ax.axhline(result["warm_start_success_rate"], color="gray", ls="--", label="warm start (eval)")
  ax.axhline(result["success_rate"], color="green", ls=":", label="final (eval)")
  ax.set_xlabel("RL update")
  ax.set_ylabel("success rate")
  ax.set_ylim(-0.02, 1.02)
  ax.set_title(f"{result['env']} / {result['algorithm']}")
  ax.legend(loc="lower right")
  path = os.path.join(workdir, "learning_curve.png")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path
