"""Recovery tasks (`rollout/recovery.py`): `collect` keeps each failed episode's state and prefix
just after its first error; `collect_recovery` continues from there in a later update. A
continuation with the source's parameters and sampling stream reproduces the source episode token
for token (so the saved environment state and prefix are exactly the source's), its behaviour
log-probs equal a full forward pass under the parameters that continued it, and the learner mixes
recovery groups into its updates at an unchanged budget."""

import dataclasses

import jax
import numpy as np
import pytest

from longhorizon import rollout
from longhorizon.core.episode import RECOVERY, to_device
from longhorizon.envs import testing
from longhorizon.models import init_params, tiny_config
from longhorizon.rollout import recovery as recovery_lib
from longhorizon.train.update import episode_logprobs

N_TASKS, MAX_STEPS, G = 4, 6, 4


def _rc(**overrides):
  return rollout.RolloutConfig(**{**dict(group_size=G, context_length=128, max_steps=MAX_STEPS,
                                         turn_tokens=5, temperature=1.0,
                                         recovery_from="first_divergence"), **overrides})


@pytest.fixture(scope="module")
def source(env, codec, model):
  config, params = model
  keys = jax.random.split(jax.random.key(3), N_TASKS)
  return rollout.collect(params, config, env, codec, testing.tasks_from_keys(env, keys), keys,
                         _rc(), sampling_seed=7)


def test_starts_are_the_failed_episodes_after_their_first_error(source):
  batch, stats = source
  starts = stats.recovery
  first = recovery_lib.first_error_steps(batch, None, "first_divergence")
  expected = np.flatnonzero(~batch.success & (first >= 0) & (first + 1 < batch.num_steps))
  assert len(expected) >= 2, "the untrained policy should fail with room to recover"
  np.testing.assert_array_equal(starts.steps, first[expected] + 1)
  np.testing.assert_array_equal(starts.source_group, batch.group[expected])
  np.testing.assert_array_equal(starts.source_row, expected)
  for j, r in enumerate(expected):
    end = int(starts.buffer.end[j])
    # The prefix ends where the source's step `steps[j]` turn began, and is the source's.
    assert batch.loss_mask[r, end] and batch.turn[r, end] == starts.steps[j]
    np.testing.assert_array_equal(starts.buffer.batch.tokens[j, :end], batch.tokens[r, :end])
    assert not starts.buffer.batch.loss_mask[j].any()


def test_continuing_with_the_source_stream_reproduces_the_source_episode(env, codec, model,
                                                                          source):
  """Same parameters, same row id and seed: the continuation samples the source's tokens, so the
  environment state it was put back in and its prefix are exactly the source's."""
  batch, stats = source
  starts, (config, params) = stats.recovery, model
  for j, r in enumerate(starts.source_row):
    again, _ = rollout.collect_recovery(params, config, env, codec, starts.take([j]),
                                        _rc(group_size=1, recovery_from=""), sampling_seed=7,
                                        row_offset=int(r))
    again.validate()
    for name in ("tokens", "turn", "attention_mask", "rewards", "step_mask", "num_steps",
                 "success", "termination"):
      np.testing.assert_array_equal(getattr(again, name)[0], getattr(batch, name)[r], name)
    own = again.loss_mask[0]
    np.testing.assert_array_equal(own, batch.loss_mask[r] & (batch.turn[r] >= starts.steps[j]))
    np.testing.assert_allclose(again.behavior_logprobs[0][own], batch.behavior_logprobs[r][own],
                               atol=1e-4)
    assert again.parent[0] == RECOVERY and again.branch_step[0] == starts.steps[j]


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_recovery_groups_under_new_parameters(env, codec, model, source):
  """G continuations per start with other parameters: one group per start, the prefix copied with
  no loss, and behaviour log-probs equal to a full forward pass under the new parameters (the
  prefix was prefilled afresh, not taken from the old cache)."""
  _, stats = source
  starts, (config, _) = stats.recovery, model
  newer = init_params(config, jax.random.key(1))
  batch, rstats = rollout.collect_recovery(newer, config, env, codec, starts,
                                           _rc(recovery_from=""), sampling_seed=11,
                                           group_offset=100, policy_version=3)
  batch.validate()
  m = len(starts)
  assert batch.batch_size == m * G == rstats.episodes
  np.testing.assert_array_equal(batch.group, 100 + np.repeat(np.arange(m), G))
  assert (batch.parent == RECOVERY).all() and (batch.policy_version == 3).all()
  np.testing.assert_array_equal(batch.branch_step, np.repeat(starts.steps, G))
  for i in range(batch.batch_size):
    j = i // G
    end = int(starts.buffer.end[j])
    np.testing.assert_array_equal(batch.tokens[i, :end], starts.buffer.batch.tokens[j, :end])
    assert not batch.loss_mask[i, :end].any() and batch.loss_mask[i, end]
  lp = np.asarray(episode_logprobs(newer, config, to_device(batch), temperature=1.0))
  np.testing.assert_allclose(lp[batch.loss_mask], batch.behavior_logprobs[batch.loss_mask],
                             atol=1e-4)
  # The G rows of a start sample differently (their own row ids).
  assert len({batch.tokens[i].tobytes() for i in range(G)}) > 1


def test_after_error_starts_follow_the_first_invalid_action(env, codec):
  oracle = rollout.oracle_turns(env, codec)
  bad = codec.tokenizer.encode("lookup", add_special_tokens=False)

  def turns(states):  # an invalid action at step 1, then a wrong answer at once
    step, ids = np.asarray(states.step), oracle(states)
    wrong = codec.tokenizer.encode("answer 0", add_special_tokens=False)
    return [(bad if step[r] == 1 else wrong if step[r] >= 2 else ids[r][:-1])
            + list(codec.stop_token_ids[:1]) for r in range(len(ids))]

  keys = jax.random.split(jax.random.key(5), 2)
  batch, stats = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys,
                                 _rc(recovery_from="after_error"), sampling_seed=0,
                                 scripted=turns)
  failed = ~batch.success & (batch.num_steps > 2)
  assert failed.any()
  np.testing.assert_array_equal(stats.recovery.steps, np.full(failed.sum(), 2))


def test_pool_keeps_the_newest_and_hands_them_out_newest_first(source):
  _, stats = source
  starts = stats.recovery
  m = len(starts)
  pool = recovery_lib.RecoveryPool(capacity=m + 1)
  pool.add(starts)
  pool.add(starts.take([0]))
  assert len(pool) == m + 1
  pool.add(starts.take([1]))  # over capacity: the oldest (start 0 of the first add) is dropped
  assert len(pool) == m + 1
  out = pool.pop(2)
  np.testing.assert_array_equal(out.steps, starts.steps[[1, 0]])
  np.testing.assert_array_equal(out.buffer.batch.tokens, starts.buffer.batch.tokens[[1, 0]])
  assert len(pool) == m - 1 and pool.pop(0) is None
  np.testing.assert_array_equal(pool.pop(m).steps, starts.steps[1:][::-1])
  assert len(pool) == 0 and pool.pop(3) is None


def test_config_errors_name_the_problem():
  with pytest.raises(ValueError, match="recovery_from"):
    _rc(recovery_from="somewhere")


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_learner_mixes_recovery_groups_at_an_unchanged_budget(tmp_path, smoke_learner):
  """Update 0 has no starts yet (all fresh tasks); update 1 replaces `recovery_groups` tasks by
  groups started from update 0's failures; shapes and episodes per update stay the same, the
  update trains on the mixed batch."""
  from longhorizon.train.metrics import Timer  # pylint: disable=g-import-not-at-top
  learner = smoke_learner(tmp_path, {"rollout.recovery_groups": 1})
  n, g = learner.rollout.num_tasks, learner.rollout.group_size
  state, timer = learner.initial_state(), Timer()
  first, stats = learner.collect_batch(state.params, 0, 0, timer)
  assert first.batch_size == n * g and stats.extra["recovery/groups"] == 0
  assert stats.extra["recovery/kept"] >= 1, "the untrained policy should fail with room to recover"
  state, _ = learner.learn(state, first, stats, timer)
  second, stats = learner.collect_batch(state.params, 1, n, timer)
  second.validate()
  assert second.batch_size == n * g and stats.extra["recovery/groups"] == 1
  recovering = second.parent == RECOVERY
  np.testing.assert_array_equal(np.flatnonzero(recovering), np.arange((n - 1) * g, n * g))
  assert len(set(second.group.tolist())) == n
  assert (second.branch_step[recovering] >= 1).all()
  assert not np.isnan(stats.extra["recovery/success_rate"])
  state, metrics = learner.learn(state, second, stats, timer)
  assert np.isfinite(metrics["loss"]) and metrics["recovery/groups"] == 1


def test_learner_refuses_what_recovery_cannot_mix_with(tmp_path, smoke_learner):
  for changes, path in (({"rollout.recovery_groups": 1, "algorithm.name": "tree_grpo",
                          "rollout.branch_k": 1, "rollout.group_size": 4}, "recovery_groups"),
                        ({"rollout.recovery_groups": 1, "curriculum.num_buckets": 2},
                         "curriculum.num_buckets"),
                        ({"rollout.recovery_groups": 99}, "below rollout.num_tasks")):
    with pytest.raises(ValueError, match=path):
      smoke_learner(tmp_path, changes)


@pytest.mark.parametrize("snapshots", [True, False])
def test_host_recovery_continues_the_source_episode(snapshots, host_fixtures):
  """A host environment's rows are put back in the source's state by restoring its snapshot (or,
  without snapshots, by replaying its actions): continued with the source's parameters and
  sampling stream, the recovery episode is the source episode, observations included."""
  from longhorizon.envs.pool import close_pools  # pylint: disable=g-import-not-at-top
  hf = host_fixtures
  env = (hf.FaultyCounter if snapshots else hf.Counter)(success=1.0, milestone=0.5)
  codec = env.codec()
  config = dataclasses.replace(tiny_config(), vocab_size=len(codec.tokenizer))
  params = init_params(config, jax.random.key(2))
  rc = _rc(group_size=2, max_steps=5, recovery_from="after_error")
  try:
    batch, stats = rollout.collect(params, config, env, codec, env.tasks("train", 2, 0),
                                   jax.random.split(jax.random.key(0), 2), rc, sampling_seed=4)
    starts = stats.recovery
    assert len(starts) >= 1
    for j, r in enumerate(starts.source_row):
      again, _ = rollout.collect_recovery(params, config, env, codec, starts.take([j]),
                                          dataclasses.replace(rc, group_size=1, recovery_from=""),
                                          sampling_seed=4, row_offset=int(r))
      for name in ("tokens", "rewards", "num_steps", "success", "termination"):
        np.testing.assert_array_equal(getattr(again, name)[0], getattr(batch, name)[r], name)
  finally:
    close_pools(env)
