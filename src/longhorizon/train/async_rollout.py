"""Asynchronous rollouts (`config.rollout.mode = 'async'`): actor threads sample episodes with the
newest published policy while the learner trains on earlier ones.

    pipeline = AsyncRollouts(s, state.params, version=u0, first_batch=k0, data_position=p0,
                             last_update=config.num_updates)
    with pipeline:
      for update in range(u0, config.num_updates):
        state, metrics = pipeline.step(state, update, timer)   # wait, learn, publish

Pieces (host threads around the same jitted sampler and update as the synchronous loop):

- **Parameter store.** After every update the learner publishes a *copy* of its parameters with
  their version (`publish`); `rl_update` donates the `TrainState`, so an actor must never hold the
  learner's live buffers. Actors read the newest (params, version) when they start a batch.
- **Actors** (`rollout.num_actors` threads). An actor takes the next batch index `k`; batch `k`
  has exactly the tasks, environment keys, sampling seed and group labels of synchronous update
  `k` (`Learner.collect_batch`), is sampled with the newest parameters (version `v`, recorded on every
  episode as `policy_version`, with the sampler's per-token `behavior_logprobs`) and is put into a
  bounded FIFO queue of `rollout.queue_size` finished batches (a full queue blocks the actor).
- **Admission (staleness control before sampling).** An actor starts a batch only if, taken in
  order, it will be at most `max_staleness` versions old when the learner trains on it:
  `taken + pending - v <= max_staleness`, where `taken` counts the batches the learner has taken
  for updates (its version once it finishes them), `pending` the batches started and not yet
  taken. With `max_staleness = 0` an actor samples batch `u` with version `u` after the learner has
  published it: the synchronous run, exactly (same seeds, same parameters, same metrics).
- **Filter (staleness control after sampling).** The learner at version `u` takes the oldest
  finished batch; an episode's lag is `u - policy_version`. Lags above `max_staleness` happen when
  several actors finish out of order (a batch slowed by tool latency arrives after later ones);
  such episodes are dropped (`stale_policy='drop'`: row weight 0; a batch dropped entirely is
  discarded and the learner takes the next) or down-weighted by
  `stale_weight ** (lag - max_staleness)` (`'downweight'`).
- **Off-policy correction** is the loss's (`config.loss`, `train/policy_losses.py`): a proximal
  anchor (`ppo_clip`, `gspo`: decoupled PPO against the learner's parameters before the update,
  with the truncated weight `min(pi_prox / pi_behaviour, loss.tis_threshold)`), or the
  truncated-IS policy gradient against the behaviour log-probs (`tis`).

- **Partial rollouts** (`rollout.continue_partial`). An actor's `collect` reads the newest
  published (params, version) before every turn (`newest`), so an episode under way when the
  learner publishes continues with the new policy; `EpisodeBatch.token_version` records the
  version of every sampled token and `behavior_logprobs` are each token's sampler's. The filter
  then weighs each token by its own lag, `update - token_version` (`token_staleness_weights`: an
  episode's fresh tail is kept when its old head is dropped), and the proximal anchor's truncated
  IS weight is per token as always. `rollout.partial_cache`: the cache of the tokens so far is
  kept as the older parameters computed it ("keep": the behaviour log-probs after a switch are
  those of the new parameters reading the old keys and values, as AReaL does) or computed again
  with the new ones ("reprefill": exact, one prefill of every row's context per switch).
  Admission is unchanged (by the version a batch starts with), so with `max_staleness = 0` no
  version is published while a batch is sampled and the run still equals the synchronous one.

Metrics of each update (`async/*`, merged into the update's `metrics.jsonl` line), over the batches
the learner took since the previous update (the trained one and any dropped before it):
`lag_mean`, `lag_max`, `lag_count/<i>` for lags `0..max_staleness` and `lag_count/stale` above it
(episode counts), `dropped_episodes`, `dropped_episode_rate`, `dropped_episodes_total`,
`weight_mean` (mean staleness weight of the trained rows; of their policy tokens with partial
rollouts), `queue_age_s` (mean time finished batches
waited in the queue), `batch_age_s` (from the trained batch's sampling start to its use),
`queue_length` (finished batches left waiting), `learner_idle_s` (the learner waiting for a batch),
`token_lag_mean` / `token_lag_max` (per sampled token), `partial_episodes` (episodes whose tokens
come from more than one version), `sampled_length_mean` / `admitted_length_mean` (policy tokens per
episode over every episode received, and over those the filter kept any token of: long episodes
dropped more often than short ones show as the second below the first),
`actor_idle_s` / `actor_busy_s` / `actor_idle_frac` (actor threads waiting for admission or queue
space / sampling, summed over actors, since the previous update), `rollout_s` (the trained batch's
sampling wall time) and `behavior_version`.

- **Task curriculum** (`curriculum.num_buckets`): an actor draws batch `k`'s tasks from the
  curriculum when it starts it, with the synchronous loop's generator for update `k`; the learner
  feeds the batch's per-task success back before it publishes the next version, so with
  `max_staleness = 0` each draw sees what the synchronous run's would.

Checkpoints: the learner's state and, in the meta, `data_position` and `next_batch` (the batch
index after the newest batch taken). Resuming restarts the actors from the checkpointed parameters
at `next_batch`; batches that were queued or being sampled when the run stopped are discarded and
sampled again (with the checkpointed parameters, so with `max_staleness > 0` a resumed run is not
bit-identical to an uninterrupted one; with 0 it is).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Callable

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.train.curriculum import draw_tasks
from longhorizon.train.metrics import Timer

__all__ = ["AsyncRollouts", "staleness_weights", "token_staleness_weights", "lag_metrics"]

_JOIN_TIMEOUT_S = 600.0


def staleness_weights(lag, max_staleness: int, policy: str, stale_weight: float) -> np.ndarray:
  """`[B]` float32 row weights of episodes `lag` versions old (`lag` `[B]` int).

      w = 1                                          lag <= max_staleness
      w = 0                                          lag >  max_staleness, policy 'drop'
      w = stale_weight ** (lag - max_staleness)      lag >  max_staleness, policy 'downweight'
  """
  lag = np.asarray(lag)
  if lag.ndim != 1:
    raise ValueError(f"lag must be a [B] array, got shape {lag.shape}.")
  if policy not in ("drop", "downweight"):
    raise ValueError(f"stale_policy must be 'drop' or 'downweight', got {policy!r}.")
  over = np.maximum(lag - max_staleness, 0)
  if policy == "drop":
    return (over == 0).astype(np.float32)
  return np.power(np.float32(stale_weight), over).astype(np.float32)


def token_staleness_weights(batch, update: int, max_staleness: int, policy: str,
                            stale_weight: float) -> np.ndarray:
  """`[B, L]` float32 weights of each policy token of `batch` by its own lag `update -
  token_version` (`staleness_weights` per token; 1 off the loss mask, where nothing is trained)."""
  version = np.asarray(batch.token_version, np.int64)
  on = np.asarray(batch.loss_mask, bool)
  lag = np.where(on, update - version, 0)
  weights = staleness_weights(lag.reshape(-1), max_staleness, policy, stale_weight)
  return weights.reshape(lag.shape)


def _length_metrics(batch, kept, update: int) -> dict:
  """One received batch's policy tokens per episode (over all its episodes, and over those `kept`,
  `[B]` bool), the lags of its policy tokens, and its episodes whose tokens span several
  versions."""
  on = np.asarray(batch.loss_mask, bool)
  tokens = on.sum(-1)
  version = np.asarray(batch.token_version, np.int64)
  newest = np.where(on, version, -1).max(-1)
  oldest = np.where(on, version, np.iinfo(np.int64).max).min(-1)
  return {"sampled": tokens, "admitted": tokens[kept], "token_lag": update - version[on],
          "partial": int(np.sum(on.any(-1) & (newest > oldest)))}


def _merge_lengths(parts: list[dict]) -> dict:
  """The `async/` length, token-lag and partial-episode metrics of the batches in `parts`."""
  cat = lambda name: np.concatenate([p[name] for p in parts]) if parts else np.zeros(0)
  mean = lambda x: float(np.mean(x)) if x.size else 0.0
  token_lag = cat("token_lag")
  return {"async/sampled_length_mean": mean(cat("sampled")),
          "async/admitted_length_mean": mean(cat("admitted")),
          "async/token_lag_mean": mean(token_lag),
          "async/token_lag_max": float(token_lag.max()) if token_lag.size else 0.0,
          "async/partial_episodes": float(sum(p["partial"] for p in parts))}


def lag_metrics(lags, max_staleness: int) -> dict:
  """Mean / max lag and episode counts per lag `0..max_staleness` and above (`stale`)."""
  lags = np.concatenate([np.asarray(x).reshape(-1) for x in lags]) if len(lags) else np.zeros(0)
  out = {"async/lag_mean": float(lags.mean()) if lags.size else 0.0,
         "async/lag_max": float(lags.max()) if lags.size else 0.0}
  for i in range(max_staleness + 1):
    out[f"async/lag_count/{i}"] = float(np.sum(lags == i))
  out["async/lag_count/stale"] = float(np.sum(lags > max_staleness))
  return out


def _copy(params):
  """A copy of `params` in new buffers (the learner's are donated to the next update)."""
  return jax.block_until_ready(jax.tree.map(jnp.copy, params))


@dataclasses.dataclass
class _Item:
  """A finished batch in the queue."""
  index: int  # batch index k: tasks, seeds and group labels of synchronous update k
  version: int  # the policy version that sampled it
  batch: Any  # EpisodeBatch (host arrays)
  stats: Any  # RolloutStats
  actor: int
  started: float  # clock at the start of sampling
  rollout_s: float  # sampling wall time
  ready: float = 0.0  # clock when it entered the queue
  drawn: Any = None  # the curriculum's (task indices, buckets, cursor after), or None


class AsyncRollouts:
  """Actor threads, the versioned parameter store, the bounded queue and the staleness filter.

  Args:
    learner: the run's `Learner` (its `collect_batch` runs in the actors, its `learn` in `step`).
    params: the parameters of version `version` (copied; the caller keeps its own).
    version: the learner's policy version (RL updates applied) at the start.
    first_batch: index of the first batch to sample (seeds and group labels of that sync update).
    data_position: train-task position of batch `first_batch` (batch `k` starts at
      `data_position + (k - first_batch) * num_tasks`).
    last_update: no batch is started that would be taken at update `last_update` or later (so
      actors do not sample past the end of training), unless drops call for a replacement.
    env_step_hook: optional `k -> on_env_step` giving batch `k`'s host hook for `rollout.collect`
      (the benchmark's simulated tool latency).
    clock: seconds, monotonic (tests may pass a fake one).
    curriculum, buckets, seed: a task curriculum (`train/curriculum.py`), its bucket index arrays
      and the run's seed: an actor draws batch `k`'s tasks from it when it starts the batch (with
      `default_rng([seed, k])`, as the synchronous loop draws update `k`'s), and `step` feeds the
      batch's task success back before publishing, so with `max_staleness = 0` every draw sees
      the curriculum the synchronous run's would. `curriculum_state` is its checkpointable state
      as of the newest batch taken.
  """

  def __init__(self, learner, params, *, version: int, first_batch: int, data_position: int,
               last_update: int | None = None,
               env_step_hook: Callable[[int], Callable | None] | None = None,
               clock: Callable[[], float] = time.perf_counter, curriculum=None, buckets=None,
               seed: int = 0):
    r = learner.rollout
    if jax.process_count() > 1:
      raise ValueError("config.rollout.mode='async' runs in one JAX process; multi-host runs use "
                       "rollout.mode='sync' (the actors' gathers would interleave with the "
                       "learner's collectives).")
    loss = learner.loss
    if r.max_staleness > 0 and loss.spec.anchor == "proximal" and not loss.tis_threshold:
      logging.warning("async rollouts with max_staleness=%d and loss.tis_threshold=0: the "
                      "%s loss clips against the proximal policy but does not reweight stale "
                      "samples (set loss.tis_threshold, e.g. 2.0).", r.max_staleness, loss.name)
    self._learner = learner
    self.max_staleness = int(r.max_staleness)
    self.num_actors = int(r.num_actors)
    self.queue_size = int(r.queue_size)
    self.stale_policy = str(r.stale_policy)
    self.stale_weight = float(r.stale_weight)
    self.continue_partial = bool(r.continue_partial)
    self._num_tasks = int(r.num_tasks)
    self._last_update = last_update
    self._env_step_hook = env_step_hook
    self._clock = clock
    self._cv = threading.Condition()
    self._params, self._version = _copy(params), int(version)
    self._taken = int(version)  # batches taken for updates (absolute: the updates begun)
    self._pending = 0  # batches started and not yet taken (sampling or queued)
    self._next_index = int(first_batch)
    self._first_batch, self._first_position = int(first_batch), int(data_position)
    self._queue: collections.deque[_Item] = collections.deque()
    self._stop = False
    self._error: tuple[int, BaseException] | None = None
    self._threads: list[threading.Thread] = []
    self._actor_idle = self._actor_busy = 0.0
    self.dropped_total = 0
    self._curriculum, self._buckets, self._seed = curriculum, buckets, int(seed)
    self.curriculum_state = None if curriculum is None else curriculum.state_dict()
    self.next_batch = int(first_batch)  # the batch after the newest one taken (checkpoint meta)
    self.data_position = int(data_position)  # its train-task position (checkpoint meta)

  # ------------------------------------------------------------------------------------ lifecycle

  def start(self) -> "AsyncRollouts":
    for i in range(self.num_actors):
      thread = threading.Thread(target=self._actor, args=(i,), name=f"longhorizon-actor-{i}",
                                daemon=True)
      thread.start()
      self._threads.append(thread)
    return self

  def close(self):
    """Stops the actors (each finishes the batch it is sampling) and drops queued batches."""
    with self._cv:
      self._stop = True
      self._queue.clear()
      self._cv.notify_all()
    for thread in self._threads:
      thread.join(_JOIN_TIMEOUT_S)
      if thread.is_alive():
        logging.warning("async rollouts: %s did not stop within %.0f s", thread.name,
                        _JOIN_TIMEOUT_S)
    self._threads = []

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.close()

  def position(self, index: int) -> int:
    """Train-task position of batch `index`."""
    return self._first_position + (index - self._first_batch) * self._num_tasks

  # --------------------------------------------------------------------------------------- actors

  def _admissible(self) -> bool:
    expected_update = self._taken + self._pending  # when the learner would take a batch started now
    if self._last_update is not None and expected_update >= self._last_update:
      return False
    return expected_update - self._version <= self.max_staleness

  def _actor(self, actor: int):
    try:
      with self._learner.in_mesh():
        while True:
          waited = self._clock()
          with self._cv:
            self._cv.wait_for(lambda: self._stop or self._admissible())
            if self._stop:
              return
            index, self._next_index = self._next_index, self._next_index + 1
            self._pending += 1
            params, version = self._params, self._version
            drawn = self._draw(index)
            started = self._clock()
            self._actor_idle += started - waited
          hook = self._env_step_hook(index) if self._env_step_hook is not None else None
          partial = {"params_source": self.newest} if self.continue_partial else {}
          batch, stats = self._learner.collect_batch(
              params, index, self.position(index), Timer(),
              drawn and drawn[0], policy_version=version, on_env_step=hook, **partial)
          finished = self._clock()
          item = _Item(index=index, version=version, batch=batch, stats=stats, actor=actor,
                       started=started, rollout_s=finished - started, drawn=drawn)
          with self._cv:
            self._actor_busy += finished - started
            self._cv.wait_for(lambda: self._stop or len(self._queue) < self.queue_size)
            if self._stop:
              return
            item.ready = self._clock()
            self._actor_idle += item.ready - finished
            self._queue.append(item)
            self._cv.notify_all()
    except BaseException as e:  # noqa: BLE001  (handed to the learner, which raises it)
      with self._cv:
        self._error = (actor, e)
        self._cv.notify_all()

  def _draw(self, index: int):
    """Batch `index`'s `(task indices, their buckets, cursor after)` from the curriculum (None
    without one). Called under the lock."""
    if self._curriculum is None:
      return None
    indices, buckets, cursor = draw_tasks(self._curriculum, self._buckets,
                                          np.random.default_rng([self._seed, index]),
                                          self._num_tasks, self._curriculum.cursor)
    self._curriculum.cursor = cursor
    return indices, buckets, cursor.copy()

  def _observe(self, item: "_Item", task_success) -> None:
    """Feeds a trained batch's per-task success back to the curriculum (before the next version
    is published) and records the checkpointable state, with the cursor as of that batch."""
    if self._curriculum is None:
      return
    with self._cv:
      self._curriculum.update(item.drawn[1], task_success)
      self.curriculum_state = dict(self._curriculum.state_dict(),
                                   cursor=[int(x) for x in item.drawn[2]])

  # -------------------------------------------------------------------------------------- learner

  def newest(self) -> tuple[Any, int]:
    """The newest published `(params, version)` (what partial rollouts switch to)."""
    with self._cv:
      return self._params, self._version

  def publish(self, params, version: int):
    """Makes a copy of `params` the newest policy, `version` (the updates applied)."""
    copy = _copy(params)
    with self._cv:
      self._params, self._version = copy, int(version)
      self._cv.notify_all()

  def take(self, update: int) -> tuple[_Item, np.ndarray, dict]:
    """Waits for the next usable batch for update `update` (learner version `update`).

    Returns `(item, scale, metrics)`, `scale` the `[B]` row weights (with partial rollouts the
    `[B, L]` token weights); batches whose episodes are all dropped are discarded on the way (and
    counted)."""
    waited = self._clock()
    lags, ages, lengths, received, dropped = [], [], [], 0, 0
    while True:
      with self._cv:
        self._cv.wait_for(lambda: self._queue or self._error is not None or self._stop)
        if self._error is not None:
          actor, error = self._error
          raise RuntimeError(f"async rollouts: actor {actor} failed: {error!r}") from error
        if self._stop:
          raise RuntimeError("async rollouts: take() called after close().")
        # Popping and counting the take happen under one lock: an actor woken in between would
        # see the batch neither pending nor taken and start one version too early.
        item = self._queue.popleft()
        lag = update - np.asarray(item.batch.policy_version, np.int64)
        scale, kept = self._weights(item.batch, lag, update)
        usable = bool(kept.any())
        self._pending -= 1
        if usable:
          self._taken += 1
          idle, busy = self._actor_idle, self._actor_busy
          self._actor_idle = self._actor_busy = 0.0
        queue_length = len(self._queue)
        self._cv.notify_all()
      taken = self._clock()
      lags.append(lag)
      ages.append(taken - item.ready)
      received += lag.size
      self.next_batch = max(self.next_batch, item.index + 1)
      self.data_position = self.position(self.next_batch)
      dropped += int(np.sum(~kept))
      lengths.append(_length_metrics(item.batch, kept, update))
      if usable:
        break
    self.dropped_total += dropped
    metrics = lag_metrics(lags, self.max_staleness)
    metrics.update(_merge_lengths(lengths))
    metrics.update({
        "async/dropped_episodes": float(dropped),
        "async/dropped_episode_rate": dropped / max(received, 1),
        "async/dropped_episodes_total": float(self.dropped_total),
        "async/weight_mean": float(scale.mean() if scale.ndim == 1 else
                                   scale[np.asarray(item.batch.loss_mask, bool)].mean()),
        "async/queue_age_s": float(np.mean(ages)),
        "async/batch_age_s": taken - item.started,
        "async/queue_length": float(queue_length),
        "async/learner_idle_s": taken - waited,
        "async/actor_idle_s": idle,
        "async/actor_busy_s": busy,
        "async/actor_idle_frac": idle / max(idle + busy, 1e-9),
        "async/rollout_s": item.rollout_s,
        "async/behavior_version": float(item.version),
    })
    return item, scale, metrics

  def _weights(self, batch, lag, update: int) -> tuple[np.ndarray, np.ndarray]:
    """`(scale, kept)`: the staleness weights of `batch` taken at `update` (`[B]` by the episodes'
    `lag`, or with partial rollouts `[B, L]` by each token's), and `[B]` the episodes that keep
    any weight."""
    if not self.continue_partial:
      scale = staleness_weights(lag, self.max_staleness, self.stale_policy, self.stale_weight)
      return scale, scale > 0
    scale = token_staleness_weights(batch, update, self.max_staleness, self.stale_policy,
                                    self.stale_weight)
    return scale, (np.where(np.asarray(batch.loss_mask, bool), scale, 0) > 0).any(-1)

  def step(self, state, update: int, timer: Timer, hook=None, on_batch=None):
    """One asynchronous RL update: the next usable batch, the learner's `learn`, publish.

    Returns `(state, metrics)` like `Learner.step` (plus the `async/*` metrics); `on_batch(batch,
    stats)` as there."""
    try:
      item, scale, async_metrics = self.take(update)
      if hook is not None:
        hook("update", update)
      row_scale = None if np.all(scale == 1) else scale
      state, metrics = self._learner.learn(state, item.batch, item.stats, timer,
                                           row_scale=row_scale)
      self._observe(item, metrics["_task_success"])
      self.publish(state.params, update + 1)
      if on_batch is not None:
        on_batch(item.batch, item.stats)
    except BaseException:
      self.close()  # do not leave actors sampling for a learner that has stopped
      raise
    metrics.update(async_metrics)
    return state, metrics
