"""gridworld: a hand-checked layout, generated tasks against a plain BFS, the oracle through the
text path and under jit + vmap, determinism, anchors, agreement with the plain-Python version."""

import collections
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import envs
from longhorizon.envs import testing
from longhorizon.envs.gridworld import (DIRECTIONS, DOOR, EV_BAD_DIRECTION, EV_DOOR, EV_EDGE,
                                        EV_ERROR, EV_GOAL, EV_HOLE, EV_KEY, EV_LOCKED, EV_MOVED,
                                        EV_START, EV_WALL, FLOOR, GOAL, HOLE, KEY, OPEN_DOOR, WALL,
                                        GridWorld)
from longhorizon.envs.types import Action, ErrorCode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "benchmarks"))
from plain_envs.gridworld import PlainGridWorld  # noqa: E402

UP, DOWN, LEFT, RIGHT = range(4)
BATCH = 128  # rows of the mixed rollouts: 16 tasks x 8 rollouts each, so states repeat
HORIZON = 14  # mixed steps of the mixed rollouts, then ORACLE_STEPS oracle moves
ORACLE_STEPS = 26


@pytest.fixture(scope="module")
def env():
  return envs.make("gridworld")


@pytest.fixture(scope="module")
def policies(env):
  """Policy objects made once: `structured_rollout` caches its compiled scan per policy object."""
  return {"oracle": lambda s, k: env.oracle(s),
          "random": functools.partial(testing.random_action, env)}


@pytest.fixture(scope="module")
def generators(env):
  return {split: jax.jit(lambda k, split=split: testing.tasks_from_keys(env, k, split))
          for split in ("train", "test", "ood")}


@pytest.fixture(scope="module")
def tasks(generators):
  """256 tasks of each split from the same 256 keys (host copies)."""
  keys = jax.random.split(jax.random.key(100), 256)
  return {split: jax.tree.map(np.asarray, gen(keys)) for split, gen in generators.items()}


def _row(tree, i):
  return jax.tree.map(lambda a: a[i], tree)


def _move(direction):
  return Action.make(0, [direction], 1)


# ----------------------------------------------------------------------------- a hand layout
# k . A .      start (0, 2); key (0, 0); the door (1, 3) is the only way down;
# # O # D      a hole at (1, 1); the goal at (2, 0).
# G . . .      Shortest solution: left left (key), right x3, down (door), down, left x3 = 10 moves.
# . . . .
HAND = {"grid": np.array([[KEY, FLOOR, FLOOR, FLOOR],
                          [WALL, HOLE, WALL, DOOR],
                          [GOAL, FLOOR, FLOOR, FLOOR],
                          [FLOOR, FLOOR, FLOOR, FLOOR]], np.int32),
        "start": np.array([0, 2], np.int32)}


@pytest.fixture(scope="module")
def hand():
  """`(env, reset, step)` of a 4x4 environment with milestone rewards and invalid penalties."""
  env = GridWorld(size=4, milestone=0.25, invalid=0.5)
  return env, jax.jit(env.reset), jax.jit(env.step)


def test_hand_layout_exact_transitions(hand):
  env, reset, step = hand
  state, ts = reset(jax.random.key(0), HAND)
  assert int(ts.observation["event"]) == EV_START
  np.testing.assert_array_equal(ts.observation["grid"], HAND["grid"])
  # (action, event, position after, reward, invalid, new milestones [key, door, goal], done)
  script = [
      (UP, EV_EDGE, (0, 2), -0.5, True, (0, 0, 0), False),
      (DOWN, EV_WALL, (0, 2), -0.5, True, (0, 0, 0), False),
      (RIGHT, EV_MOVED, (0, 3), 0.0, False, (0, 0, 0), False),
      (DOWN, EV_LOCKED, (0, 3), -0.5, True, (0, 0, 0), False),
      (LEFT, EV_MOVED, (0, 2), 0.0, False, (0, 0, 0), False),
      (LEFT, EV_MOVED, (0, 1), 0.0, False, (0, 0, 0), False),
      (LEFT, EV_KEY, (0, 0), 0.25, False, (1, 0, 0), False),
      (RIGHT, EV_MOVED, (0, 1), 0.0, False, (0, 0, 0), False),
      (LEFT, EV_MOVED, (0, 0), 0.0, False, (0, 0, 0), False),  # the key cell is floor now
      (RIGHT, EV_MOVED, (0, 1), 0.0, False, (0, 0, 0), False),
      (RIGHT, EV_MOVED, (0, 2), 0.0, False, (0, 0, 0), False),
      (RIGHT, EV_MOVED, (0, 3), 0.0, False, (0, 0, 0), False),
      (DOWN, EV_DOOR, (1, 3), 0.25, False, (0, 1, 0), False),
      (UP, EV_MOVED, (0, 3), 0.0, False, (0, 0, 0), False),
      (DOWN, EV_DOOR, (1, 3), 0.0, False, (0, 0, 0), False),  # the door milestone pays once
      (DOWN, EV_MOVED, (2, 3), 0.0, False, (0, 0, 0), False),
      (LEFT, EV_MOVED, (2, 2), 0.0, False, (0, 0, 0), False),
      (LEFT, EV_MOVED, (2, 1), 0.0, False, (0, 0, 0), False),
      (LEFT, EV_GOAL, (2, 0), 1.25, False, (0, 0, 1), True),
  ]
  anchors = [int(ts.anchor)]
  for t, (direction, event, pos, reward, invalid, new, done) in enumerate(script):
    state, ts = step(state, _move(direction))
    anchors.append(int(ts.anchor))
    where = f"step {t} ({DIRECTIONS[direction]})"
    assert int(ts.observation["event"]) == event, where
    assert tuple(np.asarray(ts.observation["pos"])) == pos, where
    assert float(ts.reward) == pytest.approx(reward), where
    assert bool(ts.invalid_action) == invalid, where
    expected_error = ErrorCode.INVALID_ARGUMENT if invalid else ErrorCode.NONE
    assert int(ts.observation["error"]) == expected_error, where
    np.testing.assert_array_equal(ts.milestones, np.array(new, bool), err_msg=where)
    assert bool(ts.terminated) == done and bool(ts.success) == done, where
    assert not bool(ts.violation), where
  assert int(ts.step) == len(script)
  view = np.asarray(ts.observation["grid"])  # the key is gone, the door shows open
  assert view[0, 0] == FLOOR and view[1, 3] == OPEN_DOOR and bool(ts.observation["has_key"])
  np.testing.assert_array_equal(state.milestones, [True, True, True])
  assert int(env.task_difficulty(HAND)) == 10
  # Anchors (after step t: anchors[t + 1]) ignore the step count but see the key and the door.
  assert anchors[0] == anchors[1] == anchors[2] == anchors[5]  # rejected moves change nothing
  assert anchors[8] == anchors[10]  # (0, 1) holding the key, twice
  assert anchors[5] != anchors[11]  # (0, 2) without, then with the key
  assert anchors[12] != anchors[14]  # (0, 3) with the key, before and after the door
  assert anchors[13] == anchors[15]  # on the door, twice


def test_goal_holding_at_reset_never_fires(hand):
  """A hand task starting the agent on the goal: `goal` holds before any action and is reached at
  reset; stepping off and back on ends the episode (a success) without paying the milestone."""
  env, reset, step = hand
  task = dict(HAND, start=np.array([2, 0], np.int32))
  state, ts = reset(jax.random.key(0), task)
  np.testing.assert_array_equal(state.milestones, [False, False, True])
  state, ts = step(state, _move(RIGHT))
  state, ts = step(state, _move(LEFT))
  assert int(ts.observation["event"]) == EV_GOAL and bool(ts.success)
  assert not bool(ts.milestones.any()) and float(ts.reward) == pytest.approx(1.0)
  state, ts = reset(jax.random.key(0), HAND)  # the usual start: nothing reached
  assert not bool(state.milestones.any())


def test_hand_layout_hole_bad_direction_and_parse_error(hand):
  _, reset, step = hand
  state, _ = reset(jax.random.key(0), HAND)
  state, ts = step(state, Action.invalid(ErrorCode.BAD_JSON, 1))
  assert int(ts.observation["event"]) == EV_ERROR
  assert int(ts.observation["error"]) == ErrorCode.BAD_JSON
  assert bool(ts.invalid_action) and float(ts.reward) == -0.5
  state, ts = step(state, Action.make(0, [7], 1))  # no such direction
  assert int(ts.observation["event"]) == EV_BAD_DIRECTION and bool(ts.invalid_action)
  assert int(ts.observation["error"]) == ErrorCode.INVALID_ARGUMENT
  assert tuple(np.asarray(state.inner["pos"])) == (0, 2)
  state, ts = step(state, _move(LEFT))
  state, ts = step(state, _move(DOWN))
  assert int(ts.observation["event"]) == EV_HOLE
  assert bool(ts.terminated) and not bool(ts.success) and not bool(ts.violation)
  assert float(ts.reward) == 0.0
  assert int(state.step) == 4


def test_hand_layout_text(hand):
  env, reset, _ = hand
  _, ts = reset(jax.random.key(0), HAND)
  obs = jax.tree.map(np.asarray, ts.observation)
  assert env.observation_text(obs, "compact") == (
      "start , key no , grid : k . A . / # O # D / G . . . / . . . .")
  assert env.observation_text(obs, "tool_call") == (
      "You are at the start. You do not have the key.\nk.A.\n#O#D\nG...\n....")
  assert env.task_text(HAND, "compact") == (
      "reach the goal G , grid : k . A . / # O # D / G . . . / . . . .")
  grid = HAND["grid"]
  opened = np.where(grid == DOOR, OPEN_DOOR, np.where(grid == KEY, FLOOR, grid))
  later = dict(obs, grid=opened, pos=np.array([1, 3]), has_key=np.bool_(True),
               event=np.int32(EV_DOOR))
  assert env.observation_text(later, "compact") == (
      "went through the door , key yes , grid : . . . . / # O # A / G . . . / . . . .")


def test_hand_layout_oracle_takes_the_shortest_route_and_finished_rows_stay(hand):
  env, reset, step = hand
  oracle = jax.jit(env.oracle)
  state, ts = reset(jax.random.key(0), HAND)
  moves = []
  while not bool(ts.done) and len(moves) < 20:
    action = oracle(state)
    moves.append(DIRECTIONS[int(action.args[0])])
    state, ts = step(state, action)
  assert moves == ["left"] * 2 + ["right"] * 3 + ["down"] * 2 + ["left"] * 3
  assert bool(ts.success)
  # Stepping the finished row is a no-op: same state, last time step without reward.
  for action in (_move(UP), Action.invalid(ErrorCode.GARBAGE, 1)):
    again, ts2 = step(state, action)
    jax.tree.map(np.testing.assert_array_equal, _plain(again), _plain(state))
    jax.tree.map(np.testing.assert_array_equal,
                 ts2.replace(reward=ts.reward, milestones=ts.milestones), ts)
    assert float(ts2.reward) == 0.0 and not np.asarray(ts2.milestones).any()


def _plain(state):
  return state.replace(key=jax.random.key_data(state.key))


# ----------------------------------------------------------------------------- generated tasks
def _bfs_length(grid, start) -> int:
  """Plain BFS over (row, column, has_key): fewest moves from `start` to the goal, -1 if none."""
  grid = np.asarray(grid).tolist()
  size = len(grid)
  first = (int(start[0]), int(start[1]), False)
  seen, queue = {first}, collections.deque([(first, 0)])
  while queue:
    (r, c, key), d = queue.popleft()
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
      nr, nc = r + dr, c + dc
      if not (0 <= nr < size and 0 <= nc < size):
        continue
      cell = grid[nr][nc]
      if cell in (WALL, HOLE) or (cell == DOOR and not key):
        continue
      if cell == GOAL:
        return d + 1
      nxt = (nr, nc, key or cell == KEY)
      if nxt not in seen:
        seen.add(nxt)
        queue.append((nxt, d + 1))
  return -1


def test_generated_tasks_are_solvable_and_splits_partition_lengths(env, tasks, generators):
  difficulty = jax.jit(jax.vmap(env.task_difficulty))
  lengths = {}
  for split, batch in tasks.items():
    grid = batch["grid"]
    counts = {code: (grid == code).sum(axis=(1, 2)) for code in (WALL, HOLE, KEY, DOOR, GOAL)}
    walls, holes = ((env.ood_num_walls, env.ood_num_holes) if split == "ood"
                    else (env.num_walls, env.num_holes))
    np.testing.assert_array_equal(counts[WALL], env.size - 1 + walls)  # barrier + extra walls
    np.testing.assert_array_equal(counts[HOLE], holes)
    for code in (KEY, DOOR, GOAL):
      np.testing.assert_array_equal(counts[code], 1)
    starts = batch["start"]
    assert (grid[np.arange(len(starts)), starts[:, 0], starts[:, 1]] == FLOOR).all()
    lengths[split] = np.asarray(difficulty(batch))
    reference = [_bfs_length(grid[i], starts[i]) for i in range(64)]
    np.testing.assert_array_equal(lengths[split][:64], reference)
  assert (lengths["train"] > 0).all() and (lengths["train"] <= env.max_length).all()
  assert (lengths["test"] > 0).all() and (lengths["test"] <= env.max_length).all()
  assert (lengths["ood"] >= env.ood_min_length).all()
  assert lengths["ood"].min() > max(lengths["train"].max(), lengths["test"].max())
  assert len({g.tobytes() for g in tasks["train"]["grid"]}) > 200  # varied layouts
  # The same keys give other tasks in each split (the split is folded in), the same ones again.
  assert (tasks["train"]["grid"] != tasks["test"]["grid"]).any(axis=(1, 2)).mean() > 0.95
  again = generators["train"](jax.random.split(jax.random.key(100), 256))
  jax.tree.map(np.testing.assert_array_equal, again, tasks["train"])
  with pytest.raises(ValueError, match="split must be one of"):
    env.generate_task(jax.random.key(0), "validation")


def test_oracle_through_the_text_path(env, tasks):
  policy = jax.jit(lambda s, k: env.oracle(s))
  for style in ("compact", "tool_call"):
    codec = env.codec(style=style)
    unk = codec.tokenizer.unk_token_id
    for split in ("test", "ood"):
      for i in range(20):
        out = testing.text_episode(env, codec, jax.random.key(i), _row(tasks[split], i),
                                   policy=policy, max_steps=40)
        where = f"{style} {split} task {i}"
        assert all(out["parsed_ok"]), where
        assert bool(out["final"].success), where
        assert not any(bool(t.invalid_action) for t in out["timesteps"]), where
        if style == "compact":
          assert unk not in out["ids"], f"{where}: {codec.decode(out['ids'])}"
        assert "reached the goal" in out["observations"][-1], where


def test_structured_oracle_solves_every_task_and_random_rarely_does(env, tasks, policies):
  difficulty = jax.jit(jax.vmap(env.task_difficulty))
  for i, split in enumerate(("train", "test", "ood")):
    keys = jax.random.split(jax.random.key(i), 256)
    summary = testing.episode_summary(
        testing.structured_rollout(env, keys, tasks[split], policies["oracle"]))
    assert summary["success"].mean() == 1.0, split
    np.testing.assert_array_equal(summary["steps"], difficulty(tasks[split]))  # shortest routes
    random = testing.episode_summary(
        testing.structured_rollout(env, keys, tasks[split], policies["random"]))
    print(f"gridworld {split}: oracle success 1.0, random success {random['success'].mean():.3f}")
    assert random["success"].mean() < 0.25, split


# ----------------------------------------------------------------------------- mixed rollouts
@pytest.fixture(scope="module")
def mixed(env, tasks):
  """`run(keys, tasks) -> (actions, timesteps, canonical)` ([T, B] each): for `HORIZON` steps rows
  take oracle moves, random directions (sometimes an unknown one), parse errors and out-of-range
  tool indices; then `ORACLE_STEPS` oracle moves."""
  def one(key, task):
    state, _ = env.reset(key, task)

    def body(state, t):
      k = jax.random.fold_in(key, t)
      u, d, e = jax.random.uniform(k, (3,))
      u = jnp.where(t < HORIZON, u, 0.0)
      direction = jnp.where(u < 0.4, env.oracle(state).args[0], (d * 4.2).astype(jnp.int32))
      error = jnp.where(u > 0.92, 1 + (e * 5).astype(jnp.int32), 0)  # parse errors 1..5
      tool = jnp.where(u > 0.92, -1, jnp.where((u > 0.9) & (u <= 0.92), 1, 0))
      action = Action(tool=tool.astype(jnp.int32), args=direction[None].astype(jnp.int32),
                      error=error.astype(jnp.int32))
      state, ts = env.step(state, action)
      return state, (action, ts, env.canonical_state(state.task, state.inner))

    return jax.lax.scan(body, state, jnp.arange(HORIZON + ORACLE_STEPS))[1]

  run = jax.jit(lambda keys, tasks: jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1),
                                                 jax.vmap(one)(keys, tasks)))
  keys = jax.random.split(jax.random.key(5), BATCH)
  batch = jax.tree.map(lambda a: np.repeat(a[:BATCH // 8], 8, axis=0), tasks["train"])
  return run, keys, batch, jax.tree.map(np.asarray, run(keys, batch))


def test_same_key_and_task_give_identical_trajectories(env, tasks, mixed, policies):
  run, keys, batch, first = mixed
  second = jax.tree.map(np.asarray, run(keys, batch))
  jax.tree.map(np.testing.assert_array_equal, first, second)
  keys = jax.random.split(jax.random.key(9), 256)
  a = testing.structured_rollout(env, keys, tasks["test"], policies["random"])
  b = testing.structured_rollout(env, keys, tasks["test"], policies["random"])
  jax.tree.map(np.testing.assert_array_equal, a, b)
  c = testing.structured_rollout(env, jax.random.split(jax.random.key(10), 256), tasks["test"],
                                 policies["random"])
  assert (np.asarray(a.anchor) != np.asarray(c.anchor)).any()  # other keys, other random moves


def test_oracle_solves_from_every_reachable_state(mixed):
  """After the mixed prefix (random moves, errors), oracle moves finish every row still running."""
  _, _, _, (_, timesteps, _) = mixed
  done = np.asarray(timesteps.terminated)
  alive = ~done[HORIZON - 1]
  assert alive.sum() > 10
  assert np.asarray(timesteps.success)[-1, alive].all()
  ended = done[HORIZON - 1] & ~np.asarray(timesteps.success)[-1]
  assert (np.asarray(timesteps.observation["event"])[-1, ended] == EV_HOLE).all()


def test_anchors_equal_exactly_when_canonical_states_equal(mixed):
  _, _, _, (_, timesteps, canonical) = mixed
  anchors = timesteps.anchor.reshape(-1)
  states = np.concatenate([np.asarray(c).reshape(anchors.shape[0], -1).astype(np.int64)
                           for c in canonical], axis=1)
  by_state, by_anchor = collections.defaultdict(set), collections.defaultdict(set)
  for anchor, state in zip(anchors.tolist(), map(bytes, states)):
    by_state[state].add(anchor)
    by_anchor[anchor].add(state)
  assert all(len(v) == 1 for v in by_state.values())
  assert all(len(v) == 1 for v in by_anchor.values())
  assert len(by_state) < anchors.shape[0] // 4  # states repeat within and across rollouts
  # Rollouts of one task meet in the same states (what step-level credit assignment uses).
  per_row = [set(timesteps.anchor[:, b].tolist()) for b in range(8)]
  assert any(per_row[0] & other for other in per_row[1:])


def test_plain_python_agrees_step_by_step(env, mixed):
  _, _, batch, (actions, timesteps, _) = mixed
  milestones = timesteps.milestones
  events = collections.Counter()
  for b in range(BATCH):
    plain = PlainGridWorld()
    obs = plain.reset(_row(batch, b))
    assert obs["pos"] == list(batch["start"][b]) and obs["event"] == EV_START
    for t in range(HORIZON + ORACLE_STEPS):
      out = plain.step(int(actions.tool[t, b]), [int(actions.args[t, b, 0])],
                       int(actions.error[t, b]))
      where = f"row {b} step {t}"
      assert out["reward"] == pytest.approx(float(timesteps.reward[t, b]), abs=1e-6), where
      for name, field in (("terminated", "terminated"), ("success", "success"),
                          ("violation", "violation"), ("invalid", "invalid_action")):
        assert out[name] == bool(getattr(timesteps, field)[t, b]), f"{where} {name}"
      assert out["milestones"] == milestones[t, b].tolist(), where
      o = out["observation"]
      assert o["grid"] == timesteps.observation["grid"][t, b].tolist(), where
      assert o["pos"] == timesteps.observation["pos"][t, b].tolist(), where
      for name in ("has_key", "event", "error"):
        assert o[name] == timesteps.observation[name][t, b].item(), f"{where} {name}"
      events[o["event"]] += 1
  # The sequences exercised every kind of outcome.
  for event in (EV_MOVED, EV_KEY, EV_DOOR, EV_GOAL, EV_EDGE, EV_WALL, EV_LOCKED, EV_BAD_DIRECTION,
                EV_ERROR):
    assert events[event] > 0, event
  assert timesteps.observation["error"].max() > 0


def test_finished_rows_stay_finished(mixed):
  _, _, _, (_, timesteps, _) = mixed
  done = np.asarray(timesteps.terminated)
  first = done.argmax(axis=0)
  assert done[-1].all()
  for b in range(BATCH):
    after = slice(first[b] + 1, None)
    assert done[after, b].all()
    assert (timesteps.reward[after, b] == 0).all() and not timesteps.milestones[after, b].any()
    assert (timesteps.step[after, b] == first[b] + 1).all()
    assert (timesteps.anchor[after, b] == timesteps.anchor[first[b], b]).all()
    assert (timesteps.success[after, b] == timesteps.success[first[b], b]).all()
    pos = timesteps.observation["pos"][:, b]
    assert (pos[after] == pos[first[b]]).all()


def test_batched_step_compiles_once(env, tasks, assert_no_retrace):
  step = jax.jit(jax.vmap(env.step))
  calls = []
  for seed in range(3):
    keys = jax.random.split(jax.random.key(seed), 8)
    states, _ = jax.vmap(env.reset)(keys, _row(tasks["test"], slice(8 * seed, 8 * seed + 8)))
    actions = Action(tool=np.zeros(8, np.int32), args=np.full((8, 1), seed, np.int32),
                     error=np.zeros(8, np.int32))
    calls.append(((states, actions), {}))
  assert_no_retrace(step, *calls)


def test_without_key_and_door():
  env = GridWorld(key_door=False)
  keys = jax.random.split(jax.random.key(0), 64)
  batch = jax.jit(lambda k: testing.tasks_from_keys(env, k, "ood"))(keys)
  grid = np.asarray(batch["grid"])
  assert not np.isin(grid, (KEY, DOOR)).any()
  assert ((grid == WALL).sum(axis=(1, 2)) == env.ood_num_walls).all()
  summary = testing.episode_summary(testing.structured_rollout(env, keys, batch, max_steps=24))
  assert summary["success"].all()
  assert (summary["steps"] >= env.ood_min_length).all()


def test_bad_parameters_name_the_problem():
  with pytest.raises(ValueError, match="size must be >= 3"):
    GridWorld(size=2)
  with pytest.raises(ValueError, match="ood tasks ask for 30 walls"):
    GridWorld(ood_num_walls=30)
  with pytest.raises(ValueError, match="train tasks ask for"):
    GridWorld(num_holes=-1)


def test_vocabulary_covers_every_compact_word(env, tasks):
  vocabulary = set(env.vocabulary())
  words = set(env.system_text("compact").split()) | set(env.task_text(_row(tasks["ood"], 0),
                                                                      "compact").split())
  for event in range(EV_ERROR + 1):
    for has_key in (False, True):
      obs = {"grid": np.arange(25).reshape(5, 5) % 7, "pos": np.array([4, 4]),
             "has_key": has_key, "event": event, "error": 0}
      words |= set(env.observation_text(obs, "compact").split())
  assert words <= vocabulary, words - vocabulary


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_min_length_gives_tasks_of_exactly_the_asked_length():
  from longhorizon import envs
  env = envs.make("gridworld", size=6, key_door=False, max_length=8, min_length=8, candidates=128)
  tasks = jax.vmap(lambda k: env.generate_task(k, "train"))(jax.random.split(jax.random.key(1), 64))
  lengths = np.asarray(jax.vmap(env.task_difficulty)(tasks))
  assert np.mean(lengths == 8) >= 0.95
  loose = envs.make("gridworld", size=6, key_door=False, max_length=8)
  tasks = jax.vmap(lambda k: loose.generate_task(k, "train"))(jax.random.split(jax.random.key(1), 64))
  assert np.mean(np.asarray(jax.vmap(loose.task_difficulty)(tasks)) == 8) < 0.5
  with pytest.raises(ValueError, match="min_length"):
    envs.make("gridworld", size=6, max_length=4, min_length=5)
  with pytest.raises(ValueError, match="candidates"):
    envs.make("gridworld", candidates=0)
