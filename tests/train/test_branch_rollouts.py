"""Branch rollouts (`rollout.collect` with `branch_k > 0`): forked rows reproduce their parent's
prefix token-exactly from the saved environment state and the parent's cached prefix, their
behaviour log-probs equal a full forward pass, the tree is recorded, the budget is kept, the branch
points are the ones each rule names, and Monte-Carlo values from branches converge to the true
values of a toy MDP."""

import jax
import numpy as np
import pytest

from longhorizon import rollout
from longhorizon.core.episode import to_device
from longhorizon.envs import testing
from longhorizon.sampling import sampler as smp
from longhorizon.train.update import episode_logprobs

N_TASKS, MAX_STEPS = 3, 5


def _collect(env, codec, model, *, seed=0, scripted=None, n=N_TASKS, **overrides):
  config, params = model or (None, None)
  rc = rollout.RolloutConfig(**{**dict(group_size=6, context_length=128, max_steps=MAX_STEPS,
                                       turn_tokens=5, branch_k=2), **overrides})
  keys = jax.random.split(jax.random.key(seed), n)
  tasks = testing.tasks_from_keys(env, keys)
  return rollout.collect(None if scripted else params, None if scripted else config, env, codec,
                         tasks, keys, rc, sampling_seed=seed, scripted=scripted)


@pytest.fixture(scope="module")
def branched(env, codec, model):
  return _collect(env, codec, model)


def _own_start(batch, i):
  """Position of row i's first policy token at its branch step."""
  return int(np.flatnonzero(batch.loss_mask[i] & (batch.turn[i] == batch.branch_step[i]))[0])


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_tree_layout_and_budget(branched):
  batch, stats = branched
  batch.validate()
  # 6 episodes per task: 2 roots, each forked into 2 continuations; the task's rows are together.
  assert batch.batch_size == N_TASKS * 6 == stats.episodes
  np.testing.assert_array_equal(batch.parent.reshape(N_TASKS, 6) - 6 * np.arange(N_TASKS)[:, None]
                                * (batch.parent.reshape(N_TASKS, 6) >= 0),
                                np.tile([-1, -1, 0, 0, 1, 1], (N_TASKS, 1)))
  np.testing.assert_array_equal(batch.group, np.repeat(np.arange(N_TASKS), 6))
  branches = batch.parent >= 0
  assert ((batch.branch_step >= 0) == branches).all()
  p = batch.parent[branches]
  np.testing.assert_array_equal(batch.env_seed[branches], batch.env_seed[p])
  assert (batch.branch_step[branches] < batch.num_steps[p]).all()
  for name, values in stats.episode_info.items():
    assert len(values) == batch.batch_size, name


def test_branches_copy_the_parent_prefix_token_exactly(branched):
  batch, _ = branched
  for i in np.flatnonzero(batch.parent >= 0):
    p, b, start = batch.parent[i], batch.branch_step[i], _own_start(batch, i)
    # The prefix is the parent's, token for token, up to the parent's own turn b.
    assert start == int(np.flatnonzero(batch.loss_mask[p] & (batch.turn[p] == b))[0])
    np.testing.assert_array_equal(batch.tokens[i, :start], batch.tokens[p, :start])
    np.testing.assert_array_equal(batch.turn[i, :start], batch.turn[p, :start])
    # ... the copied steps' records too, but none of it trains in the branch row.
    assert not batch.loss_mask[i, :start].any() and not batch.behavior_logprobs[i, :start].any()
    for name in ("rewards", "anchor", "milestones", "cost", "step_mask"):
      np.testing.assert_array_equal(getattr(batch, name)[i, :b], getattr(batch, name)[p, :b])
    # It acts in the parent's state at step b.
    assert batch.anchor[i, b] == batch.anchor[p, b]
    assert batch.loss_mask[i, start]


def test_branch_behaviour_logprobs_equal_a_full_forward_pass(branched, model):
  batch, stats = branched
  config, params = model
  lp = np.asarray(episode_logprobs(params, config, to_device(batch), temperature=1.0))
  mask = batch.loss_mask
  np.testing.assert_allclose(lp[mask], batch.behavior_logprobs[mask], atol=1e-4)
  assert mask.sum() == stats.sampled_tokens


def test_roots_are_the_unbranched_rollouts_with_the_same_ids(env, codec, model, branched):
  batch, _ = branched
  plain, _ = _collect(env, codec, model, branch_k=0)
  roots = batch.parent < 0
  # Root j of task i samples with row id i*G + j, as row i*G + j of the plain batch does.
  np.testing.assert_array_equal(batch.tokens[roots], plain.tokens[roots])
  np.testing.assert_allclose(batch.behavior_logprobs[roots], plain.behavior_logprobs[roots],
                             atol=1e-5)
  # Branches sample with their own ids: they are not copies of the plain rows they replace.
  assert not np.array_equal(batch.tokens[~roots], plain.tokens[~roots])


def test_branch_rollouts_are_deterministic(env, codec, model, branched):
  again, _ = _collect(env, codec, model)
  jax.tree.map(np.testing.assert_array_equal, branched[0], again)


def _scripted_with_mistake(env, codec, wrong_at: int):
  """The oracle, except that every row looks up a key off the chain at its step `wrong_at`."""
  oracle = rollout.oracle_turns(env, codec)

  def turns(states):
    ids = oracle(states)
    step = np.asarray(states.step)
    current = np.asarray(states.inner["current"])
    wrong = [codec.tokenizer.encode(f"lookup {(int(c) + 1) % 16}", add_special_tokens=False)
             + list(codec.stop_token_ids[:1]) for c in current]
    return [wrong[r] if step[r] == wrong_at else ids[r] for r in range(len(ids))]

  return turns


def test_first_divergence_forks_at_the_first_non_oracle_action(env, codec, model):
  batch, _ = _collect(env, codec, model, branch_at="first_divergence",
                      scripted=_scripted_with_mistake(env, codec, wrong_at=1))
  branches = batch.parent >= 0
  np.testing.assert_array_equal(batch.branch_step[branches], 1)


def test_after_error_forks_after_the_first_invalid_action(env, codec, model):
  # Rows answer an out-of-range key at step 1: the env refuses it (invalid); they fork at step 2.
  oracle = rollout.oracle_turns(env, codec)
  bad = codec.tokenizer.encode("lookup", add_special_tokens=False)

  def turns(states):
    step, ids = np.asarray(states.step), oracle(states)
    return [bad + list(codec.stop_token_ids[:1]) if step[r] == 1 else ids[r]
            for r in range(len(ids))]

  batch, _ = _collect(env, codec, model, branch_at="after_error", scripted=turns)
  branches = batch.parent >= 0
  np.testing.assert_array_equal(batch.branch_step[branches], 2)


def test_max_entropy_forks_at_the_most_surprising_turn(env, codec, model, branched):
  batch, _ = _collect(env, codec, model, branch_at="max_entropy")
  for i in np.flatnonzero(batch.parent >= 0):
    p = batch.parent[i]
    surprisal = [-batch.behavior_logprobs[p][batch.loss_mask[p] & (batch.turn[p] == t)].mean()
                 for t in range(batch.num_steps[p])]
    assert batch.branch_step[i] == int(np.argmax(surprisal))


def test_uniform_points_cover_every_step(env, codec, model):
  batch, _ = _collect(env, codec, model, n=8, seed=5, group_size=4, branch_k=1)
  roots = batch.parent < 0
  steps = batch.branch_step[batch.parent >= 0]
  assert set(steps.tolist()) <= set(range(MAX_STEPS))
  assert len(set(steps.tolist())) >= 3  # 16 draws over 5 steps
  assert (batch.num_steps[roots] >= 1).all()


def test_config_errors_name_the_problem(env, codec, model):
  with pytest.raises(ValueError, match="branch_k.*divides group_size"):
    rollout.RolloutConfig(group_size=6, branch_k=3)
  with pytest.raises(ValueError, match="branch_at must be one of"):
    rollout.RolloutConfig(group_size=6, branch_k=2, branch_at="sometimes")


def test_fork_cache_continues_exactly_like_a_fresh_prefill(model):
  config, params = model
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, config.vocab_size, size=n).tolist() for n in (11, 7)]
  tokens, lengths = smp.pad_rows(prompts, minimum=16)
  cache, _ = smp.prefill(params, config, tokens, lengths, 64)
  # Row 0 cut to 6 slots, twice, and row 1 cut to 7; then each appends its last prefix token.
  rows, ends = np.array([0, 0, 1]), np.array([6, 6, 7])
  forked = smp.fork_cache(cache, rows, ends - 1)
  last = np.array([[prompts[r][e - 1]] for r, e in zip(rows, ends)], np.int32)
  forked, logits = smp.extend(params, config, forked, last, np.ones(3, np.int32))
  fresh_tokens, fresh_lengths = smp.pad_rows([prompts[r][:e] for r, e in zip(rows, ends)],
                                             minimum=16)
  fresh, fresh_logits = smp.prefill(params, config, fresh_tokens, fresh_lengths, 64)
  np.testing.assert_array_equal(forked.end, ends)
  np.testing.assert_allclose(logits, fresh_logits, atol=1e-5)
  rule = smp.SamplingParams(temperature=0.0, max_new_tokens=6)
  a = smp.decode(params, config, forked, logits, None, rule)
  b = smp.decode(params, config, fresh, fresh_logits, None, rule)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Monte-Carlo values from branches on a toy MDP whose values are known.


def _true_values(epsilon, hops, keys, steps):
  """`V[k, t]`: the success probability of the epsilon-noisy oracle from progress `k` after `t`
  steps, in pointer_chain with `hops` hops, `keys` keys and a `steps`-step limit. Per step the
  noisy oracle follows the chain with p_f = (1 - e) + e / (2K), answers early (failure) with e / 2,
  or looks up another key (no progress) with e / 2 (1 - 1/K); at the end of the chain it answers
  right with (1 - e) + e / (2K) and looks something up (no change) with e / 2."""
  e, k = epsilon, keys
  follow, stay = (1 - e) + e / (2 * k), e / 2 * (1 - 1 / k)
  v = np.zeros((hops + 1, steps + 1))
  for t in reversed(range(steps)):
    v[hops, t] = follow + e / 2 * v[hops, t + 1]
    for progress in range(hops):
      v[progress, t] = follow * v[progress + 1, t + 1] + stay * v[progress, t + 1]
  return v


def test_branch_monte_carlo_values_converge_to_the_true_values(env, codec):
  """Roots of the noisy oracle fork at their first non-oracle action: before it every action
  followed the chain, so the state at branch step b is (progress b, b steps used). The branches
  are fresh samples of the policy from that state: their mean success estimates V(b, b) within
  a few standard errors of the sample count."""
  epsilon, k = 0.5, 15
  policy = rollout.oracle_turns(env, codec, epsilon=epsilon, seed=3)
  batch, _ = _collect(env, codec, None, scripted=policy, n=48, seed=1, group_size=k + 1,
                      branch_k=k, branch_at="first_divergence")
  batch.validate()
  v = _true_values(epsilon, hops=2, keys=env.num_keys, steps=MAX_STEPS)
  branches = batch.parent >= 0
  checked = 0
  for b in range(3):
    at = branches & (batch.branch_step == b)
    n = int(at.sum())
    if n < 60:
      continue
    estimate, truth = float(batch.success[at].mean()), v[b, b]
    # Branches of one root are independent given the state; 4 standard errors of n draws.
    tolerance = 4 * np.sqrt(truth * (1 - truth) / n) + 1e-9
    assert abs(estimate - truth) <= tolerance, (b, n, estimate, truth)
    checked += 1
  assert checked >= 2


# ----------------------------------------------------------------------------------------------------
# Host environments: the state comes from `snapshot()` / `restore()`, or from a replay of the
# parent's actions where the environment has no snapshots.


def _stay_then_up(codec):
  """Roots say `stay` at their first two steps, then `up`; branch rows (after the roots are done)
  say `up` at every step."""

  def turns(states):
    out = []
    for r, active in enumerate(states.active):
      row = states.pool.rows[r]  # branch rows are not recorded: `record` tells them apart
      stay = row.record and row.history.count("stay") < 2
      out.append(codec.encode_action("stay" if stay else "up") if active else [])
    return out

  return turns


@pytest.mark.parametrize("snapshots", [True, False])
def test_host_branches_continue_from_the_parent_state(snapshots, host_fixtures):
  hf = host_fixtures
  from longhorizon.envs.pool import close_pools  # pylint: disable=g-import-not-at-top
  env = (hf.FaultyCounter if snapshots else hf.Counter)(success=1.0, milestone=0.5)
  codec = env.codec()
  rc = rollout.RolloutConfig(group_size=4, context_length=128, max_steps=6, turn_tokens=4,
                             branch_k=1, branch_at="uniform")
  try:
    batch, _ = rollout.collect(None, None, env, codec, env.tasks("train", 2, 0),
                               jax.random.split(jax.random.key(0), 2), rc, sampling_seed=0,
                               scripted=_stay_then_up(codec))
  finally:
    close_pools(env)
  batch.validate()
  roots, branches = batch.parent < 0, np.flatnonzero(batch.parent >= 0)
  # Roots: stay, stay, up, up, up (success at step 4).
  assert (batch.num_steps[roots] == 5).all() and batch.success[roots].all()
  for i in branches:
    p, b = batch.parent[i], batch.branch_step[i]
    start = _own_start(batch, i)
    np.testing.assert_array_equal(batch.tokens[i, :start], batch.tokens[p, :start])
    # The branch goes up from the parent's position at step b: the counter's state (its position
    # and its step count, which a reset would zero) continues.
    pos = max(b - 2, 0)
    first = codec.decode(batch.tokens[i][(batch.turn[i] == b) & ~batch.loss_mask[i]
                                         & batch.attention_mask[i]])
    if pos + 1 < 3:  # not the winning step (which ends the episode without an observation)
      assert f"pos {pos + 1} step {b + 1}" in first, (b, first)
    assert batch.success[i] and batch.num_steps[i] == b + (3 - pos)
  assert len(set(batch.branch_step[branches].tolist())) >= 2


def test_host_steps_record_their_measured_latency(host_fixtures):
  hf = host_fixtures
  from longhorizon.envs.pool import close_pools  # pylint: disable=g-import-not-at-top
  env = hf.Counter(latency_s=0.05, success=1.0)
  codec = env.codec()
  rc = rollout.RolloutConfig(group_size=2, context_length=96, max_steps=4, turn_tokens=4)
  try:
    batch, _ = rollout.collect(None, None, env, codec, env.tasks("train", 2, 0),
                               jax.random.split(jax.random.key(0), 2), rc, sampling_seed=0,
                               scripted=rollout.oracle_turns(env, codec))
  finally:
    close_pools(env)
  steps = np.asarray(batch.step_mask, bool)
  assert steps.sum() == 2 * 2 * 3
  latency = np.asarray(batch.latency)
  assert (latency[steps] >= 0.05).all() and (latency[steps] < 2.0).all()
  assert not latency[~steps].any()


def test_record_oracle_marks_each_step_against_the_oracle(env, codec, model):
  batch, _ = _collect(env, codec, model, branch_k=0, record_oracle=True,
                      scripted=_scripted_with_mistake(env, codec, wrong_at=1))
  steps = np.asarray(batch.step_mask, bool)
  match = np.asarray(batch.oracle_match)
  assert (match[~steps] == -1).all()
  np.testing.assert_array_equal(match[:, 1][steps[:, 1]], 0)  # the planted mistake
  others = steps.copy()
  others[:, 1] = False
  assert (match[others] == 1).all()
  plain, _ = _collect(env, codec, model, branch_k=0,
                      scripted=_scripted_with_mistake(env, codec, wrong_at=1))
  assert (np.asarray(plain.oracle_match) == -1).all()  # not recorded unless asked


def test_first_error_metrics_locate_the_first_non_oracle_action(env, codec, model):
  from longhorizon.studies import horizon  # pylint: disable=g-import-not-at-top
  from longhorizon.train.learner import first_error_metrics  # pylint: disable=g-import-not-at-top
  batch, _ = _collect(env, codec, model, record_oracle=True, branch_at="first_divergence",
                      scripted=_scripted_with_mistake(env, codec, wrong_at=1))
  m = first_error_metrics(batch)
  assert m["first_error/rate"] == 1.0 and m["first_error/mean_step"] == 1.0
  assert m["first_error/at_first_step"] == 0.0 and m["first_error/step_1"] == 1.0
  assert sum(v for k, v in m.items() if k.startswith("first_error/step_")) == pytest.approx(1.0)
  row = horizon._first_errors(m)  # pylint: disable=protected-access
  assert row["rate"] == 1.0 and row["by_step"].split()[:2] == ["0.0000", "1.0000"]
  plain, _ = _collect(env, codec, model, scripted=_scripted_with_mistake(env, codec, wrong_at=1))
  assert first_error_metrics(plain) == {} and horizon._first_errors({}) is None


def test_shared_prompts_sample_the_same_episodes(env, codec, model):
  """Each task's prompt prefilled once and copied to its rows gives the rollouts of prefilling
  every row (the same tokens; log-probs equal up to float rounding), branches included."""
  config, params = model
  for branch_k in (0, 2):
    plain, _ = _collect(env, codec, model, branch_k=branch_k)
    shared, _ = _collect(env, codec, model, branch_k=branch_k, share_prompts=True)
    np.testing.assert_array_equal(shared.tokens, plain.tokens)
    np.testing.assert_allclose(shared.behavior_logprobs, plain.behavior_logprobs, atol=1e-5)
  lp = np.asarray(episode_logprobs(params, config, to_device(shared), temperature=1.0))
  np.testing.assert_allclose(lp[shared.loss_mask], shared.behavior_logprobs[shared.loss_mask],
                             atol=1e-4)
