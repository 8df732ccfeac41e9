"""Context modes at a horizon the context cannot hold (issue 20, point 1).

pointer_chain with N = 32 hops (33 actions) in a 128-token context: `full` overflows after about
13 steps, so even the oracle cannot finish; `window` keeps the prompt and the last 2 turns;
`summary` restates the task from where the chain stands ("start K hops H", the environment's
`state_text`); `policy` has the policy write that summary itself as a trained turn. Same warm
start recipe (SFT on noisy oracle episodes collected in the mode's own
contexts), same GRPO budget.

    python experiments/train.py --config=configs/context_modes.py:summary --workdir=DIR
    python experiments/train.py --config=configs/context_modes.py:summary,1 --workdir=DIR  # seed 1

The variant is `MODE`, `MODE,SEED` or `MODE,SEED,EVERY`: with EVERY > 0 a new segment starts after
every EVERY steps (and at most 36 // EVERY + 1 segments), else only when the context is full.
Results: `docs/context_modes.md`.
"""

import importlib.util
import os

MODES = ("full", "window", "summary", "policy")  # policy: the summary written by the policy
HOPS = 32
KEYS = 34


def _default():
  spec = importlib.util.spec_from_file_location(
      "default_config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config(arg="summary"):
  mode, _, rest = (arg or "summary").partition(",")
  seed, _, every = rest.partition(",")
  if mode not in MODES:
    raise ValueError(f"unknown context mode {mode!r}; use one of {MODES} (optionally ',SEED').")
  config = _default()
  config.unlock()
  config.seed = int(seed or 0)
  config.env.params.horizon = HOPS
  # 34 keys (the fewest a 32-hop chain allows, with ood chains as long): with the default 2 x 64 + 2
  # = 130 keys, 64 demonstrations show each key too rarely for the policy to copy it reliably (the
  # first runs' warm start copied wrong keys; docs/context_modes.md).
  config.env.params.ood_horizon = HOPS
  config.env.params.num_keys = KEYS
  config.env.max_steps = HOPS + 4
  config.rollout.context_length = 128
  config.rollout.turn_tokens = 4
  config.rollout.num_tasks = 8
  config.rollout.group_size = 8
  config.num_updates = 36
  config.sft.demo_epsilon = 0.02
  config.sft.steps = 300  # the copy of each value into the next lookup emerges after ~60 steps
  config.sft.episodes = 64  # default.py's when the study was made (it is now 256)
  config.eval.num_tasks = 64
  config.eval.k = 2
  config.context.mode = "summary" if mode == "policy" else mode
  if mode == "policy":
    config.context.summary_by = "policy"
    config.context.summary_tokens = 8  # "start K hops H" and the end of turn fit in 6
  config.context.keep = 2
  config.context.every = int(every or 0)
  config.context.segments = (config.env.max_steps // config.context.every + 1
                             if config.context.every else 5)
  config.checkpoint_every = 6
  config.progress = False
  config.lock()
  return config
