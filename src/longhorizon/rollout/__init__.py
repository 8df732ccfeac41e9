"""The multi-turn rollout loop (host loop over the KV-cached sampler and batched environments) and
turn-by-turn rendering of recorded episodes. Rewards are the environment's `RewardSpec`
(`envs/rewards.py`)."""

from longhorizon.rollout.collect import (BRANCH_POINTS, RolloutConfig, RolloutStats, collect,
                                         collect_recovery, merge_stats, oracle_turns)
from longhorizon.rollout.multihost import allgather_rows, collect_across_processes, process_share
from longhorizon.rollout.recovery import RECOVERY_FROM, RecoveryPool, RecoveryStarts
from longhorizon.rollout.render import render_episode
from longhorizon.rollout.versions import env_version, reward_version

__all__ = ["BRANCH_POINTS", "RolloutConfig", "RolloutStats", "collect", "collect_recovery",
           "merge_stats", "oracle_turns", "RECOVERY_FROM", "RecoveryPool", "RecoveryStarts",
           "render_episode", "collect_across_processes", "allgather_rows", "process_share",
           "env_version", "reward_version"]
