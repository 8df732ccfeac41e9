"""The trajectory store: exact round trips, atomic files and named corruption, schema versions,
validity filters, canonical-key dedup, priority sampling in proportion to its weights, the `tail`
command, and the training loop's appends (resume appends, never rewrites)."""

import os

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longhorizon import envs, rollout
from longhorizon.cli import store as store_cli
from longhorizon.core import episode
from longhorizon.core.episode import RECOVERY, Termination
from longhorizon.envs import testing
from longhorizon.rollout import render
from longhorizon.rollout import store as store_lib
from longhorizon.rollout.store import Priority, TrajectoryStore

ENV_PARAMS = {"horizon": 2}
MAX_STEPS = 5


@pytest.fixture(scope="module")
def env():
  return envs.TimeLimit(envs.make("pointer_chain", **ENV_PARAMS), MAX_STEPS)


@pytest.fixture(scope="module")
def collected(env):
  """A noisy-oracle batch of 3 tasks x 6 rows with branches (parents, branch steps, copies),
  successes and failures, and its rollout stats."""
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(0), 3)
  rc = rollout.RolloutConfig(group_size=6, context_length=128, max_steps=MAX_STEPS, turn_tokens=5,
                             branch_k=2, branch_at="first_divergence")
  batch, stats = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys,
                                 rc, sampling_seed=0,
                                 scripted=rollout.oracle_turns(env, codec, 0.5, seed=1))
  assert (batch.parent >= 0).any() and batch.success.any() and not batch.success.all()
  return batch, stats


def _versions(batch, policy: int):
  b = batch.batch_size
  return batch.replace(policy_version=np.full((b,), policy, np.int32),
                       env_version=np.full((b,), 123456, np.int32),
                       reward_version=np.full((b,), -98765, np.int32))


def _leaves(batch):
  flat = jax.tree_util.tree_flatten_with_path(batch)[0]
  return {jax.tree_util.keystr(path): value for path, value in flat}


def _assert_same(a, b):
  la, lb = _leaves(a), _leaves(b)
  assert la.keys() == lb.keys()
  for name, value in la.items():
    value = np.asarray(value)
    assert lb[name].dtype == value.dtype, name
    np.testing.assert_array_equal(lb[name], value, err_msg=name)


def _with_outcome(batch, rows, kind: Termination):
  """`batch` with episodes `rows` ended as `kind` (TIMEOUT, CONTEXT_OVERFLOW or ENV_ERROR)."""
  f = {k: np.array(getattr(batch, k)) for k in ("termination", "success", "terminated",
                                                  "truncated", "env_error")}
  f["termination"][rows] = kind
  f["success"][rows] = f["terminated"][rows] = False
  f["truncated"][rows] = True
  if kind == Termination.ENV_ERROR:
    f["env_error"][rows, 0] = True
  return batch.replace(**f).validate()


# ------------------------------------------------------------------------------------ round trip

def test_round_trip_keeps_every_field_exactly(tmp_path, collected):
  batch, stats = collected
  b, length = batch.batch_size, batch.context_length
  routing = np.random.default_rng(0).integers(0, 8, (b, length, 2, 3)).astype(np.int32)
  routing[~np.asarray(batch.attention_mask)] = 0
  first = _versions(batch, 0).replace(routing=routing)
  second = _with_outcome(_versions(batch, 1), [0, 1], Termination.ENV_ERROR).replace(
      routing=routing)
  store = TrajectoryStore(tmp_path / "s")
  assert len(store) == 0 and store.files() == []
  store.append(first, update=1, info=stats.episode_info, meta={"note": "first"})
  store.append(jax.tree.map(jax.numpy.asarray, second), update=2)  # device arrays are fine too
  assert len(store) == 2 * b
  assert [os.path.basename(f.path) for f in store.files()] == [
      "batch-000001-update-000001.parquet", "batch-000002-update-000002.parquet"]
  assert store.files()[0].meta == {"note": "first"}
  got = list(store)
  _assert_same(first, got[0])
  _assert_same(second, got[1])
  both = store.read()
  np.testing.assert_array_equal(both.policy_version, [0] * b + [1] * b)
  np.testing.assert_array_equal(both.env_version, 123456)
  np.testing.assert_array_equal(both.reward_version, -98765)
  # The second file's branch links point into its own rows of the concatenation.
  np.testing.assert_array_equal(both.parent[b:], np.where(batch.parent >= 0, batch.parent + b,
                                                          batch.parent))
  rows = store.rows()
  np.testing.assert_array_equal(rows.update, [1] * b + [2] * b)
  np.testing.assert_array_equal(rows.invalid_actions[:b], stats.episode_info["invalid_actions"])
  assert (rows.invalid_actions[b:] == -1).all()  # not recorded for the second file


def test_a_user_reads_the_store_with_pyarrow(tmp_path, collected):
  batch, stats = collected
  store = TrajectoryStore(tmp_path)
  store.append(_versions(batch, 4), update=5, info=stats.episode_info)
  table = pq.read_table(str(tmp_path))
  assert table.num_rows == batch.batch_size
  assert table.column("policy_version").to_pylist() == [4] * batch.batch_size
  assert table.column("tokens").to_pylist()[3] == batch.tokens[3].tolist()
  assert table.schema.metadata[b"longhorizon.store.schema_version"] == b"1"
  assert "reward_components.reward/success" in table.column_names
  assert "info.invalid_actions" in table.column_names


def test_stores_of_different_lengths_are_padded_on_read(tmp_path, collected):
  batch, _ = collected
  short = episode.trim(jax.tree.map(np.asarray, batch), 100)  # L 128 -> 100, S 5 -> 5
  assert not np.asarray(batch.attention_mask)[:, 100:].any()
  store = TrajectoryStore(tmp_path)
  store.append(short, update=1)
  store.append(batch, update=2)
  both = store.read()
  b = batch.batch_size
  assert both.tokens.shape == (2 * b, 128)
  _assert_same(jax.tree.map(np.asarray, batch).replace(
      parent=np.where(batch.parent >= 0, batch.parent + b, batch.parent)),
      jax.tree.map(lambda x: x[b:], both))
  # The short file's rows come back as they were, but for the padding's position ids (0 there,
  # `empty`'s value; the rollout wrote 0..L-1 on padding too).
  padded = jax.tree.map(lambda x: x[:b], both)
  np.testing.assert_array_equal(padded.positions[:, :100], batch.positions[:, :100])
  _assert_same(batch.replace(positions=padded.positions), padded.replace(parent=batch.parent))
  assert store.read(context_length=160).tokens.shape[1] == 160
  with pytest.raises(store_lib.StoreError, match="context_length=64 is smaller than the 128 of"):
    store.read(context_length=64)


# ---------------------------------------------------------------------------- atomic / corrupt

def test_killed_write_and_truncated_file(tmp_path, collected):
  """A killed writer leaves only a hidden temporary file, never read; a truncated data file is
  named in the error, or skipped and counted with on_corrupt='skip'."""
  batch, _ = collected
  good = TrajectoryStore(tmp_path).append(batch, update=1)
  data = open(good, "rb").read()
  (tmp_path / ".batch-000002-update-000002.parquet.tmp-4242").write_bytes(data[:len(data) // 2])
  assert len(TrajectoryStore(tmp_path)) == batch.batch_size  # the temporary file is not data
  assert TrajectoryStore(tmp_path).leftovers == [".batch-000002-update-000002.parquet.tmp-4242"]
  assert pq.read_table(str(tmp_path)).num_rows == batch.batch_size  # pyarrow skips it too
  truncated = tmp_path / "batch-000003-update-000003.parquet"
  truncated.write_bytes(data[:len(data) // 2])
  with pytest.raises(store_lib.CorruptFileError, match="batch-000003-update-000003.parquet") as e:
    TrajectoryStore(tmp_path)  # found on open
  assert e.value.path == str(truncated)
  skipping = TrajectoryStore(tmp_path, on_corrupt="skip")
  assert skipping.read().batch_size == batch.batch_size
  assert list(skipping.skipped) == [str(truncated)]
  # The next append numbers past every file, the corrupt one included.
  assert skipping.append(batch, update=4).endswith("batch-000004-update-000004.parquet")


def test_a_failed_write_leaves_nothing(tmp_path, collected, monkeypatch):
  batch, _ = collected

  def dies(table, where):
    open(where, "wb").write(b"PAR1 half a file")
    raise KeyboardInterrupt

  monkeypatch.setattr(store_lib.pq, "write_table", dies)
  with pytest.raises(KeyboardInterrupt):
    TrajectoryStore(tmp_path).append(batch, update=1)
  assert os.listdir(tmp_path) == []


def test_schema_version_is_checked(tmp_path, collected):
  batch, _ = collected
  path = TrajectoryStore(tmp_path / "a").append(batch, update=1)
  table = pq.read_table(path)
  meta = {**table.schema.metadata, b"longhorizon.store.schema_version": b"7"}
  os.makedirs(tmp_path / "b")
  pq.write_table(table.replace_schema_metadata(meta),
                 str(tmp_path / "b" / "batch-000001-update-000001.parquet"))
  with pytest.raises(store_lib.SchemaVersionError, match=r"schema version '7'; this longhorizon "
                                                         r"reads version '1'"):
    TrajectoryStore(tmp_path / "b").read()
  os.makedirs(tmp_path / "c")
  pq.write_table(pa.table({"x": [1]}), str(tmp_path / "c" / "other.parquet"))
  with pytest.raises(store_lib.StoreError, match="other.parquet is a Parquet file without"):
    len(TrajectoryStore(tmp_path / "c"))


# ------------------------------------------------------------------------------------- filters

def test_validity_filters(tmp_path, collected):
  batch, stats = collected
  roots = np.flatnonzero(batch.parent == -1)
  error, timeout, overflow = roots[:2], roots[2:3], roots[3:4]
  marked = _with_outcome(batch, error, Termination.ENV_ERROR)
  marked = _with_outcome(marked, timeout, Termination.TIMEOUT)
  marked = _with_outcome(marked, overflow, Termination.CONTEXT_OVERFLOW)
  info = dict(stats.episode_info)
  info["invalid_actions"] = np.zeros((batch.batch_size,), np.int64)
  parse = roots[4:5]
  info["invalid_actions"][parse] = 2
  store = TrajectoryStore(tmp_path)
  store.append(marked, update=1, info=info)
  kinds = {"env_error": marked.env_error.any(-1),
           "timeout": marked.termination == Termination.TIMEOUT,
           "context_overflow": marked.termination == Termination.CONTEXT_OVERFLOW,
           "parse_failure": info["invalid_actions"] > 0}
  for name, rows in (("env_error", error), ("timeout", timeout), ("context_overflow", overflow),
                     ("parse_failure", parse)):
    assert kinds[name][rows].all()
  kept = lambda *filters: store.rows(filters=filters).row.tolist()
  without = lambda *drop: np.flatnonzero(~np.any([kinds[k] for k in drop], axis=0)).tolist()
  assert kept() == list(range(batch.batch_size))
  for name in kinds:
    assert kept(name) == without(name), name
  assert kept("truncated") == without("timeout", "context_overflow")
  assert kept("invalid") == without(*kinds)
  assert kept("env_error", "parse_failure") == without("env_error", "parse_failure")
  invalid = np.any(list(kinds.values()), axis=0)
  valid = store.read(filters=["invalid"])  # orphaned branches become recovery rows
  orphans = (batch.parent >= 0) & invalid[np.maximum(batch.parent, 0)] & ~invalid
  assert valid.batch_size == (~invalid).sum() and orphans.any()
  assert (valid.parent == RECOVERY).sum() == orphans.sum()
  with pytest.raises(store_lib.StoreError, match="unknown store filter"):
    store.rows(filters=["errors"])
  bare = TrajectoryStore(tmp_path / "bare")
  bare.append(marked, update=1)
  with pytest.raises(store_lib.StoreError, match="parse_failure filter needs info.invalid_actions"):
    bare.rows(filters=["invalid"])


def test_append_filters_keep_only_valid_episodes(tmp_path, collected):
  batch, stats = collected
  roots = np.flatnonzero(batch.parent == -1)
  marked = _with_outcome(batch, roots[:2], Termination.ENV_ERROR)
  store = TrajectoryStore(tmp_path)
  store.append(marked, update=1, info=stats.episode_info, filters=("invalid",))
  stored = store.read()
  assert stored.batch_size == batch.batch_size - 2
  assert not stored.env_error.any()
  assert store.append(marked, update=2, info=stats.episode_info, filters=("env_error",)) is not None
  assert TrajectoryStore(tmp_path / "none").append(
      _with_outcome(batch, np.arange(batch.batch_size), Termination.TIMEOUT), update=1,
      filters=("truncated",)) is None


# --------------------------------------------------------------------------------------- dedup

def test_readers_keep_the_episodes_of_their_own_environment_and_reward(tmp_path, collected,
                                                                       env):
  """`matching_versions`: the rows carry each episode's env and reward versions; a reader keeps
  those of its own, warns about the others, and names what the store holds when nothing matches;
  `stored_demonstrations` (sft.store) applies it with the run's environment."""
  from longhorizon.train.learner import stored_demonstrations
  batch, stats = collected
  b = batch.batch_size
  store = TrajectoryStore(tmp_path / "s")
  store.append(batch, update=1, info=stats.episode_info)  # this environment's episodes
  other = batch.replace(env_version=np.full((b,), 7, np.int32),
                        reward_version=np.full((b,), 9, np.int32))
  store.append(other, update=2, info=stats.episode_info)
  rows = store.rows()
  own = rollout.env_version(env)
  assert (rows.env_version[:b] == own).all() and (rows.env_version[b:] == 7).all()
  assert (rows.reward_version[b:] == 9).all()
  kept = store_lib.matching_versions(rows, "test", env_version=own)
  np.testing.assert_array_equal(kept.update, np.ones((b,)))
  kept = store_lib.matching_versions(rows, "test", env_version=7, reward_version=9)
  np.testing.assert_array_equal(kept.update, np.full((b,), 2))
  with pytest.raises(store_lib.StoreError, match=r"'env_version': \{%d: %d, 7: %d\}" % (own, b, b)
                     if own < 7 else r"'env_version': \{7: %d, %d: %d\}" % (b, own, b)):
    store_lib.matching_versions(rows, "test", env_version=5)
  with pytest.raises(ValueError, match="unknown version field"):
    store_lib.matching_versions(rows, "test", policy_version=1)
  # The filter comes before dedup: the second file repeats the first's episodes (the same keys,
  # appended later), yet this environment's copies are the ones kept.
  kept = store.rows(dedup=True, versions={"env_version": own})
  assert (kept.env_version == own).all() and len(kept) == len(store.rows(dedup=True))
  # sft.store: only this environment's successes count.
  own_ok = rows.take((rows.env_version == own) & rows.success & (rows.termination == 1))
  distinct = len(set(own_ok.key.tolist()))
  demos = stored_demonstrations(str(tmp_path / "s"), distinct, 128, MAX_STEPS, env_version=own)
  assert (np.asarray(demos.env_version) == own).all() and demos.batch_size == distinct
  with pytest.raises(store_lib.StoreError, match="none of its"):
    stored_demonstrations(str(tmp_path / "s"), 1, 128, MAX_STEPS, env_version=own + 1)


def test_keys_are_canonical_state_action_sequences(collected):
  batch, _ = collected
  batch = jax.tree.map(np.asarray, batch)
  keys = store_lib.episode_keys(batch)
  # Sampling details, rewards and versions are not part of the key.
  other = batch.replace(behavior_logprobs=batch.behavior_logprobs * 0.5,
                        rewards=batch.rewards + 1, policy_version=batch.policy_version + 3)
  np.testing.assert_array_equal(store_lib.episode_keys(other), keys)
  # The same actions in other states: another key for every episode.
  moved = batch.replace(anchor=np.where(batch.step_mask, batch.anchor ^ np.uint32(0x5A5A), 0)
                        .astype(np.uint32))
  assert not (store_lib.episode_keys(moved) == keys).any()
  # A branch's key counts its parent's actions on the copied steps: the same episode written as a
  # root (its copied actions marked as its own) has the same key.
  c = int(np.flatnonzero(batch.parent >= 0)[0])
  p, t = int(batch.parent[c]), int(batch.branch_step[c])
  copied = (batch.turn[c] >= 0) & (batch.turn[c] < t)
  root = jax.tree.map(lambda x: x[c:c + 1].copy(), batch)
  root = root.replace(loss_mask=root.loss_mask | (batch.loss_mask[p] & copied)[None],
                      parent=np.array([-1], np.int32), branch_step=np.array([-1], np.int32))
  assert store_lib.episode_keys(root.validate())[0] == keys[c]


def test_dedup_keeps_the_newest_copy_per_key(tmp_path, collected):
  batch, _ = collected
  store = TrajectoryStore(tmp_path)
  store.append(_versions(batch, 0), update=1)
  store.append(_versions(batch, 1), update=2)
  unique = len(set(store_lib.episode_keys(batch)))
  rows = store.rows(dedup=True)
  assert len(rows) == unique and len(set(rows.key)) == unique
  assert (rows.update == 2).all()
  deduped = store.read(dedup=True)
  assert deduped.batch_size == unique and (deduped.policy_version == 1).all()
  # Same actions, other states: kept apart.
  moved = jax.tree.map(np.asarray, batch)
  moved = moved.replace(anchor=np.where(moved.step_mask, moved.anchor + np.uint32(1), 0)
                        .astype(np.uint32))
  store.append(moved, update=3)
  assert len(store.rows(dedup=True)) == 2 * unique


# ------------------------------------------------------------------------------------ sampling

def _share(store, rng, weights, category, draws=2000, **kwargs):
  """The share of `draws` single draws that fall in `category` (a [N] bool over store.rows())."""
  rows = store.rows()
  index = {(p, r): i for i, (p, r) in enumerate(zip(rows.path, rows.row))}
  hits = 0
  for _ in range(draws):
    drawn = store.sample_rows(1, rng, weights=weights, **kwargs)
    hits += int(category[index[(drawn.path[0], drawn.row[0])]])
  return hits / draws


def _check_share(observed, weights, category, draws=2000):
  expected = weights[category].sum() / weights.sum()
  # 4.5 standard deviations of a binomial share of `draws` draws.
  tolerance = 4.5 * np.sqrt(expected * (1 - expected) / draws)
  assert abs(observed - expected) <= tolerance, (observed, expected, tolerance)
  return expected


def test_priority_sampling_in_proportion(tmp_path, collected):
  batch, _ = collected
  store = TrajectoryStore(tmp_path)
  store.append(batch, update=1)
  store.append(batch, update=3)
  rows = store.rows()
  rng = np.random.default_rng(0)
  uniform = np.ones(len(rows))
  # Failures: 4x the weight of a success.
  w = store_lib.priority_weights(rows, Priority(failure=4.0))
  np.testing.assert_array_equal(w, np.where(rows.success, 1.0, 4.0))
  failed = ~rows.success
  expected = _check_share(_share(store, rng, Priority(failure=4.0), failed), w, failed)
  assert expected > failed.mean()
  # Recency: half-life 2 updates, the update-1 copies weigh 0.5.
  w = store_lib.priority_weights(rows, Priority(half_life=2.0))
  np.testing.assert_allclose(w, np.where(rows.update == 3, 1.0, 0.5))
  recent = rows.update == 3
  assert _check_share(_share(store, rng, Priority(half_life=2.0), recent), w, recent) > 0.6
  np.testing.assert_allclose(store_lib.priority_weights(rows, Priority(half_life=2.0), now=5),
                             np.where(rows.update == 3, 0.5, 0.25))
  # Rare milestones: weight (1 / share of the rarest bit reached).
  reached = (rows.milestones[:, None] >> np.arange(2)) & 1
  share = reached.mean(0)
  assert 0 < share.min() < share.max() <= 1
  by_hand = np.array([max([1.0] + [1 / share[m] for m in range(2) if reached[i, m]])
                      for i in range(len(rows))])
  w = store_lib.priority_weights(rows, Priority(rare_milestones=1.0))
  np.testing.assert_allclose(w, by_hand)
  rare = reached[:, np.argmin(share)].astype(bool)
  assert _check_share(_share(store, rng, Priority(rare_milestones=1.0), rare), w, rare) > \
      _check_share(_share(store, rng, Priority(), rare), uniform, rare)


def test_sampling_is_deterministic_and_without_replacement(tmp_path, collected):
  batch, _ = collected
  store = TrajectoryStore(tmp_path)
  store.append(batch, update=1)
  store.append(batch, update=2)
  weights = Priority(failure=3.0, half_life=1.0, rare_milestones=0.5)
  a = store.sample_rows(10, np.random.default_rng(7), weights=weights)
  b = store.sample_rows(10, np.random.default_rng(7), weights=weights)
  np.testing.assert_array_equal(a.row, b.row)
  np.testing.assert_array_equal(a.path, b.path)
  assert len(set(zip(a.path, a.row))) == 10
  everything = store.sample_rows(len(store), np.random.default_rng(1), weights=weights)
  assert len(set(zip(everything.path, everything.row))) == len(store)
  batch10 = store.sample(10, np.random.default_rng(7), weights=weights)
  assert batch10.batch_size == 10
  with pytest.raises(store_lib.StoreError, match="cannot sample n=99"):
    store.sample_rows(99, np.random.default_rng(0))
  with pytest.raises(TypeError, match="numpy.random.Generator"):
    store.sample_rows(1, 0)
  with pytest.raises(ValueError, match=r"Priority.failure=0.0: expected a finite number > 0"):
    Priority(failure=0.0)


# ----------------------------------------------------------------------------------------- CLI

def _record_learned(monkeypatch) -> list:
  """The batches every `Learner.learn` call is given from now on (copied to NumPy), in order."""
  from longhorizon.train.learner import Learner  # pylint: disable=g-import-not-at-top
  trained, learn = [], Learner.learn

  def recording_learn(self, state, batch, stats, timer, row_scale=None):
    trained.append(jax.tree.map(np.array, batch))
    return learn(self, state, batch, stats, timer, row_scale)

  monkeypatch.setattr(Learner, "learn", recording_learn)
  return trained


def test_cli_prints_the_newest_episodes_with_their_masks(tmp_path, collected, env, capsys,
                                                         smoke_config):
  batch, stats = collected
  store = TrajectoryStore(tmp_path / "store")
  store.append(_versions(batch, 0), update=1, info=stats.episode_info)
  store.append(_versions(batch, 1), update=2, info=stats.episode_info)
  config = smoke_config(tmp_path, **{"env.params": ENV_PARAMS, "env.max_steps": MAX_STEPS})
  (tmp_path / "config.json").write_text(config.to_json())  # beside the store: found there
  assert store_cli.main([str(tmp_path / "store"), "--last", "2", "--markup", "plain"]) == 0
  out = capsys.readouterr().out
  tokenizer = env.codec(style="compact").tokenizer
  b = batch.batch_size
  newest = store.read(last=2)
  for i in range(2):
    assert render.render_episode(newest, i, tokenizer, markup="plain",
                                 milestone_names=env.milestone_names) in out
  assert out.count("\n== update 2 | batch-000002-update-000002.parquet row ") == 2
  assert f"row {b - 1} | policy v1 env v123456 reward v-98765 | key " in out
  assert "\u00ab" in out and "\u00bb" in out  # sampled tokens (loss_mask 1) marked
  assert store_cli.main([str(tmp_path / "store"), "--filter", "bogus"]) == 2
  assert "unknown store filter" in capsys.readouterr().err
  assert store_cli.main([str(tmp_path / "nowhere" / "store")]) == 2
  assert "pass --config" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- loop

def test_store_config_is_validated(tmp_path, smoke_config):
  from longhorizon.train import config as config_lib  # pylint: disable=g-import-not-at-top
  config = smoke_config(tmp_path)
  assert config.store.enabled is False and config.store.keep == "all"
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(smoke_config(tmp_path, **{"store.keep": "some"}))
  assert ("config.store.keep='some' is not allowed; expected one of ['all', 'valid']"
          in str(info.value))


@pytest.mark.slow
def test_training_run_stores_the_batches_it_trains_on(tmp_path, monkeypatch, capsys,
                                                       smoke_config):
  from longhorizon.train import loop  # pylint: disable=g-import-not-at-top
  trained = _record_learned(monkeypatch)
  changes = {"num_updates": 2, "store.enabled": True, "sft.steps": 1, "sft.episodes": 4,
             "eval.num_tasks": 4, "eval.k": 1, "eval.greedy": False, "tensorboard": False}
  workdir = tmp_path / "run"
  loop.train_and_evaluate(smoke_config(tmp_path, **changes), str(workdir))
  store = TrajectoryStore(workdir / "trajectories")
  files = store.files()
  assert len(trained) == 2 and len(files) == 2
  for u, (expected, got) in enumerate(zip(trained, store)):
    _assert_same(expected, got)
    assert (got.policy_version == u).all()
  np.testing.assert_array_equal(store.rows().update, np.repeat([1, 2], trained[0].batch_size))
  assert files[0].meta == {"algorithm": "grpo", "env": "pointer_chain", "seed": 0}
  before = {f.path: open(f.path, "rb").read() for f in files}
  # Resumed with one more update: the stored files stay as they were, a third is appended.
  loop.train_and_evaluate(smoke_config(tmp_path, **dict(changes, num_updates=3)), str(workdir))
  files = TrajectoryStore(workdir / "trajectories").files()
  assert len(files) == 3 and len(trained) == 3
  assert {f.path: open(f.path, "rb").read() for f in files[:2]} == before
  _assert_same(trained[2], list(TrajectoryStore(workdir / "trajectories"))[2])
  # The tail command finds the store and the tokenizer from the workdir.
  capsys.readouterr()
  assert store_cli.main([str(workdir), "--last", "1", "--markup", "ansi"]) == 0
  out = capsys.readouterr().out
  assert "== update 3 | batch-000003-update-000003.parquet" in out
  assert render.ANSI_COLORS[render.SAMPLED] in out


@pytest.mark.slow
def test_async_run_stores_the_batches_it_trains_on(tmp_path, monkeypatch, smoke_config):
  """The asynchronous pipeline's updates are stored too (the batch each `learn` was given)."""
  from longhorizon.train import loop  # pylint: disable=g-import-not-at-top
  trained = _record_learned(monkeypatch)
  changes = {"num_updates": 2, "store.enabled": True, "sft.steps": 1, "sft.episodes": 4,
             "eval.num_tasks": 4, "eval.k": 1, "eval.greedy": False, "tensorboard": False,
             "rollout.mode": "async", "rollout.max_staleness": 0}
  loop.train_and_evaluate(smoke_config(tmp_path, **changes), str(tmp_path / "run"))
  stored = list(TrajectoryStore(tmp_path / "run" / "trajectories"))
  assert len(trained) == 2 and len(stored) == 2
  for expected, got in zip(trained, stored):
    _assert_same(expected, got)


def test_keep_valid_stores_the_valid_episodes(tmp_path, collected, smoke_config):
  """`config.store.keep='valid'`: the loop's appender drops what the `invalid` filter drops."""
  from longhorizon.train import loop  # pylint: disable=g-import-not-at-top
  batch, stats = collected
  marked = _with_outcome(batch, np.flatnonzero(batch.parent == -1)[:2], Termination.ENV_ERROR)
  config = smoke_config(tmp_path, **{"store.enabled": True, "store.keep": "valid"})
  loop.trajectory_store(config, str(tmp_path / "run"))(4)(marked, stats)
  drop = store_lib.drop_mask(marked.termination, marked.env_error.any(-1),
                             stats.episode_info["invalid_actions"], ["invalid"])
  assert 0 < drop.sum() < batch.batch_size
  store = TrajectoryStore(tmp_path / "run" / loop.STORE_DIR)
  _assert_same(store_lib.take_rows(marked, np.flatnonzero(~drop)), next(iter(store)))
  assert store.rows().update.tolist() == [5] * int((~drop).sum())
  off = smoke_config(tmp_path)
  assert loop.trajectory_store(off, str(tmp_path / "off"))(0) is None
