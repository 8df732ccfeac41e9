"""Running evaluations: K attempts per task through the real rollout loop, then `metrics.report`.

The policy is a model (`params` + `model_config`), or one of the two baselines every table needs:
`"oracle"` (the environment's oracle through the text path: the ceiling) and `"random"` (uniformly
random well-formed actions through the text path: the floor). Evaluation is deterministic given its
seeds: task `i`'s environment key and attempt `j`'s sampling key derive from `seed`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from longhorizon import rollout
from longhorizon.envs import tasks as task_suites
from longhorizon.eval import metrics as metrics_lib

__all__ = ["evaluate", "records_from_rollout", "BASELINES"]

BASELINES = ("oracle", "random")


def records_from_rollout(batch, stats, attempts: int) -> dict[str, np.ndarray]:
  """Per-episode evaluation records (the input of `metrics.report`) from one `collect` call whose
  rows are `attempts` consecutive rollouts per task."""
  info = stats.episode_info
  b = batch.batch_size
  milestones = np.bitwise_or.reduce(np.asarray(batch.milestones, np.int64), axis=1)
  records = {
      "task": np.arange(b) // attempts,
      "success": np.asarray(batch.success, bool),
      "num_steps": np.asarray(batch.num_steps, np.int64),
      "tokens": np.asarray(batch.loss_mask, bool).sum(-1),
      "tool_calls": np.asarray(info["tool_calls"], np.int64),
      "cost": np.asarray(batch.cost, np.float64).sum(-1),
      "milestones": milestones,
      "env_error": np.asarray(batch.env_error, bool).any(-1),
      "violation": np.asarray(batch.violation, bool).any(-1),
      "loop": np.asarray(info["loop"], bool),
      "truncated": np.asarray(batch.truncated, bool),
      "faulted": np.asarray(info["faulted"], bool),
      "unauthorized": np.asarray(info["unauthorized"], np.int64),
      "bucket": np.asarray(info["difficulty"], np.int64),
  }
  for key in ("collateral_damage", "attacked", "attack_success"):
    if key in info:
      records[key] = np.asarray(info[key], bool)
  return records


def evaluate(env, codec, tasks: Any, *, attempts: int, rollout_config: rollout.RolloutConfig,
             policy: str = "model", params=None, model_config=None, seed: int = 0
             ) -> tuple[dict, dict]:
  """`(report, records)` of `attempts` rollouts of each of the `[T]` `tasks`.

  Args:
    env, codec: the (wrapped) environment (its `reward_spec` is the reward) and its codec (the
      policy's tokenizer).
    tasks: `[T]` task pytree.
    attempts: K rollouts per task (pass@k / pass^k need K >= k).
    rollout_config: sampling and budgets (its `group_size` is replaced by `attempts`).
    policy: "model", "oracle" or "random".
    params, model_config: the policy (for "model").
    seed: evaluation seed (environment keys and sampling).

  In a multi-host JAX run, call it on every process: the `T` tasks (a multiple of the number of
  processes) are split over them, and every process returns the report of all of them.
  """
  if policy not in ("model",) + BASELINES:
    raise ValueError(f"policy must be 'model', 'oracle' or 'random', got {policy!r}.")
  if policy == "model" and (params is None or model_config is None):
    raise ValueError("policy='model' needs params and model_config.")
  n = task_suites.count(tasks)
  keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 7), n)
  rc = dataclasses.replace(rollout_config, group_size=attempts)
  scripted = None
  if policy in BASELINES:
    scripted = rollout.oracle_turns(env, codec, epsilon=1.0 if policy == "random" else 0.0,
                                    seed=seed)
  batch, stats = rollout.collect_across_processes(params, model_config, env, codec, tasks, keys, rc,
                                                  sampling_seed=seed, scripted=scripted)
  records = records_from_rollout(batch, stats, attempts)
  report = metrics_lib.report(records, k_max=attempts, milestone_names=env.milestone_names)
  return report, records
