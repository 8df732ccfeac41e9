"""Evaluation of trained policies: per-episode evaluation records -> metrics, `eval.json`, plots.

`metrics.report(records, k_max=..., milestone_names=...)` turns one row per evaluated episode (task
id, success, steps, tokens, cost, milestones, safety flags, ...) into a JSON-serialisable report:
success rate with a Wilson interval, unbiased pass@k and tau-bench pass^k, milestone success, cost per
success, recovery / safety / attack rates and per-bucket breakdowns. `metrics.plot_report` draws one
or several reports (pass@k curves, success by bucket, success-vs-cost Pareto front).

Host-side NumPy only; nothing here imports JAX (matplotlib only inside `plot_report`).
"""

from longhorizon.eval import metrics
from longhorizon.eval.metrics import (pareto_front, pass_at_k, pass_hat_k, plot_report, report,
                                      wilson_interval)

__all__ = ["metrics", "pareto_front", "pass_at_k", "pass_hat_k", "plot_report", "report",
           "wilson_interval"]
