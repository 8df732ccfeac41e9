"""The `offload` context mode (`envs/notebook.py`) on the real SQLite back office: long outputs
become notes read back exactly, bad note calls are invalid actions, the oracle still succeeds in a
shorter context, snapshots carry the notes, sampled rows stay token-exact, and the config wraps a
host environment (and refuses a JAX one)."""

import dataclasses
import pickle

import jax
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.rollout import context
from longhorizon.core.episode import to_device
from longhorizon.envs import pool as pool_lib
from longhorizon.envs.notebook import Notebook
from longhorizon.models import init_params, tiny_config
from longhorizon.train import config as config_lib
from longhorizon.train.update import episode_logprobs

WORDS = 6  # outputs of more words are offloaded


def _pair(style="compact", **kw):
  bare = envs.make("back_office", style=style)
  notebook = Notebook("back_office", {"style": style}, max_words=WORDS, preview_words=2, **kw)
  return bare, notebook


def test_long_outputs_become_notes_read_back_exactly():
  bare, nb = _pair()
  task = bare.tasks("test", 1, 0)[0]
  assert bare.reset(task, 0) == nb.reset(task, 0)  # the task itself is never offloaded
  offloaded = 0
  for _ in range(12):
    action = bare.oracle()
    assert nb.oracle() == action
    want, got = bare.step(action), nb.step(action)
    assert (got.terminated, got.success, got.milestones, got.reward) == (
        want.terminated, want.success, want.milestones, want.reward)
    if len(want.observation.split()) > WORDS:
      k = len(nb.notes) - 1
      assert nb.notes[k] == want.observation and got.info["offloaded_note"] == k
      assert got.observation == " ".join(want.observation.split()[:2]) + (
          f" ... saved to note {k} , read_note {k} to read it")
      offloaded += 1
    else:
      assert got.observation == want.observation
    if want.terminated:
      break
  assert offloaded >= 3 and want.success
  for k, text in enumerate(nb.notes):  # read back exactly, in compact and tool_call calls
    assert nb.step(f"read_note {k}").observation == text
    call = '<tool_call>{"name": "read_note", "arguments": {"note": %d}}</tool_call>' % k
    assert nb.step(call).observation == text


def test_the_policys_own_notes_and_bad_note_calls():
  _, nb = _pair(max_notes=2)
  nb.reset(nb.tasks("test", 1, 0)[0], 0)
  saved = nb.step("write_note refund 1974 after the address")
  assert saved.observation == "saved to note 0" and saved.error == 0
  assert nb.step("read_note 0").observation == "refund 1974 after the address"
  for action, words in (("read_note 5", "no note 5"), ("read_note x", "note must be an integer"),
                        ("read_note 0 1", "unexpected text")):
    result = nb.step(action)
    assert result.error and not result.terminated and words in result.observation, result
  nb.step("write_note second")
  full = nb.step("write_note third")
  assert full.error == envs.ErrorCode.BAD_ARGUMENT and "full" in full.observation
  # Anything else is the environment's: its own answer to an unknown tool.
  assert nb.step("teleport 3").error == envs.ErrorCode.UNKNOWN_TOOL


def test_snapshot_carries_the_notes_and_a_pickled_factory_rebuilds_the_wrapper():
  _, nb = _pair()
  task = nb.tasks("test", 1, 1)[0]
  nb.reset(task, 0)
  for _ in range(3):
    nb.step(nb.oracle())
  snap = nb.snapshot()
  factory = pickle.loads(pickle.dumps(pool_lib.factory_of(nb)))
  other = factory()
  assert isinstance(other, Notebook) and other.params() == nb.params()
  other.reset(task, 0)
  other.restore(snap)
  assert other.notes == nb.notes
  for _ in range(3):
    action = nb.oracle()
    assert other.oracle() == action and other.step(action) == nb.step(action)


def _rc(**kw):
  return rollout.RolloutConfig(**{**dict(group_size=1, context_length=8192, max_steps=24,
                                         turn_tokens=96), **kw})


def test_oracle_succeeds_as_without_notes_in_a_shorter_context():
  bare, nb = _pair()
  tasks = bare.tasks("test", 4, 0)
  keys = jax.random.split(jax.random.key(0), 4)
  out = {}
  for name, env in (("bare", bare), ("notebook", nb)):
    codec = env.codec()
    batch, stats = rollout.collect(None, None, env, codec, tasks, keys, _rc(), sampling_seed=0,
                                   scripted=rollout.oracle_turns(env, codec))
    assert stats.unknown_words == 0
    out[name] = (batch, codec)
  (plain, _), (noted, codec) = out["bare"], out["notebook"]
  np.testing.assert_array_equal(noted.success, plain.success)
  assert noted.success.all()
  used = lambda b: np.asarray(b.attention_mask).sum(-1)
  assert (used(noted) < used(plain)).all(), (used(noted), used(plain))
  text = codec.decode(np.asarray(noted.tokens[0])[np.asarray(noted.attention_mask[0])])
  assert "saved to note 0 , read_note 0 to read it" in text and "read_note" in text


@pytest.fixture(scope="module")
def sampled():
  """A tiny random policy's episodes in offload mode (its malformed calls' error messages are
  long outputs at max_words=3)."""
  nb = Notebook("back_office", {"style": "compact"}, max_words=3, preview_words=1)
  codec = nb.codec()
  config = dataclasses.replace(tiny_config(), vocab_size=len(codec.tokenizer))
  params = init_params(config, jax.random.key(0))
  tasks = nb.tasks("train", 2, 0)
  batch, _ = rollout.collect(params, config, nb, codec, tasks,
                             jax.random.split(jax.random.key(1), 2),
                             _rc(group_size=2, context_length=1600, max_steps=4, turn_tokens=6),
                             sampling_seed=3)
  return nb, codec, config, params, [tasks[g] for g in np.asarray(batch.group)], batch


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_sampled_rows_with_notes_are_token_exact(sampled):
  nb, codec, config, params, _, batch = sampled
  rows = [codec.decode(np.asarray(t)[np.asarray(m)]) for t, m in zip(batch.tokens,
                                                                      batch.attention_mask)]
  assert any("saved to note" in r for r in rows), rows  # the policy's errors are long outputs too
  logp = np.asarray(episode_logprobs(params, config, to_device(batch), temperature=1.0))
  mask = np.asarray(batch.loss_mask)
  assert mask.any()
  np.testing.assert_allclose(logp[mask], np.asarray(batch.behavior_logprobs)[mask], atol=1e-5)


def test_config_wraps_a_host_environment_and_refuses_a_jax_one():
  import importlib.util
  import os
  from longhorizon.train import learner as learner_lib
  path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "default.py")
  spec = importlib.util.spec_from_file_location("default_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.context.mode = "offload"
  with pytest.raises(config_lib.ConfigError, match="offload keeps long text outputs as notes"):
    config_lib.validate(config)
  config.env.name = "back_office"
  config.env.params = {"style": "compact"}
  config.context.offload_words = 10
  config.context.offload_preview = 3
  env = learner_lib.make_env(config)
  try:
    assert isinstance(env, Notebook) and (env.max_words, env.preview_words) == (10, 3)
    assert env.inner_params == {"style": "compact"}
  finally:
    pool_lib.close_pools(env)
  config.context.offload_preview = 11
  with pytest.raises(config_lib.ConfigError, match="context.offload_preview"):
    config_lib.validate(config)


def test_offload_pairs_put_each_offloaded_output_back_inline(sampled):
  nb, codec, config, params, tasks, batch = sampled
  seen, inline = context.offload_pairs(batch, nb, codec, tasks, 2048)
  np.testing.assert_array_equal(seen.tokens, batch.tokens)
  np.testing.assert_array_equal(seen.loss_mask, batch.loss_mask)
  bare = Notebook("back_office", {"style": "compact"}, max_words=10_000)  # nothing offloaded
  grown = 0
  for j in range(batch.batch_size):
    row = codec.decode(np.asarray(inline.tokens[j])[np.asarray(inline.attention_mask[j])])
    assert "to read it" not in row
    # The inline row is what the policy would have seen with no offloading: replay by hand.
    bare.reset(tasks[j], int(batch.env_seed[j]))
    turn, loss = np.asarray(batch.turn[j]), np.asarray(batch.loss_mask[j], bool)
    for t in range(int(batch.num_steps[j])):
      text = bare.step(codec.action_text(np.asarray(batch.tokens[j])[loss & (turn == t)]))
      if t < int(batch.num_steps[j]) - 1:
        assert text.observation in row
    as_seen = codec.decode(np.asarray(seen.tokens[j])[np.asarray(seen.attention_mask[j])])
    longer = inline.attention_mask[j].sum() > seen.attention_mask[j].sum()
    assert longer == ("to read it" in as_seen)
    grown += int(longer)
    # The same sampled tokens, in order, carry the loss in both.
    np.testing.assert_array_equal(np.asarray(inline.tokens[j])[np.asarray(inline.loss_mask[j])],
                                  np.asarray(seen.tokens[j])[np.asarray(seen.loss_mask[j])])
  assert grown >= 1
  # A row whose observation is not what the environment says is named.
  broken = batch.replace(tokens=np.where(
      (np.asarray(batch.turn) == 0) & ~np.asarray(batch.loss_mask) & np.asarray(
          batch.attention_mask), 3, np.asarray(batch.tokens)))
  with pytest.raises(ValueError, match=r"row \d+ step 0: the replayed observation"):
    context.offload_pairs(broken, nb, codec, tasks, 2048)
