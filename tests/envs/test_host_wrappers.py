"""Faults, tool costs and loop detection around a host environment's calls
(`envs/host_wrappers.py`), through the rollout loop: the JAX wrappers' semantics on back_office (a
real SQLite environment) and the free-text example environment."""

import json
import os

import jax
import numpy as np
import pytest

from longhorizon import rollout
from longhorizon.envs import host_wrappers
from longhorizon.envs.back_office import BackOffice
from longhorizon.envs.host import HostEnvironment, Observation, StepResult
from longhorizon.envs.types import ErrorCode
from longhorizon.eval import metrics as metrics_lib
from longhorizon.eval.runner import records_from_rollout
from longhorizon.rollout.versions import env_version

CONFIG = rollout.RolloutConfig(group_size=1, context_length=16384, max_steps=24, turn_tokens=192)


def _call(name: str, **arguments) -> str:
  return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _collect(env, tasks, scripted=None, config=CONFIG, key=0):
  codec = env.codec(None, "tool_call") if env.tools else env.codec()
  scripted = scripted or rollout.oracle_turns(env, codec)
  return rollout.collect(None, None, env, codec, tasks,
                         jax.random.split(jax.random.key(key), len(tasks)), config,
                         sampling_seed=0, scripted=scripted)


def _oracle_calls(env: BackOffice, task) -> list[str]:
  """The oracle's calls on `task`, stepped on an unguarded instance."""
  env.reset(task, 0)
  calls = []
  while (action := env.oracle()) is not None:
    calls.append(action)
    if env.step(action).terminated:
      break
  return calls


def test_recoverable_faults_are_retried_and_counted():
  """Timeouts on 30% of calls: each faulted call is answered with the error and never reaches the
  database, the oracle retries it and still succeeds; the faulted share of calls is 0.3 within
  four standard deviations, the draws repeat exactly with the same row seeds, and the
  evaluation report's recovery rate is filled."""
  env = host_wrappers.guard(BackOffice(), faults={"timeout": 0.3})
  tasks = env.tasks("test", 12, 5)
  batch, stats = _collect(env, tasks)
  again, _ = _collect(env, tasks)
  steps = np.asarray(batch.step_mask, bool)
  fault = np.asarray(stats.episode_info["faulted"], bool)
  assert batch.success.all() and fault.any()
  n = steps.sum()
  needed = sum(len(_oracle_calls(BackOffice(), t)) for t in tasks)
  share = (n - needed) / n  # the oracle repeats each faulted call: one step more per fault
  assert abs(share - 0.3) < 4 * np.sqrt(0.3 * 0.7 / n), (share, n)
  np.testing.assert_array_equal(again.tokens, batch.tokens)
  np.testing.assert_array_equal(np.asarray(again.num_steps), np.asarray(batch.num_steps))
  report = metrics_lib.report(records_from_rollout(batch, stats, attempts=1), k_max=1,
                              milestone_names=env.milestone_names)
  assert report["recovery_rate"] == 1.0


def test_every_call_faulting_makes_no_progress_and_is_no_loop():
  env = host_wrappers.guard(BackOffice(), faults={"timeout": 1.0}, loop_k=2)
  config = rollout.RolloutConfig(group_size=1, context_length=16384, max_steps=5, turn_tokens=192)
  batch, stats = _collect(env, env.tasks("test", 3, 1), config=config)
  assert not batch.success.any() and bool(np.all(batch.truncated))
  assert (np.asarray(batch.num_steps) == 5).all()  # the step limit, not the loop check, ended them
  assert not np.asarray(stats.episode_info["loop"]).any()
  assert np.asarray(stats.episode_info["faulted"]).all()
  assert not np.asarray(batch.milestones).any()  # no call reached the database
  # A faulted call did not act: every step is taken in the first state (GiGPO's anchor groups).
  anchors = np.asarray(batch.anchor)
  assert (anchors == anchors[:, :1]).all() and len(set(anchors[:, 0].tolist())) == 3


def test_an_env_error_fault_stops_the_episode_as_an_environment_error():
  env = host_wrappers.guard(BackOffice(), faults={"unavailable": 1.0})
  batch, _ = _collect(env, env.tasks("test", 3, 2))
  assert np.asarray(batch.env_error).any(-1).all() and not batch.success.any()
  assert (np.asarray(batch.num_steps) == 1).all()


def test_tool_costs_add_to_cost_and_come_off_the_reward():
  """Each get_order call costs 0.5, and reward.cost = 0.2 takes 0.1 per call off the score."""
  env = host_wrappers.guard(BackOffice(cost=0.2), tool_costs={"get_order": 0.5})
  plain = BackOffice(cost=0.2)
  tasks = env.tasks("test", 4, 3)
  batch, _ = _collect(env, tasks)
  base, _ = _collect(plain, tasks)
  reads = np.array([sum('"get_order"' in c for c in _oracle_calls(BackOffice(), t)) for t in tasks])
  assert reads.min() >= 1
  np.testing.assert_allclose(np.asarray(batch.cost).sum(-1), 0.5 * reads, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(base.score) - np.asarray(batch.score), 0.1 * reads,
                             rtol=1e-5, atol=1e-6)


def test_a_repeated_call_in_the_same_state_is_a_loop():
  """The same read in the same state for the third time truncates the episode with `loop`; the
  oracle, which never repeats itself, is not stopped."""
  env = host_wrappers.guard(BackOffice(), loop_k=3)
  tasks = env.tasks("test", 2, 4)
  codec = env.codec(None, "tool_call")
  same = _call("find_customer", email=tasks[0]["email"])

  def repeat(states):
    return [codec.encode_action(same) if states.active[r] else [] for r in range(2)]

  batch, stats = _collect(env, tasks[:1] * 2, scripted=repeat)
  # Calls 2, 3, 4 are all made in the state the first one left: the third of them is the loop.
  assert np.asarray(stats.episode_info["loop"]).all() and bool(np.all(batch.truncated))
  assert (np.asarray(batch.num_steps) == 4).all()
  oracle, stats = _collect(env, tasks)
  assert oracle.success.all() and not np.asarray(stats.episode_info["loop"]).any()


class Countdown(HostEnvironment):
  """Free-text actions (no tool schemas): any three actions succeed."""
  name, version = "countdown_test", "1"

  def tasks(self, split, num, seed):
    return [{"id": i} for i in range(num)]

  def reset(self, task, seed):
    self._left = 3
    return Observation("say anything three times")

  def step(self, action):
    self._left -= 1
    return StepResult(f"{self._left} to go", terminated=self._left == 0, success=self._left == 0)


def test_free_text_actions_fault_as_one_tool():
  """Without tool schemas every non-empty action is a call: at rate 1 none reaches the
  environment (no success in 3 steps); unguarded, the same script succeeds in 3."""
  config = rollout.RolloutConfig(group_size=1, context_length=512, max_steps=3, turn_tokens=4)
  plain = Countdown()
  codec = plain.codec()
  say = lambda states: [codec.encode_action("go") if a else [] for a in states.active]
  batch, _ = _collect(plain, plain.tasks("test", 2, 0), scripted=say, config=config)
  assert batch.success.all()
  env = host_wrappers.guard(Countdown(), faults={"empty_result": 1.0})
  batch, stats = _collect(env, env.tasks("test", 2, 0), scripted=say, config=config)
  assert not batch.success.any() and np.asarray(stats.episode_info["faulted"]).all()
  assert (np.asarray(batch.num_steps) == 3).all()


def test_guard_validates_and_enters_the_fingerprint():
  env = BackOffice()
  before = env_version(env)
  host_wrappers.guard(env, faults={"timeout": 0.1})
  assert env_version(env) != before
  assert host_wrappers.guards_of(BackOffice()) is None
  for kwargs, message in [({"faults": {"meteor": 0.1}}, "unknown fault kind"),
                          ({"faults": {"timeout": 0.7, "unavailable": 0.5}}, "sum to <= 1"),
                          ({"faults": {"teleport": {"timeout": 0.1}}}, "neither a fault kind"),
                          ({"tool_costs": {"teleport": 1.0}}, "unknown tool"),
                          ({"env_error_kinds": ("meteor",)}, "unknown fault kind"),
                          ({"loop_k": 1}, "k >= 2")]:
    with pytest.raises(ValueError, match=message):
      host_wrappers.guard(BackOffice(), **kwargs)
  assert int(ErrorCode.TIMEOUT) == 16  # the faults' codes are the JAX wrappers'


def test_the_config_guards_a_host_environment():
  """`env.faults`, `env.tool_costs` and `env.loop_k` reach a host environment through the
  learner's `make_env` (they were refused before), and a bad kind is a ConfigError naming them."""
  import importlib.util
  from longhorizon.train import config as config_lib
  from longhorizon.train.learner import make_env
  spec = importlib.util.spec_from_file_location(
      "default_config", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "default.py"))
  default = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(default)
  config = default.get_config("smoke")
  config.unlock()
  config.env.name, config.env.params = "back_office", {}
  config.env.faults, config.env.tool_costs, config.env.loop_k = {"timeout": 0.1}, {"refund": 2.0}, 3
  guards = host_wrappers.guards_of(make_env(config))
  assert dict(guards.faults)["get_order"] == (("timeout", 0.1),)
  assert guards.tool_costs == (("refund", 2.0),) and guards.loop_k == 3
  config.env.faults = {"meteor": 0.1}
  with pytest.raises(config_lib.ConfigError, match="env.faults"):
    make_env(config)
  config.env.faults, config.rollout.branch_k = {"timeout": 0.1}, 1
  with pytest.raises(config_lib.ConfigError, match="rollout.branch_k"):
    make_env(config)
