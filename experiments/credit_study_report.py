r"""The credit-assignment study's report (longhorizon.studies.credit_report) from a horizon
sweep's folder: 95% t-intervals over seeds, paired differences to the baseline (p-values, and
Bonferroni-corrected over the methods compared), sample efficiency,
p against p^H, where episodes first leave the oracle's path, and the learner's diagnostics
for runs that ended below their warm start.

    python experiments/credit_study_report.py --out=experiments/results/horizon_sweep_credit_study

Writes to --out: report.md (the tables), paired_differences.png, first_errors.png, and redraws
the sweep's own plots and summary (experiments/horizon_sweep.py --plots_only).
"""

import json
import os

from absl import app
from absl import flags

from longhorizon.studies import credit_report
from longhorizon.studies import horizon

_OUT = flags.DEFINE_string("out", None, "A horizon sweep's output folder.")
_BASELINE = flags.DEFINE_string("baseline", "grpo", "The method the paired differences are to.")
flags.mark_flags_as_required(["out"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  out = _OUT.value
  rows, _ = horizon.read_results(out)
  if not rows:
    raise app.UsageError(f"--out={out}: no results.csv rows to report on.")
  horizon.plot_all(out)
  meta_path = os.path.join(out, "sweep.json")
  updates = (json.load(open(meta_path))["config"]["num_updates"] if os.path.exists(meta_path)
             else max(int(r["updates"]) for r in rows))
  errors = credit_report.read_first_errors(out)
  parts = ["## Final success (95% t-intervals over seeds; paired differences to "
           f"{_BASELINE.value} on the same seeds with two-sided p, bold where the interval "
           "excludes 0; corrected: Bonferroni over the cell's m methods, bold where that "
           "interval excludes 0)",
           credit_report.success_table(rows, _BASELINE.value),
           "## Sample efficiency", credit_report.efficiency_table(rows)]
  credit_report.plot_paired_differences(rows, _BASELINE.value,
                                        os.path.join(out, "paired_differences.png"))
  if errors:
    parts += [f"## First-error positions (first / last third of {updates} updates)",
              credit_report.first_error_table(errors, updates)]
    credit_report.plot_first_errors(errors, updates, os.path.join(out, "first_errors.png"))
  falls = credit_report.fall_table(rows, horizon.read_update_metrics(out), updates)
  if falls:
    parts += [f"## Runs that ended below their warm start: learner diagnostics, first -> last "
              f"third of {updates} updates (runs swept with update_metrics.csv)", falls]
  text = "\n\n".join(parts) + "\n"
  with open(os.path.join(out, "report.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  app.run(main)
