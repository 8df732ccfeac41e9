"""The multi-turn host loop: the KV-cached sampler against jitted, batched environments.

`collect` runs `N` tasks x `G` rollouts turn by turn:

    prefill(prompts) -> [decode a turn (until a stop token or the turn budget)
                         -> parse (host) -> env.step (jit + vmap, all rows at once)
                         -> render observations (host) -> extend(cache)] x until every row is done

and returns a token-exact `EpisodeBatch`: the ids are exactly those the policy saw and produced
(observations are tokenised on their own and appended; nothing is re-tokenised), `loss_mask` is 1
exactly on sampled tokens, `behavior_logprobs` are the sampler's. Rows finish at different times;
finished rows sample nothing (`decode(active=...)`) and append nothing.

When a turn hits its token budget without the stop token, the end-of-turn token is appended as a
non-sampled token (loss 0) before the observation, so the context always has well-formed turns.

Context budget: the cache holds `context_length` tokens. A row whose next observation plus one more
turn would not fit is stopped after its step and marked truncated (`CONTEXT_OVERFLOW`), not failed.
A row still running after `max_steps` steps is truncated (`TIMEOUT`).

Words of the prompts and observations that the tokenizer can only encode as its unknown token (a
gap in the environment's `vocabulary()`) are counted in `RolloutStats.unknown_words`, which lands
in the run's metrics as `rollout/unknown_words`: the policy sees `<unk>` there, although a scripted
oracle, acting on the state, still succeeds.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon import sampling as sampler
from longhorizon.core.episode import EpisodeBatch, Termination, empty
from longhorizon.envs import Action, Environment
from longhorizon.envs.testing import random_action
from longhorizon.envs.types import ErrorCode, to_numpy
from longhorizon.models import ModelConfig, prepare_decode_params
from longhorizon.rollout.rewards import RewardConfig, compose_rewards

__all__ = ["RolloutConfig", "RolloutStats", "collect", "oracle_turns"]


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

  def __post_init__(self):
    for name in ("group_size", "context_length", "max_steps", "turn_tokens"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}.")

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

  def as_dict(self) -> dict:
    total = self.generation_s + self.env_s + self.host_s
    return {"rollout/generation_s": self.generation_s, "rollout/env_s": self.env_s,
            "rollout/host_s": self.host_s, "rollout/sampled_tokens": self.sampled_tokens,
            "rollout/env_steps": self.env_steps, "rollout/unknown_words": self.unknown_words,
            "rollout/tokens_per_s": self.sampled_tokens / max(total, 1e-9),
            "rollout/env_steps_per_s": self.env_steps / max(total, 1e-9),
            "rollout/generation_frac": self.generation_s / max(total, 1e-9)}


@functools.lru_cache(maxsize=None)
def _env_fns(env: Environment):
  info = lambda s: dict(env.episode_info(s.task, s.inner),
                        difficulty=env.task_difficulty(s.task))
  return (jax.jit(jax.vmap(env.reset)), jax.jit(jax.vmap(env.step)), jax.jit(jax.vmap(info)))


def _bucket(n: int, minimum: int = 8) -> int:
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _unknown_count(codec, ids, text) -> int:
  """Words of `text()` (the text `ids` encode) that became the unknown token; `text` is built only
  when `ids` hold that token."""
  unk = codec.tokenizer.unk_token_id
  if unk is None or unk not in ids:
    return 0
  return len(codec.unknown_words(text()))


def _pad_rows(rows: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  tokens = np.zeros((len(rows), width), np.int32)
  lengths = np.zeros((len(rows),), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
    lengths[i] = len(r)
  return tokens, lengths


def collect(params, model_config: ModelConfig, env: Environment, codec, tasks: Any,
            env_keys: jax.Array, config: RolloutConfig, *, sampling_seed: int,
            reward: RewardConfig | None = None, policy_version: int = 0, task_seed: int = 0,
            group_offset: int = 0, row_offset: int = 0, env_version: int = 1,
            reward_version: int = 1, scripted=None,
            on_env_step=None) -> tuple[EpisodeBatch, RolloutStats]:
  """Runs `N` tasks x `G` rollouts and returns `(EpisodeBatch [N*G], RolloutStats)`.

  Args:
    params: policy parameters (`Transformer` params or `DecodeParams`).
    model_config: the policy's config.
    env: the (possibly wrapped) environment.
    codec: `env.codec(tokenizer, style)`; its tokenizer must be the policy's.
    tasks: `[N]` task pytree.
    env_keys: `[N]` PRNG keys of the environment's own randomness; the `G` rollouts of a task share
      its key (and its task), so they differ only by the policy's samples.
    config: `RolloutConfig`.
    sampling_seed: seed of the policy's sampling; row `r` samples with
      `fold_in(key(seed), row_offset + r)`.
    reward: how step rewards and the episode score are composed (default `RewardConfig()`).
    policy_version, env_version, reward_version, task_seed: recorded on every row.
    group_offset: added to the task index to form `group` labels (unique across batches).
    row_offset: index of this batch's first row in a larger batch it is a slice of (the share of
      one process, `rollout.multihost`): its rows then sample exactly as those rows of the whole.
    scripted: optional host function `(states) -> list of [B] token-id lists` that replaces the
      policy (e.g. `oracle_turns(env, codec)` for SFT data): its ids are written as the turns, with
      loss_mask 1 and behaviour log-prob 0; no model runs (`params` and `model_config` may be None).
    on_env_step: optional host function `(t, active)` called after every batched env step `t` with
      the `[B]` bool rows that stepped; its time counts as environment time (the async benchmark
      sleeps there to simulate tool latency).
  """
  reward = reward or RewardConfig()
  stats = RolloutStats()
  t0 = time.perf_counter()
  n = jax.tree.leaves(tasks)[0].shape[0]
  g, length, max_steps = config.group_size, config.context_length, config.max_steps
  b = n * g
  task_of_row = np.repeat(np.arange(n), g)
  reset_fn, step_fn, info_fn = _env_fns(env)
  rows_tasks = jax.tree.map(lambda a: jnp.asarray(a)[task_of_row], tasks)
  rows_keys = jnp.asarray(env_keys)[task_of_row]
  decode_params = None if scripted else prepare_decode_params(params, model_config)
  stop_ids = tuple(codec.stop_token_ids)
  rule = config.sampling(stop_ids)
  eot = stop_ids[0]

  start = time.perf_counter()
  states, _ = reset_fn(rows_keys, rows_tasks)
  states = jax.block_until_ready(states)
  stats.env_s += time.perf_counter() - start

  host_tasks = to_numpy(tasks)
  task_rows = [jax.tree.map(lambda a, i=i: a[i], host_tasks) for i in range(n)]
  prompts = [codec.render_prompt(task) for task in task_rows]
  stats.unknown_words += g * sum(_unknown_count(codec, ids, lambda task=task: codec.prompt_text(task))
                                 for ids, task in zip(prompts, task_rows))
  longest = max(len(p) for p in prompts)
  if longest + config.turn_tokens + 1 > length:
    raise ValueError(f"context_length={length} cannot hold the longest prompt ({longest} tokens) "
                     f"and one turn ({config.turn_tokens} tokens + end of turn); raise "
                     f"rollout.context_length or shorten the prompt.")
  out = empty(b, length, max_steps)
  tokens, loss_mask, turn_ids = out.tokens, out.loss_mask, out.turn
  logps, attention = out.behavior_logprobs, out.attention_mask
  end = np.zeros((b,), np.int32)
  for r in range(b):
    p = prompts[task_of_row[r]]
    tokens[r, :len(p)] = p
    end[r] = len(p)
  attention[np.arange(length)[None, :] < end[:, None]] = True

  start = time.perf_counter()
  cache = last_logits = None
  if not scripted:
    width = min(_bucket(longest), length)
    prompt_tokens, prompt_lengths = _pad_rows([prompts[task_of_row[r]] for r in range(b)], width)
    cache, last_logits = sampler.prefill(decode_params, model_config, prompt_tokens,
                                         prompt_lengths, length)
  stats.generation_s += time.perf_counter() - start
  row_keys = sampler.per_row_keys(sampling_seed, row_offset + np.arange(b))

  done = np.zeros((b,), bool)
  kind = np.zeros((b,), np.int32)
  step_fields = {k: getattr(out, k) for k in ("rewards", "step_mask", "anchor", "milestones",
                                               "cost", "violation", "env_error")}
  invalid = np.zeros((b, max_steps), bool)
  unauthorized = np.zeros((b,), np.int32)
  faulted = np.zeros((b,), bool)
  looped = np.zeros((b,), bool)
  success = np.zeros((b,), bool)
  terminated = np.zeros((b,), bool)
  truncated = np.zeros((b,), bool)
  env_rewards = np.zeros((b, max_steps), np.float32)
  step_success = np.zeros((b, max_steps), bool)
  num_milestones = env.num_milestones
  anchors_before = np.asarray(states.last.anchor)

  for t in range(max_steps):
    active = ~done
    if not active.any():
      break
    stats.turns += 1
    start = time.perf_counter()
    budgets = np.minimum(config.turn_tokens, length - end - 1).astype(np.int32)
    if scripted:
      out_tokens, out_logps, out_lengths, out_stopped = _scripted_turn(
          scripted(states), active, budgets, config.turn_tokens, stop_ids)
    else:
      result = sampler.decode(decode_params, model_config, cache, last_logits, row_keys, rule,
                              jnp.asarray(budgets), jnp.asarray(active))
      cache, last_logits = result.cache, result.last_logits
      out_tokens, out_logps, out_lengths, out_stopped = jax.device_get(
          (result.tokens, result.logprobs, result.lengths, result.stopped_by_stop_token))
    stats.generation_s += time.perf_counter() - start

    start = time.perf_counter()
    actions, messages = [], [""] * b
    for r in range(b):
      k = int(out_lengths[r]) if active[r] else 0
      if k:
        tokens[r, end[r]:end[r] + k] = out_tokens[r, :k]
        loss_mask[r, end[r]:end[r] + k] = True
        turn_ids[r, end[r]:end[r] + k] = t
        logps[r, end[r]:end[r] + k] = out_logps[r, :k]
        attention[r, end[r]:end[r] + k] = True
        end[r] += k
        stats.sampled_tokens += k
      if active[r]:
        action, _, messages[r] = codec.parse_action(codec.decode(out_tokens[r, :k]))
      else:
        action = Action.invalid(1, env.num_args)
      actions.append(action)
    batch_action = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *actions)
    stats.host_s += time.perf_counter() - start

    start = time.perf_counter()
    states, timesteps = step_fn(states, batch_action)
    ts = to_numpy(timesteps)
    if on_env_step is not None:
      on_env_step(t, active)
    stats.env_s += time.perf_counter() - start
    stats.env_steps += int(active.sum())

    start = time.perf_counter()
    rows = np.nonzero(active)[0]
    step_fields["step_mask"][rows, t] = True
    step_fields["anchor"][rows, t] = anchors_before[rows]
    step_fields["milestones"][rows, t] = (ts.milestones[rows].astype(np.int32)
                                          << np.arange(num_milestones, dtype=np.int32)).sum(-1)
    step_fields["cost"][rows, t] = ts.cost[rows]
    step_fields["violation"][rows, t] = ts.violation[rows]
    step_fields["env_error"][rows, t] = ts.env_error[rows]
    env_rewards[rows, t] = ts.reward[rows]
    invalid[rows, t] = ts.invalid_action[rows]
    unauthorized[rows] += (ts.observation["error"][rows] == ErrorCode.NOT_ALLOWED)
    faulted[rows] |= (ts.fault[rows] != 0) & ~ts.env_error[rows]
    looped[rows] |= ts.loop[rows]
    step_success[rows, t] = ts.success[rows]
    anchors_before = np.asarray(ts.anchor)
    finished = active & ts.done
    for r in np.nonzero(finished)[0]:
      done[r] = True
      success[r] = bool(ts.success[r])
      terminated[r] = bool(ts.terminated[r]) and not bool(ts.env_error[r])
      truncated[r] = not terminated[r]
      kind[r] = _termination(ts, r)
    # Observations for the rows that go on.
    extension = [[] for _ in range(b)]
    for r in np.nonzero(active & ~finished)[0]:
      ts_r = jax.tree.map(lambda a, r=r: a[r], ts)
      observation = list(codec.render_observation(ts_r, messages[r] or None))
      ids = ([] if out_stopped[r] else [eot]) + observation
      if end[r] + len(ids) + config.turn_tokens + 1 > length or t + 1 >= max_steps:
        done[r] = True
        truncated[r] = True
        kind[r] = Termination.TIMEOUT if t + 1 >= max_steps else Termination.CONTEXT_OVERFLOW
        continue
      text = lambda ts_r=ts_r, m=messages[r] or None: codec.observation_turn_text(ts_r, m)
      stats.unknown_words += _unknown_count(codec, observation, text)
      extension[r] = ids
      tokens[r, end[r]:end[r] + len(ids)] = ids
      turn_ids[r, end[r]:end[r] + len(ids)] = t
      attention[r, end[r]:end[r] + len(ids)] = True
      end[r] += len(ids)
    stats.host_s += time.perf_counter() - start
    if any(extension) and not scripted:
      start = time.perf_counter()
      ext_width = min(_bucket(max(len(e) for e in extension)), length)
      ext_tokens, ext_lengths = _pad_rows(extension, ext_width)
      cache, last_logits = sampler.extend(decode_params, model_config, cache, ext_tokens,
                                          ext_lengths, last_logits)
      stats.generation_s += time.perf_counter() - start

  start = time.perf_counter()
  num_steps = step_fields["step_mask"].sum(-1).astype(np.int32)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy()
  components = compose_rewards(reward, env_rewards=env_rewards, step_mask=step_fields["step_mask"],
                               milestones=step_fields["milestones"], cost=step_fields["cost"],
                               violation=step_fields["violation"], invalid=invalid,
                               success=success, num_milestones=num_milestones)
  batch = out.replace(
      positions=positions, rewards=components.pop("step_rewards"),
      group=(task_of_row + group_offset).astype(np.int32), success=success, terminated=terminated,
      truncated=truncated, termination=kind, num_steps=num_steps, score=components.pop("score"),
      policy_version=np.full((b,), policy_version, np.int32),
      env_version=np.full((b,), env_version, np.int32),
      reward_version=np.full((b,), reward_version, np.int32),
      env_seed=np.asarray(jax.random.key_data(rows_keys))[:, -1].astype(np.uint32),
      task_seed=np.full((b,), task_seed, np.uint32),
      sampling_seed=np.full((b,), sampling_seed, np.uint32),
      reward_components=components)
  stats.episodes = b
  info = {k: np.asarray(v) for k, v in to_numpy(info_fn(states)).items()}
  stats.episode_info = dict(info, tool_calls=num_steps, invalid_actions=invalid.sum(-1),
                            unauthorized=unauthorized, faulted=faulted, loop=looped)
  stats.host_s += time.perf_counter() - start
  return batch, stats


def _scripted_turn(turns, active, budgets, width, stop_ids):
  """A scripted turn in the layout `decode` returns (tokens, log-probs 0, lengths, stopped)."""
  b = len(active)
  tokens = np.zeros((b, width), np.int32)
  lengths = np.zeros((b,), np.int32)
  stopped = np.zeros((b,), bool)
  for r in np.nonzero(active)[0]:
    ids = list(turns[r])[:int(budgets[r])]
    tokens[r, :len(ids)] = ids
    lengths[r] = len(ids)
    stopped[r] = bool(ids) and ids[-1] in stop_ids
  return tokens, np.zeros((b, width), np.float32), lengths, stopped


def oracle_turns(env: Environment, codec, epsilon: float = 0.0, seed: int = 0):
  """A `scripted` source for `collect`: each row's oracle action as text ids plus end of turn.

  With `epsilon > 0` the demonstrator is noisy: at each step, with probability `epsilon`, it takes a
  uniformly random well-formed action instead (drawn from `fold_in(key(seed), call, row)`), as an
  imperfect human or model demonstrator would; SFT on such data gives a competent but unreliable
  policy."""
  if not 0.0 <= epsilon <= 1.0:
    raise ValueError(f"epsilon must be in [0, 1], got {epsilon}.")

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
    return [codec.tokenizer.encode(codec.format_action(jax.tree.map(lambda a, r=r: a[r], actions)),
                                   add_special_tokens=False) + stop
            for r in range(len(actions.tool))]

  return turns


def _termination(ts, r) -> int:
  if ts.env_error[r]:
    return Termination.ENV_ERROR
  if ts.violation[r]:
    return Termination.SAFETY_STOP
  if ts.success[r]:
    return Termination.SUCCESS
  if ts.terminated[r]:
    return Termination.FAILURE
  return Termination.TIMEOUT  # truncated by the environment's step limit or loop detector
