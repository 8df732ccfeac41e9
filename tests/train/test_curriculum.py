"""Curriculum (learnability bucket sampler), bucket_indices and draw_tasks."""

import json
import logging

import numpy as np
import pytest

from longhorizon.train.curriculum import Curriculum, bucket_indices, draw_tasks


def _with_estimates(p, counts=4, **kwargs):
  """A curriculum whose estimates are exactly `p`: ema = 1 keeps only the last update."""
  curriculum = Curriculum(len(p), ema=1.0, **kwargs)
  buckets = np.repeat(np.arange(len(p)), counts)
  successes = np.concatenate([np.arange(counts) < round(q * counts) for q in p])
  curriculum.update(buckets, successes)
  np.testing.assert_allclose(curriculum.success_estimates(), p)
  return curriculum


def test_probabilities_by_hand():
  # p = [1/2, 1/4, 0]: learnability [1/4, 3/16, 0] -> shares [4/7, 3/7, 0];
  # floor 0.1: 0.7 * [4/7, 3/7, 0] + 0.1 = [0.5, 0.4, 0.1].
  curriculum = _with_estimates([0.5, 0.25, 0.0], alpha=1.0, floor=0.1)
  np.testing.assert_allclose(curriculum.probabilities(), [0.5, 0.4, 0.1])
  # alpha 2: weights [1/16, 9/256, 0] = [16, 9, 0] / 256 -> [0.64, 0.36, 0] with no floor.
  curriculum = _with_estimates([0.5, 0.25, 0.0], alpha=2.0, floor=0.0)
  np.testing.assert_allclose(curriculum.probabilities(), [0.64, 0.36, 0.0])
  # alpha 0, and floor = 1/B, are uniform.
  np.testing.assert_allclose(_with_estimates([0.5, 0.25, 0.0], alpha=0.0).probabilities(), 1 / 3)
  np.testing.assert_allclose(_with_estimates([0.5, 0.25, 0.0], floor=1 / 3).probabilities(), 1 / 3)
  # Every p in {0, 1}: all weights 0, uniform fallback.
  np.testing.assert_allclose(_with_estimates([1.0, 0.0, 1.0], floor=0.0).probabilities(), 1 / 3)
  # A large alpha does not underflow to the fallback: the best bucket takes all but the floor.
  curriculum = _with_estimates([0.5, 0.25, 0.0], alpha=1e4, floor=0.05)
  np.testing.assert_allclose(curriculum.probabilities(), [0.9, 0.05, 0.05])


def test_update_by_hand():
  # S = prior * c = 1, N = c = 2 at the start; ema 0.5 halves the old evidence of updated buckets.
  curriculum = Curriculum(3, ema=0.5, prior=0.5, pseudo_count=2.0)
  np.testing.assert_allclose(curriculum.success_estimates(), 0.5)
  np.testing.assert_allclose(curriculum.probabilities(), 1 / 3)  # unseen buckets: uniform
  curriculum.update(np.array([0, 0, 1]), np.array([True, True, False]))
  # bucket 0: S = 0.5 + 2 = 2.5, N = 1 + 2 = 3; bucket 1: S = 0.5 + 0, N = 1 + 1 = 2;
  # bucket 2 is not in the update and keeps S = 1, N = 2.
  np.testing.assert_allclose(curriculum.successes, [2.5, 0.5, 1.0])
  np.testing.assert_allclose(curriculum.counts, [3.0, 2.0, 2.0])
  np.testing.assert_allclose(curriculum.success_estimates(), [5 / 6, 1 / 4, 1 / 2])
  curriculum.update(np.zeros(0, int), np.zeros(0, bool))  # an empty update changes nothing
  np.testing.assert_allclose(curriculum.counts, [3.0, 2.0, 2.0])
  # ema 0: plain counts (Beta posterior mean).
  curriculum = Curriculum(1, ema=0.0, pseudo_count=1.0)
  for _ in range(3):
    curriculum.update([0, 0], [True, False])
  np.testing.assert_allclose(curriculum.success_estimates(), [3.5 / 7])


def test_mass_moves_to_the_learnable_bucket():
  true_p = np.array([0.98, 0.5, 0.02])
  floor = 0.05
  curriculum = Curriculum(3, alpha=1.0, floor=floor, ema=0.1)
  env_rng = np.random.default_rng(0)
  for update in range(200):
    buckets = curriculum.sample(np.random.default_rng([1, update]), 64)
    curriculum.update(buckets, env_rng.random(buckets.size) < true_p[buckets])
    assert np.all(curriculum.probabilities() >= floor - 1e-12)
    assert np.isclose(curriculum.probabilities().sum(), 1.0)
  probs = curriculum.probabilities()
  assert probs[1] > 1 / 3 and probs[1] > probs[0] and probs[1] > probs[2], probs
  # The floor keeps the easy and hard buckets visited, so their estimates track the truth.
  np.testing.assert_allclose(curriculum.success_estimates(), true_p, atol=0.15)
  # Learnabilities about [0.02, 0.25, 0.02]: shares ~[0.07, 0.86, 0.07], 0.85 * share + 0.05.
  assert probs[1] > 0.6, probs
  # The sampled frequencies follow the probabilities.
  counts = np.bincount(curriculum.sample(123, 20_000), minlength=3) / 20_000
  np.testing.assert_allclose(counts, probs, atol=0.02)


def test_sampling_is_deterministic_and_state_dict_round_trips(caplog):
  curriculum = Curriculum(4, alpha=1.5, floor=0.02, ema=0.2, prior=0.4, pseudo_count=3.0)
  rng = np.random.default_rng(7)
  for update in range(5):
    buckets = curriculum.sample(update, 32)
    curriculum.update(buckets, rng.random(32) < 0.3 + 0.1 * buckets)
  np.testing.assert_array_equal(curriculum.sample(11, 50), curriculum.sample(11, 50))
  np.testing.assert_array_equal(curriculum.sample(np.random.default_rng(11), 50),
                                curriculum.sample(11, 50))
  curriculum.cursor = np.array([3, 0, 9, 1])

  state = json.loads(json.dumps(curriculum.state_dict(), allow_nan=False))
  assert state == curriculum.state_dict()
  assert all(isinstance(v, (int, float, list)) for v in state.values())
  restored = Curriculum.from_state_dict(state)
  loaded = Curriculum(4, alpha=1.5, floor=0.02, ema=0.2, prior=0.4, pseudo_count=3.0)
  loaded.load_state_dict(state)
  for other in (restored, loaded):
    np.testing.assert_array_equal(other.probabilities(), curriculum.probabilities())
    np.testing.assert_array_equal(other.cursor, curriculum.cursor)
  # Identical futures: same updates, same samples.
  for update in range(5, 10):
    outs = [c.sample(update, 32) for c in (curriculum, restored, loaded)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    successes = rng.random(32) < 0.5
    for c in (curriculum, restored, loaded):
      c.update(outs[0], successes)
  assert restored.state_dict() == curriculum.state_dict() == loaded.state_dict()

  # A changed hyperparameter on resume: the config's value is kept, with a warning.
  changed = Curriculum(4, alpha=2.0, floor=0.02, ema=0.2, prior=0.4, pseudo_count=3.0)
  with caplog.at_level(logging.WARNING):
    changed.load_state_dict(state)
  assert changed.alpha == 2.0
  assert any("alpha = 1.5" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_buckets=0), "num_buckets"),
    (dict(num_buckets=3, alpha=-1.0), "alpha"),
    (dict(num_buckets=3, floor=0.34), "floor"),
    (dict(num_buckets=3, floor=-0.01), "floor"),
    (dict(num_buckets=3, ema=1.5), "ema"),
    (dict(num_buckets=3, ema=float("nan")), "ema"),
    (dict(num_buckets=3, prior=1.2), "prior"),
    (dict(num_buckets=3, pseudo_count=0.0), "pseudo_count"),
])
def test_bad_constructor_arguments(kwargs, name):
  with pytest.raises(ValueError, match=name):
    Curriculum(**kwargs)


def test_bad_call_arguments():
  curriculum = Curriculum(3)
  with pytest.raises(ValueError, match="buckets .* outside"):
    curriculum.update([0, 3], [True, False])
  with pytest.raises(ValueError, match=r"buckets \(2,\) and successes \(3,\)"):
    curriculum.update([0, 1], [True, False, True])
  with pytest.raises(ValueError, match="buckets has dtype float"):
    curriculum.update([0.0, 1.0], [True, False])
  with pytest.raises(ValueError, match="successes holds values outside"):
    curriculum.update([0, 1], [2, 0])
  with pytest.raises(ValueError, match="n = -1"):
    curriculum.sample(0, -1)
  with pytest.raises(TypeError, match="rng"):
    curriculum.sample(np.random.RandomState(0), 3)
  state = curriculum.state_dict()
  with pytest.raises(ValueError, match=r"missing keys \['cursor'\]"):
    Curriculum.from_state_dict({k: v for k, v in state.items() if k != "cursor"})
  with pytest.raises(ValueError, match="num_buckets = 3"):
    Curriculum(4).load_state_dict(state)
  with pytest.raises(ValueError, match="'counts'"):
    Curriculum.from_state_dict(dict(state, counts=[1.0, 1.0]))
  with pytest.raises(ValueError, match="'cursor'"):
    Curriculum.from_state_dict(dict(state, cursor=[0, 1.5, 0]))
  with pytest.raises(ValueError, match="difficulties has shape"):
    bucket_indices(np.zeros((2, 2), int), 3)
  with pytest.raises(ValueError, match="bucket_indices"):
    draw_tasks(curriculum, [np.arange(2)], 0, 4, np.zeros(3, int))
  with pytest.raises(ValueError, match="cursor"):
    draw_tasks(curriculum, bucket_indices([0, 1, 2], 3), 0, 4, np.zeros(2, int))
  with pytest.raises(ValueError, match="no tasks"):
    draw_tasks(curriculum, bucket_indices([], 3), 0, 4, np.zeros(3, int))


def test_bucket_indices_by_hand():
  # Small ints in [0, B): the difficulty is the bucket (bucket 3 is empty).
  got = bucket_indices(np.array([2, 0, 1, 2, 0, 0]), 4)
  assert [b.tolist() for b in got] == [[1, 4, 5], [2], [0, 3], []]
  # Otherwise equal bins over [lo, hi] = [-1, 11], width 4: [-1, 3), [3, 7), [7, 11].
  got = bucket_indices(np.array([11, -1, 3, 2, 7, 6, 10]), 3)
  assert [b.tolist() for b in got] == [[1, 3], [2, 5], [0, 4, 6]]
  # One distinct value outside [0, B): all in bucket 0.
  assert [b.tolist() for b in bucket_indices([5, 5], 2)] == [[0, 1], []]
  # A partition of the tasks.
  difficulties = np.random.default_rng(0).integers(0, 40, size=100)
  got = bucket_indices(difficulties, 7)
  assert sorted(np.concatenate(got).tolist()) == list(range(100))
  assert all(difficulties[a].max() < difficulties[b].min()
             for a, b in zip(got[:-1], got[1:]) if a.size and b.size)


def test_draw_tasks_round_robin_and_resume():
  # Tasks 0..6 with difficulties: bucket 0 = [0, 3, 5], bucket 1 = [1, 4], bucket 2 = [2, 6],
  # bucket 3 empty.
  buckets = bucket_indices(np.array([0, 1, 2, 0, 1, 0, 2]), 4)
  # floor 1/4 is uniform over the non-empty buckets after masking bucket 3.
  curriculum = Curriculum(4, floor=0.25)
  tasks, drawn, cursor = draw_tasks(curriculum, buckets, 0, 12, curriculum.cursor)
  assert 3 not in drawn.tolist()
  np.testing.assert_array_equal(cursor, np.bincount(drawn, minlength=4))
  np.testing.assert_array_equal(curriculum.cursor, 0)  # pure: the input cursor is unchanged
  # Within each bucket the tasks come round-robin in index order; buckets match the tasks.
  for b in range(3):
    members = buckets[b]
    expected = [members[j % members.size] for j in range(cursor[b])]
    assert tasks[drawn == b].tolist() == expected
  difficulty = np.array([0, 1, 2, 0, 1, 0, 2])
  np.testing.assert_array_equal(difficulty[tasks], drawn)

  # Hand case: the cursor continues where it stopped, wrapping around the bucket.
  only_0 = [np.array([10, 20, 30]), np.array([], int)]
  tasks, drawn, cursor = draw_tasks(Curriculum(2), only_0, 0, 4, np.array([2, 0]))
  assert tasks.tolist() == [30, 10, 20, 30] and drawn.tolist() == [0] * 4
  assert cursor.tolist() == [6, 0]

  # Floor 0 and all the weight on an empty bucket: uniform over the non-empty ones.
  curriculum = _with_estimates([0.5, 1.0, 0.0], floor=0.0)
  tasks, drawn, _ = draw_tasks(curriculum, [np.array([], int), np.array([0]), np.array([1])], 0,
                               100, np.zeros(3, int))
  assert set(drawn.tolist()) == {1, 2} and np.array_equal(tasks, drawn - 1)

  # Resumption: a run checkpointed after 3 updates draws what an uninterrupted run draws.
  difficulties = np.random.default_rng(1).integers(0, 3, size=20)
  buckets = bucket_indices(difficulties, 3)
  true_p = np.array([0.9, 0.5, 0.1])

  def run(curriculum, updates):
    out = []
    for update in updates:
      rng = np.random.default_rng([5, update])
      tasks, drawn, curriculum.cursor = draw_tasks(curriculum, buckets, rng, 8, curriculum.cursor)
      successes = np.random.default_rng([6, update]).random(8) < true_p[drawn]
      curriculum.update(drawn, successes)
      out.append(tasks)
    return np.stack(out)

  straight = run(Curriculum(3, floor=0.1), range(6))
  first = Curriculum(3, floor=0.1)
  run(first, range(3))
  meta = json.loads(json.dumps({"curriculum": first.state_dict()}))
  resumed = Curriculum(3, floor=0.1)
  resumed.load_state_dict(meta["curriculum"])
  np.testing.assert_array_equal(run(resumed, range(3, 6)), straight[3:])


# ----------------------------------------------------------------------------------------------------
# The horizon (step-budget) curriculum.


def test_horizon_curriculum_by_hand():
  from longhorizon.train.curriculum import HorizonCurriculum  # pylint: disable=g-import-not-at-top
  h = HorizonCurriculum((2, 4, 6), grow_at=0.5, ema=0.5)
  assert h.budget == 2
  assert not h.update(0.8) and h.success == pytest.approx(0.4)  # 0.5 * 0 + 0.5 * 0.8
  assert h.update(0.8) and h.budget == 4 and h.success == 0.0  # 0.6 >= 0.5: grow, restart
  assert not h.update(0.2) and h.budget == 4
  state = h.state_dict()
  again = HorizonCurriculum((2, 4, 6), grow_at=0.5, ema=0.5)
  again.load_state_dict(state)
  assert (again.stage, again.success) == (h.stage, h.success)
  for _ in range(10):
    h.update(1.0)
  assert h.budget == 6 and h.metrics()["horizon/step_budget"] == 6.0  # the last budget stays
  with pytest.raises(ValueError, match="same curriculum.step_budgets"):
    HorizonCurriculum((2, 6)).load_state_dict(state)
  with pytest.raises(ValueError, match="increasing integers"):
    HorizonCurriculum((4, 2))


def test_step_budget_truncates_without_changing_the_batch_shape():
  import jax  # pylint: disable=g-import-not-at-top
  from longhorizon import envs, rollout  # pylint: disable=g-import-not-at-top
  from longhorizon.core.episode import Termination  # pylint: disable=g-import-not-at-top
  from longhorizon.envs import testing  # pylint: disable=g-import-not-at-top
  env = envs.make("pointer_chain", horizon=2)  # the oracle needs 3 steps
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(0), 2)
  for budget, steps, kind in ((2, 2, Termination.TIMEOUT), (0, 3, Termination.SUCCESS)):
    rc = rollout.RolloutConfig(group_size=2, context_length=96, max_steps=5, turn_tokens=4,
                               step_budget=budget)
    batch, _ = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys, rc,
                               sampling_seed=0, scripted=rollout.oracle_turns(env, codec))
    assert batch.max_steps == 5
    assert (batch.num_steps == steps).all() and (batch.termination == kind).all()
  with pytest.raises(ValueError, match="step_budget=6"):
    rollout.RolloutConfig(max_steps=5, step_budget=6)


@pytest.mark.slow
def test_horizon_curriculum_runs_logs_and_checkpoints(tmp_path):
  from configs import default as default_config  # pylint: disable=g-import-not-at-top
  from longhorizon.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from longhorizon.train import loop  # pylint: disable=g-import-not-at-top
  from longhorizon.train.checkpoints import Checkpointer  # pylint: disable=g-import-not-at-top
  from longhorizon.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  config = default_config.get_config("smoke")
  config.unlock()
  config.tasks.data_dir = str(tmp_path / "tasks")
  for path, value in {"num_updates": 2, "checkpoint_every": 1, "curriculum.step_budgets": (1, 3),
                      "curriculum.grow_at": 0.01, "curriculum.ema": 1.0}.items():
    config_lib.set_path(config, path, value)
  config.lock()
  loop.train_and_evaluate(config, str(tmp_path / "run"))
  rows = read_metrics(str(tmp_path / "run"))
  # Update 1 ran with 1 step per episode: every episode stopped after its first step.
  assert rows[0]["horizon/step_budget"] == 1.0 and rows[0]["episode_steps"] == 1.0
  # The process's peak memory so far (getrusage), logged every update: positive, never falling.
  assert 0 < rows[0]["memory/peak_rss_gb"] <= rows[1]["memory/peak_rss_gb"]
  _, meta = Checkpointer(str(tmp_path / "run" / "checkpoints")).restore()
  assert meta["horizon"]["budgets"] == [1, 3] and meta["horizon"]["stage"] in (0, 1)
  bad = default_config.get_config("smoke")
  bad.curriculum.step_budgets = (3, 1)
  with pytest.raises(config_lib.ConfigError, match="curriculum.step_budgets"):
    config_lib.validate(bad)
