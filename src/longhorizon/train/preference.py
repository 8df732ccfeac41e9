"""The preference-optimisation stage of a run (`config.dpo`): trajectory DPO between the SFT warm
start and online RL, on episodes read from a trajectory store.

    SFT warm start (oracle demonstrations)  ->  DPO (this module)  ->  online RL (the loop)

With `dpo.store` empty the stage samples `dpo.tasks` train tasks x `dpo.group_size` rollouts with the
warm-started policy (and `dpo.branch_k` sibling branches per root, forked at `dpo.branch_at`),
appends them to the run's own store `<workdir>/trajectories/` as update 0, and reads them back from
there; a run killed during the stage finds them stored and does not sample again. With `dpo.store`
a directory, the pairs come from that store's episodes instead (e.g. another run's RL batches).
Episodes pass the store's `dpo.keep` filters; pairs are built within each task group
(`core.preference.preference_pairs`, `dpo.level` trajectory or step), and `dpo.steps` passes of
`dpo_update` follow, against reference log-probs of the policy the stage started from, computed
once (no second copy of the weights is kept): `Learner.dpo`.
"""

from __future__ import annotations

import dataclasses
import time

from absl import logging
import jax
import numpy as np

from longhorizon import rollout
from longhorizon.core import preference
from longhorizon.rollout.store import KEEP, TrajectoryStore
from longhorizon.train.learner import Learner, key
from longhorizon.train.options import PreferenceOptions
from longhorizon.train.update import TrainState

__all__ = ["STAGE_UPDATE", "preference_stage", "read_preference_batch"]

STAGE_UPDATE = 0  # the `update` the stage's own episodes are stored under (RL batches are >= 1)


def preference_stage(s: Learner, state: TrainState, store_dir: str, data_position: int
                     ) -> tuple[TrainState, dict, int]:
  """Runs the DPO stage from `state`; returns `(state, info, data_position)`: `info` the stage's
  facts for `eval.json` (episodes sampled, pairs, the last pass's metrics, seconds), the data
  position advanced past the tasks it sampled. A stage with no pair leaves `state` unchanged."""
  opts = PreferenceOptions.from_config(s.config)
  if jax.process_count() > 1:
    raise ValueError("dpo.steps > 0 needs a single-process run: the stage's episodes are written "
                     "to and read back from one process's trajectory store.")
  start = time.perf_counter()
  store, sampled = TrajectoryStore(opts.store or store_dir), 0
  if not opts.store:
    if len(store) and (store.rows().update == STAGE_UPDATE).any():
      logging.info("DPO: the stage's episodes are already in %s (a resumed stage): not sampling "
                   "again.", store.path)
    else:
      batch, stats = _sample(s, state.params, data_position, opts)
      store.append(batch, update=STAGE_UPDATE, info=stats.episode_info, meta={"stage": "dpo"})
    sampled, data_position = opts.tasks * opts.group_size, data_position + opts.tasks
  versions = dict(env_version=rollout.env_version(s.env),
                  reward_version=rollout.reward_version(s.env.reward_spec))
  batch = read_preference_batch(store, opts, versions=versions)
  pairs = preference.preference_pairs(batch, level=opts.level, min_gap=opts.min_gap)
  usable = len(pairs) - len(pairs) % opts.minibatches
  info = {"episodes": sampled, "source": store.path, "stored_episodes": int(batch.batch_size),
          "pairs": len(pairs), "pairs_used": usable, "level": opts.level,
          "success_rate_of_episodes": float(np.mean(batch.success))}
  if not usable:
    logging.warning("DPO: %d pair(s) from %d episodes (need >= dpo.minibatches=%d): the stage "
                    "leaves the policy unchanged.", len(pairs), batch.batch_size, opts.minibatches)
    return state, dict(info, seconds=time.perf_counter() - start), data_position
  pairs = preference.Pairs(*(a[:usable] for a in pairs))
  state, metrics = s.dpo(state, batch, pairs, opts)
  info.update(metrics, seconds=time.perf_counter() - start)
  return state, info, data_position


def _sample(s: Learner, params, data_position: int, opts: PreferenceOptions):
  """`opts.tasks` train tasks from `data_position`, `opts.group_size` rollouts each (with
  `opts.branch_k` branches per root) sampled with `params`: `(EpisodeBatch, RolloutStats)`."""
  c = s.config
  rc = dataclasses.replace(s.rollout.collect_config(c.env.max_steps, group_size=opts.group_size),
                           branch_k=opts.branch_k, branch_at=opts.branch_at, recovery_from="")
  logging.info("DPO: sampling %d tasks x %d rollouts with the warm-started policy.", opts.tasks,
               opts.group_size)
  return rollout.collect_across_processes(
      params, s.model_config, s.env, s.codec, s.tasks_at(data_position, opts.tasks),
      jax.random.split(key(c.seed, 6), opts.tasks), rc, sampling_seed=c.seed * 1_000_003 + 999_983,
      task_seed=c.tasks.seed, policy_version=0)


def read_preference_batch(store: TrajectoryStore, opts: PreferenceOptions,
                          versions: dict | None = None):
  """The episodes the stage pairs: those of `store` passing `opts.keep`'s filters (with the run's
  own store, only the stage's own, stored as update `STAGE_UPDATE`), as one host EpisodeBatch whose
  `group` labels are made distinct per stored file (labels repeat across runs and stages). With
  `versions` (`env_version`, `reward_version`: the stage passes its run's) only episodes produced
  under them are paired: a preference is a comparison of scores under one reward."""
  rows = store.rows(filters=KEEP[opts.keep], versions=versions)
  if not opts.store:
    rows = rows.take(rows.update == STAGE_UPDATE)
  files = {f.path: i for i, f in enumerate(store.files())}
  rank = np.array([files[p] for p in rows.path], np.int64)
  rows = rows.take(np.lexsort((rows.row, rank)))  # the order `load` returns them in
  batch = store.load(rows)
  rank = np.array([files[p] for p in rows.path], np.int64)
  _, group = np.unique(np.stack([rank, np.asarray(batch.group, np.int64)]), axis=1,
                       return_inverse=True)
  return batch.replace(group=group.reshape(-1).astype(np.int32))
