"""SFT warm start -> trajectory DPO -> online RL in one run, on the main job's task (default.py).

Launch (one run; about 6 minutes on a 2-core CPU):

  python experiments/train.py --config=configs/sft_dpo_rl.py --workdir=/tmp/lh_sft_dpo_rl

The stages:
1. SFT on 64 noisy-demonstrator episodes for 80 steps (default.py's warm start until 2026-12-07,
   pinned here so that experiments/results/sft_dpo_rl/ reproduces);
2. DPO: 64 train tasks x 8 rollouts sampled with the warm-started policy, appended to the run's
   trajectory store (`<workdir>/trajectories/`, update 0) and read back; pairs of a successful and
   a failed rollout of one task (`dpo.level='trajectory'`), 20 passes of DPO with beta 0.1 plus
   the chosen episodes' NLL (RPO, `dpo.sft_weight`), against the warm start as reference;
3. GRPO as in default.py, for 56 updates: with the DPO stage's 512 episodes, the run samples
   the 7680 episodes of default.py's 60 RL updates (`eval.json["training_episodes"]`).

`eval.json` holds each stage's evaluation on the 128 test tasks: `warm_start_success_rate`,
`dpo_success_rate` (and the greedy ones) and the final `success_rate`, with the DPO stage's pairs
and last-pass metrics under `dpo`.

The comparison at equal episodes (RL alone vs SFT -> DPO -> RL, three seeds each; the sweep's
runs resume, 6 runs of about 6 minutes):

  python experiments/sweep.py --config=configs/sft_dpo_rl.py --workdir_root=OUT
  python experiments/sft_dpo_rl_report.py --root=OUT

The DPO stage's ablation (`:ablation`: no RL updates, seed 0, one run per DPO setting: plain DPO
at two learning rates, DPO + NLL at two betas, step-level DPO + NLL, and the NLL term alone with
beta 1e-6, which leaves the DPO term no gradient; 6 runs of about 2 minutes):

  python experiments/sweep.py --config=configs/sft_dpo_rl.py:ablation --workdir_root=OUT
  python experiments/sft_dpo_rl_report.py --root=OUT

Smoke variant (`:smoke`): default.py's smoke run with a 2-pass DPO stage on 4 tasks x 4 rollouts.
"""

import os

from longhorizon.studies import sweeps

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")

SEEDS = (0, 1, 2)
RL_UPDATES = 60  # default.py's RL budget, in updates of 16 tasks x 8 rollouts


def _check(arg):
  if arg not in (None, "", "smoke", "ablation"):
    raise ValueError(f"unknown config variant {arg!r} of configs/sft_dpo_rl.py; use 'smoke', "
                     "'ablation' or nothing.")


def dpo_updates(config) -> int:
  """The RL updates the DPO stage's episodes are worth (rounded up)."""
  per_update = config.rollout.num_tasks * config.rollout.group_size
  return -(-config.dpo.tasks * config.dpo.group_size // per_update)


def get_config(arg=None):
  _check(arg)
  default = sweeps.config_module(_DEFAULT)
  config = default.get_config("smoke" if arg == "smoke" else None)
  config.unlock()
  d = config.dpo
  d.steps = 20
  d.tasks = 64
  d.group_size = 8
  d.level = "trajectory"
  d.beta = 0.1
  d.sft_weight = 1.0
  d.learning_rate = 1e-3
  if arg == "smoke":
    d.steps, d.tasks, d.group_size = 2, 4, 4
  else:  # default.py's warm start when the study was made
    config.sft.episodes, config.sft.steps = default.SFT_UNTIL_2026_12_07
    config.num_updates = 0 if arg == "ablation" else RL_UPDATES - dpo_updates(config)
  config.lock()
  return config


def get_sweep(arg=None):
  """seeds 0, 1, 2 x (RL alone: no DPO stage, 60 updates; SFT -> DPO -> RL: 56 updates); the
  smoke sweep: both arms at seed 0 on the smoke config."""
  _check(arg)
  if arg == "smoke":
    return sweeps.product({"config.dpo.steps": [0, 2]}, {"config.seed": [0]})
  if arg == "ablation":
    return sweeps.product({
        "config.dpo.sft_weight": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        "config.dpo.beta": [0.1, 0.1, 0.1, 0.5, 0.1, 1e-6],
        "config.dpo.learning_rate": [1e-3, 1e-4, 1e-3, 3e-4, 1e-3, 1e-3],
        "config.dpo.level": ["trajectory"] * 4 + ["step", "trajectory"]})
  pipeline = get_config()
  arms = {"config.dpo.steps": [0, pipeline.dpo.steps],
          "config.num_updates": [RL_UPDATES, pipeline.num_updates]}
  return sweeps.product({"config.seed": list(SEEDS)}, arms)
