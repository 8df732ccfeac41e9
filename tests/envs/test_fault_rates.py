"""Per-tool fault rates (`FaultInjection`'s `rates` with a tool's own entry): each tool draws from
its own table, equal call for call to the shared-rate wrapper built with that tool's rates; the
frequencies match the configured rates; bad tables are refused with the problem named; the
config path and evaluate.py's `--faults` take them."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import default as default_config
from longhorizon import envs
from longhorizon.train import config as config_lib
from longhorizon.train.learner import make_env

N = 4096


def _first_step_faults(env, tool: int, keys):
  """The fault code of each row's first call (tool `tool`, argument 0)."""
  states, _ = jax.vmap(env.reset)(keys)
  action = envs.Action.make(tool, [0], env.num_args)
  _, ts = jax.vmap(env.step, in_axes=(0, None))(states, action)
  return np.asarray(ts.fault), np.asarray(ts.env_error)


def test_tool_fault_rates_by_hand():
  table = envs.tool_fault_rates({"timeout": 0.1, "answer": {"unavailable": 0.5}},
                                ["lookup", "answer"])
  assert table == {"lookup": {"timeout": 0.1}, "answer": {"unavailable": 0.5}}
  assert envs.tool_fault_rates({"timeout": 0.25}, ["a", "b"]) == {"a": {"timeout": 0.25},
                                                                  "b": {"timeout": 0.25}}
  with pytest.raises(ValueError, match=r"\['search'\] in the rates is neither a fault kind"):
    envs.tool_fault_rates({"search": {"timeout": 0.1}}, ["lookup", "answer"])
  with pytest.raises(ValueError, match=r"unknown fault kind\(s\) \['meteor'\] for tool 'answer'"):
    envs.tool_fault_rates({"answer": {"meteor": 0.1}}, ["lookup", "answer"])
  with pytest.raises(ValueError, match="for tool 'lookup' must be >= 0 and sum to <= 1"):
    envs.tool_fault_rates({"lookup": {"timeout": 0.7, "unavailable": 0.4}}, ["lookup", "answer"])
  with pytest.raises(ValueError, match="for every tool must be >= 0"):
    envs.tool_fault_rates({"timeout": -0.1}, ["lookup"])


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_each_tool_draws_from_its_own_rates():
  base = envs.make("pointer_chain", horizon=4)
  keys = jax.random.split(jax.random.key(3), N)
  rates = {"timeout": 0.2, "answer": {"unavailable": 0.3, "empty_result": 0.1}}
  mixed = envs.FaultInjection(base, rates, env_error_kinds=("unavailable",))
  for tool, own in ((0, {"timeout": 0.2}), (1, rates["answer"])):
    fault, env_error = _first_step_faults(mixed, tool, keys)
    # Call for call what the shared-rate wrapper with this tool's rates gives.
    alone, alone_error = _first_step_faults(
        envs.FaultInjection(base, own, env_error_kinds=("unavailable",)), tool, keys)
    np.testing.assert_array_equal(fault, alone)
    np.testing.assert_array_equal(env_error, alone_error)
    for kind, code in envs.FAULT_KINDS.items():
      p = own.get(kind, 0.0)
      tolerance = 4 * np.sqrt(max(p * (1 - p), 1e-4) / N)
      assert abs(np.mean(fault == code) - p) < tolerance, (tool, kind)
    assert (env_error == (fault == envs.ErrorCode.UNAVAILABLE)).all()
  # Shared rates alone: every tool the same table (the wrapper's behaviour before per-tool rates).
  shared = envs.FaultInjection(base, {"timeout": 0.2})
  np.testing.assert_array_equal(_first_step_faults(shared, 1, keys)[0],
                                _first_step_faults(mixed, 0, keys)[0])
  # A tool given an empty table of its own never fails.
  quiet = envs.FaultInjection(base, {"timeout": 0.5, "lookup": {}})
  assert not _first_step_faults(quiet, 0, keys)[0].any()
  assert _first_step_faults(quiet, 1, keys)[0].any()


def _config(faults):
  config = default_config.get_config("smoke")
  config.unlock()
  config.env.faults = faults
  config.lock()
  return config


def test_the_config_takes_per_tool_rates_and_names_bad_ones():
  env = make_env(config_lib.validate(_config({"timeout": 0.1, "answer": {"unavailable": 0.2}})))
  fault_wrapper = env
  while not isinstance(fault_wrapper, envs.FaultInjection):
    fault_wrapper = fault_wrapper.env
  assert fault_wrapper.rates == {"lookup": {"timeout": 0.1}, "answer": {"unavailable": 0.2}}
  with pytest.raises(config_lib.ConfigError, match=r"env\.faults\.answer.*sum to at most 1"):
    config_lib.validate(_config({"answer": {"unavailable": 0.8, "timeout": 0.4}}))
  with pytest.raises(config_lib.ConfigError, match=r"env\.faults\.answer\.timeout.*probability"):
    config_lib.validate(_config({"answer": {"timeout": 1.5}}))
  with pytest.raises(config_lib.ConfigError, match=r"env\.faults\.answer.*fault kinds"):
    config_lib.validate(_config({"answer": {"meteor": 0.1}}))
  with pytest.raises(config_lib.ConfigError, match=r"env\.faults: .*'search'.* nor a tool"):
    make_env(config_lib.validate(_config({"search": {"timeout": 0.1}})))


def test_evaluate_parses_per_tool_faults():
  """evaluate.py's parser, run in its own interpreter (its absl flags are process-global)."""
  code = ("import sys; sys.argv = ['evaluate']; sys.path.insert(0, 'experiments'); "
          "import evaluate; print(evaluate.parse_faults('timeout:0.1,answer.unavailable:0.2,"
          "answer.timeout:0.05'))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       check=True).stdout
  assert out.strip().splitlines()[-1] == (
      "{'timeout': 0.1, 'answer': {'unavailable': 0.2, 'timeout': 0.05}}")
