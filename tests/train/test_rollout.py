"""The rollout loop: token-exact episodes, masks, determinism, context budget, env errors."""

import jax
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.core.episode import Termination, to_device
from longhorizon.envs import testing
from longhorizon.envs.pointer_chain import PointerChain
from longhorizon.train import algorithms
from longhorizon.train.update import episode_logprobs


def _collect(env, codec, model, n=3, seed=0, **overrides):
  config, params = model
  rc = rollout.RolloutConfig(**{**dict(group_size=2, context_length=128, max_steps=5,
                                       turn_tokens=5, temperature=1.0), **overrides})
  keys = jax.random.split(jax.random.key(seed), n)
  tasks = testing.tasks_from_keys(env, keys)
  return rollout.collect(params, config, env, codec, tasks, keys, rc, sampling_seed=seed)


def test_loss_mask_is_exactly_the_sampled_tokens(env, codec, model):
  batch, stats = _collect(env, codec, model)
  batch.validate()
  config, params = model
  lp = np.asarray(episode_logprobs(params, config, to_device(batch), temperature=1.0))
  mask = batch.loss_mask
  # The learner's log-probs of the loss-masked tokens are the sampler's: these are the sampled ids.
  np.testing.assert_allclose(lp[mask], batch.behavior_logprobs[mask], atol=1e-4)
  assert mask.sum() == stats.sampled_tokens
  for r in range(batch.batch_size):
    ids = batch.tokens[r][batch.attention_mask[r]].tolist()
    prompt = codec.render_prompt(envs.row(testing.tasks_from_keys(
        env, jax.random.split(jax.random.key(0), 3)), r // 2))
    assert ids[:len(prompt)] == list(prompt)  # the prompt is verbatim, never re-tokenised
    assert not mask[r, :len(prompt)].any()
    # Every non-sampled token after the prompt belongs to an observation (or a forced end of turn).
    turns = batch.turn[r]
    assert (turns[len(prompt):len(ids)] >= 0).all() and (turns[:len(prompt)] == -1).all()
    for t in range(batch.num_steps[r]):
      sampled = batch.tokens[r][mask[r] & (turns == t)]
      assert len(sampled) >= 1


def test_rollout_is_deterministic_and_row_independent(env, codec, model):
  a, _ = _collect(env, codec, model, seed=3)
  b, _ = _collect(env, codec, model, seed=3)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  c, _ = _collect(env, codec, model, seed=4)
  assert not np.array_equal(a.tokens, c.tokens)


def test_group_rows_share_task_and_env_seed(env, codec, model):
  batch, _ = _collect(env, codec, model, n=3)
  np.testing.assert_array_equal(batch.group, [0, 0, 1, 1, 2, 2])
  np.testing.assert_array_equal(batch.env_seed[0::2], batch.env_seed[1::2])
  assert (batch.anchor[0::2, 0] == batch.anchor[1::2, 0]).all()  # same start state per group


def test_context_budget_truncates_not_fails(env, codec, model):
  batch, _ = _collect(env, codec, model, context_length=64, turn_tokens=5)
  batch.validate()
  overflow = batch.termination == Termination.CONTEXT_OVERFLOW
  assert overflow.any()
  assert batch.truncated[overflow].all() and not batch.terminated[overflow].any()
  assert (batch.attention_mask.sum(-1) <= 64).all()


def test_oracle_script_gives_successful_episodes_with_the_same_layout(env, codec):
  keys = jax.random.split(jax.random.key(5), 4)
  tasks = testing.tasks_from_keys(env, keys)
  rc = rollout.RolloutConfig(group_size=1, context_length=128, max_steps=5, turn_tokens=6)
  batch, _ = rollout.collect(None, None, env, codec, tasks, keys, rc, sampling_seed=0,
                             scripted=rollout.oracle_turns(env, codec))
  batch.validate()
  assert batch.success.all() and (batch.num_steps == 3).all()
  assert (batch.score == 1.0).all()
  text = codec.decode(batch.tokens[0][batch.loss_mask[0]])
  assert text.split()[0] == "lookup" and text.count("<eot>") == 3


class _MissingWord(PointerChain):
  """pointer_chain whose vocabulary() misses one word (a gap a user's environment may have)."""

  def __init__(self, missing: str, **params):
    super().__init__(**params)
    self.missing = missing

  def vocabulary(self):
    return [w for w in super().vocabulary() if w != self.missing]


@pytest.mark.parametrize("missing,per_row", [("hops", 1), ("->", 2), (None, 0)])
def test_unknown_words_are_counted_in_the_rollout_stats(missing, per_row):
  """The oracle still solves every task when a word is missing from the vocabulary (it acts on the
  state), so the gap is counted: "hops" is in each row's prompt once (`start 3 hops 2`), "->" in
  each of the two observations a row gets (`5 -> 2`, after each lookup; the answer ends the row)."""
  base = _MissingWord(missing, horizon=2) if missing else envs.make("pointer_chain", horizon=2)
  env = envs.TimeLimit(base, 5)
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(7), 2)
  rc = rollout.RolloutConfig(group_size=2, context_length=128, max_steps=5, turn_tokens=6)
  batch, stats = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys,
                                 rc, sampling_seed=0, scripted=rollout.oracle_turns(env, codec))
  assert batch.success.all()
  unk = codec.tokenizer.unk_token_id
  assert int((batch.tokens[batch.attention_mask] == unk).sum()) == 4 * per_row
  assert stats.unknown_words == 4 * per_row
  assert stats.as_dict()["rollout/unknown_words"] == 4 * per_row


def test_env_error_episodes_are_kept_but_excluded():
  faulty = envs.FaultInjection(envs.TimeLimit(envs.make("pointer_chain", horizon=2), 5),
                               {"unavailable": 0.5}, env_error_kinds=("unavailable",))
  codec = faulty.codec(style="compact")
  keys = jax.random.split(jax.random.key(6), 8)
  rc = rollout.RolloutConfig(group_size=2, context_length=128, max_steps=5, turn_tokens=6)
  batch, _ = rollout.collect(None, None, faulty, codec, testing.tasks_from_keys(faulty, keys), keys,
                             rc, sampling_seed=0, scripted=rollout.oracle_turns(faulty, codec))
  batch.validate()
  errored = np.asarray(batch.env_error).any(-1)
  assert errored.any() and (~errored).any()
  assert (batch.termination[errored] == Termination.ENV_ERROR).all()
  db = to_device(batch)
  adv = algorithms.compute_advantages(db, None, algorithms.AlgorithmOptions())
  assert (np.asarray(adv.row_weight)[errored] == 0).all()
  assert (np.asarray(adv.advantages)[errored] == 0).all()
  # The others are the oracle's successes, untouched by the errors of other rows.
  assert batch.success[~errored].all() and not batch.success[errored].any()


def test_reward_composition_safety_first():
  out = envs.compose_rewards(
      envs.RewardSpec(success=1.0, milestone=0.1, cost=1.0, invalid=0.2, violation=1.0),
      step_mask=np.array([[1, 1, 1], [1, 1, 0]], bool),
      milestones=np.array([[1, 2, 0], [3, 0, 0]], np.int32),
      cost=np.array([[0.05, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32),
      violation=np.array([[0, 0, 0], [0, 1, 0]], bool),
      invalid=np.array([[0, 1, 0], [0, 0, 0]], bool),
      success=np.array([True, True]), num_milestones=2)
  # Row 0: milestones 0.1 + 0.1, cost -0.05, invalid -0.2, success +1 on the last step.
  np.testing.assert_allclose(out["step_rewards"][0], [0.05, -0.1, 1.0], atol=1e-6)
  np.testing.assert_allclose(out["score"][0], 0.95, atol=1e-6)
  # Row 1: a violation wipes everything else; the violating step carries the penalty.
  np.testing.assert_allclose(out["step_rewards"][1], [0.0, -1.0, 0.0])
  assert out["reward/violation"][1] == -1.0 and out["reward/milestones"][1] == 0.0
  np.testing.assert_allclose(out["reward/milestones"][0], 0.2, atol=1e-6)
