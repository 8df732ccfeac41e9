r"""Generates (once) the TextWorld games a training config will use, in parallel, into the cache.

    python experiments/prepare_textworld.py --config=configs/textworld.py [--workers=2]
    python experiments/prepare_textworld.py --config=configs/horizon_sweep.py:textworld \
        --splits=train --splits=test

A TextWorld game is generated and compiled on its first reset (about 1 s of CPU for a coin game of quest length 4, cached under
`$LONGHORIZON_DATA/textworld/`, see `longhorizon.envs.textworld_games`); a config with thousands of
training games would spend its first hour doing that inside the run. This lists the tasks of every
split the config uses (`tasks.train_size`, `tasks.test_size`, `tasks.ood_size`, `tasks.seed`) and
builds the missing games with `--workers` processes. Rerunning skips what is cached (it resumes).
"""

import multiprocessing
import sys
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from longhorizon import envs
from longhorizon.envs import textworld_games
from longhorizon.studies import horizon

_CONFIG = config_flags.DEFINE_config_file("config", None, "A training config on env textworld.",
                                          lock_config=True)
_WORKERS = flags.DEFINE_integer("workers", 2, "Generator processes.", lower_bound=1)
_SPLITS = flags.DEFINE_multi_enum("splits", ["train", "test", "ood"], ["train", "test", "ood"],
                                  "Splits to build (the horizon sweep uses train and test only).")


def _build(task: dict) -> str:
  return str(textworld_games.game_file(task))


def task_lists(config) -> dict[str, list[dict]]:
  """split -> the tasks the run will use (the learner's own lists: `env.tasks(split, n, seed)`).
  A horizon-sweep config (`sweep.textworld` quest lengths) gives the tasks of every TextWorld cell."""
  if "sweep" in config and config.sweep.get("textworld"):
    lists = {}
    for length in config.sweep.textworld:
      cell = horizon.cell_config(config, "textworld", int(length), config.sweep.algorithms[0], 0)
      for split, tasks in _run_task_lists(cell).items():
        lists.setdefault(split, []).extend(tasks)
    return lists
  return _run_task_lists(config)


def _run_task_lists(config) -> dict[str, list[dict]]:
  if config.env.name != "textworld":
    raise app.UsageError(f"--config: env.name is {config.env.name!r}; this prepares textworld games.")
  env = envs.make("textworld", **dict(config.env.params))
  sizes = {"train": config.tasks.train_size, "test": config.tasks.test_size,
           "ood": config.tasks.ood_size}
  return {split: env.tasks(split, n, config.tasks.seed) for split, n in sizes.items() if n}


def main(argv):
  del argv
  lists = {k: v for k, v in task_lists(_CONFIG.value).items() if k in _SPLITS.value}
  tasks = [t for split in lists.values() for t in split]
  folder = textworld_games.cache_dir()
  missing = [t for t in tasks if not textworld_games.is_cached(t)]
  print(f"{len(tasks)} games ({', '.join(f'{k} {len(v)}' for k, v in lists.items())}); "
        f"{len(missing)} to generate into {folder} with {_WORKERS.value} processes.", flush=True)
  start = time.perf_counter()
  ctx = multiprocessing.get_context("forkserver")  # never fork a process that imported JAX
  with ctx.Pool(_WORKERS.value) as pool:
    for i, _ in enumerate(pool.imap_unordered(_build, missing, chunksize=4), start=1):
      if i % 50 == 0 or i == len(missing):
        elapsed = time.perf_counter() - start
        print(f"{i}/{len(missing)} generated, {elapsed:.0f} s ({elapsed / i:.2f} s each)",
              flush=True)
  return 0


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  sys.exit(app.run(main))
