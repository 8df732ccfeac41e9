"""Reward composition: the step rewards and episode score the learners train on.

The environment reports the components (success, first-time milestones, cost, invalid actions,
violations); this module composes them, in a fixed priority:

1. safety gate first: an episode with a violation is a hard failure whatever else happened: all its
   positive reward is dropped and the violating step gets `violation` (negative);
2. then success (`success` on the last step), milestones (`milestone` per first-time milestone on the
   step it is reached), cost (`-cost * step cost`) and invalid actions (`-invalid` per malformed or
   rejected action).

The components are also returned per episode, so metrics report them separately.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["RewardConfig", "compose_rewards"]


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """The weights of `compose_rewards`; a hash of their values is recorded as `reward_version`
  (`rollout.reward_version`)."""
  success: float = 1.0  # reward for a verified success (on the last step)
  milestone: float = 0.0  # per milestone reached for the first time
  cost: float = 0.0  # weight of the environment's step cost (subtracted)
  invalid: float = 0.0  # penalty per malformed or rejected action
  violation: float = -1.0  # the whole episode's reward when a safety gate is hit (<= 0)

  def __post_init__(self):
    if self.violation > 0:
      raise ValueError(f"RewardConfig.violation must be <= 0 (a violation is a failure), got "
                       f"{self.violation}.")


def compose_rewards(config: RewardConfig, *, step_mask, milestones, cost, violation, invalid,
                    success, num_milestones: int) -> dict:
  """`{"step_rewards": [B, S], "score": [B], "reward/<component>": [B] ...}` (NumPy).

  Args:
    step_mask: `[B, S]` steps that happened. milestones: `[B, S]` int bitmask of first-time
    milestones. cost: `[B, S]`. violation, invalid: `[B, S]` bool. success: `[B]` bool.
  """
  step_mask = np.asarray(step_mask, bool)
  b, s = step_mask.shape
  bits = (np.asarray(milestones, np.int64)[..., None] >> np.arange(max(num_milestones, 1))) & 1
  milestone_count = bits.sum(-1).astype(np.float32) * step_mask
  last = np.maximum(step_mask.sum(-1) - 1, 0)
  success_steps = np.zeros((b, s), np.float32)
  success_steps[np.arange(b), last] = np.asarray(success, np.float32)
  parts = {
      "success": config.success * success_steps,
      "milestones": config.milestone * milestone_count,
      "cost": -config.cost * np.asarray(cost, np.float32) * step_mask,
      "invalid": -config.invalid * np.asarray(invalid, np.float32) * step_mask,
  }
  rewards = sum(parts.values()).astype(np.float32)
  violated = np.asarray(violation, bool) & step_mask
  hit = violated.any(-1)
  rewards = np.where(hit[:, None], np.where(violated, np.float32(config.violation), 0.0), rewards)
  out = {f"reward/{k}": np.where(hit, 0.0, v.sum(-1)).astype(np.float32) for k, v in parts.items()}
  out["reward/violation"] = np.where(hit, np.float32(config.violation), 0.0).astype(np.float32)
  out["step_rewards"] = (rewards * step_mask).astype(np.float32)
  out["score"] = out["step_rewards"].sum(-1).astype(np.float32)
  return out
