"""The tree estimators as the learner reaches them (`algorithms.compute_advantages` with `vine`,
`branch`, `tree_grpo`): each routes to its `core.tree_advantages` kernel on a real branched rollout
batch (scripted noisy oracle on pointer_chain, environment-error rows included), puts the step
advantages on the tokens of each row's own steps only, and a learner with `rollout.branch_k`
collects branched batches and updates from them without recompiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import envs
from longhorizon import rollout
from longhorizon.core import tree_advantages as tree
from longhorizon.core.episode import to_device
from longhorizon.envs import testing
from longhorizon.train import algorithms
from longhorizon.train import config as config_lib


@pytest.fixture(scope="module")
def batch():
  env = envs.FaultInjection(envs.TimeLimit(envs.make("pointer_chain", horizon=3), 6),
                            {"unavailable": 0.1}, env_error_kinds=("unavailable",))
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(3), 4)
  rc = rollout.RolloutConfig(group_size=6, context_length=160, max_steps=6, turn_tokens=6,
                             branch_k=2)
  b, _ = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys, rc,
                         sampling_seed=0, scripted=rollout.oracle_turns(env, codec, epsilon=0.4))
  b.validate()
  b = b.replace(score=np.random.default_rng(0).normal(size=b.score.shape).astype(np.float32))
  assert np.asarray(b.env_error).any(-1).any() and (b.parent >= 0).any()
  return to_device(b)


def _reference_tokens(batch, step_adv, weight):
  """Loops: row r's token l gets step_adv[r, turn] when it is a policy token of an own step."""
  out = np.zeros(np.shape(batch.tokens))
  turn, mask = np.asarray(batch.turn), np.asarray(batch.loss_mask)
  for r in range(out.shape[0]):
    for l in range(out.shape[1]):
      t = turn[r, l]
      if mask[r, l] and weight[r] > 0 and t >= max(int(batch.branch_step[r]), 0):
        out[r, l] = step_adv[r, t]
  return out


@pytest.mark.parametrize("name,kernel", [("vine", tree.vine_advantages),
                                         ("branch", tree.branch_advantages),
                                         ("tree_grpo", tree.tree_grpo_advantages)])
def test_tree_estimators_route_to_their_kernel_on_own_steps(batch, name, kernel):
  out = algorithms.compute_advantages(batch, None, algorithms.AlgorithmOptions(name=name))
  weight = np.asarray(out.row_weight)
  assert (weight == 0).any()  # the env-error rows
  step_adv = np.asarray(kernel(batch.score, batch.group, batch.parent, batch.branch_step,
                               batch.step_mask, valid=weight > 0))
  np.testing.assert_allclose(out.advantages, _reference_tokens(batch, step_adv, weight), atol=1e-6)
  # A branch's copied prefix carries no loss (and so no advantage): it is its parent's.
  copied = np.asarray(batch.turn) < np.asarray(batch.branch_step)[:, None]
  assert not np.asarray(out.advantages)[copied].any()
  assert np.abs(np.asarray(out.advantages)).sum() > 0


def test_estimators_needing_branches_are_refused_without(tmp_path):
  from configs import default as default_config  # pylint: disable=g-import-not-at-top
  config = default_config.get_config("smoke")
  config.algorithm.name = "vine"
  with pytest.raises(config_lib.ConfigError, match="rollout.branch_k=0 .*'vine'"):
    config_lib.validate(config)
  config.rollout.branch_k = 1
  config.rollout.group_size = 4
  config_lib.validate(config)
  config.rollout.branch_k = 2  # 3 does not divide 4
  with pytest.raises(config_lib.ConfigError, match="rollout.branch_k=2 .*dividing"):
    config_lib.validate(config)


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_learner_collects_branched_batches_and_updates(tmp_path, smoke_learner,
                                                       assert_no_retrace):
  from longhorizon.train.metrics import Timer  # pylint: disable=g-import-not-at-top
  s = smoke_learner(tmp_path, {"algorithm.name": "vine", "rollout.branch_k": 1,
                               "rollout.branch_at": "max_entropy"})
  state = s.initial_state()
  g, calls = s.rollout.group_size, []
  for update in (0, 1):
    batch, _ = s.collect_batch(state.params, update, update, Timer())
    batch.validate()
    assert batch.batch_size == s.rollout.num_tasks * g
    np.testing.assert_array_equal((batch.parent >= 0).reshape(-1, g).sum(-1), g // 2)
    db = to_device(batch)  # untrimmed: both batches have one shape
    inputs = s.learn_inputs(state, db)
    want = algorithms.compute_advantages(db, None, s.algorithm)
    np.testing.assert_allclose(inputs.advantages, want.advantages, atol=1e-6)
    calls.append(((jax.tree.map(jnp.array, state), db, inputs), {}))
  update = s.update_fn(*calls[0][0])
  assert_no_retrace(update, *calls)
  state, metrics = s.step(state, 2, 2, Timer())
  assert np.isfinite(float(metrics["loss"]))


def test_tree_critic_learns_tree_values_and_credits_value_changes(batch):
  """`tree_critic`: value targets are the tree's Monte-Carlo state values on each turn's tokens;
  a step's advantage (before whitening) is the learned value of the next state minus this one's,
  the score after the last step."""
  from longhorizon.core import advantages as adv  # pylint: disable=g-import-not-at-top
  values = np.random.default_rng(2).normal(size=np.shape(batch.tokens)).astype(np.float32)
  out = algorithms.compute_advantages(batch, values, algorithms.AlgorithmOptions(name="tree_critic"))
  weight = np.asarray(out.row_weight)
  mask = np.asarray(batch.loss_mask, bool) & (weight[:, None] > 0)
  turn, score = np.asarray(batch.turn), np.asarray(batch.score)
  raw = np.zeros(np.shape(batch.tokens))
  for r in np.flatnonzero(weight > 0):
    steps = int(batch.num_steps[r])
    own = range(max(int(batch.branch_step[r]), 0), steps)
    first = {t: int(np.flatnonzero(mask[r] & (turn[r] == t))[0]) for t in own}
    for t in own:
      nxt = values[r, first[t + 1]] if t + 1 < steps else score[r]
      raw[r][mask[r] & (turn[r] == t)] = nxt - values[r, first[t]]
  want = np.asarray(adv.masked_whiten(raw, mask)) * mask
  np.testing.assert_allclose(out.advantages, want, atol=1e-5)
  v, _, _, _ = tree.tree_values(batch.score, batch.group, batch.parent, batch.branch_step,
                                batch.step_mask, valid=weight > 0)
  np.testing.assert_allclose(out.returns, np.asarray(adv.broadcast_steps(v, batch.turn)) * mask,
                             atol=1e-6)


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_learner_trains_the_tree_critic(tmp_path, smoke_learner):
  """The learner builds a critic for `tree_critic` and moves it towards the tree's values (the
  untrained policy's scores are replaced by random ones, so the targets are not all 0)."""
  from longhorizon.train.metrics import Timer  # pylint: disable=g-import-not-at-top
  s = smoke_learner(tmp_path, {"algorithm.name": "tree_critic", "rollout.branch_k": 1})
  state = s.initial_state()
  assert state.critic_params is not None
  batch, _ = s.collect_batch(state.params, 0, 0, Timer())
  score = np.random.default_rng(0).normal(size=batch.batch_size).astype(np.float32)
  db = to_device(s.trimmed(batch.replace(score=score)))
  inputs = s.learn_inputs(state, db)
  assert np.abs(np.asarray(inputs.returns)).sum() > 0
  before = jax.tree.map(np.asarray, state.critic_params)
  state, metrics = s.update(state, db, inputs)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["value_loss"]) > 0
  changed = jax.tree.map(lambda a, b: not np.allclose(a, np.asarray(b)), before,
                         state.critic_params)
  assert any(jax.tree.leaves(changed))
