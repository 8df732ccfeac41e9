"""The multi-turn rollout loop (host loop over the KV-cached sampler and batched environments),
reward composition, and turn-by-turn rendering of recorded episodes."""

from longhorizon.rollout.collect import RolloutConfig, RolloutStats, collect, oracle_turns
from longhorizon.rollout.multihost import allgather_rows, collect_across_processes, process_share
from longhorizon.rollout.render import render_episode
from longhorizon.rollout.rewards import RewardConfig, compose_rewards
from longhorizon.rollout.versions import env_version, reward_version

__all__ = ["RolloutConfig", "RolloutStats", "collect", "oracle_turns", "RewardConfig", "compose_rewards",
           "render_episode", "collect_across_processes", "allgather_rows", "process_share",
           "env_version", "reward_version"]
