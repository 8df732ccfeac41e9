"""The credit-assignment study's report: intervals over seeds, paired differences against a
baseline, sample efficiency, p against p^H, and first-error positions, from a horizon sweep's CSV
files (`studies/horizon.py`).

Every run of a cell `(env, N, seed)` starts from that seed's warm start, so methods are compared
seed by seed: the paired difference `success(method) - success(baseline)` over the seeds removes
the warm start's spread, which dominates the unpaired intervals at 5 seeds. Intervals are
Student-t 95% intervals of the mean over seeds (`mean +- t_{0.975, n-1} s / sqrt(n)`).

A cell compares m methods with the baseline, so the success table also gives each paired
difference's two-sided p-value and its Bonferroni-corrected interval and p-value (family-wise 95%
over the cell's m comparisons: `t_{1 - 0.025/m, n-1}`, `min(1, m p)`). A difference is a finding
only where the corrected interval excludes 0.

    rows, curves = horizon.read_results(out)
    errors = read_first_errors(out)
    print(success_table(rows, baseline="grpo"))
    plot_paired_differences(rows, "grpo", path)
    plot_first_errors(errors, path)
"""

from __future__ import annotations

import csv
import math
import os
from typing import Sequence

import numpy as np
from scipy import stats

from longhorizon.studies import horizon

__all__ = ["t_quantile", "interval", "paired_test", "success_table", "efficiency_table",
           "first_error_table", "fall_table", "read_first_errors", "plot_paired_differences",
           "plot_first_errors"]

# t_{0.975, df} for df = 1..30 (two-sided 95%); df > 30 uses the normal 1.96 (within 2%).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile(df: int) -> float:
  """The two-sided 95% Student-t quantile `t_{0.975, df}` (df >= 1)."""
  if df < 1:
    raise ValueError(f"t_quantile needs df >= 1 (at least two seeds), got {df}.")
  return _T975[df - 1] if df <= len(_T975) else 1.96


def interval(values) -> tuple[float, float]:
  """`(mean, half-width of the 95% t-interval)` of `values` over seeds (half-width nan for one)."""
  values = np.asarray(values, np.float64)
  if len(values) < 2:
    return float(values.mean()), float("nan")
  half = t_quantile(len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
  return float(values.mean()), float(half)


def paired_test(differences, comparisons: int = 1) -> dict:
  """The one-sample t-test of paired `differences` (one per seed, n >= 2) against 0, with the
  Bonferroni correction for `comparisons` tests: `mean`, `half` (95% half-width), `p` (two-sided),
  `half_corrected` (half-width at `1 - 0.025 / comparisons`) and `p_corrected` (`min(1, m p)`)."""
  d = np.asarray(differences, np.float64)
  if len(d) < 2 or comparisons < 1:
    raise ValueError(f"paired_test needs >= 2 differences and >= 1 comparison, got {len(d)} "
                     f"and {comparisons}.")
  df, se = len(d) - 1, d.std(ddof=1) / math.sqrt(len(d))
  mean = float(d.mean())
  if se <= 1e-12 * abs(mean):  # every seed moved by the same amount (to rounding), or none moved
    p = 1.0 if mean == 0 else 0.0
  else:
    p = float(2 * stats.t.sf(abs(mean) / se, df))
  return {"mean": mean, "half": float(stats.t.ppf(0.975, df) * se), "p": p,
          "half_corrected": float(stats.t.ppf(1 - 0.025 / comparisons, df) * se),
          "p_corrected": min(1.0, comparisons * p)}


def _cells(rows) -> dict:
  """`{(env, N): {algorithm: {seed: row}}}`."""
  out: dict = {}
  for r in rows:
    out.setdefault((r["env"], int(r["horizon"])), {}).setdefault(r["algorithm"], {})[
        int(r["seed"])] = r
  return out


def _rank(name: str) -> tuple:
  """Sort key of a method: its place in `horizon.ALGORITHMS`, then its name."""
  return (list(horizon.ALGORITHMS).index(name) if name in horizon.ALGORITHMS else 99, name)


def _order(names) -> list[str]:
  return sorted(names, key=_rank)


_subplots = horizon._subplots  # pylint: disable=protected-access  (the pyplot-free figure)


def _fmt(mean: float, half: float) -> str:
  return f"{mean:.3f} ± {half:.3f}" if not math.isnan(half) else f"{mean:.3f}"


def success_table(rows: Sequence[dict], baseline: str = "grpo") -> str:
  """Markdown: per cell and method, the final sampled success (95% interval over seeds), the
  paired difference to `baseline` on the seeds both ran (95% interval; **bold** where the interval
  excludes 0) with its p-value, seeds better than the baseline, the Bonferroni-corrected interval
  and p-value over the cell's m compared methods (**bold** where that interval excludes 0), the
  greedy success, step accuracy p and p^H."""
  lines = [f"| env | N | method | seeds | final success | - {baseline} (paired) | p | "
           "seeds above | corrected (m): ± / p | greedy | step acc. p | p^H |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for (env, n), methods in sorted(_cells(rows).items()):
    base = methods.get(baseline, {})
    paired = {name: [runs[s]["final_success"] - base[s]["final_success"]
                     for s in sorted(runs) if s in base]
              for name, runs in methods.items() if name != baseline}
    m = sum(len(d) >= 2 for d in paired.values())
    warm = [r["warm_success"] for r in next(iter(methods.values())).values()]
    lines.append(f"| {env} | {n} | warm start | {len(warm)} | {_fmt(*interval(warm))} | | | | | | "
                 "| |")
    for name in _order(methods):
      runs = methods[name]
      seeds = sorted(runs)
      success = [runs[s]["final_success"] for s in seeds]
      d = paired.get(name, [])
      diff = p = corrected = ""
      if len(d) >= 2:
        test = paired_test(d, m)
        diff, p = _fmt(test["mean"], test["half"]), f"{test['p']:.3f}"
        if abs(test["mean"]) > test["half"]:
          diff = f"**{diff}**"
        corrected = f"± {test['half_corrected']:.3f} / {test['p_corrected']:.3f} ({m})"
        if abs(test["mean"]) > test["half_corrected"]:
          corrected = f"**{corrected}**"
      above = f"{sum(x > 0 for x in d)}/{len(d)}" if d else ""
      col = lambda k: _fmt(*interval([runs[s][k] for s in seeds]))
      lines.append(f"| {env} | {n} | {name} | {len(seeds)} | {_fmt(*interval(success))} | {diff} |"
                   f" {p} | {above} | {corrected} | {col('final_greedy_success')} | "
                   f"{col('final_step_accuracy')} | "
                   f"{np.mean([runs[s]['final_predicted'] for s in seeds]):.3f} |")
  return "\n".join(lines)


def efficiency_table(rows: Sequence[dict]) -> str:
  """Markdown: per cell and method, success gained over the warm start per 1k episodes and per
  1M tokens (95% intervals over seeds), with the episodes and mean tokens per run."""
  lines = ["| env | N | method | episodes / run | tokens / run | gain / 1k episodes | "
           "gain / 1M tokens |", "|---|---|---|---|---|---|---|"]
  for (env, n), methods in sorted(_cells(rows).items()):
    for name in _order(methods):
      runs = list(methods[name].values())
      lines.append(
          f"| {env} | {n} | {name} | {runs[0]['episodes']} | "
          f"{np.mean([r['tokens'] for r in runs]):,.0f} | "
          f"{_fmt(*interval([r['gain_per_1k_episodes'] for r in runs]))} | "
          f"{_fmt(*interval([r['gain_per_1m_tokens'] for r in runs]))} |")
  return "\n".join(lines)


def read_first_errors(out_dir: str) -> list[dict]:
  """The rows of `out_dir/first_errors.csv` with `by_step` as a float array (empty if absent);
  of a run's rows written twice (a resumed run), the last."""
  path = os.path.join(out_dir, "first_errors.csv")
  if not os.path.exists(path):
    return []
  rows: dict = {}
  with open(path, newline="") as f:
    for r in csv.DictReader(f):
      r = dict(r, horizon=int(r["horizon"]), seed=int(r["seed"]), update=int(r["update"]),
               rate=float(r["rate"]), by_step=np.array(r["by_step"].split(), np.float64))
      rows[(r["env"], r["horizon"], r["algorithm"], r["seed"], r["update"])] = r
  return list(rows.values())


def _phase(update: int, num_updates: int) -> str | None:
  """"early" in the first third of `num_updates` updates, "late" in the last, else None."""
  third = max(num_updates // 3, 1)
  return "early" if update <= third else "late" if update > num_updates - third else None


def _error_phases(errors, num_updates: int) -> dict:
  """`{(env, N, method): {phase: mean first-error distribution}}` for the first and last third of
  training (phase "early" / "late"), averaged over updates and seeds."""
  out: dict = {}
  for r in errors:
    phase = _phase(r["update"], num_updates)
    if phase is not None:
      out.setdefault((r["env"], r["horizon"], r["algorithm"]), {}).setdefault(
          phase, []).append(r["by_step"])
  def mean(dists):  # updates without an erring episode have no distribution; pad to one width
    dists = [d for d in dists if len(d)]
    width = max((len(d) for d in dists), default=0)
    return np.mean([np.pad(d, (0, width - len(d))) for d in dists], 0) if dists else np.zeros(0)

  return {k: {p: mean(v) for p, v in phases.items()} for k, phases in out.items()}


def first_error_table(errors: Sequence[dict], num_updates: int) -> str:
  """Markdown: where training episodes first left the oracle's path, early and late in training
  (first / last third of the updates): the fraction at the first step, at the final (answer)
  step, and the mean first-error step."""
  lines = ["| env | N | method | phase | at first step | at last step | mean step |",
           "|---|---|---|---|---|---|---|"]
  for (env, n, name), phases in sorted(_error_phases(errors, num_updates).items(),
                                       key=lambda kv: (kv[0][0], kv[0][1], _rank(kv[0][2]))):
    for phase in ("early", "late"):
      if phase in phases and len(phases[phase]):
        dist = phases[phase]
        used = np.flatnonzero(dist > 0)
        last = int(used[-1]) if len(used) else 0
        mean = float((dist * np.arange(len(dist))).sum() / max(dist.sum(), 1e-12))
        lines.append(f"| {env} | {n} | {name} | {phase} | {dist[0]:.3f} | {dist[last]:.3f} "
                     f"(step {last}) | {mean:.2f} |")
  return "\n".join(lines)


# update_metrics.csv columns shown for runs that fell (`fall_table`), with their short names.
_FALL_METRICS = (("entropy", "entropy"), ("zero_advantage_group_rate", "signal-free groups"),
                 ("grad_norm", "grad norm"), ("approx_kl", "KL"), ("episode_steps", "steps"))


def fall_table(rows: Sequence[dict], update_rows: Sequence[dict], num_updates: int) -> str:
  """Markdown: every run that ended below its warm start (`final_success < warm_success`), with
  the learner's diagnostics (`horizon.read_update_metrics`) averaged over the first and the last
  third of its updates, as `early -> late`. A collapsed GRPO run, for instance, shows its
  signal-free group share going to 1 (every group fails, so every advantage is 0). Runs without
  diagnostics (swept before the file existed) are left out; "" when no run fell."""
  by_run: dict = {}
  for u in update_rows:
    by_run.setdefault((u["env"], u["horizon"], u["algorithm"], u["seed"]), []).append(u)
  lines = []
  for r in sorted(rows, key=lambda r: (r["env"], r["horizon"], _rank(r["algorithm"]), r["seed"])):
    updates = by_run.get((r["env"], r["horizon"], r["algorithm"], r["seed"]))
    if r["final_success"] >= r["warm_success"] or not updates:
      continue
    early = [u for u in updates if _phase(u["update"], num_updates) == "early"]
    late = [u for u in updates if _phase(u["update"], num_updates) == "late"]
    cells = []
    for key, _ in _FALL_METRICS:
      a = [u[key] for u in early if u[key] is not None]
      b = [u[key] for u in late if u[key] is not None]
      cells.append(f"{np.mean(a):.3g} -> {np.mean(b):.3g}" if a and b else "-")
    lines.append(f"| {r['env']} | {r['horizon']} | {r['algorithm']} | {r['seed']} | "
                 f"{r['warm_success']:.3f} -> {r['final_success']:.3f} | " + " | ".join(cells)
                 + " |")
  if not lines:
    return ""
  head = ("| env | N | method | seed | success | "
          + " | ".join(name for _, name in _FALL_METRICS) + " |")
  return "\n".join([head, "|" + "---|" * (5 + len(_FALL_METRICS))] + lines)


def plot_paired_differences(rows: Sequence[dict], baseline: str, path: str) -> str:
  """Per cell, each method's paired difference to `baseline` (95% interval), one panel per cell."""
  cells = sorted(_cells(rows).items())
  fig, axes = _subplots(1, len(cells), (5.5 * len(cells), 4.5))
  for ax, ((env, n), methods) in zip(axes[0], cells):
    base = methods.get(baseline, {})
    names = [m for m in _order(methods) if m != baseline]
    for y, name in enumerate(names):
      paired = [r["final_success"] - base[s]["final_success"]
                for s, r in methods[name].items() if s in base]
      if len(paired) >= 2:
        mean, half = interval(paired)
        ax.errorbar(mean, y, xerr=half, fmt="o", capsize=3,
                    color="tab:green" if mean - half > 0 else
                    "tab:red" if mean + half < 0 else "tab:gray")
        ax.plot(paired, [y] * len(paired), "k.", ms=3, alpha=0.5)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel(f"final success - {baseline} (same seed)")
    ax.set_title(f"{env} N={n}: paired difference, 95% t-interval")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def plot_first_errors(errors: Sequence[dict], num_updates: int, path: str) -> str:
  """The distribution of first-error steps early and late in training, per cell and method."""
  phases = _error_phases(errors, num_updates)
  cells = sorted({(env, n) for env, n, _ in phases})
  fig, axes = _subplots(2, len(cells), (5.5 * len(cells), 7))
  for col, cell in enumerate(cells):
    names = _order([m for e, n, m in phases if (e, n) == cell])
    for row, phase in enumerate(("early", "late")):
      ax = axes[row][col]
      for name in names:
        dist = phases[cell + (name,)].get(phase)
        if dist is not None and len(dist):
          ax.plot(np.arange(len(dist)), dist, marker=".", label=name)
      ax.set_title(f"{cell[0]} N={cell[1]}: {phase} training")
      ax.set_xlabel("first step whose action differs from the oracle's")
      ax.set_ylabel("fraction of erring episodes")
      if row == 0 and col == 0:
        ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path
