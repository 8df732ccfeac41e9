"""Config validation checks what it claims: every numeric field has a range, the probes that used
to pass (negative gradient clip, discounts outside [0, 1], ...) are refused naming the field, and
any config that validation accepts runs a warm start and an RL update without an exception."""

import math

import hypothesis
from hypothesis import strategies as st
import jax
import numpy as np
import pytest

from configs import default as default_config
from longhorizon.train import config as config_lib
from longhorizon.train.learner import Learner
from longhorizon.train.metrics import Timer


def _numeric_paths(node, prefix=""):
  for key, value in node.items():
    if key in ("params", "faults", "tool_costs", "rules"):
      continue  # environment parameters and per-kind maps: checked by their own rules
    if hasattr(value, "items"):
      yield from _numeric_paths(value, f"{prefix}{key}.")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield prefix + key


def test_every_numeric_field_has_a_range():
  paths = set(_numeric_paths(default_config.get_config()))
  assert paths - set(config_lib.RANGES) == set()
  assert set(config_lib.RANGES) - paths == set()  # no stale entries


def test_range_by_hand():
  r = config_lib.Range(float, 0, 1, high_open=True, note="x")
  assert r.holds(0) and r.holds(0.5) and not r.holds(1.0) and not r.holds(-0.1)
  assert not r.holds(float("nan")) and not r.holds(True) and not r.holds("0.5")
  assert r.describe() == "a number in [0, 1) (x)"
  assert config_lib.Range(int, 1).describe() == "an integer >= 1"
  assert not config_lib.Range(int, 1).holds(2.0)


def _config(**changes):
  config = default_config.get_config("smoke")
  config.unlock()
  for path, value in changes.items():
    config_lib.set_path(config, path, value)
  return config


@pytest.mark.parametrize("changes,message", [
    ({"optim.max_grad_norm": -1.0}, "config.optim.max_grad_norm=-1.0"),
    ({"algorithm.gamma": 1.5}, "config.algorithm.gamma=1.5 is not allowed; expected a number in [0, 1]"),
    ({"algorithm.lam": -0.1}, "config.algorithm.lam=-0.1"),
    ({"algorithm.step_gamma": 2.0}, "config.algorithm.step_gamma=2.0"),
    ({"curriculum.ema": 1.5}, "config.curriculum.ema=1.5"),
    ({"curriculum.ema": 0.0}, "config.curriculum.ema=0.0"),
    ({"loss.clip_low": 1.0}, "config.loss.clip_low=1.0 is not allowed; expected a number in [0, 1)"),
    ({"alarm.min_entropy": -0.5}, "config.alarm.min_entropy=-0.5"),
    ({"sft.episodes": 0}, "config.sft.episodes=0 is not allowed; expected an integer >= 1 with sft.steps=4"),
    ({"rollout.group_size": 1}, "config.rollout.group_size=1 is not allowed; expected an integer >= 2 for "
                                "algorithm.name='grpo'"),
    ({"rollout.group_size": 1, "algorithm.name": "rloo"}, "for algorithm.name='rloo'"),
    ({"seed": -1}, "config.seed=-1"),
    ({"env.loop_k": 1}, "config.env.loop_k=1"),
    ({"env.faults": {"timeout": 0.7, "unavailable": 0.6}}, "sum to at most 1"),
    ({"env.tool_costs": {"lookup": -1.0}}, "config.env.tool_costs.lookup=-1.0"),
    ({"curriculum.num_buckets": 4, "curriculum.floor": 0.5}, "config.curriculum.floor=0.5"),
    ({"model.hidden_size": 12, "model.num_attention_heads": 4, "model.num_key_value_heads": 2},
     "leaving an even head size"),
    ({"mesh.data": 4096}, "config.mesh.data=4096"),
    ({"reward.cost": -1.0}, "config.reward.cost=-1.0"),
])
def test_probes_that_used_to_pass_are_refused(changes, message):
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(_config(**changes))
  assert message in str(info.value)


def test_sft_off_needs_no_episodes_and_ppo_runs_single_rollouts():
  config_lib.validate(_config(**{"sft.steps": 0, "sft.episodes": 0}))
  config_lib.validate(_config(**{"rollout.group_size": 1, "algorithm.name": "ppo",
                                 "optim.minibatches": 1}))


def _candidates(path, valid: config_lib.Range):
  """Values at and around the edges of a field's range, kept small where size means run time."""
  lo = 0 if valid.low == -math.inf else valid.low
  hi = lo + 3 if valid.high == math.inf else valid.high
  if valid.kind is int:
    values = {int(lo) - 1, int(lo), int(lo) + 1, int(lo) + 2}
  else:
    values = {lo, hi, lo - 0.5, hi + 0.5, (lo + hi) / 2, float("nan"), float("inf")}
  return sorted(values, key=repr)


# Fields whose valid values only change cost or shape, not correctness: drawn small so an example
# runs in seconds. (A context shorter than the task prompt plus one turn, 43 tokens here, depends
# on the environment's text, so `validate` cannot see it; `collect` refuses it, naming
# rollout.context_length.)
_SMALL = {"model.hidden_size": [8, 16, 32], "model.intermediate_size": [8, 32],
          "rollout.context_length": [48, 96], "rollout.turn_tokens": [1, 2, 6],
          "tasks.train_size": [1, 4, 64], "tasks.test_size": [1, 4], "tasks.ood_size": [1, 4],
          "num_updates": [1], "eval.num_tasks": [1, 4], "sft.steps": [0, 1, 2],
          "sft.episodes": [0, 1, 4, 8], "eval.every": [0, 1], "env.max_steps": [1, 2, 6],
          "rollout.num_tasks": [1, 2, 4], "rollout.group_size": [1, 2, 4],
          "optim.epochs": [1, 2], "model.num_hidden_layers": [1, 2]}


@pytest.mark.slow
def test_any_config_that_validates_runs_an_update(tmp_path):
  """Property: mutate a few fields to values at, inside and outside their ranges; whenever
  `validate` accepts the result, set-up, the SFT warm start and one RL update run without an
  exception and with finite metrics."""
  paths = sorted(config_lib.RANGES)
  accepted = []

  def field_values(path):
    options = _SMALL.get(path) or _candidates(path, config_lib.RANGES[path])
    return st.tuples(st.just(path), st.sampled_from(options))

  @hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(st.lists(st.sampled_from(paths).flatmap(field_values), min_size=1, max_size=4,
                             unique_by=lambda pair: pair[0]))
  # Configs that used to pass validation and then crash (IndexError in SFT; no such mesh).
  @hypothesis.example([("sft.episodes", 0)])
  @hypothesis.example([("mesh.data", 2)])
  def check(pairs):
    changes = dict(pairs)
    config = _config(**{"tasks.data_dir": str(tmp_path / "tasks"), "sft.steps": 1,
                        "eval.num_tasks": 4, **changes})
    try:
      config_lib.validate(config)
    except config_lib.ConfigError:
      return
    hypothesis.note(f"accepted: {changes}")
    if len(accepted) >= 8:
      return  # the expensive part runs for the first 8 accepted configs
    accepted.append(changes)
    s = Learner.build(config)
    with s.in_mesh():
      state = s.initial_state()
      state, _ = s.warm_start(state)
      state = s.with_reference(state)
      state, metrics = s.step(state, 0, 0, Timer())
    values = np.array([v for v in metrics.values() if np.ndim(v) == 0], np.float64)
    assert np.isfinite(values).all(), {k: v for k, v in metrics.items() if np.ndim(v) == 0}
    jax.clear_caches()

  check()
  assert len(accepted) == 8, accepted


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_warm_start_logs_its_demonstrations_and_progress(tmp_path, caplog):
  config = _config(**{"tasks.data_dir": str(tmp_path / "tasks"), "sft.steps": 10,
                      "sft.episodes": 8})
  s = Learner.build(config)
  with s.in_mesh(), caplog.at_level("INFO"):
    _, metrics = s.warm_start(s.initial_state())
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SFT")]
  assert lines[0].startswith("SFT: 8 demonstration episodes in "), lines
  # Every fifth of the steps (2, 4, ..., 10), with the step's loss; the last one is the returned.
  assert [line.split(":")[0] for line in lines[1:]] == [f"SFT step {i}/10" for i in (2, 4, 6, 8, 10)]
  assert f"nll {metrics['sft_nll']:.3f}" in lines[-1]
