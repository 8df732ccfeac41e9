"""Context modes (`rollout/context.py`): window and summary segments are token-exact (each row's
learner log-probs equal the sampler's), a rewritten context is exactly the prompt plus copied
turns (window) or the environment's state summary (summary), the segments of an episode repeat
its step- and episode-level fields, and their advantages are the episode's, by step, with group
statistics over episodes (not rows)."""

import dataclasses

import jax
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.rollout import context
from longhorizon.core.episode import episodes_only, join_segments, to_device
from longhorizon.envs import testing
from longhorizon.models import init_params, tiny_config
from longhorizon.train import algorithms
from longhorizon.train.update import episode_logprobs

HOPS, MAX_STEPS, N_TASKS = 8, 10, 4


@pytest.fixture(scope="module")
def env():
  return envs.TimeLimit(envs.make("pointer_chain", horizon=HOPS), MAX_STEPS)


@pytest.fixture(scope="module")
def tasks(env):
  keys = jax.random.split(jax.random.key(2), N_TASKS)
  return testing.tasks_from_keys(env, keys), keys


def _rc(mode, **overrides):
  """`mode` is a context mode, or "policy": summary written by the policy (8 tokens at most)."""
  by_policy = (dict(context_summary_by="policy", context_summary_tokens=8) if mode == "policy"
               else {})
  return rollout.RolloutConfig(**{**dict(
      group_size=2, context_length=64, max_steps=MAX_STEPS, turn_tokens=4,
      context_mode="summary" if mode == "policy" else mode, context_every=0, context_keep=2,
      context_segments=5), **by_policy, **overrides})


def _oracle(env, codec, tasks, rc):
  (task, keys) = tasks
  return rollout.collect(None, None, env, codec, task, keys, rc, sampling_seed=0,
                         scripted=rollout.oracle_turns(env, codec))


def test_summary_carries_the_oracle_where_full_overflows(env, codec, tasks):
  full, _ = _oracle(env, codec, tasks, _rc("full"))
  assert (full.termination == 4).all()  # CONTEXT_OVERFLOW: 64 tokens hold fewer than 9 turns
  batch, stats = _oracle(env, codec, tasks, _rc("summary"))
  assert batch.success.all() and stats.segment_starts > 0
  rows = join_segments(batch, stats.segments).validate()
  assert rows.batch_size == batch.batch_size * 5
  # Every later segment starts from the system text and the state summary "start K hops H", where
  # K is the key the chain reached and H the hops left: the task restated from there.
  for i in range(batch.batch_size):
    own = [i] + [j for j in np.flatnonzero(rows.segment_of == i) if rows.loss_mask[j].any()]
    assert len(own) >= 2
    segments = sorted(own, key=lambda j: rows.turn[j][rows.loss_mask[j]].min())
    for j in segments[1:]:
      text = codec.decode(rows.tokens[j][rows.attention_mask[j]])
      first_step = int(rows.turn[j][rows.loss_mask[j]].min())
      start = codec.summary_prompt_text(f"start {_key_before(codec, rows, segments, first_step)} "
                                        f"hops {HOPS - first_step}")
      assert text.startswith(codec.decode(codec.tokenizer.encode(start,
                                                                 add_special_tokens=False)))
      assert (rows.turn[j][:len(codec.tokenizer.encode(start, add_special_tokens=False))]
              == -1).all()


def _key_before(codec, rows, segments, step):
  """The key the oracle looks up at `step` (its action there), read from the row holding it."""
  for j in segments:
    at = rows.loss_mask[j] & (rows.turn[j] == step)
    if at.any():
      return codec.decode(rows.tokens[j][at]).split()[1]
  raise AssertionError(f"no row holds step {step}")


def test_window_is_the_prompt_and_the_last_turns_copied(env, codec, tasks):
  rc = _rc("window", context_every=3, context_length=128, context_segments=4)
  batch, stats = _oracle(env, codec, tasks, rc)
  rows = join_segments(batch, stats.segments).validate()
  prompt_len = int((rows.turn[0] == -1).sum() - (~rows.attention_mask[0]).sum())
  assert batch.success.all()
  for i in range(batch.batch_size):
    own = [i] + [j for j in np.flatnonzero(rows.segment_of == i) if rows.loss_mask[j].any()]
    segments = sorted(own, key=lambda j: rows.turn[j][rows.loss_mask[j]].min())
    assert len(segments) == 3  # 9 steps: steps 0-2, 3-5 and 6-8
    for before, after in zip(segments, segments[1:]):
      first = int(rows.turn[after][rows.loss_mask[after]].min())
      prompt = rows.tokens[before][:prompt_len]
      np.testing.assert_array_equal(rows.tokens[after][:prompt_len], prompt)
      # Then steps first-2 and first-1 (actions and observations) exactly as the segment before
      # held them, untrained, then the observation of step first-1 is already among them.
      carried = (rows.turn[before] >= first - 2) & (rows.turn[before] <= first - 1)
      n = int(carried.sum())
      tail = (rows.turn[after][prompt_len:] >= 0) & (rows.turn[after][prompt_len:] < first)
      assert int(tail.sum()) >= n
      np.testing.assert_array_equal(rows.tokens[after][prompt_len:prompt_len + n],
                                    rows.tokens[before][carried])
      assert not rows.loss_mask[after][:prompt_len + n].any()


@pytest.mark.parametrize("mode,every", [("window", 0), ("summary", 0), ("summary", 3),
                                        ("window", 2), ("policy", 0), ("policy", 2)])
@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_learner_logprobs_equal_the_samplers_on_every_segment(env, codec, model, tasks, mode,
                                                              every):
  config, params = model
  task, keys = tasks
  batch, stats = rollout.collect(params, config, env, codec, task, keys,
                                 _rc(mode, context_every=every, context_length=80,
                                     context_keep=1), sampling_seed=5)
  assert stats.segment_starts > 0
  rows = join_segments(batch, stats.segments).validate()
  assert (rows.segment_of[batch.batch_size:] >= 0).all()
  logp = np.asarray(episode_logprobs(params, config, to_device(rows), temperature=1.0))
  mask = rows.loss_mask
  assert mask[batch.batch_size:].any()
  np.testing.assert_allclose(logp[mask], rows.behavior_logprobs[mask], atol=1e-5)


@pytest.mark.parametrize("mode", ["window", "summary"])  # (policy's keeps its summary turns)
def test_the_unrewritten_history_is_what_full_would_hold(env, codec, tasks, mode):
  """For the (deterministic) oracle, each rewritten segment's turns after the history `full` would
  hold are exactly the full-mode episode's tokens (in a context that holds it whole)."""
  batch, stats = _oracle(env, codec, tasks, _rc(mode))
  full, _ = _oracle(env, codec, tasks, _rc("full", context_length=256))
  assert full.success.all() and stats.rewritten
  rows = join_segments(batch, stats.segments)
  rewritten, unrewritten = context.rewrite_pairs(rows, stats.rewritten, 256)
  owners = np.where(rows.segment_of < 0, np.arange(rows.batch_size), rows.segment_of)
  for i, (j, _, start) in enumerate(stats.rewritten):
    n = int(unrewritten.attention_mask[i].sum())
    np.testing.assert_array_equal(unrewritten.tokens[i, :n], full.tokens[owners[j], :n])
    np.testing.assert_array_equal(rewritten.tokens[i], rows.tokens[j])
    # Both score the segment's own turns only, the same tokens.
    np.testing.assert_array_equal(rewritten.tokens[i][rewritten.loss_mask[i]],
                                  unrewritten.tokens[i][unrewritten.loss_mask[i]])
    assert rewritten.loss_mask[i].sum() == rows.loss_mask[j].sum() > 0
    assert not rewritten.loss_mask[i, :start].any()


def test_the_policys_summary_is_a_trained_turn_carried_exactly(env, codec, model, tasks):
  """summary_by="policy": each earlier segment ends with the observation, the request and the
  summary the policy sampled (loss 1, behaviour log-probs); the next segment is the prompt's
  framing around exactly those ids (end of turn dropped), untrained."""
  config, params = model
  task, keys = tasks
  batch, stats = rollout.collect(params, config, env, codec, task, keys,
                                 _rc("policy", context_length=80, context_every=2),
                                 sampling_seed=3)
  assert stats.summary_turns > 0 and stats.summary_turns == stats.segment_starts
  rows = join_segments(batch, stats.segments).validate()
  request = codec.tokenizer.encode(context.summary_request("compact"), add_special_tokens=False)
  head, tail = (codec.tokenizer.encode(x, add_special_tokens=False)
                for x in codec.summary_prompt_text(context._MARK).split(context._MARK))
  eot = codec.stop_token_ids
  checked = 0
  for i in range(batch.batch_size):
    own = [i] + [j for j in np.flatnonzero(rows.segment_of == i) if rows.loss_mask[j].any()]
    segments = sorted(own, key=lambda j: rows.turn[j][rows.loss_mask[j]].min())
    for before, after in zip(segments, segments[1:]):
      end = int(rows.attention_mask[before].sum())
      last = rows.turn[before][end - 1]
      summary = np.flatnonzero(rows.loss_mask[before] & (rows.turn[before] == last))
      summary = summary[summary > np.flatnonzero(~rows.loss_mask[before][:end])[-1]]
      start = int(summary[0])
      np.testing.assert_array_equal(rows.tokens[before][start - len(request):start], request)
      ids = rows.tokens[before][summary].tolist()
      ids = ids[:-1] if ids[-1] in eot else ids
      context_ids = head + ids + tail
      np.testing.assert_array_equal(rows.tokens[after][:len(context_ids)], context_ids)
      assert not rows.loss_mask[after][:len(context_ids)].any()
      assert (rows.behavior_logprobs[before][summary] < 0).all()
      checked += 1
  assert checked > 0


def test_segment_rows_repeat_their_episode(env, codec, tasks):
  batch, stats = _oracle(env, codec, tasks, _rc("summary"))
  rows = join_segments(batch, stats.segments)
  earlier = np.flatnonzero(rows.segment_of >= 0)
  for name in ("group", "score", "success", "num_steps", "rewards", "step_mask", "env_seed"):
    np.testing.assert_array_equal(getattr(rows, name)[earlier],
                                  getattr(rows, name)[rows.segment_of[earlier]])
  assert episodes_only(rows).batch_size == batch.batch_size
  broken = rows.replace(group=np.where(np.arange(rows.batch_size) == earlier[0], 99, rows.group))
  with pytest.raises(ValueError, match="group differs between an earlier context segment"):
    broken.validate()


def _sampled(env, codec, model, tasks, mode):
  config, params = model
  task, keys = tasks
  return rollout.collect(params, config, env, codec, task, keys, _rc(mode, group_size=4),
                         sampling_seed=11)


@pytest.mark.parametrize("name", ["grpo", "rloo", "gigpo", "drgrpo"])
def test_step_view_advantages_equal_the_estimators_own(env, codec, model, tasks, name):
  """On one-row-per-episode batches (full mode) the per-step route gives every token exactly the
  estimator's own advantage: the estimators' advantages are functions of (row, step)."""
  batch, _ = _sampled(env, codec, model, tasks, "full")
  batch = batch.replace(score=np.random.default_rng(0).normal(size=batch.batch_size)
                        .astype(np.float32))
  options = algorithms.AlgorithmOptions(name=name)
  db = to_device(batch)
  direct = algorithms.compute_advantages(db, None, options)
  via = algorithms.segment_advantages(db, options)
  np.testing.assert_allclose(np.asarray(via.advantages), np.asarray(direct.advantages), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(via.row_weight), np.asarray(direct.row_weight))


def test_segments_take_their_episodes_advantage_with_group_statistics_over_episodes(
    env, codec, model, tasks):
  batch, stats = _sampled(env, codec, model, tasks, "summary")
  rng = np.random.default_rng(1)
  score = rng.normal(size=batch.batch_size).astype(np.float32)
  batch = batch.replace(score=score)
  segments = stats.segments.replace(score=score[stats.segments.segment_of])
  rows = join_segments(batch, segments).validate()
  options = algorithms.AlgorithmOptions(name="grpo")
  out = algorithms.segment_advantages(to_device(rows), options)
  adv = np.asarray(out.advantages)
  # GRPO by hand over the episodes (rows 0..B-1), whatever number of rows each one has.
  group = batch.group
  expected = np.zeros(batch.batch_size, np.float32)
  for g in np.unique(group):
    at = group == g
    expected[at] = (score[at] - score[at].mean()) / (score[at].std(ddof=1) + 1e-6)
  owner = np.where(rows.segment_of < 0, np.arange(rows.batch_size), rows.segment_of)
  mask = rows.loss_mask
  np.testing.assert_allclose(adv[mask], np.broadcast_to(expected[owner][:, None], adv.shape)[mask],
                             rtol=1e-4, atol=1e-4)
  assert (adv[~mask] == 0).all()
  assert mask[batch.batch_size:].any()


def test_config_refuses_what_segments_do_not_support():
  with pytest.raises(ValueError, match="context_mode='window' does not branch"):
    _rc("window", branch_k=1)
  with pytest.raises(ValueError, match="context_mode must be one of"):
    _rc("notebook")


# ------------------------------------------------------------------------- the training run
def _train_config(tmp_path, **changes):
  import importlib.util
  import os
  from longhorizon.train import config as config_lib
  spec = importlib.util.spec_from_file_location(
      "default_config", os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                     "default.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("smoke")
  config.unlock()
  config.tasks.data_dir = str(tmp_path / "tasks")
  settings = {"env.params": {"horizon": HOPS}, "env.max_steps": MAX_STEPS,
              "rollout.context_length": 64, "rollout.turn_tokens": 4, "context.mode": "summary",
              **changes}
  for path, value in settings.items():
    config_lib.set_path(config, path, value)
  config.lock()
  return config


@pytest.mark.slow
@pytest.mark.parametrize("summary_by", ["env", "policy"])
def test_training_on_segments_does_not_recompile(tmp_path, summary_by):
  from longhorizon.train.learner import Learner
  from longhorizon.train.metrics import Timer
  s = Learner.build(_train_config(tmp_path, **{"context.summary_by": summary_by,
                                               "context.summary_tokens": 8}))
  state = s.with_reference(s.initial_state())
  state, _ = s.warm_start(state)
  seen = []
  for update in range(3):
    state, metrics = s.step(state, update, update * 4, Timer())
    seen.append(metrics)
  assert all(m["context/rows_per_episode"] > 1 for m in seen)
  assert all(m["rollout/segment_starts"] > 0 for m in seen)
  assert all(np.isfinite(m["loss"]) for m in seen)
  assert [f._cache_size() for f in s._jitted.values()] == [1]  # fixed rows: one compilation
  if summary_by == "policy":
    assert all(m["rollout/summary_turns"] > 0 for m in seen)
  report = s.evaluate(state.params, "test", 4, temperature=0.0, seed=0)
  assert report["mean_steps"] > 3  # evaluation runs in the same context mode: past the overflow


@pytest.mark.parametrize("changes,message", [
    ({"algorithm.name": "ppo"}, "config.algorithm.name='ppo' is not allowed; expected a "
                                "critic-free estimator"),
    ({"rollout.mode": "async"}, "config.rollout.mode='async'"),
    ({"algorithm.empg": True}, "config.algorithm.empg=True"),
    ({"rollout.branch_k": 1}, "config.rollout.branch_k=1"),
    ({"dpo.steps": 2}, "config.dpo.steps=2"),
    ({"env.name": "gridworld", "env.params": {}}, "it has no state summary"),
])
def test_config_refuses_segments_with_what_reads_one_row_per_episode(tmp_path, changes, message):
  from longhorizon.train import config as config_lib
  with pytest.raises(config_lib.ConfigError, match=None) as info:
    config_lib.validate(_train_config(tmp_path, **changes))
  assert message in str(info.value)


def test_the_warm_start_drops_empty_segment_rows_without_changing_its_update(env, codec, model,
                                                                              tasks):
  """Segment rows past an episode's last (the fixed `B x (segments - 1)` shape) train nothing:
  the warm start drops them (keeping as few as a minibatch multiple needs), with the same
  update."""
  import optax
  from longhorizon.core.episode import without_empty_segments
  from longhorizon.train.update import TrainState, sft_update
  config, params = model
  batch, stats = _oracle(env, codec, tasks, _rc("summary", context_segments=8))
  rows = join_segments(batch, stats.segments).validate()
  b = batch.batch_size
  kept = without_empty_segments(rows, b, multiple=4).validate()
  has_loss = np.asarray(kept.loss_mask).any(-1)
  assert kept.batch_size % 4 == 0 and kept.batch_size < rows.batch_size
  assert int((~has_loss).sum()) < 4 and has_loss[:b].all()
  assert int(np.asarray(kept.loss_mask).sum()) == int(np.asarray(rows.loss_mask).sum())
  np.testing.assert_array_equal(kept.tokens[:b], rows.tokens[:b])  # episodes first, unchanged
  # nothing to drop, or no multiple reachable: the batch itself
  assert without_empty_segments(kept, b, multiple=1).batch_size == int(has_loss.sum())
  assert without_empty_segments(rows, b, multiple=rows.batch_size + 1) is rows

  optimizer = optax.sgd(0.1)

  def update(x):
    p = jax.tree.map(lambda a: a.copy(), params)
    state = TrainState(params=p, opt_state=optimizer.init(p), critic_params=None,
                       critic_opt_state=None, step=np.int32(0), policy_version=np.int32(0),
                       rng=jax.random.key(0), skipped=np.int32(0))
    out, _ = sft_update(state, to_device(x), config=config, optimizer=optimizer, minibatches=1)
    return out.params

  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-6, rtol=1e-5),
               update(rows), update(kept))
