"""The policy-collapse alarms (RAGEN's Echo Trap, `train/loop.py:collapse_alarms`): the
zero-advantage group rate they read, each alarm's conditions by hand at its thresholds, and the
warning the loop logs."""

import logging

import ml_collections
import numpy as np
import pytest

from longhorizon.core import episode as episode_lib
from longhorizon.train import loop
from longhorizon.train.learner import episode_metrics


def _alarm_config(min_entropy=0.01, max_zero=0.5, ceiling=0.9):
  config = ml_collections.ConfigDict()
  config.alarm = ml_collections.ConfigDict(
      {"min_entropy": min_entropy, "max_zero_advantage_rate": max_zero,
       "success_ceiling": ceiling})
  return config


def _batch(groups, scores):
  batch = episode_lib.empty(len(groups), 4, 2)
  batch.group[:] = groups
  batch.score[:] = scores
  batch.success[:] = np.asarray(scores) >= 1.0
  return batch


def test_zero_advantage_group_rate_counts_groups_whose_scores_are_all_equal():
  # Three groups of 3: all-fail, mixed, all-success -> 2 of 3 groups give no learning signal.
  batch = _batch([0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 1, 0.5, 1, 1, 1])
  out = episode_metrics(batch, np.ones(9))
  assert out["zero_advantage_group_rate"] == pytest.approx(2 / 3)
  assert out["success_rate"] == pytest.approx(4 / 9)
  # Groups need not be contiguous, and one differing member is enough.
  batch = _batch([5, 7, 5, 7], [0.25, 0.25, 0.25, 0.5])
  assert episode_metrics(batch, np.ones(4))["zero_advantage_group_rate"] == pytest.approx(0.5)


@pytest.mark.parametrize("entropy, zero_rate, success, expected", [
    # (entropy collapse, reward-std collapse)
    (0.5, 0.0, 0.1, (0, 0)),      # healthy
    (0.005, 0.0, 0.1, (1, 0)),    # entropy below 0.01 while failing
    (0.005, 0.0, 0.995, (0, 0)),  # low entropy on a solved task is no alarm
    (0.01, 0.0, 0.1, (0, 0)),     # at the threshold: not below it
    (0.5, 0.75, 0.2, (0, 1)),     # 3 of 4 groups flat while failing
    (0.5, 0.5, 0.2, (0, 0)),      # at the rate threshold: not above it
    (0.5, 1.0, 0.95, (0, 0)),     # flat groups because the task is solved: no alarm
    (0.005, 1.0, 0.0, (1, 1)),    # both
])
def test_collapse_alarms_by_hand(entropy, zero_rate, success, expected):
  out = loop.collapse_alarms(_alarm_config(), {"entropy": entropy, "success_rate": success,
                                               "zero_advantage_group_rate": zero_rate})
  assert (out["alarm/entropy_collapse"], out["alarm/reward_std_collapse"]) == expected
  assert out["alarm/collapse"] == float(any(expected))
  assert all(isinstance(v, float) for v in out.values())  # metrics.jsonl takes floats


def test_the_loop_warns_on_an_alarm_and_names_the_signals(caplog):
  metrics = {"entropy": 0.001, "success_rate": 0.25, "zero_advantage_group_rate": 1.0}
  metrics.update(loop.collapse_alarms(_alarm_config(), metrics))
  with caplog.at_level(logging.WARNING):
    loop._warn_about(6, metrics, 0)
  (record,) = [r for r in caplog.records if "collapse alarm" in r.getMessage()]
  assert "update 7" in record.getMessage() and "entropy 0.0010" in record.getMessage()
  assert "zero-advantage group rate 1.00 at success 0.25" in record.getMessage()
  caplog.clear()
  healthy = {"entropy": 0.5, "success_rate": 0.25, "zero_advantage_group_rate": 0.0}
  healthy.update(loop.collapse_alarms(_alarm_config(), healthy))
  with caplog.at_level(logging.WARNING):
    loop._warn_about(6, healthy, 0)
  assert not [r for r in caplog.records if "collapse alarm" in r.getMessage()]
