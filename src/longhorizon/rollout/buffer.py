"""`EpisodeBuffer`: the host record of `B` episodes in progress, written turn by turn by `collect`.

It owns the arrays of the `EpisodeBatch` being filled (NumPy, written in place) and the little
bookkeeping the loop needs besides them; `finish` composes the rewards and returns the batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from longhorizon.core.episode import EpisodeBatch, Termination, empty
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
  unauthorized: np.ndarray  # [B] int32 forbidden calls (ErrorCode.NOT_ALLOWED answers)
  faulted: np.ndarray  # [B] bool, saw a recoverable injected fault (not an env error)
  looped: np.ndarray  # [B] bool, the loop detector fired
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
    return cls(batch=batch, end=end, done=np.zeros((b,), bool), next_anchor=np.asarray(anchor),
               invalid=np.zeros((b, max_steps), bool), unauthorized=np.zeros((b,), np.int32),
               faulted=np.zeros((b,), bool), looped=np.zeros((b,), bool),
               num_milestones=num_milestones)

  def budgets(self, turn_tokens: int) -> np.ndarray:
    """`[B]` int32 tokens each row may sample this turn: `turn_tokens`, less if the context ends
    sooner (one slot stays free for an end of turn)."""
    return np.minimum(turn_tokens, self.batch.context_length - self.end - 1).astype(np.int32)

  def write_turn(self, t: int, active, tokens, logprobs, lengths) -> int:
    """Appends turn `t` of each `active` row: `tokens[r, :lengths[r]]` as sampled tokens (loss 1,
    behaviour log-probs `logprobs[r, :lengths[r]]`). Returns the number of tokens written."""
    written = 0
    for r in np.nonzero(active)[0]:
      k = int(lengths[r])
      if k:
        self._write(r, t, tokens[r, :k], logprobs[r, :k])
        written += k
    return written

  def append_observation(self, r: int, t: int, ids) -> None:
    """Appends `ids` (an observation, perhaps after a forced end of turn) to row `r`: loss 0."""
    self._write(r, t, ids)

  def _write(self, r, t, ids, logprobs=None):
    s = slice(self.end[r], self.end[r] + len(ids))
    out = self.batch
    out.tokens[r, s] = ids
    out.turn[r, s] = t
    out.attention_mask[r, s] = True
    if logprobs is not None:
      out.loss_mask[r, s] = True
      out.behavior_logprobs[r, s] = logprobs
    self.end[r] += len(ids)

  def record_step(self, t: int, active, ts: TimeStep, env_reward=None) -> np.ndarray:
    """Records environment step `t` of the `active` rows from the host time step `ts` (`[B]`
    leaves) and, for a host environment, its own step rewards `env_reward` (`[B]`); the rows it
    ended are done, with their outcome. Returns those rows (`[B]` bool)."""
    rows, out = np.nonzero(active)[0], self.batch
    if env_reward is not None:
      if self.env_reward is None:
        self.env_reward = np.zeros(out.step_mask.shape, np.float32)
      self.env_reward[rows, t] = np.asarray(env_reward)[rows]
    out.step_mask[rows, t] = True
    out.anchor[rows, t] = self.next_anchor[rows]
    bits = np.arange(self.num_milestones, dtype=np.int32)
    out.milestones[rows, t] = (ts.milestones[rows].astype(np.int32) << bits).sum(-1)
    out.cost[rows, t] = ts.cost[rows]
    out.violation[rows, t] = ts.violation[rows]
    out.env_error[rows, t] = ts.env_error[rows]
    self.invalid[rows, t] = ts.invalid_action[rows]
    self.unauthorized[rows] += (ts.observation["error"][rows] == ErrorCode.NOT_ALLOWED)
    self.faulted[rows] |= (ts.fault[rows] != 0) & ~ts.env_error[rows]
    self.looped[rows] |= ts.loop[rows]
    self.next_anchor = np.asarray(ts.anchor)
    finished = active & ts.done
    rows = np.nonzero(finished)[0]
    self.done[rows] = True
    out.success[rows] = ts.success[rows]
    out.terminated[rows] = ts.terminated[rows] & ~ts.env_error[rows]
    out.truncated[rows] = ~out.terminated[rows]
    out.termination[rows] = _termination(ts)[rows]
    return finished

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
            "invalid_actions": self.invalid.sum(-1), "unauthorized": self.unauthorized,
            "faulted": self.faulted, "loop": self.looped}


def _termination(ts: TimeStep) -> np.ndarray:
  """`[B]` int32 `Termination` of rows whose episode `ts` ended, by priority: an environment error,
  a safety stop, a success, a failure; else a truncation by the environment (its step limit or
  loop detector), `TIMEOUT`."""
  return np.select([ts.env_error, ts.violation, ts.success, ts.terminated],
                   [Termination.ENV_ERROR, Termination.SAFETY_STOP, Termination.SUCCESS,
                    Termination.FAILURE], Termination.TIMEOUT).astype(np.int32)
