"""Summary mode on a host environment: TextWorld's `state_text` (the objective without the steps
already scored, then the room) is the reset observation at the start and keeps exactly the
remaining plan's clauses; through the process pool it is the instance's own; summary segments of
TextWorld episodes start from it, the oracle finishes in a context `full` overflows, and sampled
segment rows are token-exact."""

from __future__ import annotations

import jax
import numpy as np
import pytest

textworld = pytest.importorskip(
    "textworld", reason="TextWorld is optional; to run these tests install the [textworld] extra: "
                        "pip install -e .[textworld]")

from longhorizon import envs, rollout  # noqa: E402
from longhorizon.core.episode import join_segments, to_device  # noqa: E402
from longhorizon.envs import pool as pool_lib  # noqa: E402
from longhorizon.envs.textworld_games import normalize_text  # noqa: E402
from longhorizon.models import init_params, tiny_config  # noqa: E402
from longhorizon.train.update import episode_logprobs  # noqa: E402

QUEST = 6


@pytest.fixture(scope="module", autouse=True)
def data_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("longhorizon_data")
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("LONGHORIZON_DATA", str(path))
    yield path


@pytest.fixture(scope="module")
def env():
  return envs.make("textworld", family="coin", quest_length=QUEST, ood_quest_length=QUEST)


def _clauses(env, text):
  """The plan clauses a summary (or the reset text) still holds: its sentences before the room,
  less the introduction and the closing sentence."""
  objective = normalize_text(env._state["objective"])
  intro = len(objective.split(" . ")) - 1 - int(env._state["max_score"])
  room = normalize_text(env._state["description"])
  assert text.endswith(" " + room)
  return len(text[:-len(room) - 1].split(" . ")) - 1 - intro


def test_state_text_is_the_reset_text_then_the_plan_left(env):
  for task in env.tasks("train", 3, 0):
    first = env.reset(task, 0)
    assert env.state_text() == first.text
    assert _clauses(env, first.text) == QUEST
    for step in range(1, QUEST):
      env.step(env.oracle())
      assert int(env._state["score"]) == step
      summary = env.state_text()
      # one clause per walkthrough action left, and the room the player is in
      assert _clauses(env, summary) == len(env._state["policy_commands"]) == QUEST - step
    assert summary.split(" . ")[-5:] != first.text.split(" . ")[-5:]  # a different room
  # a move off the path scores nothing: the plan is unchanged, the room is the new one
  task = env.tasks("test", 1, 0)[0]
  env.reset(task, 0)
  wrong = sorted(set(c for c in env._state["admissible_commands"] if c.startswith("go "))
                 - {env.oracle()})
  before = env.state_text()
  if wrong:
    env.step(wrong[0])
    assert int(env._state["score"]) == 0 and _clauses(env, env.state_text()) == QUEST
    assert env.state_text() != before


def test_the_pool_returns_each_instances_own_summary(env):
  tasks = env.tasks("test", 2, 0)
  with pool_lib.EnvPool(pool_lib.factory_of(env), backend="process", workers=2) as pool:
    pool.reset(tasks, [0, 0])
    pool.step({0: pool.oracle([0])[0]})
    got = pool.state_texts([0, 1])
  for r, steps in ((0, 1), (1, 0)):
    env.reset(tasks[r], 0)
    for _ in range(steps):
      env.step(env.oracle())
    assert got[r] == env.state_text()


def _rc(**kw):
  return rollout.RolloutConfig(**{**dict(
      group_size=1, context_length=320, max_steps=QUEST + 2, turn_tokens=8,
      context_mode="summary", context_every=2, context_keep=2, context_segments=5), **kw})


@pytest.mark.slow  # (the default suite sits at its 20-minute bar; CI runs it)
def test_summary_carries_the_oracle_where_full_overflows(env):
  codec = env.codec()
  tasks = env.tasks("test", 2, 0)
  keys = jax.random.split(jax.random.key(0), 2)
  oracle = rollout.oracle_turns(env, codec)
  full, _ = rollout.collect(None, None, env, codec, tasks, keys, _rc(context_mode="full"),
                            sampling_seed=0, scripted=oracle)
  assert (full.termination == 4).all()  # CONTEXT_OVERFLOW
  batch, stats = rollout.collect(None, None, env, codec, tasks, keys, _rc(), sampling_seed=0,
                                 scripted=oracle)
  assert batch.success.all() and stats.segment_starts > 0 and stats.unknown_words == 0
  rows = join_segments(batch, stats.segments).validate()
  for i, task in enumerate(tasks):  # segment k starts from the summary after 2k oracle steps
    env.reset(task, 0)
    own = [i] + [j for j in np.flatnonzero(rows.segment_of == i) if rows.loss_mask[j].any()]
    segments = sorted(own, key=lambda j: rows.turn[j][rows.loss_mask[j]].min())
    assert len(segments) == QUEST // 2
    for k, j in enumerate(segments):
      if k:
        env.step(env.oracle())
        env.step(env.oracle())
      start = codec.render_prompt(env.state_text())
      np.testing.assert_array_equal(rows.tokens[j][:len(start)], start)
      assert int(rows.turn[j][rows.loss_mask[j]].min()) == 2 * k


@pytest.mark.slow
def test_sampled_summary_segments_are_token_exact(env):
  codec = env.codec()
  config = tiny_config()
  config = type(config)(**{**config.__dict__, "vocab_size": len(codec.tokenizer)})
  params = init_params(config, jax.random.key(0))
  tasks = env.tasks("train", 2, 0)
  batch, stats = rollout.collect(params, config, env, codec, tasks,
                                 jax.random.split(jax.random.key(1), 2),
                                 _rc(group_size=2, context_every=1, max_steps=3),
                                 sampling_seed=3)
  assert stats.segment_starts > 0
  rows = join_segments(batch, stats.segments).validate()
  logp = np.asarray(episode_logprobs(params, config, to_device(rows), temperature=1.0))
  mask = rows.loss_mask
  assert mask[batch.batch_size:].any()
  np.testing.assert_allclose(logp[mask], rows.behavior_logprobs[mask], atol=1e-5)


def test_the_config_takes_summary_for_textworld_only_among_host_envs():
  from longhorizon.train import config as config_lib
  assert config_lib._has_state_text("textworld")
  assert not config_lib._has_state_text("back_office")
  assert config_lib._has_state_text("pointer_chain")
