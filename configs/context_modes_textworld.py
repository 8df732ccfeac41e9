"""Context modes on TextWorld at quest length 16, in a context `full` cannot hold (issue 20, point 1).

Coin-collector quests of 16 actions (15 moves, then `take coin`) in worlds of 32 rooms: the
objective spells the whole route (about 250 tokens of the word-level tokenizer) and each turn adds
a command and a room description (about 50 tokens), so an episode needs about 1,100 tokens and a
640-token context holds the prompt and 6-7 turns. `window` keeps the prompt and the last 2 turns;
`summary` starts each segment from the environment's `state_text` (the objective without the
steps already scored, then the current room: what a game started from here would say; at the
start it is exactly the first observation); `offload` keeps room descriptions as notes the policy
can read back (`envs/notebook.py`; the context is never rewritten). Same warm start recipe (SFT
on noisy walkthrough episodes collected in the mode's own contexts), same GRPO budget.

    python experiments/prepare_textworld.py --config=configs/context_modes_textworld.py  # games
    python experiments/train.py --config=configs/context_modes_textworld.py:summary --workdir=DIR
    python experiments/train.py --config=configs/context_modes_textworld.py:summary,1 --workdir=DIR

The variant is `MODE`, `MODE,SEED` or `MODE,SEED,EVERY` (EVERY > 0: a new segment after every
EVERY steps, default 4; 0: only when the context is full). Needs the `[textworld]` extra.
Results: `docs/context_modes.md`.
"""

import os

from longhorizon.studies import sweeps

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")
MODES = ("full", "window", "summary", "offload")
QUEST = 16


def get_config(arg="summary"):
  mode, _, rest = (arg or "summary").partition(",")
  seed, _, every = rest.partition(",")
  if mode not in MODES:
    raise ValueError(f"unknown context mode {mode!r}; use one of {MODES} (optionally ',SEED').")
  config = sweeps.config_module(_DEFAULT).get_config()
  config.unlock()
  config.seed = int(seed or 0)
  config.env.name = "textworld"
  config.env.params = {"family": "coin", "quest_length": QUEST, "nb_rooms": 2 * QUEST,
                       "ood_quest_length": QUEST, "ood_nb_rooms": 2 * QUEST}
  config.env.max_steps = QUEST + 8
  # 512 SFT games, then 16 x 8 RL games: none seen twice (a few games were memorised in the
  # TextWorld learning run, docs/notes/issue-17.md)
  config.tasks.train_size = 640
  config.tasks.test_size = 32
  config.tasks.ood_size = 1  # (the ood split is not evaluated here)
  config.algorithm.name = "grpo"
  config.num_updates = 16
  config.rollout.num_tasks = 8
  config.rollout.group_size = 8
  config.rollout.context_length = 640
  config.rollout.turn_tokens = 8
  config.optim.learning_rate = 1e-4
  config.optim.minibatches = 4
  config.sft.steps = 12
  config.sft.episodes = 512
  config.sft.minibatches = 32
  config.sft.learning_rate = 1e-3
  config.sft.demo_epsilon = 0.2
  # one point per move along the route: with success alone a 16-step quest gives all-fail groups
  config.reward.milestone = 0.5
  config.eval.num_tasks = 32
  config.eval.k = 2
  config.eval.greedy = False
  config.context.mode = mode
  config.context.keep = 2
  config.context.every = 4 if every == "" else int(every)
  config.context.segments = (config.env.max_steps // config.context.every + 1
                             if config.context.every else 8)
  config.context.offload_words = 12
  config.context.offload_preview = 6
  config.checkpoint_every = 2
  config.pool.backend = "process"
  config.pool.workers = 2
  config.pool.timeout_s = 60.0  # a game missing from the cache is generated on its first reset
  config.progress = False
  config.lock()
  return config
