"""Fixtures shared by the rollout-level tests (test_rollout, test_branch_rollouts,
test_recovery_tasks): pointer_chain with 2 hops under a step limit (the test module's
`MAX_STEPS`, default 5), its compact codec, and a random tiny policy of that codec's vocabulary;
and by the update-level tests (test_nonfinite, test_skip_zero_grad): a scripted batch for
`rl_update` (`update_batch`)."""

import dataclasses
import importlib
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.core.episode import to_device
from longhorizon.envs import testing
from longhorizon.models import init_params, tiny_config
from longhorizon.train.update import episode_logprobs


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


@pytest.fixture(scope="module")
def update_batch():
  """A tiny hand-built `rl_update` input, so the update compiles in seconds: 8 scripted (noisy
  oracle) pointer_chain episodes (4 tasks x 2, 1 hop, compact vocabulary) on device, a 2-layer
  model's initial parameters and their log-probs `old_logp [B, L]`, the bool loss `mask [B, L]`
  (every row has trained tokens) and `advantages [B, L]`: +1 / -1 per group member on the mask."""
  env = envs.make("pointer_chain", horizon=1)
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(0), 4)
  tasks = testing.tasks_from_keys(env, keys, "train")
  config = rollout.RolloutConfig(group_size=2, context_length=64, max_steps=3, turn_tokens=8)
  batch, _ = rollout.collect(None, None, env, codec, tasks, keys, config, sampling_seed=0,
                             scripted=rollout.oracle_turns(env, codec, epsilon=0.3))
  batch = to_device(batch)
  model_config = tiny_config(vocab_size=len(codec.tokenizer))
  params = init_params(model_config, jax.random.key(1))
  old_logp = jax.jit(episode_logprobs, static_argnames=("config",))(params, model_config, batch)
  mask = np.asarray(batch.loss_mask)
  assert mask.any(-1).all()
  signs = np.tile([1.0, -1.0], 4)[:, None]
  advantages = jnp.asarray(np.where(mask, signs, 0.0), jnp.float32)
  return types.SimpleNamespace(model_config=model_config, params=params, batch=batch,
                               old_logp=old_logp, advantages=advantages, mask=mask)
