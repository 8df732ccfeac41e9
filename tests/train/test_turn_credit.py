"""The turn-level estimators and EMPG as the learner reaches them (`algorithms.compute_advantages`):
each option routes to the `core.turn_advantages` kernel it names, on a real multi-turn rollout batch
(scripted oracle on pointer_chain, with environment-error rows) whose rewards and scores are then
randomised so that every advantage is non-trivial."""

import dataclasses

import jax
import numpy as np
import pytest

from longhorizon import envs
from longhorizon import rollout
from longhorizon.core import advantages as adv
from longhorizon.core import turn_advantages as ta
from longhorizon.core.episode import to_device
from longhorizon.envs import testing
from longhorizon.train import algorithms


@pytest.fixture(scope="module")
def batch():
  env = envs.FaultInjection(envs.TimeLimit(envs.make("pointer_chain", horizon=3), 6),
                            {"unavailable": 0.15}, env_error_kinds=("unavailable",))
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(3), 4)
  rc = rollout.RolloutConfig(group_size=4, context_length=160, max_steps=6, turn_tokens=6)
  b, _ = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys, rc,
                         sampling_seed=0, scripted=rollout.oracle_turns(env, codec))
  b.validate()
  rng = np.random.default_rng(0)
  rewards = np.where(b.step_mask, rng.normal(size=b.rewards.shape), 0.0).astype(np.float32)
  b = b.replace(rewards=rewards, score=rng.normal(size=b.score.shape).astype(np.float32))
  assert np.asarray(b.env_error).any(-1).any() and (b.step_mask.sum(-1) >= 3).any()
  return to_device(b)


def _values(batch, seed=1):
  return np.random.default_rng(seed).normal(size=np.shape(batch.tokens)).astype(np.float32)


def _options(**kw):
  return algorithms.AlgorithmOptions(name=kw.pop("name", "ppo"), **kw)


def _mask_steps(batch, weight):
  mask = np.asarray(batch.loss_mask, bool) & (np.asarray(weight)[:, None] > 0)
  steps = np.asarray(batch.step_mask, bool) & (np.asarray(weight)[:, None] > 0)
  return mask, steps


def test_ppo_turn_unit_is_turn_gae_on_the_turns_tokens(batch):
  values = _values(batch)
  out = algorithms.compute_advantages(batch, values, _options(unit="turn", gamma=0.9, lam=0.8))
  mask, steps = _mask_steps(batch, out.row_weight)
  assert (np.asarray(out.row_weight) == 0).any()  # the env-error rows
  step_values = ta.turn_start_values(values, batch.turn, mask, steps)
  a, r = ta.turn_gae(batch.rewards, step_values, steps, gamma=0.9, lam=0.8)
  want_a = adv.masked_whiten(adv.broadcast_steps(a, batch.turn) * mask, mask) * mask
  np.testing.assert_allclose(out.advantages, want_a, atol=1e-5)
  np.testing.assert_allclose(out.returns, adv.broadcast_steps(r, batch.turn) * mask, atol=1e-6)
  # One advantage per turn: every policy token of a turn carries the same value.
  a_tok, turn = np.asarray(out.advantages), np.asarray(batch.turn)
  for b_, k in zip(*np.nonzero(steps)):
    picked = a_tok[b_][mask[b_] & (turn[b_] == k)]
    np.testing.assert_allclose(picked, picked[0], atol=1e-6)


def test_token_and_turn_units_differ_when_lambda_is_below_one(batch):
  values = _values(batch)
  token = algorithms.compute_advantages(batch, values, _options(gamma=1.0, lam=0.5))
  turn = algorithms.compute_advantages(batch, values, _options(unit="turn", gamma=1.0, lam=0.5))
  assert not np.allclose(token.advantages, turn.advantages, atol=1e-3)


def test_vapo_lambda_from_turns(batch):
  """`vapo_length='turns'`: each row's lambda is 1 - 1/(alpha * its number of turns), and the value
  targets are the lambda-1 ones (VAPO's critic), on turns as on tokens."""
  values = _values(batch)
  opts = _options(unit="turn", advantage="length_adaptive_gae", vapo_length="turns",
                  vapo_alpha=1.0, gamma=1.0)
  out = algorithms.compute_advantages(batch, values, opts)
  mask, steps = _mask_steps(batch, out.row_weight)
  turns = steps.sum(-1)
  lam = np.where(turns > 0, np.maximum(0.0, 1.0 - 1.0 / np.maximum(turns, 1)), 0.0)
  step_values = ta.turn_start_values(values, batch.turn, mask, steps)
  a, _ = ta.turn_gae(batch.rewards, step_values, steps, gamma=1.0, lam=lam.astype(np.float32))
  _, r = ta.turn_gae(batch.rewards, step_values, steps, gamma=1.0, lam=1.0)
  want_a = adv.masked_whiten(adv.broadcast_steps(a, batch.turn) * mask, mask) * mask
  np.testing.assert_allclose(out.advantages, want_a, atol=1e-5)
  np.testing.assert_allclose(out.returns, adv.broadcast_steps(r, batch.turn) * mask, atol=1e-6)
  # Token recursion, lambda from turns: gae with that per-row lambda and critic lambda 1.
  tok = algorithms.compute_advantages(batch, values, dataclasses.replace(opts, unit="token"))
  a2, r2 = adv.gae(batch.token_rewards(), values, mask, gamma=1.0, lam=lam.astype(np.float32),
                   critic_lam=1.0)
  np.testing.assert_allclose(tok.advantages, adv.masked_whiten(a2, mask) * mask, atol=1e-5)
  np.testing.assert_allclose(tok.returns, r2, atol=1e-6)


def test_vapo_tokens_is_unchanged(batch):
  values = _values(batch)
  out = algorithms.compute_advantages(batch, values, _options(advantage="length_adaptive_gae",
                                                              gamma=0.99, vapo_alpha=0.05))
  mask, _ = _mask_steps(batch, out.row_weight)
  a, r = adv.length_adaptive_gae(batch.token_rewards(), values, mask, gamma=0.99, alpha=0.05)
  np.testing.assert_array_equal(out.advantages, adv.masked_whiten(a, mask) * mask)
  np.testing.assert_array_equal(out.returns, r * mask)


def test_bilevel_gae_is_routed(batch):
  values = _values(batch)
  out = algorithms.compute_advantages(batch, values, _options(
      advantage="bilevel_gae", gamma=1.0, lam=0.9, step_gamma=0.95, step_lam=0.8))
  mask, steps = _mask_steps(batch, out.row_weight)
  a, r = ta.bilevel_gae(batch.rewards, steps, values, batch.turn, mask, gamma=1.0, lam=0.9,
                        turn_gamma=0.95, turn_lam=0.8)
  np.testing.assert_allclose(out.advantages, adv.masked_whiten(a, mask) * mask, atol=1e-5)
  np.testing.assert_allclose(out.returns, r, atol=1e-6)


def test_empg_modulates_the_step_advantages(batch):
  entropy = np.random.default_rng(2).uniform(0, 2, np.shape(batch.tokens)).astype(np.float32)
  plain = algorithms.compute_advantages(batch, None, _options(name="grpo"))
  opts = _options(name="grpo", empg=True, empg_k=1.5, empg_k_future=0.5, empg_zeta=0.1)
  out = algorithms.compute_advantages(batch, None, opts, entropy)
  mask, steps = _mask_steps(batch, plain.row_weight)
  step_adv = ta.step_means(plain.advantages, batch.turn, mask, steps)
  step_h = ta.step_means(entropy, batch.turn, mask, steps)
  want = ta.empg(step_adv, step_h, steps, k=1.5, k_future=0.5, zeta=0.1)
  np.testing.assert_allclose(out.advantages, adv.broadcast_steps(want, batch.turn) * mask, atol=1e-6)
  np.testing.assert_array_equal(out.row_weight, plain.row_weight)
  assert not np.allclose(out.advantages, plain.advantages, atol=1e-3)
  assert np.all(np.asarray(out.advantages)[~mask] == 0)


def test_empg_errors_name_the_problem(batch):
  with pytest.raises(ValueError, match="needs the per-token entropy"):
    algorithms.compute_advantages(batch, None, _options(name="grpo", empg=True))
  with pytest.raises(ValueError, match="critic-free"):
    algorithms.compute_advantages(batch, _values(batch), _options(empg=True),
                                  np.zeros(np.shape(batch.tokens), np.float32))


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_learner_feeds_empg_the_current_policy_entropy(tmp_path, smoke_learner):
  """With `algorithm.empg` the learner's update inputs are EMPG's advantages from the entropy of
  the current parameters on the batch; a step updates with them."""
  from longhorizon.train.learner import _logprobs  # pylint: disable=g-import-not-at-top
  from longhorizon.train.metrics import Timer  # pylint: disable=g-import-not-at-top
  s = smoke_learner(tmp_path, {"algorithm.empg": True, "algorithm.empg_zeta": 0.2})
  state = s.initial_state()
  batch, _ = s.collect_batch(state.params, 0, 0, Timer())
  db = to_device(s.trimmed(batch))
  inputs = s.learn_inputs(state, db)
  _, entropy = _logprobs(state.params, db, config=s.model_config, temperature=s.rollout.temperature,
                         chunk_size=s.loss.chunk_size, with_entropy=True)
  want = algorithms.compute_advantages(db, None, s.algorithm, entropy)
  np.testing.assert_allclose(inputs.advantages, want.advantages, atol=1e-6)
  plain = algorithms.compute_advantages(db, None, dataclasses.replace(s.algorithm, empg=False))
  assert not np.allclose(inputs.advantages, plain.advantages, atol=1e-4)
  _, metrics = s.update(state, db, inputs)
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("source", ["latency", "cost"])
def test_time_discount_replaces_the_constant_step_discount(batch, source):
  rng = np.random.default_rng(5)
  durations = np.where(batch.step_mask, rng.exponential(2.0, np.shape(batch.step_mask)), 0.0)
  b = batch.replace(**{source: durations.astype(np.float32)})
  gamma = ta.time_discounts(durations, b.step_mask, 0.3)
  # ppo over turns: gamma_k = exp(-0.3 d_k) instead of the constant gamma.
  values = _values(b)
  out = algorithms.compute_advantages(
      b, values, _options(unit="turn", lam=0.8, time_discount=0.3, time_source=source))
  mask, steps = _mask_steps(b, out.row_weight)
  step_values = ta.turn_start_values(values, b.turn, mask, steps)
  a, _ = ta.turn_gae(b.rewards, step_values, steps, gamma=gamma, lam=0.8)
  want = adv.masked_whiten(adv.broadcast_steps(a, b.turn) * mask, mask) * mask
  np.testing.assert_allclose(out.advantages, want, atol=1e-5)
  # gigpo: the step returns are discounted per step.
  out = algorithms.compute_advantages(b, None, _options(name="gigpo", time_discount=0.3,
                                                        time_source=source))
  step_adv = adv.gigpo(b.score, b.rewards, b.step_mask, b.group, b.anchor, gamma=gamma,
                       valid=np.asarray(out.row_weight) > 0, normalize_std=True)
  want = adv.broadcast_steps(step_adv, b.turn) * np.asarray(b.loss_mask) * np.asarray(
      out.row_weight)[:, None]
  np.testing.assert_allclose(out.advantages, want, atol=1e-5)
  plain = algorithms.compute_advantages(b, None, _options(name="gigpo"))
  assert not np.allclose(plain.advantages, out.advantages, atol=1e-4)


def test_time_discount_errors_name_the_problem():
  from configs import default as default_config  # pylint: disable=g-import-not-at-top
  from longhorizon.train import config as config_lib  # pylint: disable=g-import-not-at-top
  config = default_config.get_config("smoke")
  config.algorithm.time_discount = 0.1
  with pytest.raises(config_lib.ConfigError, match="algorithm.time_discount=0.1 .*'grpo'"):
    config_lib.validate(config)
  config.algorithm.name = "gigpo"
  with pytest.raises(config_lib.ConfigError, match="algorithm.time_source='latency' .*JAX"):
    config_lib.validate(config)
  config.algorithm.time_source = "cost"
  config_lib.validate(config)


@pytest.mark.parametrize("verifier", ["milestone", "oracle"])
def test_step_verifier_adds_group_relative_step_advantages(batch, verifier):
  rng = np.random.default_rng(7)
  match = np.where(batch.step_mask, rng.integers(0, 2, np.shape(batch.step_mask)), -1)
  b = batch.replace(oracle_match=match.astype(np.int32))
  plain = algorithms.compute_advantages(b, None, _options(name="grpo"))
  out = algorithms.compute_advantages(b, None, _options(name="grpo", step_verifier=verifier,
                                                        verifier_weight=0.3))
  weight = np.asarray(out.row_weight)
  steps = np.asarray(b.step_mask, bool) & (weight[:, None] > 0)
  scores = (np.asarray(b.milestones) != 0) if verifier == "milestone" else match == 1
  step_adv = ta.verifier_advantages(scores.astype(np.float32), steps, b.group)
  extra = 0.3 * adv.broadcast_steps(step_adv, b.turn) * np.asarray(b.loss_mask) * weight[:, None]
  np.testing.assert_allclose(out.advantages, np.asarray(plain.advantages) + extra, atol=1e-5)
  assert np.abs(extra).sum() > 0
  with pytest.raises(ValueError, match="critic-free"):
    algorithms.compute_advantages(b, _values(b), _options(step_verifier=verifier))
