"""The multi-turn rollout loop (host loop over the KV-cached sampler and batched environments) and
reward composition."""

from longhorizon.rollout.collect import RolloutConfig, RolloutStats, collect, oracle_turns
from longhorizon.rollout.rewards import RewardConfig, compose_rewards

__all__ = ["RolloutConfig", "RolloutStats", "collect", "oracle_turns", "RewardConfig", "compose_rewards"]
