"""Partial rollouts across weight updates (`rollout.continue_partial`): a version change planted
mid-episode is recorded per token, the behaviour log-probs are each token's sampler's, and the
learner weighs and corrects each token by its own version."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import rollout
from longhorizon.core import losses
from longhorizon.core.episode import to_device
from longhorizon.envs import testing
from longhorizon.models import init_params
from longhorizon.train import async_rollout
from longhorizon.train import loop
from longhorizon.train.learner import Learner
from longhorizon.train.metrics import read_metrics
from longhorizon.train.update import episode_logprobs

MAX_STEPS = 5


def _switching_source(params, version, after_calls: int = 1):
  """A `params_source` that has nothing newer for its first `after_calls` calls (turns), then
  offers `(params, version)`."""
  calls = []

  def source():
    calls.append(1)
    return (params, version) if len(calls) > after_calls else None
  return source


@pytest.fixture(scope="module")
def switched(env, codec, model):
  """Episodes whose turn 0 was sampled by version 7 (params p0) and later turns by version 8
  (params p1), collected with the cache kept and with it recomputed."""
  config, p0 = model
  p1 = init_params(config, jax.random.key(1))
  keys = jax.random.split(jax.random.key(2), 3)
  rc = rollout.RolloutConfig(group_size=2, context_length=96, max_steps=MAX_STEPS, turn_tokens=6)
  out = {}
  for reprefill in (False, True):
    batch, _ = rollout.collect(p0, config, env, codec, testing.tasks_from_keys(env, keys), keys,
                               rc, sampling_seed=0, policy_version=7,
                               params_source=_switching_source(p1, 8), reprefill=reprefill)
    out[reprefill] = jax.tree.map(np.asarray, batch.validate())
  return config, p0, p1, out


def test_token_versions_follow_the_planted_switch(switched):
  _, _, _, out = switched
  for batch in out.values():
    on, turn, version = batch.loss_mask, batch.turn, batch.token_version
    assert (version[on & (turn == 0)] == 7).all() and (version[on & (turn > 0)] == 8).all()
    assert (version[~on] == -1).all() and (batch.policy_version == 7).all()
    assert (on & (turn > 0)).any()


def test_behaviour_logprobs_are_each_tokens_samplers(switched):
  """Re-prefilled: every token's behaviour log-prob equals a full forward pass of the version that
  sampled it. Kept cache: turn 0 still does; after the switch the new parameters read keys and
  values the old ones computed, which a full pass of either version does not reproduce."""
  config, p0, p1, out = switched
  for reprefill, batch in out.items():
    db = to_device(batch)
    full = {7: np.asarray(episode_logprobs(p0, config, db)),
            8: np.asarray(episode_logprobs(p1, config, db))}
    for v, logp in full.items():
      on = batch.loss_mask & (batch.token_version == v)
      err = np.abs(logp - batch.behavior_logprobs)[on].max()
      if reprefill or v == 7:
        assert err < 1e-5, (reprefill, v, err)
      else:
        assert err > 1e-3, "a kept cache should not match the new parameters' full pass"


def test_learner_weighs_and_corrects_each_token_by_its_version(tmp_path, smoke_config, switched):
  """A batch with turn-0 tokens of version 3 and later ones of version 5, taken at update 5 with
  max_staleness 1 and 'downweight' 0.5: the loss mask keeps the later tokens at 1 and halves the
  first turn's, and the truncated IS weight of every token is min(exp(prox - its behaviour
  log-prob), C) with its own version's behaviour log-prob."""
  _, _, _, out = switched
  batch = out[True]
  version = np.where(batch.loss_mask, np.where(batch.turn == 0, 3, 5), -1).astype(np.int32)
  batch = batch.replace(token_version=version, policy_version=np.full_like(batch.policy_version, 3))
  weights = async_rollout.token_staleness_weights(batch, 5, 1, "downweight", 0.5)
  on = batch.loss_mask
  assert (weights[on & (batch.turn == 0)] == 0.5).all() and (weights[on & (batch.turn > 0)] == 1).all()
  config = smoke_config(tmp_path, **{"rollout.mode": "async", "rollout.continue_partial": True,
                                     "rollout.context_length": 96, "env.max_steps": MAX_STEPS,
                                     "env.params": {"horizon": 2}, "loss.tis_threshold": 1.5,
                                     "rollout.group_size": 2, "rollout.num_tasks": 3})
  s = Learner.build(config)
  db = to_device(s.trimmed(batch))
  inputs = s.learn_inputs(s.initial_state(), db, row_scale=weights)
  length = db.tokens.shape[1]
  np.testing.assert_array_equal(np.asarray(inputs.token_weight), weights[:, :length])
  mask = np.asarray(db.loss_mask, np.float32) * np.asarray(inputs.row_weight)[:, None] \
      * weights[:, :length]
  is_w = np.asarray(losses.truncated_is_weights(inputs.old_logp, db.behavior_logprobs,
                                                jnp.asarray(mask), threshold=1.5))
  want = np.minimum(np.exp(np.asarray(inputs.old_logp) - batch.behavior_logprobs[:, :length]), 1.5)
  np.testing.assert_allclose(is_w[mask > 0], want[mask > 0], rtol=1e-5)


@pytest.mark.slow
def test_partial_async_with_max_staleness_zero_equals_sync(tmp_path, smoke_config):
  """With max_staleness 0 no version is published while a batch is sampled: partial rollouts on
  (with either cache choice) change nothing, and the run equals the synchronous one."""
  changes = {"reward.invalid": 0.1, "num_updates": 2, "eval.num_tasks": 8, "tensorboard": False}
  loop.train_and_evaluate(smoke_config(tmp_path, **changes), str(tmp_path / "sync"))
  timing = lambda k: k.startswith(("time", "memory", "rollout/", "async/")) or k.endswith("_s") \
      or "per_s" in k
  strip = lambda rows: [{k: v for k, v in r.items() if not timing(k)} for r in rows]
  expected = strip(read_metrics(str(tmp_path / "sync")))
  for cache in ("keep", "reprefill"):
    work = str(tmp_path / cache)
    loop.train_and_evaluate(smoke_config(tmp_path, **dict(changes, **{
        "rollout.mode": "async", "rollout.max_staleness": 0, "rollout.continue_partial": True,
        "rollout.partial_cache": cache})), work)
    rows = read_metrics(work)
    assert strip(rows) == expected
    assert all(r["async/partial_episodes"] == 0 and r["async/token_lag_max"] == 0 for r in rows)


def test_without_a_source_every_token_carries_the_batch_version(env, codec, model):
  config, params = model
  keys = jax.random.split(jax.random.key(3), 2)
  rc = rollout.RolloutConfig(group_size=2, context_length=96, max_steps=MAX_STEPS, turn_tokens=6)
  batch, _ = rollout.collect(params, config, env, codec, testing.tasks_from_keys(env, keys), keys,
                             rc, sampling_seed=1, policy_version=4)
  on = np.asarray(batch.loss_mask)
  assert (np.asarray(batch.token_version)[on] == 4).all()
  assert (np.asarray(batch.token_version)[~on] == -1).all()
