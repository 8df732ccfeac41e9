"""`train_and_evaluate(config, workdir)`: SFT warm start, RL updates, evaluation, checkpoints, logs.

Phases (each resumable from `workdir`):

1. set-up: environment (+ wrappers from the config), codec, task suites (TFDS), policy (a fresh tiny
   decoder with the codec's tokenizer, or a checkpoint), optimiser, and the checkpoint manager;
2. warm start (no checkpoint yet): SFT on oracle episodes of train tasks, then the warm-start
   evaluation (sampled at the rollout temperature, and greedy); checkpoint at update 0;
3. RL: per update, the next `num_tasks` train tasks (the data position is checkpointed), `G`
   rollouts each, advantages by the configured algorithm, one jitted update; metrics to
   `metrics.jsonl` and TensorBoard, a progress bar, checkpoints every `checkpoint_every` updates;
   with `config.store.enabled`, each update's training batch appended to the trajectory store
   `<workdir>/trajectories/` (`trajectory_store`; print it with `python -m longhorizon.cli.store`),
   and with `config.store.replay_groups`, whole task groups of earlier updates replayed from it
   in each sync update (`store_replay`, `train/replay.py`);
4. final evaluation on `eval.split`: `eval.json` and `learning_curve.png`.

Determinism: every random stream of update `u` is derived from `(config.seed, u)` and the
checkpointed state, so a run killed and resumed reproduces the uninterrupted run's metrics.

Every update goes through the run's `Learner` (`train/learner.py`: `step` = `collect_batch` then
`learn`). Asynchronous rollouts (`config.rollout.mode='async'`): actor threads run the learner's
`collect_batch` with published copies of the parameters while this loop runs its `learn` (see
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

import json
import os
import resource
import sys
import time

from absl import logging
import jax
import jax.numpy as jnp
from matplotlib.figure import Figure  # pyplot-free: no global backend switch (notebooks)
import numpy as np

from longhorizon.envs import tasks as task_suites
from longhorizon.eval import metrics as metrics_lib
from longhorizon.eval.provenance import provenance
from longhorizon.eval import runner
from longhorizon.rollout.store import KEEP, Priority, TrajectoryStore
from longhorizon.train import config as config_lib
from longhorizon.train import workdir as workdir_lib
from longhorizon.train.async_rollout import AsyncRollouts
from longhorizon.train.checkpoints import Checkpointer
from longhorizon.train.curriculum import (Curriculum, HorizonCurriculum, bucket_indices,
                                          draw_tasks)
from longhorizon.train.learner import Learner
from longhorizon.train.metrics import MetricsWriter, Progress, Timer, read_metrics
from longhorizon.train.preference import preference_stage
from longhorizon.train.replay import StoreReplay
from longhorizon.train.update import TrainState

__all__ = ["train_and_evaluate", "eval_seed", "new_run", "start_from", "trajectory_store",
           "store_replay", "STORE_DIR"]

STORE_DIR = "trajectories"  # the run's trajectory store, under its workdir (`config.store`)


def eval_seed(config) -> int:
  """The seed of a run's evaluations (warm start, `eval.every`, final); evaluate.py reuses it."""
  return config.seed + 17


def _evaluate_both(s: Learner, params, seed: int, full: bool = False) -> dict:
  """Sampled (training temperature) and greedy success on `eval.split`; with `full`, the whole
  evaluation report (`eval.k` attempts per task: pass@k, pass^k, milestones, rates, buckets).
  `greedy_success_rate` is None when `eval.greedy` is off."""
  c = s.config
  greedy = {"success_rate": None}
  if c.eval.get("greedy", True):
    greedy = s.evaluate(params, c.eval.split, c.eval.num_tasks, temperature=0.0, seed=seed)
  if not full:
    sampled = s.evaluate(params, c.eval.split, c.eval.num_tasks,
                         temperature=s.rollout.temperature, seed=seed)
    return {"success_rate": sampled["success_rate"], "greedy_success_rate": greedy["success_rate"],
            "mean_steps": sampled["mean_steps"], "truncation_rate": sampled["truncation_rate"]}
  source = s.eval_tasks.get(c.eval.split, s.train_tasks)
  tasks = task_suites.stack(source, range(min(c.eval.num_tasks, len(source))))
  report, _ = runner.evaluate(s.env, s.codec, tasks, attempts=c.eval.k,
                              rollout_config=s.collect_config(),
                              policy="model", params=params, model_config=s.model_config,
                              seed=seed)
  report["greedy_success_rate"] = greedy["success_rate"]
  return report


def _rate(value) -> str:
  """A success rate for the log (greedy ones are None when `eval.greedy` is off)."""
  return "off" if value is None else f"{value:.3f}"


def make_horizon_curriculum(config, state_dict=None) -> HorizonCurriculum | None:
  """The step-budget curriculum of `config.curriculum.step_budgets` (None when empty), at the
  checkpoint's stage when resuming."""
  c = config.curriculum
  if not c.step_budgets:
    return None
  horizon = HorizonCurriculum(c.step_budgets, grow_at=c.grow_at, ema=c.ema)
  if state_dict is not None:
    horizon.load_state_dict(state_dict)
  return horizon


def make_curriculum(s: Learner, state_dict=None):
  """`(Curriculum, bucket index arrays)` over the train split's difficulty buckets, or `(None,
  None)` when `config.curriculum.num_buckets` is 0. Its state lives in the checkpoint meta."""
  c = s.config.curriculum
  if not c.num_buckets:
    return None, None
  n = len(s.train_tasks)
  levels = np.concatenate([
      task_suites.difficulties(s.env, task_suites.stack(s.train_tasks, range(i, min(i + 1024, n))))
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

def train_and_evaluate(config, workdir: str, *, hook=None, init_from: str | None = None,
                       init_from_step: int | None = None) -> dict:
  """Runs (or resumes) the configured experiment in `workdir` (see `_train_and_evaluate`).

  `workdir` may be relative or start with `~`; it is made absolute first. The run holds the
  workdir's lock (`train/workdir.py`) from before set-up to the end, so a second run on the same
  workdir refuses at once. `init_from` (another run's workdir) starts a new run from that run's
  newest restorable checkpoint, or checkpoint step `init_from_step` (see `start_from`); on resume
  both are ignored when they name the run and step the workdir was started from, and refused
  otherwise.
  """
  config_lib.validate(config)
  workdir = workdir_lib.resolve(workdir)
  with workdir_lib.WorkdirLock(workdir):
    s = Learner.build(config)
    with s.in_mesh():
      return _train_and_evaluate(s, config, workdir, hook=hook, init_from=init_from,
                                 init_from_step=init_from_step)


def new_run(s: Learner, state: TrainState, config, workdir: str | None = None
            ) -> tuple[TrainState, dict]:
  """The start of a new run: SFT on oracle episodes and its evaluation, then with `config.dpo.steps`
  the DPO stage (`train/preference.py`, its episodes in `<workdir>/trajectories/`) and its
  evaluation. `(state, meta)`; the KL reference is the policy RL starts from."""
  logging.info("New run: warm start by SFT for %d steps on %d oracle episodes.", config.sft.steps,
               config.sft.episodes)
  state, sft_metrics = s.warm_start(state)
  warm = _evaluate_both(s, state.params, eval_seed(config), full=True)
  # RL tasks start after the SFT tasks, so the first updates do not replay the demonstrations.
  position = config.sft.episodes if config.sft.steps else 0
  meta = {"update": 0, "warm_start": warm, "sft": sft_metrics}
  logging.info("Warm start: sampled success %.3f, greedy %s.", warm["success_rate"],
               _rate(warm["greedy_success_rate"]))
  if config.get("dpo") and config.dpo.steps:
    if workdir is None:
      raise ValueError("new_run: the DPO stage (dpo.steps > 0) needs the run's workdir (its "
                       "trajectory store).")
    state, info, position = preference_stage(s, state, os.path.join(workdir, STORE_DIR), position)
    info["evaluation"] = _evaluate_both(s, state.params, eval_seed(config), full=True)
    meta["dpo"] = info
    logging.info("After DPO (%d pairs): sampled success %.3f, greedy %s.", info["pairs_used"],
                 info["evaluation"]["success_rate"],
                 _rate(info["evaluation"]["greedy_success_rate"]))
  meta["data_position"] = position
  return s.with_reference(state), meta


# Fields that decide the policy's parameter shapes and vocabulary: a run started from another run's
# checkpoint (`start_from`) must agree with it on these.
_PARAMETER_FIELDS = ("model.", "env.name", "env.style")
# Model fields that change how the parameters are computed with, not what they are (and
# `model.lora.init`, which only chooses the starting adapters: a checkpoint's replace them).
_COMPUTE_FIELDS = ("model.remat", "model.decode_kernel", "model.decode_quant", "model.lora.dropout",
                   "model.lora.init")


def start_from(s: Learner, state: TrainState, source: str, step: int | None = None
               ) -> tuple[TrainState, dict]:
  """A new run from another run's checkpoint: its parameters, this run's everything else.

  The policy parameters come from the newest restorable checkpoint of the workdir `source` (or
  its checkpoint `step`: restored or an error naming the steps there, no fallback); the
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
          if any(k == f or (f.endswith(".") and k.startswith(f)) for f in _PARAMETER_FIELDS)
          and k not in _COMPUTE_FIELDS}
  if diff:
    lines = "\n".join(f"  {k}: {a!r} (source) -> {b!r} (now)" for k, (a, b) in diff.items())
    raise workdir_lib.WorkdirError(f"--init_from={source}: the source run's model or tokenizer differs from this "
                     f"config's:\n{lines}\nUse the source's values for these fields.")
  checkpointer = Checkpointer(os.path.join(src, "checkpoints"))
  if checkpointer.latest_step() is None:
    raise workdir_lib.WorkdirError(f"--init_from={source}: no checkpoint in {src}/checkpoints yet.")
  try:
    saved_state, src_meta = checkpointer.restore(step)
  except (FileNotFoundError, ValueError) as e:  # an explicit step that is missing or incomplete
    raise workdir_lib.WorkdirError(f"--init_from={source} --init_from_step={step}: {e}") from None
  finally:
    step = checkpointer.restored_step if checkpointer.restored_step is not None else step
    checkpointer.close()
  params = saved_state["params"]
  expected = jax.tree_util.tree_flatten_with_path(state.params)[0]
  got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, leaf in expected:
    if path not in got or np.shape(got[path]) != leaf.shape:
      raise workdir_lib.WorkdirError(f"--init_from={source}: parameter {jax.tree_util.keystr(path)} has shape "
                       f"{np.shape(got.get(path))} in step {step} of {src}, this config builds "
                       f"{leaf.shape}.")
  # (a LoRA policy's frozen base leaves may be host NumPy arrays: they have no sharding)
  params = jax.tree.map(lambda t, x: jax.device_put(jnp.asarray(x, t.dtype),
                                                    getattr(t, "sharding", None)),
                        state.params, params)
  state = s.with_reference(state.replace(params=params, opt_state=s.init_opt_state(params)))
  origin = {"workdir": src, "step": step, "update": src_meta.get("update"),
            "algorithm": saved.get("algorithm", {}).get("name")}
  logging.info("New run from %s (checkpoint step %d, %s): evaluating the starting policy.", src,
               step, origin["algorithm"])
  warm = _evaluate_both(s, state.params, eval_seed(s.config), full=True)
  meta = {"update": 0, "data_position": int(src_meta.get("data_position", 0)),
          "warm_start": warm, "sft": src_meta.get("sft", {}), "init_from": origin}
  return state, meta


def _check_init_from(workdir: str, init_from: str | None, meta: dict,
                     init_from_step: int | None = None):
  """On resume, `init_from` (and `init_from_step`) must name the run (and checkpoint step) this
  workdir was started from, or be absent."""
  if init_from is None:
    if init_from_step is not None:
      raise workdir_lib.WorkdirError("--init_from_step needs --init_from (the run to start from).")
    return
  origin = (meta.get("init_from") or {}).get("workdir")
  origin_step = (meta.get("init_from") or {}).get("step")
  if origin == workdir_lib.resolve(init_from) and init_from_step not in (None, origin_step):
    raise workdir_lib.WorkdirError(f"--init_from_step={init_from_step}: {workdir} already holds a "
                                   f"run started from step {origin_step} of {origin}; drop the "
                                   f"flags to resume it, or use a new --workdir.")
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


def _train_and_evaluate(s: Learner, config, workdir: str, *, hook=None, init_from=None,
                        init_from_step=None) -> dict:
  """Runs (or resumes) the configured experiment in `workdir`; returns the final `eval.json` dict.

  `hook(point, update)`, if given, is called at `"rollout"`, `"update"` and `"checkpoint"` (after a
  save has started) of every update; the process-kill tests use it to die at a chosen point.
  """
  hook = hook or (lambda point, update: None)
  primary = jax.process_index() == 0
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                              max_to_keep=config.keep_checkpoints)
  state, meta = _start_or_resume(s, config, workdir, checkpointer, init_from, init_from_step)
  start, data_position = int(meta["update"]), int(meta["data_position"])
  # metrics.jsonl numbers updates from 1: drop lines after the checkpoint (updates > start).
  writer = MetricsWriter(workdir, tensorboard=config.tensorboard, is_primary=primary,
                         resume_from=start + 1)
  progress = Progress(config.num_updates, initial=start, enabled=config.progress and primary)
  timer = Timer()
  skipped_before = int(jax.device_get(state.skipped))
  param_bytes = params_bytes_per_device(state.params)
  curriculum, buckets = make_curriculum(s, meta.get("curriculum"))
  horizon = make_horizon_curriculum(config, meta.get("horizon"))
  pipeline, store_batch = None, trajectory_store(config, workdir)
  replay = store_replay(config, workdir)
  if config.rollout.mode == "async" and start < config.num_updates:
    # Actor threads sample with published copies of the parameters (train/async_rollout.py); a
    # resumed run restarts them from the checkpointed parameters at the checkpointed batch.
    pipeline = AsyncRollouts(s, state.params, version=start,
                             first_batch=int(meta.get("next_batch", start)),
                             data_position=data_position, last_update=config.num_updates,
                             curriculum=curriculum, buckets=buckets, seed=config.seed).start()
  for update in range(start, config.num_updates):
    timer.reset()
    started = time.perf_counter()
    hook("rollout", update)
    task_indices = task_buckets = None
    if curriculum is not None and pipeline is None:  # (async: the actors draw, `AsyncRollouts`)
      task_indices, task_buckets, curriculum.cursor = draw_tasks(
          curriculum, buckets, np.random.default_rng([config.seed, update]),
          config.rollout.num_tasks, curriculum.cursor)
    if pipeline is None:
      state, metrics = s.step(state, update, data_position, timer, hook, task_indices,
                              step_budget=horizon and horizon.budget, on_batch=store_batch(update),
                              replay=replay)
    else:
      state, metrics = pipeline.step(state, update, timer, hook, on_batch=store_batch(update))
    meta = _update_curricula(curriculum, horizon, pipeline, task_buckets, metrics, meta)
    if pipeline is None:
      data_position += config.rollout.num_tasks
    else:
      data_position = pipeline.data_position  # after the newest batch taken (dropped ones too)
    metrics.update(timer.split())
    metrics["update_s"] = time.perf_counter() - started
    metrics["params/bytes_per_device"] = param_bytes
    metrics["memory/peak_rss_gb"] = peak_rss_gb()
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


def _update_curricula(curriculum, horizon, pipeline, task_buckets, metrics: dict,
                      meta: dict) -> dict:
  """After an update: feeds its per-task success (popped from `metrics`) to the task curriculum
  (the async pipeline has already, before publishing) and its success to the horizon curriculum,
  adds their metrics, and returns `meta` with their checkpointable states."""
  task_success = metrics.pop("_task_success")
  if curriculum is not None:
    if pipeline is None:
      curriculum.update(task_buckets, task_success)
    metrics.update(curriculum.metrics())
    meta = dict(meta, curriculum=curriculum.state_dict() if pipeline is None
                else pipeline.curriculum_state)
  if horizon is not None:
    metrics.update(horizon.metrics())  # the budget this update ran with
    horizon.update(metrics["success_rate"])
    meta = dict(meta, horizon=horizon.state_dict())
  return meta


def trajectory_store(config, workdir: str):
  """`for_update(update) -> on_batch(batch, stats)` or None: with `config.store.enabled`, process 0
  appends each update's training batch (the one `learn` was given) to `<workdir>/trajectories/`
  (`rollout/store.py`) as update `update + 1` (numbered as in metrics.jsonl), with the rollout's
  `episode_info`, keeping the episodes `config.store.keep` names. A resumed run appends; the updates
  it computes again after its checkpoint are stored again."""
  c = config.get("store")
  if not (c and c.enabled) or jax.process_index() != 0:
    return lambda update: None
  store = TrajectoryStore(os.path.join(workdir, STORE_DIR))
  meta = {"env": config.env.name, "algorithm": config.algorithm.name, "seed": config.seed}
  return lambda update: lambda batch, stats: store.append(
      batch, update=update + 1, info=stats.episode_info, meta=meta, filters=KEEP[c.keep])


def store_replay(config, workdir: str) -> StoreReplay | None:
  """The run's `StoreReplay` (`train/replay.py`) with `config.store.replay_groups > 0`, else None."""
  c = config.get("store")
  if not (c and c.get("replay_groups", 0)):
    return None
  if jax.process_count() > 1:
    raise ValueError("store.replay_groups > 0 runs on one process (the store is process 0's).")
  return StoreReplay(os.path.join(workdir, STORE_DIR), groups=c.replay_groups,
                     group_size=config.rollout.group_size,
                     context_length=config.rollout.context_length,
                     max_steps=config.env.max_steps, seed=config.seed,
                     priority=Priority(failure=c.replay_failure, half_life=c.replay_half_life))


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


def _start_or_resume(s: Learner, config, workdir: str, checkpointer: Checkpointer, init_from,
                     init_from_step=None) -> tuple[TrainState, dict]:
  """`(state, meta)` to continue from: the workdir's checkpoint, else a new run (a warm start, or
  another run's checkpoint with `init_from`) saved as step 0. The config is checked against the
  saved one before anything is written, and recorded."""
  state = s.initial_state()
  latest = checkpointer.latest_step()
  # Compared before anything is written: an incompatible config is refused with the diff.
  changes = workdir_lib.check_config(workdir, config, resuming=latest is not None)
  if latest is not None:
    state, meta = checkpointer.restore(template=s.with_reference(state))
    _check_init_from(workdir, init_from, meta, init_from_step)
    logging.warning("%s", _resume_message(checkpointer, latest, meta, config))
    workdir_lib.save_config(workdir, config, int(meta["update"]), changes)
    return state, meta
  if init_from is None and init_from_step is not None:
    raise workdir_lib.WorkdirError("--init_from_step needs --init_from (the run to start from).")
  workdir_lib.save_config(workdir, config, 0)
  if init_from is None:
    state, meta = new_run(s, state, config, workdir)
  else:
    state, meta = start_from(s, state, init_from, init_from_step)
    if jax.process_index() == 0:
      with open(os.path.join(workdir, "init_from.json"), "w") as f:
        json.dump(meta["init_from"], f, indent=2, sort_keys=True)
  checkpointer.save(0, state, meta, force=True)
  checkpointer.wait()
  return state, meta


def _final_evaluation(s: Learner, config, workdir: str, params, meta: dict) -> dict:
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
                 "algorithm": config.algorithm.name, "init_from": meta.get("init_from"),
                 "training_episodes": _episodes(config, meta), "provenance": provenance()})
  if meta.get("dpo"):
    dpo = meta["dpo"]
    result.update({"dpo_success_rate": dpo["evaluation"]["success_rate"],
                   "dpo_greedy_success_rate": dpo["evaluation"]["greedy_success_rate"],
                   "dpo": {k: v for k, v in dpo.items() if k != "evaluation"}})
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "eval.json"), "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)
    plot_learning_curve(workdir, result)
    stages = [("warm start", warm)] + ([("DPO", meta["dpo"]["evaluation"])] if meta.get("dpo")
                                       else []) + [("final", final)]
    metrics_lib.plot_report(stages,
                            os.path.join(workdir, "eval.png"))
  return result


def _episodes(config, meta: dict) -> dict:
  """The episodes each stage of the run sampled (SFT demonstrations, DPO, RL), and their total."""
  out = {"sft": config.sft.episodes if config.sft.steps else 0,
         "dpo": int(meta.get("dpo", {}).get("episodes", 0)),
         "rl": config.num_updates * config.rollout.num_tasks * config.rollout.group_size}
  return dict(out, sampled=out["dpo"] + out["rl"])


# The largest peak `peak_rss_gb` has read in this process (see there).
_PEAK_RSS_GB = 0.0


def peak_rss_gb() -> float:
  """This process's peak resident memory so far, in GB, never lower than an earlier answer.

  Read from Linux's `VmHWM` (the address space's own high-water mark; `getrusage`'s `ru_maxrss`
  survives exec, so a child of a large process would report its parent's peak), else `getrusage`
  (kilobytes on Linux, bytes on macOS). Linux counts resident pages per CPU and sums them only
  approximately, so a later `VmHWM` can read a few hundred kB below an earlier one (seen on kernel
  6.18: 5.50552 GB, then 5.50538 GB): the answer is the largest reading so far."""
  global _PEAK_RSS_GB
  _PEAK_RSS_GB = max(_PEAK_RSS_GB, _read_peak_rss_gb())
  return _PEAK_RSS_GB


def _read_peak_rss_gb() -> float:
  """One reading of the peak resident memory, in GB (see `peak_rss_gb`)."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024 / 1e9
  except OSError:
    pass
  maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return maxrss / 1e9 if sys.platform == "darwin" else maxrss * 1024 / 1e9


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
