"""Every RL algorithm on the main job, three seeds each: configs/default.py x algorithm x seed.

Launch (18 runs, one after another; about 6 minutes each on a 2-core CPU, per default.py):

  python experiments/sweep.py --config=configs/algorithm_sweep.py --workdir_root=/tmp/lh_algos

See the commands first (nothing runs), or run a subset by index:

  python experiments/sweep.py --config=configs/algorithm_sweep.py --workdir_root=/tmp/lh_algos \
      --dry_run
  python experiments/sweep.py --config=configs/algorithm_sweep.py --workdir_root=/tmp/lh_algos \
      --only=0,3

Smoke sweep (grpo and gigpo, seed 0, default.py's smoke config; a minute or two in all):

  python experiments/sweep.py --config=configs/algorithm_sweep.py:smoke --workdir_root=/tmp/lh_sw

How often the main job learns (`:grpo_seeds`: GRPO, the main job exactly, with `config.seed` 0-4;
the task suites keep `config.tasks.seed`, so every run is evaluated on the same 128 test tasks),
and its report (mean, 95% interval, how many runs meet default.py's claim):

  python experiments/sweep.py --config=configs/algorithm_sweep.py:grpo_seeds \
      --workdir_root=/tmp/lh_seeds
  python experiments/sweep_report.py --root=/tmp/lh_seeds

`:grpo_seeds_sft80` is the same sweep with default.py's warm start before 2026-12-07 (64
episodes x 80 SFT steps), which made experiments/results/main_job_seeds/sft_steps_80/.

One run by hand (what the sweep runs for run `algorithm.name=gigpo,seed=1`):

  python experiments/train.py --config=configs/algorithm_sweep.py \
      --workdir=/tmp/lh_algos/algorithm.name=gigpo,seed=1 \
      --config.algorithm.name=gigpo --config.seed=1

Result: `<workdir_root>/sweep.json` lists each run's status; each run's workdir holds `eval.json`
(`success_rate`, `warm_start_success_rate`, `greedy_success_rate` on 128 test tasks) and
`metrics.jsonl`. Expected: grpo, seed 0 reproduces default.py (sampled success about 0.26 -> >= 0.9
after 60 updates); the other algorithms share every hyperparameter with it (none is tuned per
algorithm), so this sweep measures them at GRPO's settings, and the seeds show the spread of each.
"""

import os

from longhorizon.studies import sweeps

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")

ALGORITHMS = ("grpo", "drgrpo", "rloo", "reinforce_pp", "gigpo", "ppo")
SEEDS = (0, 1, 2)


GRPO_SEEDS = (0, 1, 2, 3, 4)


def _check(arg):
  if arg not in (None, "", "smoke", "grpo_seeds", "grpo_seeds_sft80"):
    raise ValueError(f"unknown config variant {arg!r} of configs/algorithm_sweep.py; use 'smoke', "
                     "'grpo_seeds', 'grpo_seeds_sft80' or nothing.")


def get_config(arg=None):
  """default.py's config (its smoke variant for `:smoke`); the sweep sets algorithm and seed."""
  _check(arg)
  default = sweeps.config_module(_DEFAULT)
  config = default.get_config("smoke" if arg == "smoke" else None)
  if arg == "grpo_seeds_sft80":
    config.sft.episodes, config.sft.steps = default.SFT_UNTIL_2026_12_07
  return config


def get_sweep(arg=None):
  """algorithm.name x seed (6 x 3 = 18 runs); `smoke`: grpo and gigpo, seed 0; `grpo_seeds` (and
  `grpo_seeds_sft80`): grpo, seeds 0-4."""
  _check(arg)
  if arg == "smoke":
    return sweeps.product({"config.algorithm.name": ["grpo", "gigpo"]}, {"config.seed": [0]})
  if arg in ("grpo_seeds", "grpo_seeds_sft80"):
    return sweeps.product({"config.algorithm.name": ["grpo"]}, {"config.seed": list(GRPO_SEEDS)})
  return sweeps.product({"config.algorithm.name": list(ALGORITHMS)}, {"config.seed": list(SEEDS)})
