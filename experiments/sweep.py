r"""Expands the `get_sweep(arg)` beside a config into `experiments/train.py` runs and runs them.

    python experiments/sweep.py --config=configs/algorithm_sweep.py:smoke \
        --workdir_root=/tmp/lh_sweep [--dry_run] [--max_parallel=1] [--only=0,3] \
        [-- extra train.py flags for every run, e.g. --config.tensorboard=False]

The `:arg` suffix goes to both `get_config(arg)` and `get_sweep(arg)` of the config file. Every
override is checked against the config before anything runs (unknown field or wrong type: an error
naming the run and the key). Run `i` trains in `<workdir_root>/<run-name>` with the name built from
its overrides (`algorithm.name=gigpo,seed=1`), so rerunning the sweep resumes every run.

--dry_run prints one shell-quoted command per run on stdout (one per line; run index and name go
to the log on stderr) and touches nothing, e.g. `... --dry_run | bash` or `| parallel -j4`.
Without it the runs are started as subprocesses (sequentially, or up to --max_parallel at a time;
each sees all local devices, so on one GPU set XLA_PYTHON_CLIENT_PREALLOCATE=false or keep 1),
with output in `<workdir_root>/logs/<run-name>.log`, exit codes in the log and
`<workdir_root>/sweep.json` (name, overrides, command, status). Exits 1 if any run failed.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging

from longhorizon.studies import sweeps

_CONFIG = flags.DEFINE_string("config", None, "Config file with get_sweep, as path[:arg].")
_WORKDIR_ROOT = flags.DEFINE_string("workdir_root", None, "Each run's workdir is a folder in here.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands; run nothing.")
_MAX_PARALLEL = flags.DEFINE_integer("max_parallel", 1, "Runs at a time.", lower_bound=1)
_ONLY = flags.DEFINE_list("only", [], "Run only these run indices (0-based, comma-separated).")
flags.mark_flags_as_required(["config", "workdir_root"])

_TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


def _selected(runs, only):
  if not only:
    return runs
  try:
    indices = [int(i) for i in only]
  except ValueError:
    raise app.UsageError(f"--only={','.join(only)}: expected run indices like --only=0,3.")
  bad = [i for i in indices if not 0 <= i < len(runs)]
  if bad:
    raise app.UsageError(f"--only: indices {bad} out of range; the sweep has {len(runs)} runs "
                         f"(0..{len(runs) - 1}).")
  return [runs[i] for i in dict.fromkeys(indices)]


def main(argv):
  extra_flags = argv[1:]  # everything after `--`
  logging.set_verbosity(logging.INFO)
  if any(not flag.startswith("--") for flag in extra_flags):
    raise app.UsageError(f"unexpected arguments {extra_flags}: only train.py flags (--name=value) "
                         "may follow `--`.")
  train_script = os.path.relpath(_TRAIN)
  if train_script.startswith(".."):
    train_script = _TRAIN
  try:
    config, sweep = sweeps.load_sweep(_CONFIG.value)
    sweeps.check_overrides(config, sweep)
    runs = sweeps.expand(sweep, _CONFIG.value, _WORKDIR_ROOT.value, python=sys.executable,
                         train_script=train_script, extra_flags=extra_flags)
  except ValueError as e:
    raise app.UsageError(str(e))
  runs = _selected(runs, _ONLY.value)
  logging.info("%d runs of %s:", len(runs), _CONFIG.value)
  for run in runs:
    logging.info("  [%d] %s", run.index, run.name)
  if _DRY_RUN.value:
    for run in runs:
      print(run.shell)
    return
  records = sweeps.run_sweep(runs, _WORKDIR_ROOT.value, max_parallel=_MAX_PARALLEL.value)
  failed = [f"[{r['index']}] {r['name']} (exit {r['returncode']}, log {r['log']})"
            for r in records if r["status"] != "ok"]
  logging.info("%d of %d runs ok; results in %s", len(records) - len(failed), len(records),
               os.path.join(_WORKDIR_ROOT.value, "sweep.json"))
  if failed:
    logging.error("failed runs:\n  %s", "\n  ".join(failed))
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
