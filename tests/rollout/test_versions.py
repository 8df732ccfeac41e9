"""`env_version` / `reward_version`: fingerprints that change with what produced an episode, and
only with that; `collect` records them on every row."""

import dataclasses

import jax
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.envs import testing
from longhorizon.envs.pointer_chain import PointerChain


def _chain(horizon=2, max_steps=5, **wrappers):
  env = envs.TimeLimit(envs.make("pointer_chain", horizon=horizon), max_steps)
  if "faults" in wrappers:
    env = envs.FaultInjection(env, wrappers["faults"])
  if "costs" in wrappers:
    env = envs.ToolCost(env, wrappers["costs"])
  return env


class _NextChain(PointerChain):
  version = "2"


def test_env_version_depends_on_the_environment_and_only_on_it():
  version = rollout.env_version(_chain())
  assert version == rollout.env_version(_chain())  # rebuilt: same fingerprint
  assert 0 <= version < 2**31  # fits the int32 field
  others = [_chain(horizon=3), _chain(max_steps=6), envs.make("pointer_chain", horizon=2),
            _chain(faults={"timeout": 0.1}), _chain(faults={"timeout": 0.2}),
            _chain(costs={"lookup": 1.0}), _chain(costs={"lookup": 2.0}),
            envs.TimeLimit(_NextChain(horizon=2), 5),
            envs.TimeLimit(envs.make("pointer_chain", horizon=2, success=2.0), 5)]
  versions = [rollout.env_version(e) for e in others]
  assert version not in versions and len(set(versions)) == len(versions)


def test_reward_version_is_a_function_of_the_field_values():
  default = rollout.reward_version(envs.RewardSpec())
  assert default == rollout.reward_version(envs.RewardSpec(success=1.0))
  assert default == 1578723728  # crc32 is stable across processes and platforms: pinned
  changed = [rollout.reward_version(envs.RewardSpec(**{f.name: f.default + 0.5 * (i + 1)}))
             for i, f in enumerate(dataclasses.fields(envs.RewardSpec))]
  assert default not in changed and len(set(changed)) == len(changed)


@pytest.mark.parametrize("reward", [None, envs.RewardSpec(milestone=0.1)])
def test_collect_records_both_versions_on_every_row(reward):
  env = _chain() if reward is None else envs.TimeLimit(
      envs.make("pointer_chain", horizon=2, reward=reward), 5)
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(1), 2)
  rc = rollout.RolloutConfig(group_size=2, context_length=128, max_steps=5, turn_tokens=6)
  batch, _ = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys, rc,
                             sampling_seed=0, scripted=rollout.oracle_turns(env, codec))
  batch.validate()
  np.testing.assert_array_equal(batch.env_version, [rollout.env_version(env)] * 4)
  expected = rollout.reward_version(reward or envs.RewardSpec())
  np.testing.assert_array_equal(batch.reward_version, [expected] * 4)
  assert batch.env_version.dtype == np.int32 and batch.reward_version.dtype == np.int32
