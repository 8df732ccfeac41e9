"""The multi-turn host loop: the KV-cached sampler against jitted, batched environments.

`collect` runs `N` tasks x `G` rollouts turn by turn:

    prefill(prompts) -> [decode a turn (until a stop token or the turn budget)
                         -> parse (host) -> env.step (jit + vmap, all rows at once)
                         -> render observations (host) -> extend(cache)] x until every row is done

and returns a token-exact `EpisodeBatch`: the ids are exactly those the policy saw and produced
(observations are tokenised on their own and appended; nothing is re-tokenised), `loss_mask` is 1
exactly on sampled tokens, `behavior_logprobs` are the sampler's. Rows finish at different times;
finished rows sample nothing (`decode(active=...)`) and append nothing.

The loop writes into an `EpisodeBuffer` (`rollout/buffer.py`) and asks one of two policies behind
one `turn` / `extend` interface for each turn: the model (`_ModelPolicy`, the sampler's KV cache)
or a scripted host source (`_ScriptedPolicy`, e.g. `oracle_turns`).

When a turn hits its token budget without the stop token and its row goes on, the end-of-turn token
is appended as a non-sampled token (loss 0) before the observation, so the context always has
well-formed turns.

Context budget: the cache holds `context_length` tokens. A row whose next observation plus one more
turn would not fit is stopped after its step and marked truncated (`CONTEXT_OVERFLOW`), not failed.
A row still running after `max_steps` steps is truncated (`TIMEOUT`).

Words of the prompts and observations that the tokenizer can only encode as its unknown token (a
gap in the environment's `vocabulary()`) are counted in `RolloutStats.unknown_words`, which lands
in the run's metrics as `rollout/unknown_words`: the policy sees `<unk>` there, although a scripted
oracle, acting on the state, still succeeds.

Every row records its group, the policy version, the fingerprints of the environment and of the
reward config (`env_version`, `reward_version`: `rollout/versions.py`) and its seeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from types import SimpleNamespace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon import sampling as sampler
from longhorizon.core.episode import RECOVERY, EpisodeBatch, Termination
from longhorizon.envs import Action, Environment, action_parts
from longhorizon.envs.base import batch_reset, batch_step, stack_actions
from longhorizon.envs.testing import random_action
from longhorizon.envs.types import num_tasks, row, to_numpy
from longhorizon.models import ModelConfig, prepare_decode_params
from longhorizon.rollout.buffer import EpisodeBuffer
from longhorizon.rollout.context import CONTEXT_MODES, SUMMARY_BY, Segmenter, segment_keys
from longhorizon.rollout.recovery import (RECOVERY_FROM, RecoveryStarts, first_error_steps,
                                           recovery_starts)
from longhorizon.envs import RewardSpec
from longhorizon.envs.host import Observation, StepResult, is_host
from longhorizon.envs.host_wrappers import GuardedRows, guards_of
from longhorizon.envs.pool import pool_for
from longhorizon.envs.types import ErrorCode
from longhorizon.rollout.versions import env_version, reward_version

__all__ = ["BRANCH_POINTS", "RolloutConfig", "RolloutStats", "collect", "collect_recovery",
           "merge_stats", "oracle_turns"]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """How episodes are sampled."""
  group_size: int = 8  # G rollouts per task (same task, same environment seed)
  context_length: int = 256  # L: KV-cache capacity and EpisodeBatch width (the context budget)
  max_steps: int = 16  # S: environment steps per episode (then truncated as TIMEOUT)
  turn_tokens: int = 32  # per-turn token budget of the policy
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  # Branch rollouts: each root episode is forked once, at a step chosen by `branch_at` (see
  # `BRANCH_POINTS`), into `branch_k` continuations; `group_size` stays the number of episodes per
  # task (roots x (1 + branch_k)), so the budget equals the unbranched one. 0 = off.
  branch_k: int = 0
  branch_at: str = "uniform"
  # Record each step's agreement with the oracle's action (`EpisodeBatch.oracle_match`; one oracle
  # call per step), for the `oracle` step verifier; `first_divergence` branching records it too.
  record_oracle: bool = False
  # Label each policy token with the part of the action it belongs to (`EpisodeBatch.action_part`:
  # tool name, arguments, final answer, free text), for per-part loss weights.
  label_parts: bool = False
  # Steps an episode may take before it is truncated (TIMEOUT), when below `max_steps` (a horizon
  # curriculum grows it); the batch keeps `max_steps` step slots, so nothing recompiles. 0 = max.
  step_budget: int = 0
  # Prefill each distinct prompt once and copy its cache to the rows that share it (a task's G
  # rollouts): G times less prompt prefill. Float rounding may differ from prefilling every row
  # (another batch size), so it is a choice, off by default.
  share_prompts: bool = False
  # Keep the starts of recovery tasks (`rollout/recovery.py`): each failed root episode's state
  # and prefix just after its first error by this rule ("first_divergence" or "after_error"), in
  # `RolloutStats.recovery`, for `collect_recovery` in a later update. "" = off.
  recovery_from: str = ""
  # Context management (`rollout/context.py`, `config.context`): "full" keeps the whole episode
  # in one context; "window" and "summary" start a new context segment after every
  # `context_every` steps (0: only when the next turn would not fit), rewritten as the prompt plus
  # the last `context_keep` turns (window) or as the environment's state summary (summary); an
  # episode holds at most `context_segments` segments (then it is truncated on overflow).
  context_mode: str = "full"
  context_every: int = 0
  context_keep: int = 2
  context_segments: int = 4
  # summary: who writes it: "env" (`Environment.state_text`) or "policy" (a turn of at most
  # `context_summary_tokens` sampled after a request, trained with the episode's advantage).
  context_summary_by: str = "env"
  context_summary_tokens: int = 24

  def __post_init__(self):
    for name in ("group_size", "context_length", "max_steps", "turn_tokens"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}.")
    if self.branch_k < 0 or self.group_size % (1 + self.branch_k):
      raise ValueError(f"RolloutConfig.branch_k={self.branch_k}: group_size={self.group_size} "
                       f"episodes per task must be roots x (1 + branch_k) with branch_k >= 0; "
                       f"choose a branch_k + 1 that divides group_size.")
    if not 0 <= self.step_budget <= self.max_steps:
      raise ValueError(f"RolloutConfig.step_budget={self.step_budget} must be in [0, max_steps="
                       f"{self.max_steps}] (0 = max_steps).")
    if self.recovery_from not in ("",) + RECOVERY_FROM:
      raise ValueError(f"RolloutConfig.recovery_from must be '' (off) or one of {RECOVERY_FROM}, "
                       f"got {self.recovery_from!r}.")
    if self.context_mode not in CONTEXT_MODES:
      raise ValueError(f"RolloutConfig.context_mode must be one of {CONTEXT_MODES}, got "
                       f"{self.context_mode!r}.")
    if self.context_mode != "full" and (self.branch_k or self.recovery_from):
      raise ValueError(f"RolloutConfig.context_mode={self.context_mode!r} does not branch or keep "
                       f"recovery starts (a fork would need the segment its step is in); use "
                       f"branch_k=0 and recovery_from=''.")
    if self.context_summary_by not in SUMMARY_BY or self.context_summary_tokens < 1:
      raise ValueError(f"RolloutConfig.context_summary_by must be one of {SUMMARY_BY} and "
                       f"context_summary_tokens >= 1, got {self.context_summary_by!r}, "
                       f"{self.context_summary_tokens}.")
    if self.context_every < 0 or self.context_keep < 1 or self.context_segments < 1:
      raise ValueError(f"RolloutConfig: context_every >= 0, context_keep >= 1 and "
                       f"context_segments >= 1 are needed, got {self.context_every}, "
                       f"{self.context_keep}, {self.context_segments}.")
    if self.branch_at not in BRANCH_POINTS:
      raise ValueError(f"RolloutConfig.branch_at must be one of {sorted(BRANCH_POINTS)}, got "
                       f"{self.branch_at!r}.")

  @property
  def branch_roots(self) -> int:
    """Root episodes per task: `group_size / (1 + branch_k)`."""
    return self.group_size // (1 + self.branch_k)

  def sampling(self, stop_token_ids) -> sampler.SamplingParams:
    return sampler.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                  max_new_tokens=self.turn_tokens,
                                  stop_token_ids=tuple(stop_token_ids))


@dataclasses.dataclass
class RolloutStats:
  """Throughput and time split of one `collect` call."""
  generation_s: float = 0.0  # prefill, decode and extend (device work, waited for)
  env_s: float = 0.0  # env.step under jit
  host_s: float = 0.0  # parsing, rendering, bookkeeping
  sampled_tokens: int = 0
  env_steps: int = 0
  episodes: int = 0
  turns: int = 0  # decode rounds
  # Words of the prompts and appended observations encoded as the tokenizer's unknown token (every
  # row counts its own prompt); nonzero means the environment's vocabulary() misses them.
  unknown_words: int = 0
  # Per-episode facts for evaluation ([B] arrays): tool_calls, invalid_actions, unauthorized
  # (forbidden calls), faulted (saw a recoverable injected fault), loop, difficulty, and whatever
  # the environment's `episode_info` reports (e.g. collateral_damage, attack_success).
  episode_info: dict = dataclasses.field(default_factory=dict)
  # Host environments: the pool's counters (`pool/...`: calls, retries, timeouts, crashes, rate
  # limits, circuit breaker, validity rate; envs/pool.py).
  extra: dict = dataclasses.field(default_factory=dict)
  # `RecoveryStarts` of the failed root episodes (`RolloutConfig.recovery_from`), else None.
  recovery: Any = None
  # Context modes window / summary: an `EpisodeBatch` of `B * (context_segments - 1)` rows, the
  # earlier context segments of the episodes (`segment_of` indexing the returned batch's rows;
  # rows without tokens pad it to that fixed size), for `episode.join_segments`; else None.
  segments: Any = None
  segment_starts: int = 0  # new context segments begun (window / summary)
  summary_turns: int = 0  # summaries the policy wrote (context summary_by="policy")
  # Each segment begun from a rewritten context: `(its row in join_segments(batch, segments), the
  # ids full would hold before its first turn, its rewritten context's length)`, for
  # `context.rewrite_pairs` (the distribution shift of the rewrite).
  rewritten: Any = None

  def as_dict(self) -> dict:
    total = self.generation_s + self.env_s + self.host_s
    return {"rollout/generation_s": self.generation_s, "rollout/env_s": self.env_s,
            "rollout/host_s": self.host_s, "rollout/sampled_tokens": self.sampled_tokens,
            "rollout/env_steps": self.env_steps, "rollout/unknown_words": self.unknown_words,
            "rollout/tokens_per_s": self.sampled_tokens / max(total, 1e-9),
            "rollout/env_steps_per_s": self.env_steps / max(total, 1e-9),
            "rollout/generation_frac": self.generation_s / max(total, 1e-9),
            **({"rollout/segment_starts": self.segment_starts} if self.segment_starts else {}),
            **({"rollout/summary_turns": self.summary_turns} if self.summary_turns else {}),
            **self.extra}


def merge_stats(first: RolloutStats, second: RolloutStats) -> RolloutStats:
  """The stats of two `collect` calls run one after the other, as one: times and counts summed,
  `episode_info` concatenated (first's rows, then second's), `first`'s `extra` and `recovery`."""
  sums = {f.name: getattr(first, f.name) + getattr(second, f.name)
          for f in dataclasses.fields(RolloutStats)
          if f.name not in ("episode_info", "extra", "recovery", "segments", "rewritten")}
  if first.segments is not None or second.segments is not None:
    raise ValueError("merge_stats: batches with context segments are not merged (context.mode "
                     "window / summary runs without recovery groups).")
  info = {name: np.concatenate([np.asarray(first.episode_info[name]),
                                np.asarray(second.episode_info[name])])
          for name in first.episode_info if name in second.episode_info}
  return RolloutStats(**sums, episode_info=info, extra=dict(first.extra),
                      recovery=first.recovery)


@functools.lru_cache(maxsize=None)
def _env_fns(env: Environment):
  """Jitted batched `reset`, `step` and per-episode info of `env` (built once per environment)."""
  info = lambda s: dict(env.episode_info(s.task, s.inner),
                        difficulty=env.task_difficulty(s.task))
  return (jax.jit(functools.partial(batch_reset, env)), jax.jit(functools.partial(batch_step, env)),
          jax.jit(jax.vmap(info)))


@functools.lru_cache(maxsize=None)
def _oracle_fn(env: Environment):
  """The jitted batched oracle of `env` (built once per environment)."""
  return jax.jit(jax.vmap(env.oracle))


@contextlib.contextmanager
def _timed(stats: RolloutStats, field: str):
  """Adds the wall time of the block to `stats.<field>`."""
  start = time.perf_counter()
  yield
  setattr(stats, field, getattr(stats, field) + time.perf_counter() - start)


def collect(params, model_config: ModelConfig, env: Environment, codec, tasks: Any,
            env_keys: jax.Array, config: RolloutConfig, *, sampling_seed: int,
            policy_version: int = 0, task_seed: int = 0,
            group_offset: int = 0, row_offset: int = 0, scripted=None,
            on_env_step=None, params_source=None,
            reprefill: bool = False) -> tuple[EpisodeBatch, RolloutStats]:
  """Runs `N` tasks x `G` rollouts and returns `(EpisodeBatch [N*G], RolloutStats)`.

  Args:
    params: policy parameters (`Transformer` params or `DecodeParams`).
    model_config: the policy's config.
    env: the (possibly wrapped) environment; its fingerprint is recorded as `env_version`. Its
      `reward_spec` (`envs/rewards.py`) composes the step rewards and the episode score; its
      fingerprint is recorded as `reward_version`.
    codec: `env.codec(tokenizer, style)`; its tokenizer must be the policy's.
    tasks: `[N]` task pytree.
    env_keys: `[N]` PRNG keys of the environment's own randomness; the `G` rollouts of a task share
      its key (and its task), so they differ only by the policy's samples.
    config: `RolloutConfig`.
    sampling_seed: seed of the policy's sampling; row `r` samples with
      `fold_in(key(seed), row_offset + r)`.
    policy_version, task_seed: recorded on every row.
    group_offset: added to the task index to form `group` labels (unique across batches).
    row_offset: index of this batch's first row in a larger batch it is a slice of (the share of
      one process, `rollout.multihost`): its rows then sample exactly as those rows of the whole.
    scripted: optional host function `(states) -> list of [B] token-id lists` that replaces the
      policy (e.g. `oracle_turns(env, codec)` for SFT data): its ids are written as the turns, with
      loss_mask 1 and behaviour log-prob 0; no model runs (`params` and `model_config` may be None).
    on_env_step: optional host function `(t, active)` called after every batched env step `t` with
      the `[B]` bool rows that stepped; its time counts as environment time (the async benchmark
      sleeps there to simulate tool latency).
    params_source: optional `() -> (params, version)`, the newest published policy (partial
      rollouts across weight updates, `rollout.continue_partial`): before every turn, a version
      newer than the one sampling replaces it for the rest of the episodes (`token_version`
      records which sampled each token). The KV cache of the tokens so far is kept as the older
      parameters computed it, or with `reprefill` computed again with the new ones.
  """
  reward, stats = env.reward_spec, RolloutStats()
  n, g = num_tasks(tasks), config.group_size
  roots = config.branch_roots
  task_of_row = np.repeat(np.arange(n), roots)
  row_ids = row_offset + (task_of_row * g + np.tile(np.arange(roots), n))  # their ids in [N*G]
  rows_keys = jnp.asarray(env_keys)[task_of_row]
  rows = (_HostRows(env, codec) if is_host(env) else _JaxRows(env, codec))
  rows.keep_history = config.branch_k > 0 or bool(config.recovery_from)
  rows.track_oracle = (config.record_oracle or config.recovery_from == "first_divergence"
                       or (config.branch_k > 0 and config.branch_at == "first_divergence"))
  with _timed(stats, "env_s"):
    prompts, anchors = rows.start(tasks, task_of_row, rows_keys, config, stats)
  buffer = EpisodeBuffer.start(prompts, config.context_length, config.max_steps, anchors,
                               env.num_milestones)
  segmenter = None if config.context_mode == "full" else Segmenter(config, codec, rows, prompts)
  with _timed(stats, "generation_s"):
    policy = (_ScriptedPolicy(scripted, config, codec, policy_version) if scripted else
              _ModelPolicy(params, model_config, config, codec, prompts, sampling_seed, row_ids,
                           version=policy_version, source=params_source, reprefill=reprefill))
  _run_turns(buffer, policy, rows, codec, config, stats, np.zeros(len(prompts), np.int64),
             on_env_step, segmenter)
  labels = dict(policy_version=policy_version, task_seed=task_seed, sampling_seed=sampling_seed)
  with _timed(stats, "host_s"):
    env_seed = np.asarray(jax.random.key_data(rows_keys))[:, -1]
    batch = _finish(buffer, policy, env, reward, task_of_row + group_offset, env_seed, labels,
                    config)
    stats.episode_info = dict(rows.episode_info(), **buffer.episode_info())
    if segmenter is not None:
      stats.segments = segmenter.segments(batch)
      stats.segment_starts = len(segmenter.saved)
      stats.rewritten = segmenter.rewritten(batch.batch_size)
      stats.unknown_words += segmenter.unknown_words
    if config.recovery_from:  # before branching: a host pool's rows then become the branches
      stats.recovery = recovery_starts(batch, buffer, rows, config.recovery_from, _reached)
  if config.branch_k:
    batch = _branch(batch, buffer, policy, rows, env, codec, config, stats, row_ids, labels,
                    on_env_step)
  with _timed(stats, "host_s"):
    stats.episodes = batch.batch_size
    stats.extra.update(rows.finish())
  return batch, stats


def collect_recovery(params, model_config: ModelConfig, env: Environment, codec,
                     starts: RecoveryStarts, config: RolloutConfig, *, sampling_seed: int,
                     policy_version: int = 0, task_seed: int = 0, group_offset: int = 0,
                     row_offset: int = 0, on_env_step=None) -> tuple[EpisodeBatch, RolloutStats]:
  """`G = config.group_size` continuations of each of the `M` recovery `starts` (from an earlier
  `collect`'s `RolloutStats.recovery`): `(EpisodeBatch [M*G], RolloutStats)`, start `j`'s rows
  `j*G .. j*G+G-1` forming group `group_offset + j`. Each row is put back in its start's saved
  environment state (a JAX state pytree; a host pool restores the snapshot or replays the actions)
  with its token prefix, which the policy prefills afresh (`params` may be newer than those that
  sampled it), and samples from the step after the source episode's first error. The prefix is
  held as copies (loss_mask 0); rows have `parent = RECOVERY` and `branch_step` = that step.
  Row `r` samples with `fold_in(key(sampling_seed), row_offset + r)`."""
  if config.branch_k:
    raise ValueError("collect_recovery does not branch: pass a RolloutConfig with branch_k=0.")
  stats, g, m = RolloutStats(), config.group_size, len(starts)
  index = np.repeat(np.arange(m), g)
  start = starts.take(index)
  buffer = start.buffer
  prompts = [buffer.batch.tokens[r, :buffer.end[r]].tolist() for r in range(m * g)]
  with _timed(stats, "env_s"):
    kind = _HostRows if is_host(env) else _JaxRows
    rows = kind.resume(env, codec, start.states, start.milestones)
    rows.track_oracle = config.record_oracle
  with _timed(stats, "generation_s"):
    policy = _ModelPolicy(params, model_config, config, codec, prompts, sampling_seed,
                          row_offset + np.arange(m * g), version=policy_version)
  _run_turns(buffer, policy, rows, codec, config, stats, start.steps.astype(np.int64), on_env_step)
  labels = dict(policy_version=policy_version, task_seed=task_seed, sampling_seed=sampling_seed)
  with _timed(stats, "host_s"):
    batch = _finish(buffer, policy, env, env.reward_spec, group_offset + index, start.env_seed,
                    labels, config)
    stats.episode_info = dict(rows.episode_info(), **buffer.episode_info())
    stats.episodes = batch.batch_size
    stats.extra.update(rows.finish())
  return batch.replace(parent=np.full(m * g, RECOVERY, np.int32),
                       branch_step=start.steps.astype(np.int32)), stats


def _run_turns(buffer: EpisodeBuffer, policy, rows, codec, config: RolloutConfig,
               stats: RolloutStats, steps: np.ndarray, on_env_step=None,
               segmenter: Segmenter | None = None) -> None:
  """The turn loop: every row that is not done takes its next step (`steps[r]`, counted per row)
  until every row is done or has taken `config.max_steps` steps. With a `segmenter` (context
  modes window / summary), rows may start new context segments between steps."""
  for _ in range(config.max_steps):
    active = ~buffer.done
    if not active.any():
      break
    stats.turns += 1
    with _timed(stats, "generation_s"):
      policy.refresh(buffer, active)
      turn = policy.turn(rows.states(active), active, buffer.budgets(config.turn_tokens))
    with _timed(stats, "host_s"):
      starts = buffer.end.copy()
      stats.sampled_tokens += buffer.write_turn(steps, active, turn.tokens, turn.logprobs,
                                                turn.lengths, policy.version)
      if config.label_parts:
        for r in np.nonzero(active & (turn.lengths > 0))[0]:
          ids = turn.tokens[r, :int(turn.lengths[r])]
          buffer.label_parts(r, starts[r], action_parts.token_parts(
              codec.decode, ids, codec.style, codec.stop_token_ids))
    with _timed(stats, "env_s"):
      ts = rows.step(turn, active)
      if rows.track_oracle:
        buffer.record_oracle(steps, active, rows.match)
      if on_env_step is not None:
        on_env_step(int(steps[active].max()), active)
    stats.env_steps += int(active.sum())
    with _timed(stats, "host_s"):
      going_on = active & ~buffer.record_step(steps, active, ts, rows.env_reward(ts))
      observations, cut, ask = _append_observations(buffer, codec, config, stats, steps,
                                                    going_on, rows.observation, turn.stopped,
                                                    segmenter)
    extended = ask.any()
    if extended:  # the policy writes the summaries that rewrite these rows' contexts
      _summary_turns(buffer, policy, rows, segmenter, stats, observations, steps, ask)
      cut |= ask & ~buffer.done
    steps = steps + active
    if cut.any():  # rewritten contexts: the cache is prefilled again from every row's context
      with _timed(stats, "generation_s"):
        policy.restart(buffer, segmenter.index)
    elif any(observations) and not extended:
      with _timed(stats, "generation_s"):
        policy.extend(observations)


def _summary_turns(buffer: EpisodeBuffer, policy, rows, segmenter: Segmenter,
                   stats: RolloutStats, observations, steps, ask) -> None:
  """The rows `ask` asked for a summary after step `steps[r]` (their observation and the request
  are in `observations`): the cache is extended, the policy samples each summary turn (loss 1,
  that step's turn; its behaviour log-probs kept), and the row's context is rewritten around it
  (a row whose rewrite would not fit is truncated)."""
  limit = segmenter.config.context_summary_tokens
  with _timed(stats, "generation_s"):
    policy.extend(observations)
    turn = policy.summary_turn(rows, ask, np.minimum(limit, buffer.budgets(limit)))
  with _timed(stats, "host_s"):
    stats.sampled_tokens += buffer.write_turn(steps, ask, turn.tokens, turn.logprobs,
                                              turn.lengths, policy.version)
    stats.summary_turns += int(ask.sum())
    for r in np.nonzero(ask)[0]:
      ids = turn.tokens[r, :int(turn.lengths[r])].tolist()
      if not segmenter.summarised(buffer, r, int(steps[r]), ids):
        buffer.stop(r, Termination.CONTEXT_OVERFLOW)


def _finish(buffer: EpisodeBuffer, policy, env, reward, groups, env_seed, labels,
            config: RolloutConfig) -> EpisodeBatch:
  if config.label_parts:
    buffer.label_answers()
  batch = buffer.finish(reward, **_labels(env, reward, groups, env_seed, **labels))
  return batch.replace(routing=policy.routing(buffer.end, batch.attention_mask))


def _branch(batch: EpisodeBatch, buffer: EpisodeBuffer, policy, rows, env, codec,
            config: RolloutConfig, stats: RolloutStats, row_ids, labels: dict,
            on_env_step=None) -> EpisodeBatch:
  """The second phase of a branch rollout: `branch_k` continuations of every root of `batch` from
  the state before its step chosen by `config.branch_at`, sampled from the saved environment
  state and the root's cached prefix. Returns roots and branches in one batch, each task's rows
  together: its roots, then root 0's branches, root 1's, ... (so row ids do not depend on how the
  tasks are split between processes)."""
  k, roots = config.branch_k, config.branch_roots
  with _timed(stats, "host_s"):
    steps = BRANCH_POINTS[config.branch_at](batch, buffer, rows, labels["sampling_seed"], row_ids)
    parents, at = np.repeat(np.arange(batch.batch_size), k), np.repeat(steps, k)
    child_buffer = buffer.fork(parents, at)
    # Root j of task i is row i*G + j; its branch m is row i*G + R + j*K + m.
    child_ids = (row_ids[parents] + roots + (parents % roots) * (k - 1)
                 + np.tile(np.arange(k), len(steps)))
    last = batch.tokens[parents, child_buffer.end - 1]
  with _timed(stats, "generation_s"):
    child_policy = policy.fork(parents, child_buffer.end, last, child_ids)
  with _timed(stats, "env_s"):
    child_rows = rows.fork(parents, at, _reached(child_buffer))
    child_rows.track_oracle = rows.track_oracle
  _run_turns(child_buffer, child_policy, child_rows, codec, config, stats, at.astype(np.int64),
             on_env_step)
  with _timed(stats, "host_s"):
    child = _finish(child_buffer, child_policy, env, env.reward_spec, batch.group[parents],
                    batch.env_seed[parents], labels, config)
    n = batch.batch_size // roots
    order = np.concatenate([np.concatenate([i * roots + np.arange(roots), batch.batch_size
                                            + i * roots * k + np.arange(roots * k)])
                            for i in range(n)])
    both = jax.tree.map(lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)])[order],
                        batch, child)
    position = np.argsort(order)  # final row of each source row
    parent = np.concatenate([np.full(batch.batch_size, -1), position[parents]])[order]
    branch_step = np.concatenate([np.full(batch.batch_size, -1), at])[order]
    info = dict(child_rows.episode_info(), **child_buffer.episode_info())
    stats.episode_info = {name: np.concatenate([np.asarray(stats.episode_info[name]),
                                                np.asarray(info[name])])[order]
                          for name in stats.episode_info}
    return both.replace(parent=parent.astype(np.int32), branch_step=branch_step.astype(np.int32))


def _reached(buffer: EpisodeBuffer) -> np.ndarray:
  """`[B, M]` bool: the milestones each row has reached in the steps it holds."""
  bits = np.bitwise_or.reduce(np.asarray(buffer.batch.milestones), axis=-1)
  return (bits[:, None] >> np.arange(buffer.num_milestones)) & 1 == 1


def _uniform_points(batch, buffer, rows, seed, row_ids) -> np.ndarray:
  """A step drawn uniformly from each root's steps (`Generator([seed, row id])`)."""
  del buffer, rows
  steps = np.maximum(np.asarray(batch.num_steps), 1)
  return np.array([np.random.default_rng([seed, int(i)]).integers(0, n)
                   for i, n in zip(row_ids, steps)], np.int64)


def _entropy_points(batch, buffer, rows, seed, row_ids) -> np.ndarray:
  """The step whose sampled tokens have the largest mean surprisal `-log p` (an unbiased estimate
  of the turn's mean token entropy under the sampling distribution); ties: the earliest."""
  del buffer, rows, seed, row_ids
  mask, turn = np.asarray(batch.loss_mask), np.asarray(batch.turn)
  s = batch.max_steps
  one_hot = (turn[:, :, None] == np.arange(s)) & mask[:, :, None]  # [B, L, S]
  total = np.einsum("bl,bls->bs", -np.asarray(batch.behavior_logprobs, np.float64), one_hot)
  mean = np.where(one_hot.any(1), total / np.maximum(one_hot.sum(1), 1), -np.inf)
  return np.argmax(mean, axis=-1).astype(np.int64)


def _after_error_points(batch, buffer, rows, seed, row_ids) -> np.ndarray:
  """The step right after the root's first invalid or forbidden action
  (`first_error_steps(..., "after_error")` + 1: the erroneous step stays shared, the branches
  take the next one); uniform for a root without one, or whose error was its last step."""
  first = first_error_steps(batch, buffer, "after_error")
  ok = (first >= 0) & (first + 1 < np.asarray(batch.num_steps))
  return np.where(ok, first + 1, _uniform_points(batch, buffer, rows, seed, row_ids))


def _divergence_points(batch, buffer, rows, seed, row_ids) -> np.ndarray:
  """The first step whose action differs from the oracle's action in that state (`oracle_match`
  0; `first_error_steps(..., "first_divergence")` itself, unlike `after_error`: the branches
  resample the divergent action); uniform for a root that agreed with the oracle throughout."""
  first = first_error_steps(batch, buffer, "first_divergence")
  return np.where(first >= 0, first, _uniform_points(batch, buffer, rows, seed, row_ids))


# Where `collect` forks each root (`RolloutConfig.branch_at`): `(root batch, its buffer, its env
# rows, sampling seed, row ids) -> [R]` steps, each one the root took.
BRANCH_POINTS = {"uniform": _uniform_points, "max_entropy": _entropy_points,
                 "after_error": _after_error_points, "first_divergence": _divergence_points}


class _JaxRows:
  """The rows of a JAX environment: reset, step and episode facts jitted and vmapped over rows;
  the codec parses each turn into an `Action` on the host."""

  def __init__(self, env: Environment, codec, states=None):
    self.env, self.codec = env, codec
    self.reset_fn, self.step_fn, self.info_fn = _env_fns(env)
    self.messages, self._states, self._host = None, states, None
    self.keep_history, self.track_oracle, self.history = False, False, []

  def fork(self, parents, steps, milestones=None) -> "_JaxRows":
    """Rows in the saved states: row `i` in row `parents[i]`'s state before its step `steps[i]`
    (the state holds the milestones reached: `milestones` is not needed)."""
    del milestones
    return _JaxRows(self.env, self.codec, self.saved(parents, steps))

  def saved(self, parents, steps):
    """The state pytree (`[R, ...]` leaves) of row `parents[i]` before its step `steps[i]`."""
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *self.history)  # [T, B, ...] leaves
    at = (jnp.asarray(steps, jnp.int32), jnp.asarray(parents, jnp.int32))
    return jax.tree.map(lambda x: x[at], stacked)

  @classmethod
  def resume(cls, env: Environment, codec, saved, milestones=None) -> "_JaxRows":
    """Rows in `saved` states (from `saved`, possibly of an earlier `collect`)."""
    del milestones
    return cls(env, codec, jax.tree.map(jnp.asarray, saved))

  def start(self, tasks, task_of_row, rows_keys, config, stats):
    states, _ = self.reset_fn(rows_keys, jax.tree.map(lambda a: jnp.asarray(a)[task_of_row], tasks))
    self._states = jax.block_until_ready(states)
    task_prompts = _prompts(self.codec, tasks, config, stats)
    return [task_prompts[i] for i in task_of_row], self._states.last.anchor

  def states(self, active):
    del active
    return self._states

  def step(self, turn, active):
    actions, self.messages = _parse_actions(self.env, self.codec, turn, active)
    if self.keep_history:  # the state each row acts in, for branch rollouts
      self.history.append(self._states)
    if self.track_oracle:
      self.match = self._oracle_match(to_numpy(actions), active)
    self._states, timesteps = self.step_fn(self._states, actions)
    self._host = None
    self.ts = to_numpy(timesteps)
    return self.ts

  def _oracle_match(self, actions, active) -> np.ndarray:
    """`[B]` int32: 1 where the row's action, as text, is the oracle's in its state, else 0."""
    best = to_numpy(_oracle_fn(self.env)(self._states))
    match = np.zeros(len(active), np.int32)
    for r in np.nonzero(active & (actions.error == 0))[0]:
      match[r] = self.codec.format_action(row(best, r)) == self.codec.format_action(row(actions, r))
    return match

  def env_reward(self, ts):
    del ts
    return None

  def state_text(self, r: int) -> str:
    """The environment's summary of row `r`'s current state (`Environment.state_text`)."""
    if self._host is None:  # one host copy of the states per step
      self._host = to_numpy(self._states)
    return self.env.state_text(row(self._host.task, r), row(self._host.inner, r), self.codec.style)

  def observation(self, r: int):
    """`(ids, text)` of row `r`'s latest observation framed as the next turn (`text` a function)."""
    ts_r, message = row(self.ts, r), self.messages[r] or None
    return (list(self.codec.render_observation(ts_r, message)),
            lambda: self.codec.observation_turn_text(ts_r, message))

  def episode_info(self) -> dict:
    return {k: np.asarray(v) for k, v in to_numpy(self.info_fn(self._states)).items()}

  def finish(self) -> dict:
    return {}


class _HostStates(NamedTuple):
  """What a scripted source sees of host rows: the pool and the rows that act."""
  pool: Any
  active: np.ndarray


class _HostRows:
  """The rows of a host environment, stepped by its `EnvPool` (`envs/pool.py`): each turn's text
  goes to the environment as is (end-of-turn removed); first-time milestone logic, the safety
  stop and invalid actions are applied here as the JAX base class applies them."""

  def __init__(self, env, codec):
    self.env, self.codec = env, codec
    self.pool = pool_for(env)
    self.names = {name: i for i, name in enumerate(env.milestone_names)}
    # Branch rollouts: each step's snapshots `{row: snapshot or None}`.
    self.keep_history, self.track_oracle, self.snapshots = False, False, []
    self.guarded, self.anchors, self.infos = None, [], []  # set by `start` / `resume`

  def fork(self, parents, steps, milestones) -> "_HostRows":
    """Rows in saved states: row `i` in row `parents[i]`'s state before its step `steps[i]`
    (restored from that step's snapshot, or replayed from reset with the parent's actions), with
    the milestones it had reached (`milestones [R, M]` bool)."""
    sources = self.saved(parents, steps)
    self.pool.finish()  # the roots' records, before the pool's rows become the branches
    return _HostRows.resume(self.env, self.codec, sources, milestones)

  def saved(self, parents, steps) -> list:
    """Row `parents[i]` before its step `steps[i]` as `EnvPool.fork` sources: `(task, seed,
    actions so far, that step's snapshot or None)`."""
    if self.guarded is not None and self.guarded.rates:
      raise ValueError(f"branch and recovery rollouts of the host environment {self.env.name!r} "
                       "cannot start from saved states while faults are injected (env.faults): "
                       "a faulted call never reached the environment, so its history does not "
                       "index the episode's steps.")
    histories = [list(row.history) for row in self.pool.rows]
    return [(self.tasks[p], self.pool.rows[p].seed, histories[p][:t], self.snapshots[t].get(p))
            for p, t in zip(parents, steps)]

  @classmethod
  def resume(cls, env, codec, sources: list, milestones) -> "_HostRows":
    """Rows started in the states `sources` describe (from `saved`, possibly of an earlier
    `collect`), with the milestones they had reached (`[R, M]` bool)."""
    rows = cls(env, codec)
    rows.tasks = [source[0] for source in sources]
    rows.infos = [[] for _ in sources]  # the facts of a forked row's own steps
    rows.reached = np.asarray(milestones, bool).copy()
    rows.anchors = [0] * len(sources)  # a forked row's loop check starts afresh
    rows._guard([source[1] for source in sources], [len(source[2]) for source in sources])
    rows.pool.fork(sources)
    return rows

  def start(self, tasks, task_of_row, rows_keys, config, stats):
    tasks = list(tasks)
    seeds = np.asarray(jax.random.key_data(rows_keys))[:, -1].astype(np.uint32)
    self.tasks = [tasks[i] for i in task_of_row]
    b = len(self.tasks)
    first = self.pool.reset(self.tasks, [int(x) for x in seeds])
    self.reached = np.zeros((b, self.env.num_milestones), bool)
    self.infos = [[] for _ in range(b)]  # each row's step infos, for `env.episode_info`
    self._guard([int(x) for x in seeds], [0] * b)
    texts = [o.text if isinstance(o, Observation) else "" for o in first]
    prompts = [self.codec.render_prompt(text) for text in texts]
    stats.unknown_words += sum(_unknown_count(self.codec, ids, lambda t=t: self.codec.prompt_text(t))
                               for ids, t in zip(prompts, texts))
    longest, length = max(len(p) for p in prompts), config.context_length
    if longest + config.turn_tokens + 1 > length:
      raise ValueError(f"context_length={length} cannot hold the longest prompt ({longest} "
                       f"tokens) and one turn ({config.turn_tokens} tokens + end of turn); raise "
                       f"rollout.context_length or shorten the prompt.")
    anchors = np.array([self.env.anchor(t) for t in texts], np.uint32)
    self.anchors = [int(a) for a in anchors]
    return prompts, anchors

  def _guard(self, seeds, steps):
    """Faults, tool costs and loop detection (`envs/host_wrappers.py`), when `guard` set any."""
    guards = guards_of(self.env)
    self.guarded = None if guards is None else GuardedRows(
        self.env, guards, seeds, getattr(self.codec, "style", "tool_call"), steps)

  def states(self, active):
    return _HostStates(self.pool, active)

  def step(self, turn, active):
    rows = np.nonzero(active)[0]
    actions = {int(r): self.codec.action_text(turn.tokens[r, :int(turn.lengths[r])])
               for r in rows}
    if self.keep_history:  # the state each row acts in, for branch rollouts
      self.snapshots.append(self.pool.snapshot(rows))
    if self.track_oracle:  # 1 where the action is the oracle's (whitespace-normalised text)
      best, self.match = self.pool.oracle([int(r) for r in rows]), np.zeros(len(active), np.int32)
      for r, a in actions.items():
        self.match[r] = best.get(r) is not None and best[r].split() == a.split()
    if self.guarded is None:
      self.results = self.pool.step(actions)
      return self._timestep(len(active))
    # A faulted call is answered here and never made; the others get their cost and loop check.
    faulted = {r: f for r, a in actions.items() if (f := self.guarded.before(r, a)) is not None}
    self.results = {**faulted, **self.pool.step({r: a for r, a in actions.items()
                                                 if r not in faulted})}
    self.results = {r: self.guarded.after(r, actions[r], self.anchors[r], res)
                    for r, res in self.results.items()}
    return self._timestep(len(active))

  def _timestep(self, b: int) -> SimpleNamespace:
    m = self.env.num_milestones
    out = SimpleNamespace(
        milestones=np.zeros((b, m), bool), cost=np.zeros((b,), np.float32),
        latency=np.zeros((b,), np.float32),
        violation=np.zeros((b,), bool), env_error=np.zeros((b,), bool),
        invalid_action=np.zeros((b,), bool), observation={"error": np.zeros((b,), np.int32)},
        fault=np.zeros((b,), np.int32), loop=np.zeros((b,), bool),
        anchor=np.zeros((b,), np.uint32), done=np.zeros((b,), bool),
        success=np.zeros((b,), bool), terminated=np.zeros((b,), bool),
        reward=np.zeros((b,), np.float32))
    for r, res in self.results.items():
      unknown = [n for n in res.milestones if n not in self.names]
      if unknown and not res.env_error:
        res = StepResult(f"environment error: milestone(s) {unknown} not in milestone_names "
                         f"{tuple(self.names)}", terminated=True, env_error=True)
        self.results[r] = res
      hit = np.zeros((m,), bool)
      hit[[self.names[n] for n in res.milestones if n in self.names]] = True
      ok = not res.env_error
      if ok:
        self.infos[r].append(res.info)
      out.milestones[r] = hit & ~self.reached[r] & ok
      self.reached[r] |= hit & ok
      out.cost[r] = res.cost if ok else 0.0
      out.latency[r] = self.pool.latency.get(r, 0.0)
      out.violation[r] = res.violation and ok
      out.env_error[r] = res.env_error
      fault = int(res.info.get("fault", 0))  # an injected fault (envs/host_wrappers.py)
      out.fault[r], out.loop[r] = fault, bool(res.info.get("loop", False))
      code = (res.error or fault) if ok else 0
      out.observation["error"][r] = code
      out.invalid_action[r] = 1 <= code <= int(ErrorCode.NOT_ALLOWED)
      # A faulted call did not act: the state, hence its anchor, is the one before it.
      out.anchor[r] = self.anchors[r] if fault else self.env.anchor(res.observation)
      self.anchors[r] = int(out.anchor[r])
      out.terminated[r] = (res.terminated or res.violation) and ok
      out.done[r] = res.terminated or res.truncated or res.violation or res.env_error
      out.success[r] = res.success and out.terminated[r] and not res.violation
      out.reward[r] = res.reward if ok else 0.0
    return out

  def env_reward(self, ts):
    return ts.reward

  def state_text(self, r: int) -> str:
    """Row `r`'s state summary, from its instance in the pool (`HostEnvironment.state_text`)."""
    text = self.pool.state_texts([r]).get(r)
    if text is None:
      raise RuntimeError(f"context.mode='summary': the host environment {self.env.name!r} gave no "
                         f"state summary for row {r} (its state_text call failed: "
                         f"{self.pool.stats()})")
    return text

  def observation(self, r: int):
    text = self.results[r].observation
    return (self.codec.render_observation(text), lambda: self.codec.observation_turn_text(text))

  def episode_info(self) -> dict:
    """Each row's difficulty and the environment's `episode_info` facts (`[B]` arrays)."""
    facts = [self.env.episode_info(t, i) for t, i in zip(self.tasks, self.infos)]
    keys = set(facts[0]) if facts else set()
    if any(set(f) != keys for f in facts):
      odd = next(set(f) for f in facts if set(f) != keys)
      raise ValueError(f"{type(self.env).__name__}.episode_info gave different keys for two "
                       f"episodes: {sorted(keys)} and {sorted(odd)}; every episode needs the same.")
    out = {key: np.asarray([f[key] for f in facts]) for key in sorted(keys)}
    out["difficulty"] = np.array([self.env.task_difficulty(t) for t in self.tasks], np.int32)
    return out

  def finish(self) -> dict:
    self.pool.finish()
    return self.pool.stats()


def _prompts(codec, tasks, config: RolloutConfig, stats: RolloutStats) -> list:
  """Each task's prompt ids. Counts their unknown words in `stats` (once per rollout of the task);
  raises if the longest prompt and one turn do not fit in the context."""
  host = to_numpy(tasks)
  task_rows = [row(host, i) for i in range(jax.tree.leaves(host)[0].shape[0])]
  prompts = [codec.render_prompt(task) for task in task_rows]
  stats.unknown_words += config.group_size * sum(
      _unknown_count(codec, ids, lambda task=task: codec.prompt_text(task))
      for ids, task in zip(prompts, task_rows))
  longest, length = max(len(p) for p in prompts), config.context_length
  if longest + config.turn_tokens + 1 > length:
    raise ValueError(f"context_length={length} cannot hold the longest prompt ({longest} tokens) "
                     f"and one turn ({config.turn_tokens} tokens + end of turn); raise "
                     f"rollout.context_length or shorten the prompt.")
  return prompts


class _Turn(NamedTuple):
  """One decode round on the host, in the layout of `sampler.DecodeResult`."""
  tokens: np.ndarray  # [B, T] int32 the turn's ids (T >= every row's length)
  logprobs: np.ndarray  # [B, T] float32 behaviour log-probs (0 for a scripted turn)
  lengths: np.ndarray  # [B] int32 ids per row (0 for rows that did not act)
  stopped: np.ndarray  # [B] bool, the turn ended with the stop token


class _ModelPolicy:
  """Turns sampled by the model from its KV cache, which holds every row's context; row `r` samples
  with `fold_in(key(sampling_seed), row_offset + r)`."""

  def __init__(self, params, model_config: ModelConfig, config: RolloutConfig, codec, prompts,
               sampling_seed: int, row_ids, *, version: int = 0, source=None,
               reprefill: bool = False):
    self.params = prepare_decode_params(params, model_config)
    self.version, self.source, self.reprefill = version, source, reprefill
    self.model_config, self.length = model_config, config.context_length
    self.sampling_seed = sampling_seed
    self.row_keys = sampler.per_row_keys(sampling_seed, np.asarray(row_ids))
    self.base_keys = self.row_keys
    self.rule = config.sampling(codec.stop_token_ids)
    if prompts is not None:
      self._prefill(prompts, config.share_prompts)

  def _prefill(self, prompts, share: bool) -> None:
    """The prompts' cache; with `share`, each distinct prompt is encoded once and its cache row
    copied to every row that has it (`sampler.fork_cache`)."""
    index = np.arange(len(prompts))
    if share:
      first: dict = {}
      index = np.array([first.setdefault(tuple(p), len(first)) for p in prompts])
      prompts = [list(p) for p in first]
    tokens, lengths = sampler.pad_rows(prompts, minimum=8, maximum=self.length)
    cache, logits = sampler.prefill(self.params, self.model_config, tokens, lengths, self.length)
    if share:
      cache = sampler.fork_cache(cache, index, lengths[index])
      logits = logits[jnp.asarray(index)]
    self.cache, self.last_logits = cache, logits

  def fork(self, parents, prefix_ends, last_tokens, row_ids) -> "_ModelPolicy":
    """Branch rows from this policy's cache without prefilling their prefixes again: row `i` gets
    row `parents[i]`'s cache cut to its first `prefix_ends[i]` slots (the prefix's keys and values
    do not change as the parent goes on), less the last, which is appended again (`last_tokens[i]`,
    one token per row) to give the next-token logits. Row `i` samples with key `row_ids[i]`."""
    child = object.__new__(_ModelPolicy)
    child.params, child.model_config, child.length = self.params, self.model_config, self.length
    child.version, child.source, child.reprefill = self.version, self.source, self.reprefill
    child.sampling_seed, child.rule = self.sampling_seed, self.rule
    child.row_keys = sampler.per_row_keys(self.sampling_seed, np.asarray(row_ids))
    cache = sampler.fork_cache(self.cache, jnp.asarray(parents, jnp.int32),
                               jnp.asarray(prefix_ends, jnp.int32) - 1)
    tokens = np.asarray(last_tokens, np.int32)[:, None]
    child.cache, child.last_logits = sampler.extend(self.params, self.model_config, cache, tokens,
                                                    np.ones(len(tokens), np.int32))
    return child

  def refresh(self, buffer: EpisodeBuffer, active) -> None:
    """Takes a newer policy version from `source`, if there is one, for the turns to come; with
    `reprefill` the cache of every row's tokens so far is computed again with it."""
    newest = self.source() if self.source is not None else None
    if newest is None or newest[1] <= self.version:
      return
    params, self.version = newest
    self.params = prepare_decode_params(params, self.model_config)
    if self.reprefill and active.any():
      tokens, lengths = sampler.pad_rows(
          [buffer.batch.tokens[r, :buffer.end[r]] for r in range(len(buffer.end))], minimum=8,
          maximum=self.length)
      self.cache, self.last_logits = sampler.prefill(self.params, self.model_config, tokens,
                                                     lengths, self.length)

  def summary_turn(self, rows, ask, budgets) -> _Turn:
    """The summary turn of the rows `ask`, sampled from their contexts (which end with the
    request)."""
    return self.turn(rows.states(ask), ask, budgets)

  def restart(self, buffer: EpisodeBuffer, segment_index) -> None:
    """The cache prefilled again from every row's context in `buffer`, after some rows began new
    context segments (`rollout/context.py`; `segment_index [B]`, the segment each row is in, which
    folds into its sampling key)."""
    tokens, lengths = sampler.pad_rows(
        [buffer.batch.tokens[r, :buffer.end[r]] for r in range(len(buffer.end))], minimum=8,
        maximum=self.length)
    self.cache, self.last_logits = sampler.prefill(self.params, self.model_config, tokens,
                                                   lengths, self.length)
    self.row_keys = segment_keys(self.base_keys, segment_index)

  def turn(self, states, active, budgets) -> _Turn:
    del states  # the model acts on its context only
    result = sampler.decode(self.params, self.model_config, self.cache, self.last_logits,
                            self.row_keys, self.rule, jnp.asarray(budgets), jnp.asarray(active))
    self.cache, self.last_logits = result.cache, result.last_logits
    return _Turn(*jax.device_get((result.tokens, result.logprobs, result.lengths,
                                  result.stopped_by_stop_token)))

  def extend(self, observations: list[list[int]]) -> None:
    """Appends each row's observation ids (`[]` for none) to the cache."""
    tokens, lengths = sampler.pad_rows(observations, minimum=8, maximum=self.length)
    self.cache, self.last_logits = sampler.extend(self.params, self.model_config, self.cache,
                                                  tokens, lengths, self.last_logits)

  def routing(self, end, attention_mask) -> np.ndarray | None:
    """`[B, L, layers, k]` experts of every episode token (0 on padding), as the cache recorded
    them while sampling; None for a dense model. `end`: the episode buffer's token counts, which
    the cache's must equal (its slot `i` holds episode token `i`)."""
    if getattr(self.cache, "routing", None) is None:
      return None
    routing, cache_end = jax.device_get((self.cache.routing, self.cache.end))
    if not np.array_equal(cache_end, end):
      raise RuntimeError(f"routing replay: the KV cache holds {cache_end.tolist()} tokens per row "
                         f"but the episodes {np.asarray(end).tolist()}; the recorded experts would "
                         f"not align with the episode tokens.")
    return np.where(np.asarray(attention_mask)[:, :, None, None], routing, 0).astype(np.int32)


class _ScriptedPolicy:
  """Turns from a host source `(states) -> [B] id lists` (see `collect`), clipped to the budgets."""

  def __init__(self, source, config: RolloutConfig, codec, version: int = 0):
    self.source, self.width, self.stop_ids = source, config.turn_tokens, tuple(codec.stop_token_ids)
    self.version = version

  def refresh(self, buffer: EpisodeBuffer, active) -> None:
    """A scripted source has no parameters to update."""

  def turn(self, states, active, budgets) -> _Turn:
    turns, b = self.source(states), len(active)
    tokens = np.zeros((b, self.width), np.int32)
    lengths = np.zeros((b,), np.int32)
    stopped = np.zeros((b,), bool)
    for r in np.nonzero(active)[0]:
      ids = list(turns[r])[:int(budgets[r])]
      tokens[r, :len(ids)] = ids
      lengths[r] = len(ids)
      stopped[r] = bool(ids) and ids[-1] in self.stop_ids
    return _Turn(tokens, np.zeros((b, self.width), np.float32), lengths, stopped)

  def extend(self, observations) -> None:
    del observations  # no model, no cache

  def restart(self, buffer: EpisodeBuffer, segment_index) -> None:
    del buffer, segment_index  # acts on the states only

  def summary_turn(self, rows, ask, budgets) -> _Turn:
    """The demonstrated summary: the environment's `state_text` of each row `ask`, then the end
    of turn, clipped to the budget."""
    b = len(ask)
    tokens = np.zeros((b, max(int(np.max(budgets, initial=1)), 1)), np.int32)
    lengths, stopped = np.zeros((b,), np.int32), np.zeros((b,), bool)
    for r in np.nonzero(ask)[0]:
      ids = (rows.codec.tokenizer.encode(" " + rows.state_text(r), add_special_tokens=False)
             + list(self.stop_ids[:1]))[:int(budgets[r])]
      tokens[r, :len(ids)], lengths[r] = ids, len(ids)
      stopped[r] = bool(ids) and ids[-1] in self.stop_ids
    return _Turn(tokens, np.zeros(tokens.shape, np.float32), lengths, stopped)

  def fork(self, parents, prefix_ends, last_tokens, row_ids) -> "_ScriptedPolicy":
    del parents, prefix_ends, last_tokens, row_ids  # acts on the states only
    return self

  def routing(self, end, attention_mask) -> None:
    del end, attention_mask  # no model ran: nothing was routed
    return None


def _parse_actions(env: Environment, codec, turn: _Turn, active) -> tuple[Action, list[str]]:
  """The `[B]` batched action parsed from each active row's turn (an invalid action for the others,
  whose steps are not recorded) and each row's parse message ('' if none)."""
  actions, messages = [], [""] * len(active)
  for r, acts in enumerate(active):
    if acts:
      text = codec.decode(turn.tokens[r, :int(turn.lengths[r])])
      action, _, messages[r] = codec.parse_action(text)
    else:
      action = Action.invalid(1, env.num_args)
    actions.append(action)
  return stack_actions(actions), messages


def _append_observations(buffer: EpisodeBuffer, codec, config: RolloutConfig,
                         stats: RolloutStats, steps, rows, observation, stopped,
                         segmenter: Segmenter | None = None) -> tuple[list, np.ndarray,
                                                                      np.ndarray]:
  """Appends the observation of step `steps[r]` (`observation(r) -> (ids, text function)`) to each
  of `rows` (`[B]` bool, the rows that go on), after an end-of-turn token where the turn hit its
  budget instead. Stops a row as `TIMEOUT` after the last step, and as `CONTEXT_OVERFLOW` when its
  observation plus one more turn would not fit (and the `segmenter`, if any, starts no new
  segment instead). Returns the ids appended to each row (`[]` for none), `[B]` bool the rows
  that started a new context segment, and `[B]` bool the rows whose appended ids end with the
  request for the policy's summary (context summary_by="policy")."""
  eot = codec.stop_token_ids[0]
  appended = [[] for _ in range(len(rows))]
  cut, ask = np.zeros((len(rows),), bool), np.zeros((len(rows),), bool)
  for r in np.nonzero(rows)[0]:
    if steps[r] + 1 >= (config.step_budget or config.max_steps):
      buffer.stop(r, Termination.TIMEOUT)
      continue
    ids, text = observation(r)
    ids = list(ids)
    framed = ([] if stopped[r] else [eot]) + ids
    fits = buffer.end[r] + len(framed) + config.turn_tokens + 1 <= config.context_length
    boundary = segmenter.cut(buffer, r, int(steps[r]), framed, fits) if segmenter else ""
    if boundary == "cut":
      cut[r] = True
      if config.context_mode == "window":  # the observation is in the new context
        stats.unknown_words += _unknown_count(codec, ids, text)
      continue
    if boundary == "ask":  # the observation, then the request for the policy's summary
      ask[r] = True
      framed = framed + segmenter.request
      fits = True
    if not fits:
      buffer.stop(r, Termination.CONTEXT_OVERFLOW)
      continue
    stats.unknown_words += _unknown_count(codec, ids, text)
    buffer.append_observation(r, steps[r], framed)
    appended[r] = framed
  return appended, cut, ask


def _labels(env: Environment, reward: RewardSpec, group, env_seed, *, policy_version: int,
            task_seed: int, sampling_seed: int) -> dict:
  """The per-episode labels of an `EpisodeBatch` (`[B]` arrays): group, versions and seeds."""
  b = len(group)
  return dict(group=np.asarray(group).astype(np.int32),
              policy_version=np.full((b,), policy_version, np.int32),
              env_version=np.full((b,), env_version(env), np.int32),
              reward_version=np.full((b,), reward_version(reward), np.int32),
              env_seed=np.asarray(env_seed).astype(np.uint32),
              task_seed=np.full((b,), task_seed, np.uint32),
              sampling_seed=np.full((b,), sampling_seed, np.uint32))


def _unknown_count(codec, ids, text) -> int:
  """Words of `text()` (the text `ids` encode) that became the unknown token; `text` is built only
  when `ids` hold that token."""
  unk = codec.tokenizer.unk_token_id
  if unk is None or unk not in ids:
    return 0
  return len(codec.unknown_words(text()))


def oracle_turns(env: Environment, codec, epsilon: float = 0.0, seed: int = 0):
  """A `scripted` source for `collect`: each row's oracle action as text ids plus end of turn.

  With `epsilon > 0` the demonstrator is noisy: at each step, with probability `epsilon`, it takes a
  uniformly random well-formed action instead (row `r` of call `c` draws from the key
  `split(fold_in(key(seed), c), B)[r]`), as an imperfect human or model demonstrator would; SFT on
  such data gives a competent but unreliable policy."""
  if not 0.0 <= epsilon <= 1.0:
    raise ValueError(f"epsilon must be in [0, 1], got {epsilon}.")
  if is_host(env):
    return _host_oracle_turns(env, codec, epsilon, seed)

  @jax.jit
  def choose(states, key):
    b = states.step.shape[0]
    keys = jax.random.split(key, b)
    best = jax.vmap(env.oracle)(states)
    noise = jax.vmap(lambda st, k: random_action(env, st, k))(states, keys)
    explore = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)) < epsilon)(keys)
    return jax.tree.map(lambda a, n: jnp.where(
        explore.reshape(explore.shape + (1,) * (a.ndim - 1)), n, a), best, noise)

  stop = list(codec.stop_token_ids[:1])
  calls = [0]

  def turns(states):
    actions = to_numpy(choose(states, jax.random.fold_in(jax.random.key(seed), calls[0])))
    calls[0] += 1
    encode = lambda action: codec.tokenizer.encode(codec.format_action(action),
                                                   add_special_tokens=False)
    return [encode(row(actions, r)) + stop for r in range(len(actions.tool))]

  return turns



def _host_oracle_turns(env, codec, epsilon: float, seed: int):
  """`oracle_turns` of a host environment: each active row's `oracle()` text (through its pool),
  or with probability `epsilon` its `random_action(seed)`, encoded with the end of turn. A row
  without an action writes an empty turn."""
  calls = [0]

  def turns(states: _HostStates):
    rows = np.nonzero(states.active)[0]
    # Row r's slip at call c: a draw of Random(seed, c, r); its random action a function of it.
    rng = np.random.default_rng([seed, calls[0]])
    draws, seeds = rng.random(len(states.active)), rng.integers(0, 2**31, len(states.active))
    calls[0] += 1
    slip = [int(r) for r in rows if draws[r] < epsilon]
    texts = states.pool.oracle([int(r) for r in rows if draws[r] >= epsilon])
    if slip:
      texts.update(states.pool.random_actions({r: int(seeds[r]) for r in slip}))
    return [codec.encode_action(texts[r]) if texts.get(r) else []
            for r in range(len(states.active))]

  return turns
