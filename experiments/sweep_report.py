r"""The report of a seed sweep of `experiments/train.py` runs (what `experiments/sweep.py` ran).

    python experiments/sweep.py --config=configs/algorithm_sweep.py:grpo_seeds --workdir_root=ROOT
    python experiments/sweep_report.py --root=ROOT [--out=DIR] [--min_success=0.75 --min_gain=0.3]

Reads `ROOT/sweep.json` (each run's name and overrides) and each run's `eval.json` (a run without
one is unfinished: named in the log and left out). Runs whose overrides differ only in
`config.seed` form one arm. Writes to --out (default ROOT): `runs.csv` (one row per finished run),
`summary.md` (per arm: mean and 95% t-interval over seeds of the warm start, final and greedy
success and of the gain, how many runs meet the claim `final >= --min_success` and
`final - warm >= --min_gain`, and a line per run with its commit and CPU) and `summary.json`.
The defaults are the claim in configs/default.py's docstring.
"""

import csv
import json
import os

from absl import app
from absl import flags

from longhorizon.studies import seed_report

_ROOT = flags.DEFINE_string("root", None, "The sweep's --workdir_root (holds sweep.json).")
_OUT = flags.DEFINE_string("out", None, "Where the report goes (default: --root).")
_MIN_SUCCESS = flags.DEFINE_float("min_success", 0.75, "The claim's final sampled success.")
_MIN_GAIN = flags.DEFINE_float("min_gain", 0.3, "The claim's gain over the warm start.")
flags.mark_flags_as_required(["root"])


def main(argv):
  del argv
  out = _OUT.value or _ROOT.value
  rows = seed_report.read_runs(_ROOT.value, _MIN_SUCCESS.value, _MIN_GAIN.value)
  if not rows:
    raise app.UsageError(f"no finished run under {_ROOT.value} (no eval.json in any run folder).")
  summary = seed_report.summarise(rows)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "runs.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, seed_report.FIELDS)
    writer.writeheader()
    writer.writerows(rows)
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
  text = seed_report.markdown(rows, summary, _MIN_SUCCESS.value, _MIN_GAIN.value)
  with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  app.run(main)
