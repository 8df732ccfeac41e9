"""`EpisodeBuffer`: the host record of `B` episodes in progress, written turn by turn by `collect`.

It owns the arrays of the `EpisodeBatch` being filled (NumPy, written in place) and the little
bookkeeping the loop needs besides them; `finish` composes the rewards and returns the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from longhorizon.core.episode import EpisodeBatch, Termination, empty
from longhorizon.envs.action_parts import ANSWER
from longhorizon.envs.types import ErrorCode, TimeStep
from longhorizon.envs.rewards import RewardSpec, compose_rewards

__all__ = ["EpisodeBuffer"]


@dataclasses.dataclass
class EpisodeBuffer:
  """`B` episodes being collected. Shapes: `L` tokens (context budget), `S` environment steps."""
  batch: EpisodeBatch  # token, step and outcome fields, filled in place (starts as `empty`)
  end: np.ndarray  # [B] int32 tokens written per row (the next free position)
  done: np.ndarray  # [B] bool, the row takes no more turns
  next_anchor: np.ndarray  # [B] uint32 anchor of the state each row's next action is taken in
  invalid: np.ndarray  # [B, S] bool, the step's action was malformed or rejected
  unauthorized: np.ndarray  # [B, S] bool, the step's call was forbidden (ErrorCode.NOT_ALLOWED)
  faulted: np.ndarray  # [B, S] bool, the step met a recoverable injected fault (not an env error)
  looped: np.ndarray  # [B, S] bool, the loop detector fired at the step
  num_milestones: int  # M: bits of the `milestones` bitmask
  env_reward: np.ndarray | None = None  # [B, S] a host environment's own step rewards

  @classmethod
  def start(cls, prompts: list[list[int]], context_length: int, max_steps: int,
            anchor: np.ndarray, num_milestones: int) -> "EpisodeBuffer":
    """Rows holding `prompts[r]` (turn -1, no loss); `anchor` `[B]` of the initial states."""
    b = len(prompts)
    batch = empty(b, context_length, max_steps)
    end = np.array([len(p) for p in prompts], np.int32)
    for r, p in enumerate(prompts):
      batch.tokens[r, :len(p)] = p
    batch.attention_mask[np.arange(context_length)[None, :] < end[:, None]] = True
    steps = lambda: np.zeros((b, max_steps), bool)
    return cls(batch=batch, end=end, done=np.zeros((b,), bool), next_anchor=np.asarray(anchor),
               invalid=steps(), unauthorized=steps(), faulted=steps(), looped=steps(),
               num_milestones=num_milestones)

  def fork(self, parents: np.ndarray, steps: np.ndarray) -> "EpisodeBuffer":
    """Branch rows: row `i` copies row `parents[i]` up to the start of its step `steps[i]` (the
    tokens before that turn's first policy token, the records of the steps before), with loss_mask
    0 and behaviour log-probs 0 on the copies (they are the parent's samples); it takes step
    `steps[i]` next, from the parent's state there."""
    parents, steps = np.asarray(parents, np.int64), np.asarray(steps, np.int64)
    src = self.batch
    starts = np.array([self.turn_start(p, t) for p, t in zip(parents, steps)], np.int32)
    copy = lambda x: np.asarray(x)[parents].copy()
    batch = src.replace(**{name: copy(getattr(src, name)) for name in _ROW_FIELDS})
    token_kept = np.arange(batch.tokens.shape[1])[None, :] < starts[:, None]
    step_kept = np.arange(batch.step_mask.shape[1])[None, :] < steps[:, None]
    for name in _TOKEN_FIELDS:
      x = getattr(batch, name)
      x[~token_kept] = -1 if name == "turn" else 0
    batch.loss_mask[:] = False
    batch.behavior_logprobs[:] = 0.0
    batch.token_version[:] = -1
    for name in _STEP_FIELDS:
      getattr(batch, name)[~step_kept] = -1 if name == "oracle_match" else 0
    b = len(parents)
    per_step = {name: copy(getattr(self, name)) & step_kept for name in
                ("invalid", "unauthorized", "faulted", "looped")}
    env_reward = (None if self.env_reward is None
                  else np.where(step_kept, copy(self.env_reward), 0.0).astype(np.float32))
    return EpisodeBuffer(batch=batch, end=starts, done=np.zeros((b,), bool),
                         next_anchor=np.asarray(src.anchor)[parents, steps], **per_step,
                         num_milestones=self.num_milestones, env_reward=env_reward)

  def take(self, rows: np.ndarray) -> "EpisodeBuffer":
    """The buffer of rows `rows` (indices, repeats allowed), every array copied."""
    rows = np.asarray(rows, np.int64)
    per_row = lambda x: None if x is None else np.asarray(x)[rows].copy()
    batch = self.batch.replace(**{name: per_row(getattr(self.batch, name)) for name in _ROW_FIELDS})
    return dataclasses.replace(
        self, batch=batch, end=per_row(self.end),
        done=per_row(self.done), next_anchor=per_row(self.next_anchor),
        invalid=per_row(self.invalid), unauthorized=per_row(self.unauthorized),
        faulted=per_row(self.faulted), looped=per_row(self.looped),
        env_reward=per_row(self.env_reward))

  @classmethod
  def concat(cls, parts: list["EpisodeBuffer"]) -> "EpisodeBuffer":
    """One buffer holding the rows of `parts` in order (`parts[0]`'s rows first): every array of
    the batch (its `reward_components` and `routing` included) and every per-row array (`end`,
    `done`, `next_anchor`, `invalid`, `unauthorized`, `faulted`, `looped`, `env_reward` unless
    None) concatenated along its first axis, into new arrays.

    Raises:
      ValueError if `parts` is empty, or if a part differs from `parts[0]` in context length `L`,
      step slots `S`, `num_milestones`, whether it holds `env_reward`, its reward component names or
      its routing (`None` or its `[layers, k]`).
    """
    if not parts:
      raise ValueError("EpisodeBuffer.concat needs at least one buffer.")
    _check_compatible(parts)
    cat = lambda *xs: np.concatenate([np.asarray(x) for x in xs])
    batch = jax.tree.map(cat, *[p.batch for p in parts])
    per_row = {f.name: None if getattr(parts[0], f.name) is None
               else cat(*[getattr(p, f.name) for p in parts])
               for f in dataclasses.fields(cls) if f.name not in ("batch", "num_milestones")}
    return cls(batch=batch, num_milestones=parts[0].num_milestones, **per_row)

  def turn_start(self, r: int, t: int) -> int:
    """The position of row `r`'s first policy token of step `t` (where that turn's prefix ends)."""
    at = np.flatnonzero(self.batch.loss_mask[r] & (self.batch.turn[r] == t))
    if not len(at):
      raise ValueError(f"row {r} has no policy token at step {t}: it cannot branch there.")
    return int(at[0])

  def budgets(self, turn_tokens: int) -> np.ndarray:
    """`[B]` int32 tokens each row may sample this turn: `turn_tokens`, less if the context ends
    sooner (one slot stays free for an end of turn)."""
    return np.minimum(turn_tokens, self.batch.context_length - self.end - 1).astype(np.int32)

  def write_turn(self, t, active, tokens, logprobs, lengths, version: int = 0) -> int:
    """Appends turn `t` (an int, or `[B]` per row) of each `active` row: `tokens[r, :lengths[r]]`
    as sampled tokens (loss 1, behaviour log-probs `logprobs[r, :lengths[r]]`, sampled by policy
    `version`). Returns the number of tokens written."""
    written, t = 0, _per_row(t, len(active))
    for r in np.nonzero(active)[0]:
      k = int(lengths[r])
      if k:
        self._write(r, t[r], tokens[r, :k], logprobs[r, :k], version)
        written += k
    return written

  def append_observation(self, r: int, t: int, ids) -> None:
    """Appends `ids` (an observation, perhaps after a forced end of turn) to row `r`: loss 0."""
    self._write(r, t, ids)

  def _write(self, r, t, ids, logprobs=None, version: int = 0):
    s = slice(self.end[r], self.end[r] + len(ids))
    out = self.batch
    out.tokens[r, s] = ids
    out.turn[r, s] = t
    out.attention_mask[r, s] = True
    if logprobs is not None:
      out.loss_mask[r, s] = True
      out.behavior_logprobs[r, s] = logprobs
      out.token_version[r, s] = version
    self.end[r] += len(ids)

  def cut(self, r: int, ids, turns) -> dict:
    """Starts a new context segment of row `r` (`rollout/context.py`): returns its token fields
    so far (`{name: [L] copy}`), then clears them and writes `ids` as the row's new context, with
    step labels `turns` (`-1` for the prompt), loss 0."""
    out = self.batch
    kept = {name: np.array(getattr(out, name)[r]) for name in _TOKEN_FIELDS}
    for name in _TOKEN_FIELDS:
      getattr(out, name)[r] = _TOKEN_FILL.get(name, 0)
    n = len(ids)
    out.tokens[r, :n], out.turn[r, :n], out.attention_mask[r, :n] = ids, turns, True
    self.end[r] = n
    return kept

  def record_step(self, t, active, ts: TimeStep, env_reward=None) -> np.ndarray:
    """Records environment step `t` (an int, or `[B]` per row) of the `active` rows from the host
    time step `ts` (`[B]` leaves) and, for a host environment, its own step rewards `env_reward`
    (`[B]`); the rows it ended are done, with their outcome. Returns those rows (`[B]` bool)."""
    rows, out = np.nonzero(active)[0], self.batch
    t = _per_row(t, len(active))[rows]
    if env_reward is not None:
      if self.env_reward is None:
        self.env_reward = np.zeros(out.step_mask.shape, np.float32)
      self.env_reward[rows, t] = np.asarray(env_reward)[rows]
    out.step_mask[rows, t] = True
    out.anchor[rows, t] = self.next_anchor[rows]
    bits = np.arange(self.num_milestones, dtype=np.int32)
    out.milestones[rows, t] = (ts.milestones[rows].astype(np.int32) << bits).sum(-1)
    out.cost[rows, t] = ts.cost[rows]
    if getattr(ts, "latency", None) is not None:
      out.latency[rows, t] = ts.latency[rows]
    out.violation[rows, t] = ts.violation[rows]
    out.env_error[rows, t] = ts.env_error[rows]
    self.invalid[rows, t] = ts.invalid_action[rows]
    self.unauthorized[rows, t] = ts.observation["error"][rows] == ErrorCode.NOT_ALLOWED
    self.faulted[rows, t] = (ts.fault[rows] != 0) & ~ts.env_error[rows]
    self.looped[rows, t] = ts.loop[rows]
    self.next_anchor = np.asarray(ts.anchor)
    finished = active & ts.done
    rows = np.nonzero(finished)[0]
    self.done[rows] = True
    out.success[rows] = ts.success[rows]
    out.terminated[rows] = ts.terminated[rows] & ~ts.env_error[rows]
    out.truncated[rows] = ~out.terminated[rows]
    out.termination[rows] = _termination(ts)[rows]
    return finished

  def record_oracle(self, t, active, match) -> None:
    """Writes `match [B]` (1: the step's action was the oracle's, 0: not) at step `t` (an int or
    `[B]`) of the `active` rows."""
    rows = np.nonzero(active)[0]
    self.batch.oracle_match[rows, _per_row(t, len(active))[rows]] = np.asarray(match)[rows]

  def label_parts(self, r: int, start: int, parts) -> None:
    """Writes the action parts (`envs.action_parts`) of row `r`'s turn written at `start`."""
    self.batch.action_part[r, start:start + len(parts)] = parts

  def label_answers(self) -> None:
    """Marks every policy token of each terminated episode's last step as the final answer."""
    out = self.batch
    last = out.step_mask.sum(-1) - 1
    answer = (out.loss_mask & (out.turn == last[:, None]) & out.terminated[:, None]
              & (last[:, None] >= 0))
    out.action_part[answer] = ANSWER

  def stop(self, r: int, kind: Termination) -> None:
    """Ends row `r` as truncated by the loop (`TIMEOUT` or `CONTEXT_OVERFLOW`)."""
    self.done[r] = True
    self.batch.truncated[r] = True
    self.batch.termination[r] = kind

  def finish(self, reward: RewardSpec, **episode) -> EpisodeBatch:
    """The finished `EpisodeBatch`: rewards composed by `reward`, positions, step counts, and the
    per-episode labels in `episode` (`[B]` arrays: group, versions, seeds)."""
    out = self.batch
    components = compose_rewards(reward, step_mask=out.step_mask, milestones=out.milestones,
                                 cost=out.cost, violation=out.violation, invalid=self.invalid,
                                 success=out.success, num_milestones=self.num_milestones,
                                 env_reward=self.env_reward)
    b, length = out.tokens.shape
    return out.replace(
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy(),
        num_steps=out.step_mask.sum(-1).astype(np.int32), rewards=components.pop("step_rewards"),
        score=components.pop("score"), reward_components=components, **episode)

  def episode_info(self) -> dict:
    """Per-episode facts for evaluation (`[B]` arrays; see `RolloutStats.episode_info`)."""
    return {"tool_calls": self.batch.step_mask.sum(-1).astype(np.int32),
            "invalid_actions": self.invalid.sum(-1),
            "unauthorized": self.unauthorized.sum(-1).astype(np.int32),
            "faulted": self.faulted.any(-1), "loop": self.looped.any(-1)}


def _per_row(t, b: int) -> np.ndarray:
  """`[B]` int step index of each row from an int or a `[B]` array."""
  return np.broadcast_to(np.asarray(t, np.int64), (b,))


# What `fork` copies of a parent row: every per-row field of the batch being filled.
_TOKEN_FIELDS = ("tokens", "positions", "attention_mask", "loss_mask", "turn", "behavior_logprobs",
                 "action_part", "token_version")
_TOKEN_FILL = {"turn": -1, "token_version": -1}  # the other token fields are 0 on padding
_STEP_FIELDS = ("rewards", "step_mask", "anchor", "milestones", "cost", "latency", "violation",
                "env_error", "oracle_match")
_ROW_FIELDS = _TOKEN_FIELDS + _STEP_FIELDS + (
    "group", "success", "terminated", "truncated", "termination", "num_steps", "score",
    "policy_version", "env_version", "reward_version", "env_seed", "task_seed", "sampling_seed",
    "parent", "branch_step", "segment_of")


def _check_compatible(parts: list[EpisodeBuffer]) -> None:
  """Raises a ValueError naming the first property in which a buffer of `parts` differs from
  `parts[0]` (see `EpisodeBuffer.concat`)."""
  properties = {
      "context_length (L, rollout.context_length)": lambda p: p.batch.context_length,
      "max_steps (S, rollout.max_steps)": lambda p: p.batch.max_steps,
      "num_milestones (the environment's)": lambda p: p.num_milestones,
      "env_reward (held by host-environment buffers only)": lambda p: p.env_reward is not None,
      "reward_components names": lambda p: sorted(p.batch.reward_components),
      "routing [layers, k] (None for a dense policy)":
          lambda p: None if p.batch.routing is None else np.shape(p.batch.routing)[2:],
  }
  for name, value in properties.items():
    want = value(parts[0])
    for i, part in enumerate(parts[1:], start=1):
      if value(part) != want:
        raise ValueError(f"EpisodeBuffer.concat: buffer {i} has {name} = {value(part)!r} but "
                         f"buffer 0 has {want!r}; concatenate only buffers collected with one "
                         f"environment and one RolloutConfig.")


def _termination(ts: TimeStep) -> np.ndarray:
  """`[B]` int32 `Termination` of rows whose episode `ts` ended, by priority: an environment error,
  a safety stop, a success, a failure; else a truncation by the environment (its step limit or
  loop detector), `TIMEOUT`."""
  return np.select([ts.env_error, ts.violation, ts.success, ts.terminated],
                   [Termination.ENV_ERROR, Termination.SAFETY_STOP, Termination.SUCCESS,
                    Termination.FAILURE], Termination.TIMEOUT).astype(np.int32)
