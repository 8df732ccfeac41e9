"""The async benchmark's length-bias setting: episodes that end at different lengths per batch.

    python experiments/benchmarks/async_vs_sync.py --config=configs/async_lengths.py --warm_start \
        --modes=sync,async:2:1,partial:2:1 --updates=24 --latency=pareto --latency_ms=20 \
        --latency_shape=1.2

GridWorld tasks whose shortest routes are 2 to 8 moves on a 6 x 6 grid (gridworld's N = 8
setting, `GridWorld.horizon_settings(8)`, with `min_length` 2), one task x 4 rollouts per batch,
and an SFT warm start, so a batch's episodes are about as long as its task's route and batches
differ in length. Rollouts are batched (every row of a batch waits for the slowest call of each
step), so in the async pipeline a long batch arrives later and staler than a short one: the
staleness filter's length bias is between batches, and this setting makes it visible (with
`configs/default.py:smoke`'s untrained policy every episode runs to its step limit).
"""

import os

from longhorizon.envs.gridworld import GridWorld
from longhorizon.studies import sweeps

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")


def get_config(arg=None):
  del arg
  config = sweeps.config_module(_DEFAULT).get_config()
  config.unlock()
  settings = GridWorld.horizon_settings(8)
  config.env.name = "gridworld"
  config.env.params = dict(settings["params"], min_length=2)
  config.env.max_steps = 10
  config.rollout.context_length = 48 + settings["turn_tokens"] * (config.env.max_steps + 1)
  config.rollout.num_tasks = 1
  config.rollout.group_size = 4
  config.optim.minibatches = 1
  config.tasks.train_size = 512
  config.tasks.test_size = 16
  config.tasks.ood_size = 8
  config.sft.steps = 60
  config.sft.episodes = 128
  config.sft.demo_epsilon = 0.1
  config.sft.learning_rate = 1e-3
  config.sft.minibatches = 8
  config.progress = False
  config.lock()
  return config
