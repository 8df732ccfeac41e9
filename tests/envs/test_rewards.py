"""One reward definition (`envs.RewardSpec`): the environment's step reward and the composed
training reward come from the same weights, with one sign convention."""

import jax
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.envs import testing


def _oracle_batch(env, n=4):
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(0), n)
  rc = rollout.RolloutConfig(group_size=1, context_length=128, max_steps=6, turn_tokens=6)
  batch, _ = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys, rc,
                             sampling_seed=0, scripted=rollout.oracle_turns(env, codec))
  return batch


def test_the_environments_reward_is_what_training_composes():
  """`make(name, success=2.0, milestone=0.5)` changes the scores `collect` records (before the
  change to one definition, the environment's weights were ignored by training)."""
  plain = _oracle_batch(envs.TimeLimit(envs.make("pointer_chain", horizon=2), 6))
  weighted = _oracle_batch(envs.TimeLimit(
      envs.make("pointer_chain", horizon=2, success=2.0, milestone=0.5), 6))
  assert plain.success.all() and weighted.success.all()
  np.testing.assert_allclose(plain.score, 1.0)
  milestones = envs.make("pointer_chain", horizon=2).num_milestones
  np.testing.assert_allclose(weighted.score, 2.0 + 0.5 * milestones)
  assert (weighted.reward_version != plain.reward_version).all()


def test_step_reward_and_composition_agree_without_a_violation():
  """The environment's own `TimeStep.reward`, summed over each oracle episode (with weighted tool
  costs and milestones), equals the score `collect` composes for the same task and key."""
  spec = envs.RewardSpec(success=1.5, milestone=0.25, cost=2.0, invalid=0.1)
  env = envs.ToolCost(envs.TimeLimit(envs.make("pointer_chain", horizon=2, reward=spec), 6),
                      {"lookup": 0.05})
  keys = jax.random.split(jax.random.key(0), 4)
  tasks = testing.tasks_from_keys(env, keys)
  steps = testing.structured_rollout(env, keys, tasks, "oracle", max_steps=6)
  env_return = np.asarray(steps.reward).sum(0)
  batch = _oracle_batch(env, n=4)
  assert batch.success.all() and np.asarray(batch.cost).sum() > 0
  np.testing.assert_allclose(batch.score, env_return, rtol=1e-6)
  np.testing.assert_allclose(batch.score, 1.5 + 0.25 * env.num_milestones
                             - 2.0 * np.asarray(batch.cost).sum(-1), rtol=1e-6)


def test_one_sign_convention():
  with pytest.raises(ValueError, match=r"RewardSpec.violation must be a finite number >= 0"):
    envs.RewardSpec(violation=-1.0)
  with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['success_reward'\]"):
    envs.make("pointer_chain", success_reward=2.0)
  out = envs.compose_rewards(envs.RewardSpec(violation=3.0), step_mask=np.ones((1, 2), bool),
                             milestones=np.zeros((1, 2), np.int32), cost=np.zeros((1, 2)),
                             violation=np.array([[False, True]]), invalid=np.zeros((1, 2), bool),
                             success=np.array([False]), num_milestones=1)
  np.testing.assert_allclose(out["score"], [-3.0])
