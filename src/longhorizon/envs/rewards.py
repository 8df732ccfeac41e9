"""The reward: one definition, `RewardSpec`, used by the environments' step rewards and by training.

Every weight is >= 0 and penalties are subtracted (one sign convention):

    step reward = success * [verified success] + milestone * [new milestones]
                  - cost * step cost - invalid * [malformed or rejected action]
                  - violation * [safety gate hit]

An environment's `TimeStep.reward` is that step reward with its own `reward_spec`
(`make(name, success=2.0)` or `make(name, reward=RewardSpec(...))`; `ToolCost` subtracts the cost
term). Training composes the same spec over whole episodes (`compose_rewards`, called by
`rollout.collect` with the environment's spec, which a training run builds from `config.reward`),
adding one episode-level rule a single step cannot apply, the safety gate: an episode with a
violation is a hard failure, all its positive reward is dropped and the violating step gets
`-violation`. Without a violation an episode's step rewards are exactly the environment's.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["RewardSpec", "compose_rewards", "reward_spec_of"]


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """The weights of the reward (all >= 0; penalties are subtracted)."""
  success: float = 1.0  # per verified success (on the last step)
  milestone: float = 0.0  # per milestone reached for the first time
  cost: float = 0.0  # weight of the environment's step cost (`TimeStep.cost`, e.g. `ToolCost`)
  invalid: float = 0.0  # penalty per malformed or rejected action
  violation: float = 1.0  # penalty of the violating step (the episode's only reward then)

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
          value) or value < 0:
        raise ValueError(f"RewardSpec.{field.name} must be a finite number >= 0 (penalties are "
                         f"subtracted), got {value!r}.")


def reward_spec_of(owner: str, reward: RewardSpec | None, reward_kwargs: dict) -> RewardSpec:
  """An environment's spec from its constructor's `reward=` or reward keyword arguments (not
  both); an unknown keyword raises a TypeError naming `owner` and the RewardSpec fields."""
  names = [f.name for f in dataclasses.fields(RewardSpec)]
  if reward is not None and reward_kwargs:
    raise ValueError("pass either reward=RewardSpec(...) or reward keyword arguments, not both.")
  unknown = sorted(set(reward_kwargs) - set(names))
  if unknown:
    raise TypeError(f"{owner}: unknown parameter(s) {unknown}; reward weights are the RewardSpec "
                    f"fields {names}.")
  return reward or RewardSpec(**reward_kwargs)


def compose_rewards(spec: RewardSpec, *, step_mask, milestones, cost, violation, invalid,
                    success, num_milestones: int, env_reward=None) -> dict:
  """`{"step_rewards": [B, S], "score": [B], "reward/<component>": [B] ...}` (NumPy).

  Args:
    step_mask: `[B, S]` steps that happened. milestones: `[B, S]` int bitmask of first-time
    milestones. cost: `[B, S]`. violation, invalid: `[B, S]` bool. success: `[B]` bool.
    env_reward: optional `[B, S]`, a host environment's own step rewards (`StepResult.reward`),
      added as the component `reward/env` (JAX environments have none).
  """
  step_mask = np.asarray(step_mask, bool)
  b, s = step_mask.shape
  bits = (np.asarray(milestones, np.int64)[..., None] >> np.arange(max(num_milestones, 1))) & 1
  milestone_count = bits.sum(-1).astype(np.float32) * step_mask
  last = np.maximum(step_mask.sum(-1) - 1, 0)
  success_steps = np.zeros((b, s), np.float32)
  success_steps[np.arange(b), last] = np.asarray(success, np.float32)
  parts = {
      "success": spec.success * success_steps,
      "milestones": spec.milestone * milestone_count,
      "cost": -spec.cost * np.asarray(cost, np.float32) * step_mask,
      "invalid": -spec.invalid * np.asarray(invalid, np.float32) * step_mask,
  }
  if env_reward is not None:
    parts["env"] = np.asarray(env_reward, np.float32) * step_mask
  rewards = sum(parts.values()).astype(np.float32)
  violated = np.asarray(violation, bool) & step_mask
  hit = violated.any(-1)
  penalty = np.float32(-spec.violation)
  rewards = np.where(hit[:, None], np.where(violated, penalty, 0.0), rewards)
  out = {f"reward/{k}": np.where(hit, 0.0, v.sum(-1)).astype(np.float32) for k, v in parts.items()}
  out["reward/violation"] = np.where(hit, penalty, 0.0).astype(np.float32)
  out["step_rewards"] = (rewards * step_mask).astype(np.float32)
  out["score"] = out["step_rewards"].sum(-1).astype(np.float32)
  return out
