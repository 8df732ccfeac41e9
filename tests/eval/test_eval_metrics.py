"""Tests of `longhorizon.eval.metrics`.

Tiny cases worked out by hand (pass@k / pass^k, Wilson intervals, a six-episode report whose every
key is computed in the comments), agreement of pass@k / pass^k with brute-force enumeration of all
k-subsets of attempts, the ordering pass^k <= pass@1 <= pass@k, input errors, and the plot file.
"""

import itertools
import json
import math

import numpy as np
import pytest

from longhorizon.eval import metrics

SEEDS = range(6)


# ----------------------------------------------------------------------------------------------------
# pass@k and pass^k.


def ref_pass_at_and_hat_k(num_samples, num_correct, k):
  """Brute force: over every k-subset of each task's attempts, the share with any (pass@k) and with
  all (pass^k) attempts successful, averaged over tasks."""
  at, hat = [], []
  for n, c in zip(num_samples, num_correct):
    attempts = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(attempts, k))
    at.append(np.mean([any(s) for s in subsets]))
    hat.append(np.mean([all(s) for s in subsets]))
  return float(np.mean(at)), float(np.mean(hat))


def test_pass_k_by_hand():
  # n = 4, c = 2: pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6, pass^2 = C(2,2)/C(4,2) = 1/6.
  assert metrics.pass_at_k([4], [2], 1) == pytest.approx(0.5)
  assert metrics.pass_at_k([4], [2], 2) == pytest.approx(5 / 6)
  assert metrics.pass_at_k([4], [2], 3) == pytest.approx(1.0)
  assert metrics.pass_hat_k([4], [2], 1) == pytest.approx(0.5)
  assert metrics.pass_hat_k([4], [2], 2) == pytest.approx(1 / 6)
  assert metrics.pass_hat_k([4], [2], 3) == 0.0
  # Averaged over tasks with equal weight: tasks (n=2, c=0), (n=4, c=4) -> pass@2 = (0 + 1) / 2.
  assert metrics.pass_at_k([2, 4], [0, 4], 2) == pytest.approx(0.5)
  assert metrics.pass_hat_k([2, 4], [0, 4], 2) == pytest.approx(0.5)


@pytest.mark.parametrize("seed", SEEDS)
def test_pass_k_matches_enumeration(seed):
  rng = np.random.default_rng(seed)
  num_tasks = int(rng.integers(1, 6))
  num_samples = rng.integers(1, 9, size=num_tasks)
  num_correct = rng.integers(0, num_samples + 1)
  for k in range(1, int(num_samples.min()) + 1):
    want_at, want_hat = ref_pass_at_and_hat_k(num_samples, num_correct, k)
    assert metrics.pass_at_k(num_samples, num_correct, k) == pytest.approx(want_at, abs=1e-12)
    assert metrics.pass_hat_k(num_samples, num_correct, k) == pytest.approx(want_hat, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_pass_hat_k_le_pass_at_1_le_pass_at_k(seed):
  rng = np.random.default_rng(100 + seed)
  num_samples = rng.integers(1, 17, size=20)
  num_correct = rng.integers(0, num_samples + 1)
  pass_at_1 = metrics.pass_at_k(num_samples, num_correct, 1)
  assert pass_at_1 == pytest.approx(np.mean(num_correct / num_samples))
  for k in range(1, int(num_samples.min()) + 1):
    assert metrics.pass_hat_k(num_samples, num_correct, k) <= pass_at_1 + 1e-12
    assert pass_at_1 <= metrics.pass_at_k(num_samples, num_correct, k) + 1e-12


def test_pass_k_large_counts_are_stable():
  # Binomials of this size overflow float64; the product form stays exact to rounding.
  n, c, k = 2000, 700, 150
  want_at = 1 - math.comb(n - c, k) / math.comb(n, k)
  want_hat = math.comb(c, k) / math.comb(n, k)
  assert metrics.pass_at_k([n], [c], k) == pytest.approx(want_at, rel=1e-12)
  assert metrics.pass_hat_k([n], [c], k) == pytest.approx(want_hat, rel=1e-9, abs=1e-300)


def test_pass_k_errors():
  with pytest.raises(ValueError, match=r"task 1 has num_samples = 2 < k = 3"):
    metrics.pass_at_k([4, 2, 5], [1, 1, 1], 3)
  with pytest.raises(ValueError, match="task 1"):
    metrics.pass_hat_k([4, 2, 5], [1, 1, 1], 3)
  with pytest.raises(ValueError, match=r"task 0: num_correct = 5"):
    metrics.pass_at_k([4], [5], 1)
  with pytest.raises(ValueError, match="k must be a positive integer"):
    metrics.pass_at_k([4], [1], 0)
  with pytest.raises(ValueError, match="same shape"):
    metrics.pass_at_k([4, 4], [1], 1)
  with pytest.raises(ValueError, match="integer counts"):
    metrics.pass_at_k([4.5], [1], 1)


# ----------------------------------------------------------------------------------------------------
# Wilson interval.


def test_wilson_interval_by_hand():
  # 8 / 10 at 95%: z = 1.959964, center = (0.8 + z^2/20) / (1 + z^2/10) = 0.716717,
  # half = z / 1.384146 * sqrt(0.016 + z^2/400) = 0.226601.
  lo, hi = metrics.wilson_interval(8, 10)
  assert lo == pytest.approx(0.490162, abs=1e-6)
  assert hi == pytest.approx(0.943318, abs=1e-6)
  z = 1.959963984540054
  # 0 / 10: lo = 0 and hi = z^2 / (n + z^2); 10 / 10 mirrors it.
  assert metrics.wilson_interval(0, 10) == (0.0, pytest.approx(z * z / (10 + z * z)))
  assert metrics.wilson_interval(10, 10) == (pytest.approx(10 / (10 + z * z)), 1.0)
  assert metrics.wilson_interval(0, 0) == (0.0, 1.0)
  # Wider at higher confidence.
  lo99, hi99 = metrics.wilson_interval(8, 10, confidence=0.99)
  assert lo99 < lo and hi99 > hi


def test_wilson_interval_errors():
  with pytest.raises(ValueError, match="successes <= total"):
    metrics.wilson_interval(11, 10)
  with pytest.raises(ValueError, match="confidence"):
    metrics.wilson_interval(1, 10, confidence=1.0)


# ----------------------------------------------------------------------------------------------------
# The report.

MILESTONES = ("a", "b", "c")


def hand_records():
  """Three tasks x two attempts. Columns per episode:

    ep task succ steps tok tools cost miles err viol loop trunc fault unauth collat att att_ok bucket
     0   0    1    3   30    2   1.0  0b011  0   0    0    0     1     0      0     1    0      0
     1   0    0    5   50    4   2.0  0b001  0   1    0    1     1     2      1     1    1      0
     2   1    1    4   40    3   0.5  0b111  0   0    0    0     0     0      0     0    0      1
     3   1    1    2   20    1   0.5  0b011  0   0    0    0     0     0      0     0    0      1
     4   2    0    1   10    0   0.0  0b000  1   0    0    0     0     0      0     0    0      2
     5   2    0    8   80    6   4.0  0b001  0   0    1    1     0     1      0     0    0      1
  """
  b = lambda *x: np.array(x, bool)
  i = lambda *x: np.array(x, np.int32)
  return {
      "task": i(0, 0, 1, 1, 2, 2),
      "success": b(1, 0, 1, 1, 0, 0),
      "num_steps": i(3, 5, 4, 2, 1, 8),
      "tokens": i(30, 50, 40, 20, 10, 80),
      "tool_calls": i(2, 4, 3, 1, 0, 6),
      "cost": np.array([1.0, 2.0, 0.5, 0.5, 0.0, 4.0], np.float32),
      "milestones": i(0b011, 0b001, 0b111, 0b011, 0b000, 0b001),
      "env_error": b(0, 0, 0, 0, 1, 0),
      "violation": b(0, 1, 0, 0, 0, 0),
      "loop": b(0, 0, 0, 0, 0, 1),
      "truncated": b(0, 1, 0, 0, 0, 1),
      "faulted": b(1, 1, 0, 0, 0, 0),
      "unauthorized": i(0, 2, 0, 0, 0, 1),
      "collateral_damage": b(0, 1, 0, 0, 0, 0),
      "attacked": b(1, 1, 0, 0, 0, 0),
      "attack_success": b(0, 1, 0, 0, 0, 0),
      "bucket": i(0, 0, 1, 1, 2, 1),
      "split": np.array(["test"] * 6),  # unknown keys are ignored
  }


TOP_KEYS = {
    "success_rate", "success_ci", "success_rate_excluding_env_errors", "pass_at_k", "pass_hat_k",
    "milestone_success", "cost_per_success", "recovery_rate", "env_error_rate", "violation_rate",
    "unauthorized_call_rate", "collateral_damage_rate", "loop_rate", "truncation_rate",
    "attack_success_rate", "steps", "tokens", "tool_calls", "num_episodes", "num_tasks",
    "attempts_per_task"}
BUCKET_KEYS = {"bucket_name", "by_bucket"}


def test_report_by_hand():
  rep = metrics.report(hand_records(), k_max=5, milestone_names=MILESTONES)
  json.dumps(rep, allow_nan=False)
  assert set(rep) == TOP_KEYS | BUCKET_KEYS
  approx = pytest.approx
  assert rep["success_rate"] == approx(0.5)
  assert rep["success_ci"] == approx(list(metrics.wilson_interval(3, 6)))
  assert rep["success_rate_excluding_env_errors"] == approx(3 / 5)
  # Per task (n, c) = (2, 1), (2, 2), (2, 0); k > 2 is not reported.
  assert rep["pass_at_k"] == {"1": approx(0.5), "2": approx(2 / 3)}
  assert rep["pass_hat_k"] == {"1": approx(0.5), "2": approx(1 / 3)}
  assert rep["milestone_success"] == {"a": approx(5 / 6), "b": approx(3 / 6), "c": approx(1 / 6)}
  assert rep["cost_per_success"] == approx(8.0 / 3)
  assert rep["recovery_rate"] == approx(0.5)
  assert rep["env_error_rate"] == approx(1 / 6)
  assert rep["violation_rate"] == approx(1 / 6)
  assert rep["unauthorized_call_rate"] == approx(2 / 6)
  assert rep["collateral_damage_rate"] == approx(1 / 6)
  assert rep["loop_rate"] == approx(1 / 6)
  assert rep["truncation_rate"] == approx(2 / 6)
  assert rep["attack_success_rate"] == approx(0.5)
  assert rep["steps"] == {"success": approx(3.0), "failure": approx(14 / 3)}
  assert rep["tokens"] == {"success": approx(30.0), "failure": approx(140 / 3)}
  assert rep["tool_calls"] == {"success": approx(2.0), "failure": approx(10 / 3)}
  assert (rep["num_episodes"], rep["num_tasks"], rep["attempts_per_task"]) == (6, 3, 2)
  assert rep["bucket_name"] == "difficulty"
  assert rep["by_bucket"] == {
      "0": {"success_rate": approx(0.5), "success_ci": approx(list(metrics.wilson_interval(1, 2))),
            "num_episodes": 2, "mean_steps": approx(4.0)},
      "1": {"success_rate": approx(2 / 3), "success_ci": approx(list(metrics.wilson_interval(2, 3))),
            "num_episodes": 3, "mean_steps": approx(14 / 3)},
      "2": {"success_rate": 0.0, "success_ci": approx(list(metrics.wilson_interval(0, 1))),
            "num_episodes": 1, "mean_steps": approx(1.0)},
  }
  for value in (rep["success_rate"], rep["num_episodes"], rep["pass_at_k"]["1"]):
    assert type(value) in (float, int)


def test_report_nulls():
  records = hand_records()
  for key in ("collateral_damage", "attacked", "attack_success", "bucket"):
    del records[key]
  records["success"] = np.zeros(6, bool)
  records["faulted"] = np.zeros(6, bool)
  records["milestones"] = np.zeros(6, np.int64)
  rep = metrics.report(records, k_max=1, milestone_names=MILESTONES)
  json.dumps(rep, allow_nan=False)
  assert set(rep) == TOP_KEYS
  assert rep["cost_per_success"] is None
  assert rep["recovery_rate"] is None
  assert rep["collateral_damage_rate"] is None
  assert rep["attack_success_rate"] is None
  assert rep["steps"] == {"success": None, "failure": pytest.approx(23 / 6)}
  assert rep["success_ci"] == [0.0, pytest.approx(metrics.wilson_interval(0, 6)[1])]
  assert rep["pass_at_k"] == {"1": 0.0} and rep["pass_hat_k"] == {"1": 0.0}
  assert rep["milestone_success"] == {"a": 0.0, "b": 0.0, "c": 0.0}
  # Attack keys present but nobody attacked: still null.
  records["attacked"] = records["attack_success"] = np.zeros(6, bool)
  assert metrics.report(records, k_max=1, milestone_names=MILESTONES)["attack_success_rate"] is None
  # Every episode an env error: the rate without them is undefined.
  records["env_error"] = np.ones(6, bool)
  assert metrics.report(records, k_max=1, milestone_names=MILESTONES)[
      "success_rate_excluding_env_errors"] is None


def test_report_uneven_attempts():
  # Task 7 has 3 attempts, task 9 has 2: k stops at the minimum; records may come as 0/1 ints.
  records = {key: np.zeros(5, np.int64) for key in metrics.REQUIRED_KEYS}
  records["task"] = np.array([7, 9, 7, 9, 7])
  records["success"] = np.array([1, 0, 0, 1, 1])
  rep = metrics.report(records, k_max=3, milestone_names=())
  assert (rep["num_tasks"], rep["attempts_per_task"]) == (2, 2)
  assert rep["pass_at_k"] == {"1": pytest.approx((2 / 3 + 1 / 2) / 2),
                              "2": pytest.approx((1.0 + 1.0) / 2)}
  assert rep["pass_hat_k"]["2"] == pytest.approx((1 / 3 + 0.0) / 2)
  assert rep["success_rate"] == pytest.approx(3 / 5)


def test_report_errors():
  def check(match, k_max=2, milestone_names=MILESTONES, **changes):
    records = hand_records()
    for key, value in changes.items():
      if value is None:
        del records[key]
      else:
        records[key] = value
    with pytest.raises(ValueError, match=match):
      metrics.report(records, k_max=k_max, milestone_names=milestone_names)

  check(r"missing required key\(s\) \['tokens'\]", tokens=None)
  check(r"records\['cost'\] has shape \(5,\), expected \[E\] = \(6,\)", cost=np.zeros(5))
  check(r"records\['bucket'\] has shape \(6, 1\), expected \[E\] = \(6,\)",
        bucket=np.zeros((6, 1), int))
  check(r"records\['loop'\] must be bool", loop=np.array([0, 2, 0, 0, 0, 0]))
  check(r"records\['num_steps'\] must hold integers", num_steps=np.full(6, 1.5))
  check(r"records\['tokens'\] must be >= 0", tokens=-np.ones(6, int))
  check(r"records\['cost'\] holds non-finite", cost=np.array([np.nan] + [0.0] * 5))
  check("bit\\(s\\) >= len\\(milestone_names\\) = 2", milestone_names=("a", "b"))
  check("has 'attack_success' but not 'attacked'", attacked=None)
  check("True on episodes without an attack", attack_success=np.ones(6, bool))
  check("k_max must be a positive int", k_max=0)
  check(r"records\['task'\] must have shape \[E\]", task=np.zeros(0, int))


# ----------------------------------------------------------------------------------------------------
# Pareto front and plots.


def test_pareto_front_by_hand():
  cost = [1.0, 2.0, 3.0, 2.0, 0.5, 3.0]
  success = [0.5, 0.7, 0.6, 0.7, 0.1, 0.7]
  # 2 is dominated by 1 (cheaper, better), 5 by 1 (same success, cheaper); 1 and 3 tie and stay.
  np.testing.assert_array_equal(metrics.pareto_front(cost, success), [4, 0, 1, 3])
  np.testing.assert_array_equal(metrics.pareto_front([1.0], [0.0]), [0])
  with pytest.raises(ValueError, match="shape"):
    metrics.pareto_front([1.0, 2.0], [0.5])
  with pytest.raises(ValueError, match="finite"):
    metrics.pareto_front([np.nan], [0.5])


def test_plot_report_writes_png(tmp_path):
  policy = metrics.report(hand_records(), k_max=2, milestone_names=MILESTONES)
  oracle = {**policy, "success_rate": 1.0, "success_ci": [0.6, 1.0], "cost_per_success": 1.0}
  random = {**policy, "success_rate": 0.0, "cost_per_success": None}  # left out of panel (c)
  no_buckets = {k: v for k, v in policy.items() if k not in BUCKET_KEYS}
  for name, arg in (("one.png", policy), ("many.png", [("oracle", oracle), ("random", random),
                                                       ("policy", policy)]),
                    ("dict.png", {"a": no_buckets, "b": policy}), ("flat.png", no_buckets)):
    path = metrics.plot_report(arg, tmp_path / "sub" / name)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
  with pytest.raises(ValueError, match="plot_report takes"):
    metrics.plot_report([("x", {"not": "a report"})], tmp_path / "bad.png")
