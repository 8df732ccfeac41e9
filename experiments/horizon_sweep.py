r"""The horizon cliff: success versus horizon per credit-assignment algorithm
(longhorizon.studies.horizon).

    python experiments/horizon_sweep.py --config=configs/horizon_sweep.py \
        --out=experiments/results/horizon_sweep [--only_env=pointer_chain] [--plots_only]

    # smoke (a few minutes on a CPU), accelerator scale:
    python experiments/horizon_sweep.py --config=configs/horizon_sweep.py:smoke --out=/tmp/hs
    python experiments/horizon_sweep.py --config=configs/horizon_sweep.py:accelerator --out=...

Writes to --out: results.csv (one row per env, horizon, algorithm, seed), curves.csv (training
success per update), summary.json / summary.md (mean +- std over seeds), success_vs_horizon.png,
learning_curves.png, sample_efficiency.png, and sweep.json (the config, the command, the wall time).
Rerunning with the same --out skips finished runs (a killed sweep resumes run by run); sweeps
over disjoint seeds may write into one --out side by side.
"""

import json
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from longhorizon.eval import provenance
from longhorizon.studies import horizon

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/horizon_sweep.py[:variant]",
                                          lock_config=True)
_OUT = flags.DEFINE_string("out", None, "Output folder (results, plots); reruns resume.")
_ONLY_ENV = flags.DEFINE_list("only_env", [], "Run only these environments.")
_PLOTS_ONLY = flags.DEFINE_bool("plots_only", False, "Only redraw plots and summaries from --out.")
flags.mark_flags_as_required(["config", "out"])


def cells_of(config, only_env=()):
  sweep = config.sweep
  envs = [e for e in ("pointer_chain", "gridworld", "textworld") if e in sweep and sweep[e]]
  unknown = sorted(set(only_env) - set(envs))
  if unknown:
    raise app.UsageError(f"--only_env={','.join(only_env)}: {unknown} not in the sweep ({envs}).")
  envs = [e for e in envs if not only_env or e in only_env]
  # Seed-major: an interrupted sweep has every cell at fewer seeds rather than some cells at none.
  return [horizon.Cell(env, int(n), int(seed))
          for seed in sweep.seeds for env in envs for n in sweep[env]]


def _record_session(out: str, config, session: dict) -> None:
  """Adds (or updates, by start time and pid) `session` in `out/sweep.json`."""
  os.makedirs(out, exist_ok=True)
  meta_path = os.path.join(out, "sweep.json")
  meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
  meta["config"] = json.loads(config.to_json_best_effort())
  sessions = [s for s in meta.get("sessions", [])
              if (s.get("started"), s.get("pid")) != (session["started"], session["pid"])]
  meta["sessions"] = sessions + [session]
  with open(meta_path, "w") as f:
    json.dump(meta, f, indent=1)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  config, out = _CONFIG.value, _OUT.value
  if not _PLOTS_ONLY.value:
    cells = cells_of(config, _ONLY_ENV.value)
    print(f"{len(cells)} cells x {len(config.sweep.algorithms)} algorithms; devices "
          f"{jax.devices()}", flush=True)
    started = time.perf_counter()
    # The session is recorded as it starts (the code as it is now; the tree may change later)
    # and its wall time when it ends, so a killed session still says what it ran on.
    session = {"command": " ".join(["python"] + sys.argv), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "pid": os.getpid(), "wall_s": None, "devices": [str(d) for d in jax.devices()],
               "jax": jax.__version__, "cpus": os.cpu_count(), "provenance": provenance.provenance()}
    _record_session(out, config, session)
    horizon.run_sweep(config, cells, list(config.sweep.algorithms), out,
                      log=lambda line: print(line, flush=True),
                      keep_warm_starts=config.sweep.get("keep_warm_starts", False),
                      checkpoint_every=config.sweep.get("checkpoint_every", 0))
    session["wall_s"] = round(time.perf_counter() - started, 1)
    _record_session(out, config, session)
  paths = horizon.plot_all(out)
  print(open(os.path.join(out, "summary.md")).read())
  print("plots:", ", ".join(paths.values()))


if __name__ == "__main__":
  app.run(main)
