"""The horizon cliff: end-to-end success versus horizon, per credit-assignment algorithm.

One *cell* is `(env, horizon, seed)`: a policy is warm-started once by SFT on noisy-demonstrator
episodes, then every algorithm trains a copy of that same warm start for the same budget (updates x
tasks x group), so algorithms differ only in how they assign credit. Per run we record the
warm-start and final success (sampled at the rollout temperature, and greedy), the *single-step
accuracy* p (the mean probability the policy gives the oracle's action in states along oracle
episodes, teacher-forced), its independent-steps prediction p^H for an episode of H actions, the
episodes and tokens consumed, and the training-success learning curve.

`run_sweep` runs cells one after another in this process (compiled functions are shared by every
run of one shape), appends each finished run to `results.csv` / `curves.csv` (and its per-update
diagnostics to `update_metrics.csv`, first errors to `first_errors.csv`) and skips runs already
there, so a killed sweep resumes (sweeps over disjoint seeds may share one folder). `summarize` and the `plot_*` functions read those files back;
`experiments/horizon_sweep.py` is the entry point and `notebooks/credit_assignment_ablation.ipynb`
reuses the plots.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import hashlib
import io
import json
import math
import os
import shutil
import time
from typing import Any, Callable, Iterable, Sequence
import warnings

import jax
import jax.numpy as jnp
from matplotlib.figure import Figure
import numpy as np

from longhorizon import envs
from longhorizon import rollout
from longhorizon.core.episode import to_device
from longhorizon.envs import tasks as task_suites
from longhorizon.eval import provenance
from longhorizon.models import init_params
from longhorizon.train import config as config_lib
from longhorizon.train import learner as learner_lib
from longhorizon.train import workdir as workdir_lib
from longhorizon.train.checkpoints import Checkpointer
from longhorizon.train.learner import Learner
from longhorizon.train.metrics import Timer

__all__ = ["ALGORITHMS", "Cell", "actions_needed", "cell_config", "step_probabilities",
           "step_accuracy", "run_cell", "run_sweep", "run_path", "run_fingerprint",
           "warm_fingerprint", "warm_settings",
           "save_warm_start", "load_warm_start", "read_results", "read_update_metrics", "summarize",
           "plot_success_vs_horizon", "plot_learning_curves", "plot_sample_efficiency", "plot_all",
           "markdown_table"]

# Label -> config overrides. Every run shares all other hyperparameters (none is tuned per method).
ALGORITHMS = {
    "grpo": {"algorithm.name": "grpo"},
    "drgrpo": {"algorithm.name": "drgrpo"},
    "rloo": {"algorithm.name": "rloo"},
    "ppo_gae": {"algorithm.name": "ppo", "algorithm.advantage": "gae"},
    "ppo_lagae": {"algorithm.name": "ppo", "algorithm.advantage": "length_adaptive_gae"},
    "gigpo": {"algorithm.name": "gigpo"},
    # Turn-level credit (issue 19): GAE whose recursion counts turns; VAPO's lambda with the
    # length in turns (alpha 1: lambda = 1 - 1/turns); bi-level GAE; EMPG on GRPO.
    "ppo_turn_gae": {"algorithm.name": "ppo", "algorithm.unit": "turn"},
    "ppo_turn_lagae": {"algorithm.name": "ppo", "algorithm.unit": "turn",
                       "algorithm.advantage": "length_adaptive_gae",
                       "algorithm.vapo_length": "turns", "algorithm.vapo_alpha": 1.0},
    "ppo_bilevel": {"algorithm.name": "ppo", "algorithm.advantage": "bilevel_gae"},
    "grpo_empg": {"algorithm.name": "grpo", "algorithm.empg": True},
    # Branch rollouts (issue 19): 2 roots per task of 8 episodes, each forked into 3
    # continuations at a uniformly drawn step (or at its first non-oracle action); the tree
    # estimators; GRPO on the same branched batches as the control.
    "grpo_branched": {"algorithm.name": "grpo", "rollout.branch_k": 3},
    "vine": {"algorithm.name": "vine", "rollout.branch_k": 3},
    "branch": {"algorithm.name": "branch", "rollout.branch_k": 3},
    "tree_grpo": {"algorithm.name": "tree_grpo", "rollout.branch_k": 3},
    "tree_grpo_divergence": {"algorithm.name": "tree_grpo", "rollout.branch_k": 3,
                             "rollout.branch_at": "first_divergence"},
    "tree_critic": {"algorithm.name": "tree_critic", "rollout.branch_k": 3},
    # Rule-based step verifiers (issue 19): GRPO plus the verifier's group-relative step advantage
    # (weight 0.5), never folded into the outcome reward.
    "grpo_milestone_verifier": {"algorithm.name": "grpo", "algorithm.step_verifier": "milestone"},
    "grpo_oracle_verifier": {"algorithm.name": "grpo", "algorithm.step_verifier": "oracle"},
    # The combination: Tree-GRPO's sibling step groups plus the milestone verifier's step
    # advantages (neither needs privileged information).
    "tree_grpo_milestone_verifier": {"algorithm.name": "tree_grpo", "rollout.branch_k": 3,
                                     "algorithm.step_verifier": "milestone"},
    # Recovery tasks (issue 19): 2 of the 8 groups per update restart just after an earlier
    # failed episode's first non-oracle action (the newest such failures), 6 are fresh tasks.
    "grpo_recovery": {"algorithm.name": "grpo", "rollout.recovery_groups": 2,
                      "rollout.recovery_from": "first_divergence"},
}

RESULT_FIELDS = ("env", "horizon", "actions", "algorithm", "seed", "updates", "episodes", "tokens",
                 "warm_success", "warm_greedy_success", "warm_step_accuracy", "warm_predicted",
                 "final_success", "final_greedy_success", "final_step_accuracy", "final_predicted",
                 "gain", "gain_per_1k_episodes", "gain_per_1m_tokens", "mean_task_length",
                 "wall_s")
CURVE_FIELDS = ("env", "horizon", "algorithm", "seed", "update", "episodes", "tokens",
                "train_success")
# What each update's learner step measured beyond success (`update_metrics.csv`), so a run that
# collapses can be read afterwards without rerunning it: the policy's entropy on its own tokens,
# the approximate KL of the update (k1 and k3, each minibatch's before its step), the largest
# ratio and the clipped-ratio fraction, the gradient norm, the share of groups whose advantages
# were all 0 (no signal), the rollout engine's log-prob gap to the learner's, episode length in
# steps, the invalid-action reward and the failure / timeout rates, and updates skipped for a
# zero gradient. A metric the algorithm does not compute is left empty.
UPDATE_METRICS = ("entropy", "approx_kl", "approx_kl_k3", "ratio_max", "clipfrac", "grad_norm",
                  "zero_advantage_group_rate", "logp_mismatch_mean", "logp_mismatch_max",
                  "episode_steps", "reward/invalid", "termination/failure", "termination/timeout",
                  "termination/success", "skipped_updates")
UPDATE_METRIC_FIELDS = ("env", "horizon", "algorithm", "seed", "update") + UPDATE_METRICS
# Where training episodes first left the oracle's path, per update (runs with
# rollout.record_oracle): the rate of episodes with an error, the mean first-error step, the
# fraction at the first step, and the fraction at each step as one space-separated field.
FIRST_ERROR_FIELDS = ("env", "horizon", "algorithm", "seed", "update", "rate", "mean_step",
                      "at_first_step", "by_step")


@dataclasses.dataclass(frozen=True)
class Cell:
  env: str
  horizon: int
  seed: int


def _horizon_settings(env_name: str, horizon: int) -> dict:
  try:
    return envs.resolve(env_name).horizon_settings(horizon)
  except (NotImplementedError, AttributeError) as e:
    raise ValueError(f"horizon sweeps need an environment with horizon_settings(horizon); "
                     f"{env_name!r}: {e}") from None


def actions_needed(env_name: str, horizon: int) -> int:
  """Actions H of a flawless episode at horizon N (the environment's `horizon_settings`)."""
  return _horizon_settings(env_name, horizon)["actions"]


def _env_settings(env_name: str, horizon: int) -> dict[str, Any]:
  """Environment parameters and budgets for one horizon: a step limit with some slack to recover
  from a wrong action, and a context budget that holds the longest episode (the prompt's
  `prompt_tokens`, default 48, and `turn_tokens` per step)."""
  settings = _horizon_settings(env_name, horizon)
  actions = settings["actions"]
  max_steps = actions + max(2, actions // 4)
  return {"env.name": env_name, "env.params": settings["params"], "env.max_steps": max_steps,
          "rollout.context_length": (settings.get("prompt_tokens", 48)
                                     + settings["turn_tokens"] * (max_steps + 1))}


def cell_config(base, env_name: str, horizon: int, algorithm: str, seed: int):
  """`base` (a training config, e.g. configs/horizon_sweep.py) set to one run of the sweep."""
  if algorithm not in ALGORITHMS:
    raise ValueError(f"unknown algorithm label {algorithm!r}; expected one of {list(ALGORITHMS)}.")
  config = copy.deepcopy(base)
  config.unlock()
  for path, value in {**_env_settings(env_name, horizon), **ALGORITHMS[algorithm]}.items():
    config_lib.set_path(config, path, value)
  config.seed = int(seed)
  config_lib.validate(config)
  return config


def step_probabilities(logp, turn, loss_mask, step_mask) -> np.ndarray:
  """`[B, S]` probability of each step's action: `exp` of the sum of its sampled tokens' log-probs
  (`loss_mask` tokens whose `turn` is the step); NaN where the step did not happen."""
  logp, turn = np.asarray(logp, np.float64), np.asarray(turn)
  on = np.asarray(loss_mask, bool) & (turn >= 0)
  steps = np.asarray(step_mask, bool)
  sums = np.zeros(steps.shape, np.float64)
  rows = np.broadcast_to(np.arange(turn.shape[0])[:, None], turn.shape)
  np.add.at(sums, (rows[on], turn[on]), logp[on])
  return np.where(steps, np.exp(sums), np.nan)


def step_accuracy(learner: Learner, params, oracle_batch) -> tuple[float, np.ndarray]:
  """`(p, p_by_step)`: the probability the policy (at temperature 1) gives the oracle's action,
  teacher-forced on oracle episodes, averaged over all steps, and by step index."""
  logp = learner.logprobs(params, to_device(oracle_batch), temperature=1.0)
  prob = step_probabilities(logp, oracle_batch.turn, oracle_batch.loss_mask,
                            oracle_batch.step_mask)
  with np.errstate(invalid="ignore"), warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    return float(np.nanmean(prob)), np.nanmean(prob, axis=0)


def _evaluate(learner: Learner, params, seed: int) -> dict:
  c = learner.config
  n = c.eval.num_tasks
  sampled = learner.evaluate(params, "test", n, temperature=learner.rollout.temperature, seed=seed,
                             group_size=c.eval.k)
  greedy = learner.evaluate(params, "test", n, temperature=0.0, seed=seed)
  return {"success": sampled["success_rate"], "greedy_success": greedy["success_rate"]}


def _oracle_episodes(learner: Learner):
  """Oracle episodes of the test tasks (for the teacher-forced single-step accuracy) and the
  tasks' mean difficulty."""
  c = learner.config
  source = learner.eval_tasks["test"]
  tasks = task_suites.stack(source, range(min(c.eval.num_tasks, len(source))))
  keys = jax.random.split(jax.random.key(c.seed + 101), task_suites.count(tasks))
  oracle, _ = rollout.collect(None, None, learner.env, learner.codec, tasks, keys,
                              learner.collect_config(group_size=1),
                              sampling_seed=0,
                              scripted=rollout.oracle_turns(learner.env, learner.codec, 0.0))
  if not np.all(oracle.success):
    raise RuntimeError(f"the oracle solves only {np.mean(oracle.success):.2f} of the test tasks "
                       f"of {c.env.name}; raise env.max_steps or rollout.context_length.")
  difficulty = task_suites.difficulties(learner.env, tasks)
  return oracle, float(np.mean(np.asarray(difficulty)))


# Config fields that do not change a cell's warm-start parameters (nor its warm evaluation's
# meaning): left out of the warm-start file's fingerprint.
_NOT_IN_WARM_FINGERPRINT = ("num_updates", "progress", "tensorboard", "sweep", "tasks.data_dir")


def warm_settings(config) -> dict:
  """The settings a cell's warm start depends on, flat (`section.field`) and JSON-normal: the
  config less `_NOT_IN_WARM_FINGERPRINT`, and less every field added to the config after warm
  starts were first kept (`workdir.ADDED_FIELDS`) while it holds the value that reproduces the
  behaviour from before it existed. So adding a config field does not orphan the kept warm starts;
  setting it to anything else does."""
  flat = json.loads(json.dumps(workdir_lib.flatten(config.to_dict(), keep_empty=False),
                                default=str))
  added = json.loads(json.dumps(workdir_lib.ADDED_FIELDS, default=str))
  return {k: v for k, v in flat.items()
          if not any(k == n or k.startswith(n + ".") for n in _NOT_IN_WARM_FINGERPRINT)
          and not (k in added and v == added[k])}


def warm_fingerprint(config) -> str:
  """A hash of `warm_settings(config)`."""
  return _fingerprint(warm_settings(config))


def _fingerprint(settings: dict) -> str:
  return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def warm_start_path(warm_dir: str, cell: Cell) -> str:
  return os.path.join(warm_dir, f"{cell.env}_N{cell.horizon}_s{cell.seed}")


def save_warm_start(path: str, params, config, info: dict) -> None:
  """`path.npz` (the parameters, one array per tree path) and `path.json` (`config`'s
  `warm_fingerprint` and `warm_settings`, and `info`),
  each written to a temporary name and renamed, so a killed sweep never leaves half a file."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  arrays = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}
  with open(path + ".npz.tmp", "wb") as f:
    np.savez(f, **arrays)
  os.replace(path + ".npz.tmp", path + ".npz")
  settings = warm_settings(config)
  with open(path + ".json.tmp", "w") as f:
    json.dump({"fingerprint": _fingerprint(settings), "settings": settings, **info}, f, indent=1,
              sort_keys=True)
  os.replace(path + ".json.tmp", path + ".json")


def load_warm_start(path: str, template, config) -> tuple[Any, dict]:
  """`(params, info)` from `save_warm_start`'s files, laid out as `template`. Raises ValueError
  naming the file when it was made with other `warm_settings` than `config`'s (naming the fields
  that differ when the file records its settings), or when it does not hold `template`'s arrays (a
  corrupt or truncated file included)."""
  with open(path + ".json") as f:
    info = json.load(f)
  settings = warm_settings(config)
  fingerprint = _fingerprint(settings)
  if info.get("fingerprint") != fingerprint:
    differ = ""
    if isinstance(info.get("settings"), dict):
      diff = list(workdir_lib.config_diff(info["settings"], settings).items())
      differ = "; fields that differ (saved -> now): " + ", ".join(
          f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff[:8])
    raise ValueError(f"{path}.json: a warm start of other settings (fingerprint "
                     f"{info.get('fingerprint')!r}, this cell's {fingerprint!r}{differ}); move it "
                     f"away to recompute it.")
  try:
    with np.load(path + ".npz") as data:
      arrays = {k: data[k] for k in data.files}
  except Exception as e:  # a truncated zip, a bad CRC, ...
    raise ValueError(f"{path}.npz: unreadable warm start ({type(e).__name__}: {e}).") from None
  leaves = []
  for key, like in jax.tree_util.tree_leaves_with_path(template):
    name = jax.tree_util.keystr(key)
    if name not in arrays or arrays[name].shape != np.shape(like):
      raise ValueError(f"{path}.npz: no array {name} of shape {np.shape(like)}.")
    leaves.append(jnp.asarray(arrays[name], like.dtype))
  return jax.tree.unflatten(jax.tree.structure(template), leaves), info


def _warm_start(base, cell: Cell, algorithm: str, setups: dict,
                warm_dir: str | None = None) -> tuple[Learner, Any, dict | None]:
  """The cell's learner (environment, tasks and codec shared by every seed of an `(env, N)`), its
  SFT warm-start parameters and, when they were read from `warm_dir`, the info saved with them
  (else None; the caller saves them with `save_warm_start`)."""
  config = cell_config(base, cell.env, cell.horizon, algorithm, cell.seed)
  if config.model.checkpoint:
    raise ValueError("horizon sweeps train fresh tiny policies; set model.checkpoint=''.")
  if (cell.env, cell.horizon) not in setups:
    setups[(cell.env, cell.horizon)] = Learner.build(config)
  shared = setups[(cell.env, cell.horizon)]
  learner = shared.with_config(
      config, init_params=init_params(shared.model_config, learner_lib.key(cell.seed, 1)))
  state = learner.initial_state()
  path = None if warm_dir is None else warm_start_path(warm_dir, cell)
  if path is not None and os.path.exists(path + ".json"):
    params, info = load_warm_start(path, state.params, config)
    return learner, params, info
  state, _ = learner.warm_start(state)
  return learner, jax.tree.map(jnp.copy, state.params), None


def run_path(partial_dir: str, cell: Cell, label: str) -> str:
  """Where a run's mid-run checkpoints live (`_train`'s `run_dir`)."""
  return os.path.join(partial_dir, f"{cell.env}_N{cell.horizon}_s{cell.seed}_{label}")


def run_fingerprint(config, params) -> str:
  """A hash of what a run's updates depend on: its settings (`warm_settings` and `num_updates`)
  and the parameters it starts from, so a checkpoint is resumed only by the same run."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return _fingerprint({"settings": warm_settings(config), "num_updates": config.num_updates,
                       "params": digest.hexdigest()})


def _train(learner: Learner, params, cell: Cell, label: str, run_dir: str | None = None,
           every: int = 0, log: Callable[[str], None] = print
           ) -> tuple[Any, list[dict], int, int, float]:
  """Trains `params` (copied) with `learner` for `num_updates`: `(state, curve rows, episodes,
  tokens, seconds spent in earlier processes)`. RL tasks start after the warm start's SFT tasks.

  With `run_dir` and `every > 0` the state, the curve rows so far and the counters are saved
  there every `every` updates, and a run that finds a checkpoint of its own (`run_fingerprint`)
  continues from it: the update's samples depend only on the saved state, the update index and
  the data position, so the result equals the uninterrupted run's. A checkpoint of another run is
  refused with an error naming the folder. The caller removes `run_dir` once the run is recorded.
  `log` gets a line at each checkpoint (update, training success, seconds so far) and when a run
  continues from one, so a long run shows its progress.
  Recovery tasks keep their pool of failed starts in the learner, not the state, so a run with
  `rollout.recovery_groups` is not checkpointed."""
  c = learner.config
  params = jax.tree.map(jnp.copy, params)
  state = learner.initial_state().replace(params=params, opt_state=learner.init_opt_state(params))
  curves, episodes, tokens, start, earlier_s = [], 0, 0, 0, 0.0
  data_position, timer = c.sft.episodes, Timer()
  checkpointer = None
  if run_dir is not None and every > 0 and not c.rollout.recovery_groups:
    fingerprint = run_fingerprint(c, params)
    checkpointer = Checkpointer(run_dir, max_to_keep=1)
  run_started = time.perf_counter()
  batch_size = c.rollout.num_tasks * c.rollout.group_size
  try:
    if checkpointer is not None and checkpointer.latest_step() is not None:
      state, meta = checkpointer.restore(template=state)
      if meta.get("fingerprint") != fingerprint:
        raise ValueError(f"{run_dir}: a checkpoint of another run (fingerprint "
                         f"{meta.get('fingerprint')!r}, this run's {fingerprint!r}: other "
                         f"settings or another warm start); move it away to start this run afresh.")
      start, curves = int(meta["update"]), list(meta["curves"])
      episodes, tokens, data_position = meta["episodes"], meta["tokens"], meta["data_position"]
      earlier_s = float(meta["seconds"])
      log(f"  {label:10s} continues from its checkpoint at update {start}/{c.num_updates} "
          f"[{earlier_s:.0f}s before]")
    for update in range(start, c.num_updates):
      state, metrics = learner.step(state, update, data_position, timer)
      data_position += c.rollout.num_tasks
      episodes += batch_size
      tokens += int(round(metrics["episode_tokens"] * batch_size))
      curves.append({"env": cell.env, "horizon": cell.horizon, "algorithm": label,
                     "seed": cell.seed, "update": update + 1, "episodes": episodes,
                     "tokens": tokens, "train_success": metrics["success_rate"],
                     "first_error": _first_errors(metrics),
                     "metrics": {k: metrics.get(k, "") for k in UPDATE_METRICS}})
      if checkpointer is not None and (update + 1) % every == 0 and update + 1 < c.num_updates:
        seconds = earlier_s + time.perf_counter() - run_started
        checkpointer.save(update + 1, state, {
            "fingerprint": fingerprint, "update": update + 1, "curves": curves,
            "episodes": episodes, "tokens": tokens, "data_position": data_position,
            "seconds": seconds})
        log(f"  {label:10s} update {update + 1}/{c.num_updates}: training success "
            f"{metrics['success_rate']:.3f}, checkpoint saved  [{seconds:.0f}s]")
  finally:
    if checkpointer is not None:
      checkpointer.close()  # waits for a save under way
  return state, curves, episodes, tokens, earlier_s


def _first_errors(metrics: dict) -> dict | None:
  """The update's `first_error/...` metrics as a FIRST_ERROR_FIELDS row's values (None if the
  run did not record oracle matches)."""
  if "first_error/rate" not in metrics:
    return None
  steps = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in metrics.items()
                 if k.startswith("first_error/step_"))
  return {"rate": metrics["first_error/rate"], "mean_step": metrics.get("first_error/mean_step", ""),
          "at_first_step": metrics.get("first_error/at_first_step", ""),
          "by_step": " ".join(f"{v:.4f}" for _, v in steps)}


def run_cell(base, cell: Cell, algorithms: Sequence[str], *, log: Callable[[str], None] = print,
             setups: dict | None = None, warm_algorithm: str | None = None,
             on_run: Callable[[dict, list[dict]], None] | None = None,
             warm_dir: str | None = None, partial_dir: str | None = None,
             checkpoint_every: int = 0) -> tuple[list[dict], list[dict]]:
  """Warm start once, then every algorithm from that warm start: `(result rows, curve rows)`.

  `setups` (a dict kept across calls) reuses the environment, task suites and codec of an
  `(env, horizon)` for every seed, so their jitted functions compile once. The warm start is
  built with `warm_algorithm`'s config (default: the first of `algorithms`), so a resumed cell
  that runs only some algorithms starts them from the same warm start. With `warm_dir`, the warm
  start and its evaluation are saved there (`save_warm_start`) and read back by a resumed cell,
  which then starts from the same parameters on any machine (XLA's numerics differ between CPU
  models, so recomputing the SFT elsewhere would give another start). `on_run(row, curves)` is
  called as each algorithm's run finishes. With `partial_dir` and `checkpoint_every > 0` each run
  saves a checkpoint every `checkpoint_every` updates under `run_path(partial_dir, cell, label)`
  and continues from it when restarted (see `_train`); the folder is removed after `on_run`."""
  if checkpoint_every < 0:
    raise ValueError(f"sweep.checkpoint_every must be >= 0 (0: no mid-run checkpoints), got "
                     f"{checkpoint_every}.")
  started = time.perf_counter()
  warm_learner, warm_params, saved = _warm_start(base, cell, warm_algorithm or algorithms[0],
                                                 {} if setups is None else setups, warm_dir)
  c = warm_learner.config
  actions = actions_needed(cell.env, cell.horizon)
  oracle, mean_length = _oracle_episodes(warm_learner)
  if saved is not None:
    warm, warm_p = saved["warm"], saved["warm_step_accuracy"]
  else:
    warm = _evaluate(warm_learner, warm_params, c.seed + 17)
    warm_p, _ = step_accuracy(warm_learner, warm_params, oracle)
    if warm_dir is not None:
      save_warm_start(warm_start_path(warm_dir, cell), warm_params, warm_learner.config,
                      {"warm": warm, "warm_step_accuracy": float(warm_p),
                       "provenance": provenance.provenance()})
  log(f"{cell.env} N={cell.horizon} seed={cell.seed}: warm start success {warm['success']:.3f} "
      f"(greedy {warm['greedy_success']:.3f}), step accuracy {warm_p:.3f} -> p^{actions} = "
      f"{warm_p ** actions:.3f}  [{time.perf_counter() - started:.0f}s"
      f"{', read from ' + warm_dir if saved is not None else ''}]")
  rows, curves = [], []
  for label in algorithms:
    run_started = time.perf_counter()
    learner = warm_learner.with_config(cell_config(base, cell.env, cell.horizon, label, cell.seed))
    checkpointed = partial_dir is not None and checkpoint_every > 0
    run_dir = run_path(partial_dir, cell, label) if checkpointed else None
    state, run_curves, episodes, tokens, earlier_s = _train(learner, warm_params, cell, label,
                                                            run_dir, checkpoint_every, log)
    curves += run_curves
    final = _evaluate(learner, state.params, c.seed + 17)
    final_p, _ = step_accuracy(learner, state.params, oracle)
    gain = final["success"] - warm["success"]
    rows.append({"env": cell.env, "horizon": cell.horizon, "actions": actions, "algorithm": label,
                 "seed": cell.seed, "updates": learner.config.num_updates, "episodes": episodes,
                 "tokens": tokens, "warm_success": warm["success"],
                 "warm_greedy_success": warm["greedy_success"], "warm_step_accuracy": warm_p,
                 "warm_predicted": warm_p ** actions, "final_success": final["success"],
                 "final_greedy_success": final["greedy_success"],
                 "final_step_accuracy": final_p, "final_predicted": final_p ** actions,
                 "gain": gain, "gain_per_1k_episodes": gain / max(episodes, 1) * 1e3,
                 "gain_per_1m_tokens": gain / max(tokens, 1) * 1e6,
                 "mean_task_length": mean_length,
                 "wall_s": earlier_s + time.perf_counter() - run_started})
    log(f"  {label:10s} success {warm['success']:.3f} -> {final['success']:.3f} (greedy "
        f"{final['greedy_success']:.3f}), step accuracy {final_p:.3f} -> p^{actions} = "
        f"{final_p ** actions:.3f}  [{time.perf_counter() - run_started:.0f}s]")
    if on_run is not None:
      on_run(rows[-1], run_curves)
    if run_dir is not None:
      shutil.rmtree(run_dir, ignore_errors=True)
  return rows, curves


# ----------------------------------------------------------------------------------- files

def _append(path: str, fields: Sequence[str], rows: Iterable[dict]):
  """Appends `rows` in one `write` to a file opened for appending, so sweeps of other seeds
  running in other processes into the same folder never interleave their lines."""
  text = io.StringIO()
  writer = csv.DictWriter(text, fieldnames=list(fields))
  if not os.path.exists(path):
    writer.writeheader()
  else:
    _widen(path, fields)
  for row in rows:
    writer.writerow({k: row[k] for k in fields})
  with open(path, "a", newline="") as f:
    f.write(text.getvalue())


def _widen(path: str, fields: Sequence[str]) -> None:
  """Rewrites `path` under the header `fields` when its own header is an older, shorter one (a
  column added since: its old rows get it empty), so appended rows line up; raises ValueError
  naming the file when its columns are not a subset of `fields`."""
  with open(path, newline="") as f:
    reader = csv.DictReader(f)
    header = reader.fieldnames or []
    if header == list(fields):
      return
    if not set(header) <= set(fields):
      raise ValueError(f"{path}: its columns {header} are not among this version's "
                       f"{list(fields)}; move the file aside or write to another folder.")
    rows = list(reader)
  text = io.StringIO()
  writer = csv.DictWriter(text, fieldnames=list(fields), restval="")
  writer.writeheader()
  writer.writerows(rows)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", newline="") as f:
    f.write(text.getvalue())
  os.replace(tmp, path)


def _read_csv(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    for key, value in row.items():
      if value == "":  # a metric the run did not compute
        row[key] = None
      elif key not in ("env", "algorithm"):
        number = float(value)
        row[key] = int(number) if number.is_integer() and key in (
            "horizon", "actions", "seed", "updates", "episodes", "tokens", "update") else number
  return rows


def read_results(out_dir: str) -> tuple[list[dict], list[dict]]:
  """`(result rows, curve rows)` from `results.csv` and `curves.csv` in `out_dir`. A run whose
  curve was written before the sweep was killed (and its result row never was) is rerun on
  resume; of its curve rows only the last written are kept."""
  return (_read_csv(os.path.join(out_dir, "results.csv")),
          _last_per_update(os.path.join(out_dir, "curves.csv")))


def read_update_metrics(out_dir: str) -> list[dict]:
  """The rows of `out_dir/update_metrics.csv` (UPDATE_METRIC_FIELDS), the last written for each
  (run, update) as in `read_results`; [] for a sweep from before the file existed."""
  return _last_per_update(os.path.join(out_dir, "update_metrics.csv"))


def _last_per_update(path: str) -> list[dict]:
  """The rows of a per-update CSV, the last written for each (env, horizon, algorithm, seed,
  update): a run rerun after a kill wrote its rows again."""
  rows = {}
  for row in _read_csv(path):
    rows[(row["env"], row["horizon"], row["algorithm"], row["seed"], row["update"])] = row
  return list(rows.values())


def run_sweep(base, cells: Sequence[Cell], algorithms: Sequence[str], out_dir: str, *,
              log: Callable[[str], None] = print, keep_warm_starts: bool = False,
              checkpoint_every: int = 0) -> list[dict]:
  """Runs every (cell, algorithm) not yet in `out_dir/results.csv`; returns all result rows.

  Each run's rows are appended as it finishes, so a killed sweep loses at most the run under way
  and redoes its cell's warm start, or with `keep_warm_starts` reads it back from
  `out_dir/warm_starts/` (see `run_cell`). With `checkpoint_every > 0` the run under way loses
  only the updates since its last checkpoint (`out_dir/partial/`)."""
  os.makedirs(out_dir, exist_ok=True)
  done = {(r["env"], r["horizon"], r["seed"], r["algorithm"]) for r in read_results(out_dir)[0]}

  def record(row: dict, curves: list[dict]) -> None:
    _append(os.path.join(out_dir, "curves.csv"), CURVE_FIELDS, curves)
    errors = [{**{k: c[k] for k in FIRST_ERROR_FIELDS[:5]}, **c["first_error"]}
              for c in curves if c.get("first_error")]
    if errors:
      _append(os.path.join(out_dir, "first_errors.csv"), FIRST_ERROR_FIELDS, errors)
    _append(os.path.join(out_dir, "update_metrics.csv"), UPDATE_METRIC_FIELDS,
            [{**{k: c[k] for k in UPDATE_METRIC_FIELDS[:5]}, **c["metrics"]} for c in curves])
    _append(os.path.join(out_dir, "results.csv"), RESULT_FIELDS, [row])

  setups: dict = {}
  for i, cell in enumerate(cells):
    todo = [a for a in algorithms if (cell.env, cell.horizon, cell.seed, a) not in done]
    if not todo:
      log(f"[{i + 1}/{len(cells)}] {cell} already in results.csv: skipped")
      continue
    log(f"[{i + 1}/{len(cells)}] {cell}" + (f" (resumed: {', '.join(todo)})"
                                            if len(todo) < len(algorithms) else ""))
    run_cell(base, cell, todo, log=log, setups=setups, warm_algorithm=algorithms[0],
             on_run=record,
             warm_dir=os.path.join(out_dir, "warm_starts") if keep_warm_starts else None,
             partial_dir=os.path.join(out_dir, "partial"), checkpoint_every=checkpoint_every)
  return read_results(out_dir)[0]


# --------------------------------------------------------------------------------- summary

def summarize(rows: Sequence[dict]) -> list[dict]:
  """Mean and standard deviation over seeds per `(env, horizon, algorithm)`."""
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    groups.setdefault((row["env"], row["horizon"], row["algorithm"]), []).append(row)
  order = {name: i for i, name in enumerate(ALGORITHMS)}
  out = []
  for (env, horizon, algorithm), members in sorted(
      groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 99))):
    entry = {"env": env, "horizon": horizon, "algorithm": algorithm, "seeds": len(members),
             "actions": members[0]["actions"]}
    for key in ("warm_success", "final_success", "final_greedy_success", "warm_step_accuracy",
                "final_step_accuracy", "final_predicted", "gain", "gain_per_1k_episodes",
                "gain_per_1m_tokens"):
      values = np.array([m[key] for m in members], np.float64)
      entry[key] = float(values.mean())
      entry[key + "_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    out.append(entry)
  return out


def markdown_table(summary: Sequence[dict]) -> str:
  """The summary as a Markdown table (mean +- std over seeds)."""
  lines = ["| env | N | H | algorithm | seeds | warm success | final success | greedy | "
           "step acc. p | p^H | gain / 1k episodes |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  pm = lambda e, k: f"{e[k]:.3f} ± {e[k + '_std']:.3f}"
  for e in summary:
    lines.append(f"| {e['env']} | {e['horizon']} | {e['actions']} | {e['algorithm']} | "
                 f"{e['seeds']} | {pm(e, 'warm_success')} | {pm(e, 'final_success')} | "
                 f"{pm(e, 'final_greedy_success')} | {pm(e, 'final_step_accuracy')} | "
                 f"{e['final_predicted']:.3f} | {pm(e, 'gain_per_1k_episodes')} |")
  return "\n".join(lines)


def _subplots(rows: int, cols: int, figsize):
  """A pyplot-free figure (no global backend switch, so notebooks keep their inline plots)."""
  fig = Figure(figsize=figsize)
  return fig, fig.subplots(rows, cols, squeeze=False)


def _colors(labels):
  palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
             "tab:pink", "tab:gray")
  names = list(ALGORITHMS) + [l for l in labels if l not in ALGORITHMS]
  return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def plot_success_vs_horizon(rows: Sequence[dict], path: str) -> str:
  """Final sampled success (mean +- std over seeds) versus horizon per algorithm, per env, with the
  warm start and each algorithm's independent-steps prediction p^H (dotted)."""
  summary = summarize(rows)
  env_names = sorted({e["env"] for e in summary})
  colors = _colors({e["algorithm"] for e in summary})
  fig, axes = _subplots(1, len(env_names), (6 * len(env_names), 4.2))
  for ax, env in zip(axes[0], env_names):
    entries = [e for e in summary if e["env"] == env]
    for label in dict.fromkeys(e["algorithm"] for e in entries):
      mine = sorted((e for e in entries if e["algorithm"] == label), key=lambda e: e["horizon"])
      x = [e["horizon"] for e in mine]
      ax.errorbar(x, [e["final_success"] for e in mine], [e["final_success_std"] for e in mine],
                  color=colors[label], marker="o", capsize=3, label=label)
      ax.plot(x, [e["final_predicted"] for e in mine], color=colors[label], ls=":", lw=1)
    warm = {}
    for e in entries:
      warm.setdefault(e["horizon"], e["warm_success"])
    ax.plot(sorted(warm), [warm[h] for h in sorted(warm)], color="black", ls="--", marker="x",
            label="warm start")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(warm), [str(h) for h in sorted(warm)])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("horizon N")
    ax.set_ylabel("success (sampled, test tasks)")
    ax.set_title(f"{env}: final success; dotted: p^H from step accuracy")
    ax.legend(fontsize=8, loc="lower left")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def plot_learning_curves(curves: Sequence[dict], path: str, smooth: int = 3) -> str:
  """Training success per update (mean over seeds, moving average of `smooth`), one panel per
  `(env, horizon)`."""
  panels = sorted({(c["env"], c["horizon"]) for c in curves})
  cols = max(len({h for _, h in panels}), 1)
  env_names = sorted({e for e, _ in panels})
  fig, axes = _subplots(len(env_names), cols, (3.4 * cols, 2.8 * len(env_names)))
  colors = _colors({c["algorithm"] for c in curves})
  for r, env in enumerate(env_names):
    horizons = sorted({h for e, h in panels if e == env})
    for k in range(cols):
      ax = axes[r][k]
      if k >= len(horizons):
        ax.axis("off")
        continue
      h = horizons[k]
      mine = [c for c in curves if c["env"] == env and c["horizon"] == h]
      for label in dict.fromkeys(c["algorithm"] for c in mine):
        by_update: dict[int, list[float]] = {}
        for c in mine:
          if c["algorithm"] == label:
            by_update.setdefault(c["update"], []).append(c["train_success"])
        x = np.array(sorted(by_update))
        y = np.array([np.mean(by_update[u]) for u in x])
        if smooth > 1 and len(y) >= smooth:
          y = np.convolve(y, np.ones(smooth) / smooth, mode="valid")
          x = x[smooth - 1:]
        ax.plot(x, y, color=colors[label], label=label)
      ax.set_title(f"{env} N={h}", fontsize=9)
      ax.set_ylim(-0.02, 1.02)
      ax.set_xlabel("update", fontsize=8)
      if k == 0:
        ax.set_ylabel("train success", fontsize=8)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path


def plot_sample_efficiency(rows: Sequence[dict], path: str) -> str:
  """Success gained per 1k episodes and per 1M tokens versus horizon, per env and algorithm."""
  summary = summarize(rows)
  env_names = sorted({e["env"] for e in summary})
  colors = _colors({e["algorithm"] for e in summary})
  fig, axes = _subplots(2, len(env_names), (6 * len(env_names), 7))
  for col, env in enumerate(env_names):
    entries = [e for e in summary if e["env"] == env]
    for row, (key, name) in enumerate((("gain_per_1k_episodes", "success gained / 1k episodes"),
                                       ("gain_per_1m_tokens", "success gained / 1M tokens"))):
      ax = axes[row][col]
      for label in dict.fromkeys(e["algorithm"] for e in entries):
        mine = sorted((e for e in entries if e["algorithm"] == label), key=lambda e: e["horizon"])
        ax.errorbar([e["horizon"] for e in mine], [e[key] for e in mine],
                    [e[key + "_std"] for e in mine], color=colors[label], marker="o", capsize=3,
                    label=label)
      ax.axhline(0, color="gray", lw=0.8)
      ax.set_xscale("log", base=2)
      horizons = sorted({e["horizon"] for e in entries})
      ax.set_xticks(horizons, [str(h) for h in horizons])
      ax.set_xlabel("horizon N")
      ax.set_ylabel(name)
      ax.set_title(env)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def plot_all(out_dir: str) -> dict[str, str]:
  """Every plot and `summary.json` / `summary.md` from the CSV files in `out_dir`: `{name: path}`
  of the plots drawn (no learning curves or sample efficiency for runs of zero updates)."""
  rows, curves = read_results(out_dir)
  if not rows:
    raise FileNotFoundError(f"no results in {os.path.join(out_dir, 'results.csv')}")
  summary = summarize(rows)
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  with open(os.path.join(out_dir, "summary.md"), "w") as f:
    f.write(markdown_table(summary) + "\n")
  paths = {"success_vs_horizon": plot_success_vs_horizon(
      rows, os.path.join(out_dir, "success_vs_horizon.png"))}
  if curves:  # a sweep of warm starts alone (`num_updates=0`) has no curve and no gain per episode
    paths["learning_curves"] = plot_learning_curves(
        curves, os.path.join(out_dir, "learning_curves.png"))
    paths["sample_efficiency"] = plot_sample_efficiency(
        rows, os.path.join(out_dir, "sample_efficiency.png"))
  return paths
