"""Fixtures shared by the rollout-level tests (test_rollout, test_branch_rollouts,
test_recovery_tasks): pointer_chain with 2 hops under a step limit (the test module's
`MAX_STEPS`, default 5), its compact codec, and a random tiny policy of that codec's vocabulary."""

import dataclasses
import importlib
import os
import sys

import jax
import pytest

from longhorizon import envs
from longhorizon.models import init_params, tiny_config


@pytest.fixture(scope="module")
def env(request):
  return envs.TimeLimit(envs.make("pointer_chain", horizon=2),
                        getattr(request.module, "MAX_STEPS", 5))


@pytest.fixture(scope="module")
def codec(env):
  return env.codec(style="compact")


@pytest.fixture(scope="module")
def model(codec):
  config = dataclasses.replace(tiny_config(), vocab_size=len(codec.tokenizer))
  return config, init_params(config, jax.random.key(0))


@pytest.fixture(scope="session")
def host_fixtures():
  """tests/envs/host_fixtures.py (the pool tests' host environments), imported by its name (the
  process backend's workers import it so)."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "envs"))
  return importlib.import_module("host_fixtures")
