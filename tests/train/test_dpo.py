"""Trajectory DPO: the jitted update against a NumPy reference, and the stage between the SFT warm
start and RL (`train/preference.py`) with its store, resume and `eval.json`; SFT from a store."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import rollout
from longhorizon.envs import testing
from longhorizon.core import preference
from longhorizon.rollout.store import StoreError, TrajectoryStore
from longhorizon.train import loop
from longhorizon.train import preference as stage
from longhorizon.train.learner import Learner, stored_demonstrations
from longhorizon.train.update import TrainState, dpo_update, episode_logprobs, make_optimizer

MAX_STEPS = 4


@pytest.fixture(scope="module")
def episodes(env, codec):
  """8 tasks x 2 noisy-demonstrator episodes (real pointer_chain rollouts)."""
  keys = jax.random.split(jax.random.key(2), 8)
  rc = rollout.RolloutConfig(group_size=2, context_length=64, max_steps=MAX_STEPS, turn_tokens=6)
  batch, _ = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys,
                             rc, sampling_seed=0,
                             scripted=rollout.oracle_turns(env, codec, 0.4, seed=3))
  return jax.tree.map(np.asarray, batch)


def _state(params, optimizer):
  return TrainState(params=params, opt_state=optimizer.init(params), critic_params=None,
                    critic_opt_state=None, step=jnp.zeros((), jnp.int32),
                    policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(0),
                    skipped=jnp.zeros((), jnp.int32))


def _np_loss(config, params, batch, masks, ref, beta, sft_weight):
  """The minibatch loss of `dpo_update` written out in NumPy from the model's log-probs."""
  logp = np.asarray(episode_logprobs(params, config, batch), np.float64)
  seq = (logp * masks).sum(-1)
  n = len(seq) // 2
  m = beta * ((seq[:n] - ref[:n]) - (seq[n:] - ref[n:]))
  dpo = np.mean(np.log1p(np.exp(-m)))
  nll = -np.mean(seq[:n] / masks[:n].sum(-1))
  return dpo, nll


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_dpo_update_matches_numpy_and_compiles_once(model, episodes):
  config, params = model
  masks = preference.policy_mask(episodes).astype(np.float32)
  ref = (np.asarray(episode_logprobs(params, config, episodes)) * masks).sum(-1)
  opt = make_optimizer(1e-2)
  state = _state(jax.tree.map(jnp.copy, params), opt)
  kw = dict(config=config, optimizer=opt, beta=0.5, sft_weight=0.3)
  # policy == reference: the margin is 0 and the DPO loss log 2 (to the float32 rounding of the
  # two passes' sums)
  state, m = dpo_update(state, episodes, masks, ref, **kw)
  assert float(m["dpo_margin"]) == pytest.approx(0.0, abs=1e-4)
  assert float(m["dpo_loss"]) == pytest.approx(math.log(2.0), abs=1e-5)
  compiled = dpo_update._cache_size()
  losses = [float(m["dpo_loss"])]
  for _ in range(6):
    want_dpo, want_nll = _np_loss(config, state.params, episodes, masks, ref, 0.5, 0.3)
    state, m = dpo_update(state, episodes, masks, ref, **kw)
    assert float(m["dpo_loss"]) == pytest.approx(want_dpo, rel=1e-4, abs=1e-5)
    assert float(m["dpo_nll"]) == pytest.approx(want_nll, rel=1e-4, abs=1e-5)
    assert float(m["loss"]) == pytest.approx(want_dpo + 0.3 * want_nll, rel=1e-4, abs=1e-5)
    losses.append(float(m["dpo_loss"]))
  assert dpo_update._cache_size() == compiled  # every pass reuses the one compilation
  assert losses[-1] < losses[0] - 0.05 and float(m["dpo_accuracy"]) > 0.5


def test_dpo_update_ignores_unscored_tokens(model, episodes):
  """The loss reads only the masked (policy) tokens: changing an observation token's id changes
  nothing once the mask is 0 there and no later token is scored."""
  config, params = model
  masks = preference.policy_mask(episodes).astype(np.float32)
  last = np.asarray(episodes.attention_mask).sum(-1) - 1
  tokens = np.asarray(episodes.tokens).copy()
  rows = np.arange(len(last))
  masks[rows, last] = 0.0  # the final token of every row is unscored ...
  tokens[rows, last] = (tokens[rows, last] + 1) % config.vocab_size  # ... and changed
  ref = np.zeros((len(last),), np.float32)
  opt = make_optimizer(1e-2)
  out = []
  for batch in (episodes, episodes.replace(tokens=tokens)):
    _, m = dpo_update(_state(jax.tree.map(jnp.copy, params), opt), batch, masks, ref, config=config,
                      optimizer=opt, beta=0.5)
    out.append(float(m["dpo_loss"]))
  assert out[0] == pytest.approx(out[1], abs=1e-6)


def _demo_store(learner, path, tasks: int = 16, group: int = 4):
  """A store of noisy-demonstrator episodes (group `group` per task): some succeed, some fail."""
  c = learner.config
  rc = learner.rollout.collect_config(c.env.max_steps, group_size=group)
  batch, stats = rollout.collect(
      None, None, learner.env, learner.codec, learner.tasks_at(200, tasks),
      jax.random.split(jax.random.key(4), tasks), rc, sampling_seed=0,
      scripted=rollout.oracle_turns(learner.env, learner.codec, 0.5, seed=5))
  TrajectoryStore(path).append(batch, update=3, info=stats.episode_info)
  TrajectoryStore(path).append(batch, update=4, info=stats.episode_info)  # same group labels
  return batch


@pytest.mark.slow
def test_stage_reads_another_store_and_reports_in_eval_json(tmp_path, smoke_config):
  config = smoke_config(tmp_path, **{"num_updates": 0, "dpo.steps": 3, "dpo.learning_rate": 1e-2,
                                     "dpo.store": str(tmp_path / "demos"), "dpo.sft_weight": 0.5})
  demos = _demo_store(Learner.build(config), tmp_path / "demos")
  assert 0 < demos.success.mean() < 1
  result = loop.train_and_evaluate(config, str(tmp_path / "run"))
  # the two files repeat group labels: pairs stay within a file's groups
  batch = stage.read_preference_batch(TrajectoryStore(tmp_path / "demos"),
                                      stage.PreferenceOptions.from_config(config))
  assert batch.batch_size == 2 * demos.batch_size
  assert len(np.unique(batch.group)) == 2 * len(np.unique(demos.group))
  want = len(preference.preference_pairs(batch))
  assert result["dpo"]["pairs"] == want > 0 and result["dpo"]["episodes"] == 0
  assert 0.0 <= result["dpo_success_rate"] <= 1.0 and "dpo_greedy_success_rate" in result
  assert result["training_episodes"] == {"sft": 16, "dpo": 0, "rl": 0, "sampled": 0}
  saved = json.loads((tmp_path / "run" / "eval.json").read_text())
  assert saved["dpo"]["pairs_used"] == want
  assert not (tmp_path / "run" / "trajectories").exists()  # read, not written


def test_stage_samples_once_into_the_runs_store(tmp_path, smoke_config):
  """Sampling mode: the episodes go to `<workdir>/trajectories` as update 0 and are read back from
  there; a stage run again (a killed run restarting) finds them and does not sample again."""
  config = smoke_config(tmp_path, **{"dpo.steps": 1, "dpo.tasks": 4, "dpo.group_size": 2})
  s = Learner.build(config)
  store_dir = tmp_path / "trajectories"
  state, info, position = stage.preference_stage(s, s.initial_state(), str(store_dir), 16)
  store = TrajectoryStore(store_dir)
  assert position == 20 and info["episodes"] == 8 and len(store) == 8
  assert (store.rows().update == stage.STAGE_UPDATE).all()
  _, again, position = stage.preference_stage(s, s.initial_state(), str(store_dir), 16)
  assert position == 20 and len(TrajectoryStore(store_dir).files()) == 1
  assert again["stored_episodes"] == info["stored_episodes"] == 8


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_sft_reads_the_newest_distinct_successes_of_a_store(tmp_path, smoke_config):
  config = smoke_config(tmp_path, **{"sft.store": str(tmp_path / "demos"), "sft.episodes": 4,
                                     "sft.steps": 6, "sft.minibatches": 1})
  s = Learner.build(config)
  demos = _demo_store(s, tmp_path / "demos")
  store = TrajectoryStore(tmp_path / "demos")
  want = store.rows(dedup=True)
  want = want.take(want.success & (want.termination == 1))
  assert len(want) >= 4 and (want.update == 4).all()  # dedup keeps the second copy of each
  batch = stored_demonstrations(str(tmp_path / "demos"), 4, config.rollout.context_length,
                                config.env.max_steps)
  assert batch.success.all() and batch.batch_size == 4
  tail = store.load(want.take(np.arange(len(want) - 4, len(want))))
  np.testing.assert_array_equal(batch.tokens[:, :tail.tokens.shape[1]], tail.tokens)
  assert batch.tokens.shape[1] == config.rollout.context_length
  with pytest.raises(StoreError, match=r"distinct valid successful episode\(s\) stored"):
    stored_demonstrations(str(tmp_path / "demos"), int(demos.success.sum()) + 1, 160, 6)
  nll = []
  s.warm_start(s.initial_state(), on_step=lambda step, params, m: nll.append(float(m["sft_nll"])))
  assert len(nll) == 6 and nll[-1] < nll[0] - 0.5
