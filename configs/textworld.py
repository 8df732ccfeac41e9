"""TextWorld quests (a host environment, `envs/textworld_games.py`): SFT on walkthroughs, then RL.

  python experiments/prepare_textworld.py --config=configs/textworld.py   # once: the games
  python experiments/train.py --config=configs/textworld.py --workdir=/tmp/lh_textworld

Needs the `[textworld]` extra (`pip install -e .[textworld]`). The policy is the small default
decoder (2 layers, d=128) over a word-level tokenizer built from the games' vocabulary. Games are
generated offline by TextWorld's own generator and cached under `$LONGHORIZON_DATA/textworld/`
(coin games about 1 s of CPU each: the 2096 games of this config took 24.5 minutes on two
processes with the prepare script, resumable; a game missing from the cache is generated on its
first reset). Coin-collector quests of length 4 (three moves and `take coin`; the objective
describes the route in varied words, e.g. "take a trip east ... venture north"), train / test
games disjoint; the warm start is SFT on noisy walkthrough episodes (`sft.demo_epsilon`: a random
admissible command instead of the walkthrough's), then RL.

Variants: `configs/textworld.py:smoke` (a few updates, for tests).
"""

import os

from longhorizon.studies import sweeps

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")


def get_config(arg=None):
  config = sweeps.config_module(_DEFAULT).get_config()
  config.num_updates = 40
  config.env.name = "textworld"
  config.env.params = {"family": "coin", "quest_length": 4, "nb_rooms": 8,
                       "ood_quest_length": 8, "ood_nb_rooms": 16}
  config.env.max_steps = 8
  config.tasks.train_size = 2048  # distinct games: 512 were memorised (see docs/notes/issue-17.md)
  config.tasks.test_size = 32
  config.tasks.ood_size = 16
  # GiGPO: rollouts of one game share their first observation (and rooms recur), so the step-level
  # groups compare actions taken in the same state; GRPO at lr 3e-4 made the policy worse.
  config.algorithm.name = "gigpo"
  config.rollout.num_tasks = 16
  config.rollout.group_size = 8
  config.rollout.context_length = 640  # the prompt and 6-7 turns: room to recover from a wrong move
  config.rollout.turn_tokens = 8
  config.optim.learning_rate = 1e-4
  config.optim.minibatches = 4
  # Many distinct games once rather than a few many times (a few were memorised).
  config.sft.steps = 12
  config.sft.episodes = 1024
  config.sft.minibatches = 32
  config.sft.learning_rate = 1e-3
  config.sft.demo_epsilon = 0.2
  # TextWorld's intermediate score (one point per move along the route) as milestone rewards: with
  # success alone, 8 tasks x 8 rollouts from a 0.14 warm start gave mostly all-fail groups and no
  # learning in 18 updates (every episode a timeout).
  config.reward.milestone = 0.5
  config.eval.num_tasks = 32
  config.eval.k = 4
  config.checkpoint_every = 5
  config.pool.backend = "process"
  config.pool.workers = 2
  config.pool.timeout_s = 60.0  # the first reset of a game generates and compiles it
  if arg == "smoke":
    config.num_updates = 2
    config.tasks.train_size = 8
    config.tasks.test_size = 4
    config.tasks.ood_size = 2
    config.rollout.num_tasks = 2
    config.rollout.group_size = 2
    config.sft.steps = 2
    config.sft.episodes = 4
    config.sft.minibatches = 2
    config.eval.num_tasks = 4
    config.eval.k = 1
  return config
