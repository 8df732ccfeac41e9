"""The credit study's report: t-intervals, paired differences to the baseline, first-error
phases, and the plots, on hand-made rows."""

import math
import os

import numpy as np
import pytest

from longhorizon.studies import credit_report as cr


def test_t_quantiles_match_scipy():
  stats = pytest.importorskip("scipy.stats")
  for df in (1, 2, 4, 9, 30):
    assert cr.t_quantile(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3)
  assert cr.t_quantile(100) == 1.96
  with pytest.raises(ValueError, match="df >= 1"):
    cr.t_quantile(0)


def test_interval_by_hand():
  # mean 2, sample std 1 (values 1, 2, 3), n = 3: half-width t_{0.975,2} / sqrt(3).
  mean, half = cr.interval([1.0, 2.0, 3.0])
  assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
  assert math.isnan(cr.interval([0.5])[1])


def test_paired_test_by_hand():
  # Two seeds: t has 1 degree of freedom, the Cauchy distribution, whose quantiles and tails
  # have closed forms. d = (1, 3): mean 2, se = std / sqrt(2) = 1, t = 2.
  test = cr.paired_test([1.0, 3.0], comparisons=2)
  assert test["mean"] == 2.0
  assert test["half"] == pytest.approx(math.tan(math.pi * 0.475), rel=1e-9)  # 12.706
  assert test["p"] == pytest.approx(1 - 2 / math.pi * math.atan(2.0), rel=1e-9)  # 0.295
  assert test["half_corrected"] == pytest.approx(math.tan(math.pi * (0.4875)), rel=1e-9)
  assert test["p_corrected"] == pytest.approx(2 * test["p"], rel=1e-12)
  assert cr.paired_test([1.0, 3.0], comparisons=9)["p_corrected"] == 1.0  # capped at 1
  assert cr.paired_test([0.1, 0.1, 0.1])["p"] == 0.0  # no spread, non-zero mean
  assert cr.paired_test([0.0, 0.0])["p"] == 1.0
  with pytest.raises(ValueError, match=">= 2 differences"):
    cr.paired_test([0.5])


def test_paired_test_matches_a_numpy_reference():
  # The p-value by integrating the t density numerically (no scipy), on random differences.
  rng = np.random.default_rng(0)
  for n in (3, 5, 8):
    d = rng.normal(0.05, 0.1, n)
    df, t = n - 1, abs(d.mean()) / (d.std(ddof=1) / math.sqrt(n))
    x = np.linspace(t, t + 2000.0, 4_000_001)
    dens = (math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
            * (1 + x**2 / df) ** (-(df + 1) / 2))
    tail = np.trapezoid(dens, x) if hasattr(np, "trapezoid") else np.trapz(dens, x)
    assert cr.paired_test(d)["p"] == pytest.approx(2 * tail, abs=2e-4)


def _row(algorithm, seed, final, warm=0.3, **extra):
  return {"env": "pointer_chain", "horizon": 8, "actions": 9, "algorithm": algorithm,
          "seed": seed, "episodes": 2304, "tokens": 1000, "warm_success": warm,
          "final_success": final, "final_greedy_success": final, "final_step_accuracy": 0.9,
          "final_predicted": 0.9 ** 9, "gain": final - warm,
          "gain_per_1k_episodes": (final - warm) / 2.304, "gain_per_1m_tokens": final - warm,
          **extra}


def test_paired_differences_remove_the_seed_spread():
  # Seeds differ a lot (0.2 .. 0.8), but tree_grpo beats grpo by 0.05 +- 0.01 on every seed: the
  # unpaired intervals overlap, the paired one excludes 0 (bold), 5/5 seeds above.
  base = [0.2, 0.35, 0.5, 0.65, 0.8]
  gaps = [0.04, 0.05, 0.06, 0.05, 0.05]
  rows = ([_row("grpo", s, b) for s, b in enumerate(base)]
          + [_row("tree_grpo", s, b + g) for s, (b, g) in enumerate(zip(base, gaps))]
          + [_row("vine", s, b + (-0.1 if s % 2 else 0.1)) for s, b in enumerate(base)])
  table = cr.success_table(rows, baseline="grpo")
  mean, half = cr.interval(gaps)
  assert f"**{mean:.3f} ± {half:.3f}**" in table
  assert "| 5/5 |" in table
  # Two methods against grpo: Bonferroni over m = 2; the gap is tight enough to survive it.
  test = cr.paired_test(gaps, comparisons=2)
  assert test["half_corrected"] > half
  assert f"| {test['p']:.3f} | 5/5 | **± {test['half_corrected']:.3f} / " in table
  assert f"/ {test['p_corrected']:.3f} (2)** |" in table
  vine = [line for line in table.splitlines() if "| vine |" in line][0]
  assert "**" not in vine and "| 3/5 |" in vine  # seeds 0, 2, 4 above, 1 and 3 below
  assert "| warm start | 5 |" in table


def test_paired_differences_use_only_shared_seeds():
  rows = [_row("grpo", 0, 0.5), _row("grpo", 1, 0.6), _row("gigpo", 1, 0.9), _row("gigpo", 2, 0.1)]
  table = cr.success_table(rows)
  gigpo = [line for line in table.splitlines() if "| gigpo |" in line][0]
  assert "| 1/1 |" in gigpo  # one shared seed: no interval, but the count


def _errors(path, rows):
  with open(path, "w") as f:
    f.write("env,horizon,algorithm,seed,update,rate,mean_step,at_first_step,by_step\n")
    for algorithm, seed, update, dist in rows:
      f.write(f"pointer_chain,8,{algorithm},{seed},{update},0.5,1,{dist[0]},"
              f"{' '.join(str(x) for x in dist)}\n")


def test_first_error_phases_and_table(tmp_path):
  rows = []
  for update in range(1, 10):  # early (1-3): errors at step 0; late (7-9): at step 3
    dist = [1.0, 0, 0, 0] if update <= 3 else [0, 0, 0, 1.0] if update >= 7 else [0, 1.0, 0, 0]
    rows += [("grpo", 0, update, dist), ("grpo", 1, update, dist)]
  _errors(tmp_path / "first_errors.csv", rows + [("grpo", 0, 9, [0, 0, 0, 1.0])])  # rewritten
  errors = cr.read_first_errors(str(tmp_path))
  assert len(errors) == 18
  table = cr.first_error_table(errors, num_updates=9)
  assert "| grpo | early | 1.000 | 1.000 (step 0) | 0.00 |" in table
  assert "| grpo | late | 0.000 | 1.000 (step 3) | 3.00 |" in table
  path = cr.plot_first_errors(errors, 9, str(tmp_path / "fe.png"))
  assert os.path.getsize(path) > 5000
  assert cr.read_first_errors(str(tmp_path / "none")) == []


def test_efficiency_table_and_paired_plot(tmp_path):
  rows = [_row(a, s, 0.5 + 0.1 * s + (0.05 if a == "gigpo" else 0)) for a in ("grpo", "gigpo")
          for s in range(3)]
  table = cr.efficiency_table(rows)
  gains = [(0.5 + 0.1 * s - 0.3) / 2.304 for s in range(3)]
  mean, half = cr.interval(gains)
  assert f"| pointer_chain | 8 | grpo | 2304 | 1,000 | {mean:.3f} ± {half:.3f} |" in table
  path = cr.plot_paired_differences(rows, "grpo", str(tmp_path / "pd.png"))
  assert os.path.getsize(path) > 5000
  np.testing.assert_allclose(cr.interval([0.05] * 3), (0.05, 0.0), atol=1e-12)


def _update(algorithm, seed, update, entropy, zero, clipfrac=None):
  return {"env": "pointer_chain", "horizon": 8, "algorithm": algorithm, "seed": seed,
          "update": update, "entropy": entropy, "zero_advantage_group_rate": zero,
          "grad_norm": 1.0, "approx_kl": 0.01, "episode_steps": 9.0, "clipfrac": clipfrac}


def test_fall_table_lists_runs_below_their_warm_start_with_early_and_late_means():
  rows = [_row("grpo", 0, final=0.0, warm=0.3), _row("gigpo", 0, final=0.6, warm=0.3),
          _row("vine", 0, final=0.1, warm=0.3)]
  # 6 updates: thirds are updates 1-2 and 5-6. grpo's entropy 2.0, 1.0 early and 0.5, 0.25 late;
  # its signal-free groups 0 -> 1 (the collapse). vine fell but has no diagnostics: left out.
  updates = [_update("grpo", 0, u, e, z) for u, e, z in
             [(1, 2.0, 0.0), (2, 1.0, 0.0), (3, 9.0, 0.5), (4, 9.0, 0.5), (5, 0.5, 1.0),
              (6, 0.25, 1.0)]]
  updates += [_update("gigpo", 0, u, 1.0, 0.0) for u in range(1, 7)]
  table = cr.fall_table(rows, updates, num_updates=6)
  lines = table.splitlines()
  assert len(lines) == 3  # header, rule, grpo
  assert lines[2] == ("| pointer_chain | 8 | grpo | 0 | 0.300 -> 0.000 | 1.5 -> 0.375 | 0 -> 1 "
                      "| 1 -> 1 | 0.01 -> 0.01 | 9 -> 9 |")
  assert cr.fall_table(rows[1:2], updates, num_updates=6) == ""
