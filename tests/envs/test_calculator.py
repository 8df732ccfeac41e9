"""The `calculator` environment: a hand-checked episode, the oracle through the text path and under
jit + vmap, determinism, anchors, agreement with the plain-Python implementation, and the task
generator against a NumPy fold."""

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.envs import Action, ErrorCode, make, testing
from longhorizon.envs.calculator import Calculator
from longhorizon.envs.codec import compact_vocabulary

ROOT = pathlib.Path(__file__).parents[2]
ADD, SUB, MUL, DIV = range(4)
CALC, ANSWER = 0, 1


def _load_plain():
  path = ROOT / "experiments" / "benchmarks" / "plain_envs" / "calculator.py"
  spec = importlib.util.spec_from_file_location("plain_calculator", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.PlainCalculator


def _fold(start, ops, operands, max_value):
  """NumPy/Python reference: the running values of a chain, each checked to stay in range."""
  values = [int(start)]
  for op, b in zip(ops, operands):
    x, b = values[-1], int(b)
    if op == DIV:
      assert b >= 2 and x % b == 0, (x, b)
      values.append(x // b)
    else:
      values.append([x + b, x - b, x * b][op])
    assert 0 <= values[-1] <= max_value, values
  return values


def _rows(tree):
  flat = jax.tree.map(np.asarray, tree)
  n = jax.tree.leaves(flat)[0].shape[0]
  return [jax.tree.map(lambda a, i=i: a[i], flat) for i in range(n)]


def _generator(env):
  """`gen(keys, split)`: `[B]` tasks of `split`, jitted (once per split)."""
  return jax.jit(lambda keys, split: testing.tasks_from_keys(env, keys, split),
                 static_argnames="split")


@pytest.fixture(scope="module")
def env():
  return make("calculator")


@pytest.fixture(scope="module")
def jitted(env):
  gen = _generator(env)
  # Policies as fixed objects, so `structured_rollout` compiles each once (its cache is per policy).
  return {"gen": gen, "oracle": jax.jit(env.oracle),
          "random": functools.partial(testing.random_action, env)}


# ------------------------------------------------------------------------- (a) by hand
# max_value 20; 4 * 3 = 12, 12 - 5 = 7 (two steps, padded to three for the ood split).
HAND_TASK = {"start": np.int32(4), "ops": np.array([MUL, SUB, 0], np.int32),
             "operands": np.array([3, 5, 0], np.int32),
             "values": np.array([4, 12, 7, -1], np.int32), "answer": np.int32(7),
             "num_ops": np.int32(2), "story": np.int32(0)}


@pytest.fixture(scope="module")
def hand():
  env = Calculator(num_ops=2, ood_num_ops=3, max_value=20, milestone=0.25,
                   invalid=0.5)
  return env, jax.jit(env.reset), jax.jit(env.step)


def _act(env, tool, *args):
  return Action.make(tool, args, env.num_args)


def test_hand_episode_progress_rejections_milestones_and_rewards(hand):
  env, reset, step = hand
  state, ts = reset(jax.random.key(0), HAND_TASK)
  assert {k: int(v) for k, v in ts.observation.items()} == {
      "kind": 0, "a": 4, "op": -1, "b": 2, "result": -1, "error": 0}
  start_anchor = int(ts.anchor)
  # (action, result, error, progress, reward, new milestones, anchor equals the start's)
  script = [
      ((CALC, 4, ADD, 3), 7, 0, 0, 0.0, [0, 0], True),  # a valid calc, but not the next step
      ((CALC, 3, MUL, 4), 12, 0, 1, 0.25, [1, 0], False),  # the step, swapped (mul commutes)
      ((CALC, 12, MUL, 2), -1, 6, 1, -0.5, [0, 0], False),  # 24 > max_value: rejected
      ((CALC, 12, DIV, 5), -1, 6, 1, -0.5, [0, 0], False),  # inexact division: rejected
      ((CALC, 12, DIV, 0), -1, 6, 1, -0.5, [0, 0], False),  # division by zero: rejected
      ((CALC, 5, SUB, 12), -1, 6, 1, -0.5, [0, 0], False),  # negative (and sub does not commute)
      ((CALC, 12, SUB, 5), 7, 0, 2, 0.25, [0, 1], False),  # the last step
      ((CALC, 12, SUB, 5), 7, 0, 2, 0.0, [0, 0], False),  # again: no progress past N, no milestone
  ]
  for (tool, a, op, b), result, error, progress, reward, new, same_anchor in script:
    state, ts = step(state, _act(env, tool, a, op, b))
    obs = {k: int(v) for k, v in ts.observation.items()}
    assert obs == {"kind": 1, "a": a, "op": op, "b": b, "result": result, "error": error}
    assert int(state.inner["progress"]) == progress
    assert float(ts.reward) == reward
    assert bool(ts.invalid_action) == (error != 0)
    assert ts.milestones.tolist() == [bool(m) for m in new]
    assert not bool(ts.terminated)
    assert (int(ts.anchor) == start_anchor) == same_anchor
  assert state.milestones.tolist() == [True, True]
  done_anchor = int(ts.anchor)
  # An answer out of range is rejected and does not end the episode.
  state, ts = step(state, _act(env, ANSWER, 21))
  assert int(ts.observation["kind"]) == 2
  assert int(ts.observation["error"]) == ErrorCode.INVALID_ARGUMENT
  assert not bool(ts.terminated) and bool(ts.invalid_action) and float(ts.reward) == -0.5
  assert int(ts.anchor) == done_anchor
  # A parse error: the base answers with an error observation and the penalty.
  state, ts = step(state, Action.invalid(ErrorCode.BAD_JSON, env.num_args))
  assert int(ts.observation["kind"]) == 3 and int(ts.observation["error"]) == ErrorCode.BAD_JSON
  assert float(ts.reward) == -0.5 and not bool(ts.terminated)
  # Right answer: success.
  win_state, ts = step(state, _act(env, ANSWER, 7))
  assert bool(ts.terminated) and bool(ts.success) and float(ts.reward) == 1.0
  assert {k: int(v) for k, v in ts.observation.items()} == {
      "kind": 2, "a": 7, "op": -1, "b": -1, "result": -1, "error": 0}
  # A finished row stays finished.
  again, ts2 = step(win_state, _act(env, CALC, 1, ADD, 1))
  assert float(ts2.reward) == 0.0 and bool(ts2.success) and int(again.step) == int(win_state.step)
  # Wrong answer: terminated without success.
  _, ts = step(state, _act(env, ANSWER, 8))
  assert bool(ts.terminated) and not bool(ts.success) and float(ts.reward) == 0.0


def test_hand_correct_answer_without_calculator_succeeds_without_milestones(hand):
  env, reset, step = hand
  state, _ = reset(jax.random.key(1), HAND_TASK)
  state, ts = step(state, _act(env, ANSWER, 7))
  assert bool(ts.success) and float(ts.reward) == 1.0
  assert ts.milestones.tolist() == [False, False]


def test_hand_oracle_and_texts(hand):
  env, reset, step = hand
  state, _ = reset(jax.random.key(2), HAND_TASK)
  expected = [(CALC, [4, MUL, 3]), (CALC, [12, SUB, 5]), (ANSWER, [7, 0, 0])]
  for tool, args in expected:
    action = env.oracle(state)
    assert int(action.tool) == tool and np.asarray(action.args).tolist() == args
    state, ts = step(state, action)
  assert bool(ts.success)
  task = jax.tree.map(np.asarray, HAND_TASK)
  assert env.task_text(task, "compact") == "start 4 , mul 3 , sub 5 ."
  assert env.task_text(task, "tool_call") == (
      "Ann has 4 apples. She ends up with 3 times as many apples as before. She gives away 5 "
      "apples. How many apples does Ann have at the end?")

  def obs(kind, a, op, b, result, error=0):
    return dict(kind=kind, a=a, op=op, b=b, result=result, error=error)

  cases = [(obs(1, 4, MUL, 3, 12), "4 mul 3 = 12", "4 * 3 = 12"),
           (obs(1, 12, MUL, 2, -1, 6), "12 mul 2 = error : out of range",
            "Error: 12 * 2 is outside the range 0 to 20."),
           (obs(1, 12, DIV, 5, -1, 6), "12 div 5 = error : not exact",
            "Error: 12 / 5 is not a whole number."),
           (obs(1, 12, DIV, 0, -1, 6), "12 div 0 = error : division by zero",
            "Error: 12 / 0 divides by zero."),
           (obs(2, 7, -1, -1, -1), "answer 7", "Answer 7 received."),
           (obs(2, 21, -1, -1, -1, 6), "answer error : out of range",
            "Error: the answer must be in the range 0 to 20.")]
  vocabulary = set(compact_vocabulary(env))
  for observation, compact, tool_call in cases:
    assert env.observation_text(observation, "compact") == compact
    assert env.observation_text(observation, "tool_call") == tool_call
    assert set(compact.split()) <= vocabulary, set(compact.split()) - vocabulary
  words = env.system_text("compact").split() + env.task_text(task, "compact").split()
  assert set(words) <= vocabulary


def test_bad_parameters_raise():
  with pytest.raises(ValueError, match="num_ops"):
    Calculator(num_ops=0)
  with pytest.raises(ValueError, match="max_value"):
    Calculator(max_value=100_000)
  with pytest.raises(ValueError, match="split"):
    Calculator().generate_task(jax.random.key(0), "validation")


def test_milestone_holding_at_reset_never_fires(hand):
  """A 0-step task ("answer the start value"): `all_steps` holds before any action. It used to fire
  on the first action (0.25); now it is reached at reset and `first_step` can never be reached."""
  env, reset, step = hand
  task = dict(HAND_TASK, num_ops=np.int32(0), answer=np.int32(4))
  state, ts = reset(jax.random.key(0), task)
  assert state.milestones.tolist() == [False, True] and ts.milestones.tolist() == [False, False]
  state, ts = step(state, _act(env, CALC, 4, MUL, 3))  # a valid calc: not a step of the task
  assert ts.milestones.tolist() == [False, False] and float(ts.reward) == 0.0
  state, ts = step(state, _act(env, ANSWER, 4))
  assert bool(ts.success) and float(ts.reward) == 1.0 and not bool(ts.milestones.any())
  states, _ = jax.vmap(lambda k: env.reset(k))(jax.random.split(jax.random.key(1), 64))
  assert not bool(states.milestones.any())  # generated tasks (N >= 1) start with nothing reached


# --------------------------------------------------------------------- (b) text path
@pytest.mark.parametrize("style", ["compact", "tool_call"])
def test_oracle_through_the_text_path_solves_test_and_ood(env, jitted, style):
  codec = env.codec(style=style)
  unk = codec.tokenizer.unk_token_id
  for split, seed in (("test", 1), ("ood", 2)):
    tasks = _rows(jitted["gen"](jax.random.split(jax.random.key(seed), 20), split))
    for i, task in enumerate(tasks):
      out = testing.text_episode(env, codec, jax.random.key(i), task,
                                 policy=lambda s, k: jitted["oracle"](s))
      n = int(task["num_ops"])
      assert n == (env.ood_num_ops if split == "ood" else env.num_ops)
      assert bool(out["final"].success), (split, i, out["actions"], out["observations"])
      assert all(out["parsed_ok"]) and len(out["actions"]) == n + 1
      assert not any(bool(t.invalid_action) for t in out["timesteps"])
      if style == "compact":
        assert unk not in out["ids"], codec.decode(out["ids"])
        assert out["actions"][-1] == f"answer {int(task['answer'])}"
      text = codec.decode(out["ids"])
      assert env.task_text(task, style) in text


# ---------------------------------------------------------------- (c) structured rollouts
@pytest.fixture(scope="module")
def split_tasks(jitted):
  test = jitted["gen"](jax.random.split(jax.random.key(10), 256), "test")
  ood = jitted["gen"](jax.random.split(jax.random.key(11), 256), "ood")
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), test, ood)


def test_structured_oracle_solves_every_task_and_random_rarely_does(env, jitted, split_tasks):
  keys = jax.random.split(jax.random.key(3), 512)
  oracle = testing.structured_rollout(env, keys, split_tasks, "oracle", max_steps=16)
  summary = testing.episode_summary(oracle)
  num_ops = np.asarray(split_tasks["num_ops"])
  assert summary["success"].mean() == 1.0
  np.testing.assert_array_equal(summary["steps"], num_ops + 1)
  assert not np.asarray(oracle.invalid_action).any()
  # Every oracle episode reaches both milestones, each exactly once.
  np.testing.assert_array_equal(np.asarray(oracle.milestones).sum(axis=0), 1)
  random = testing.structured_rollout(env, keys, split_tasks, jitted["random"], max_steps=16)
  rate = testing.episode_summary(random)["success"].mean()
  print(f"calculator random-policy success: {rate:.4f} (oracle 1.0)")
  assert rate < 0.05


# ---------------------------------------------------------------------- (d) determinism
def test_same_key_and_task_give_identical_trajectories(env, jitted, split_tasks):
  keys = jax.random.split(jax.random.key(4), 512)
  first = testing.structured_rollout(env, keys, split_tasks, jitted["random"], max_steps=16)
  second = testing.structured_rollout(env, keys, split_tasks, jitted["random"], max_steps=16)
  jax.tree.map(np.testing.assert_array_equal, first, second)
  reset = jax.jit(env.reset)
  task_a = reset(jax.random.key(5))[0].task
  task_b = reset(jax.random.key(5))[0].task
  task_c = reset(jax.random.key(6))[0].task
  jax.tree.map(np.testing.assert_array_equal, task_a, task_b)
  assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, task_a, task_c)))


# --------------------------------------------------------------------------- (e) anchors
def test_anchors_equal_exactly_when_canonical_states_equal(env, split_tasks):
  # 16 tasks x 16 rows each, a policy mixing oracle steps, random calcs and random actions, so
  # rows of the same task often reach the same state by different paths and step counts.
  tasks = jax.tree.map(lambda a: jnp.repeat(a[::32][:16], 16, axis=0), split_tasks)
  keys = jax.random.split(jax.random.key(7), 256)

  def one(key, task):
    state, ts = env.reset(key, task)

    def body(state, t):
      k_pick, k_act = jax.random.split(jax.random.fold_in(key, t))
      u = jax.random.uniform(k_pick)
      rand = testing.random_action(env, state, k_act)
      calc = rand.replace(tool=jnp.int32(CALC))
      action = jax.tree.map(lambda o, c, r: jnp.where(u < 0.6, o, jnp.where(u < 0.95, c, r)),
                            env.oracle(state), calc, rand)
      state, ts = env.step(state, action)
      return state, (env.canonical_state(state.task, state.inner), ts.anchor)

    _, (canon, anchors) = jax.lax.scan(body, state, jnp.arange(12))
    first = jax.tree.map(lambda a: a[None], env.canonical_state(task, state.inner))
    canon = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), first, canon)
    return canon, jnp.concatenate([ts.anchor[None], anchors])

  canon, anchors = jax.jit(jax.vmap(one))(keys, tasks)
  rows = np.concatenate([np.asarray(leaf).reshape(256 * 13, -1).astype(np.int64)
                         for leaf in jax.tree.leaves(canon)], axis=1)
  anchors = np.asarray(anchors).reshape(-1)
  unique, group = np.unique(rows, axis=0, return_inverse=True)
  group = group.reshape(-1)
  assert 100 < len(unique) < len(rows)  # many states, many of them revisited
  for g in range(len(unique)):
    assert len(set(anchors[group == g].tolist())) == 1
  assert len(set(anchors.tolist())) == len(unique)


# -------------------------------------------------------------- (f) plain-Python agreement
def _plain_action(rng, plain, max_value):
  """A host action mixing oracle steps, near misses, random calcs, answers and parse errors."""
  p = min(plain.progress, len(plain.ops) - 1)
  x, op, b = plain.values[p], plain.ops[p], plain.operands[p]
  kind = rng.integers(0, 10)
  if kind <= 2 and plain.progress < plain.num_ops:
    return CALC, [x, op, b], 0
  if kind == 3:
    return CALC, [b, op, x], 0  # swapped: counts for add and mul only
  if kind == 4:
    return CALC, [x, (op + 1) % 4, b], 0
  if kind == 5:
    return CALC, [int(rng.integers(0, max_value + 1)), int(rng.integers(0, 4)),
                  int(rng.integers(0, max_value + 1))], 0
  if kind == 6:
    return CALC, [int(rng.integers(-2, max_value + 3)), int(rng.integers(-1, 5)),
                  int(rng.integers(-2, max_value + 3))], 0  # hand-built, possibly out of range
  if kind == 7:
    value = plain.target if rng.random() < 0.5 else int(rng.integers(-1, max_value + 2))
    return ANSWER, [value], 0
  if kind == 8:
    return -1, [], int(rng.integers(1, 6))  # a parse error
  return int(rng.choice([-1, 2, 7])), [1, 0, 1], 0  # a tool index out of range


SMALL = dict(num_ops=3, ood_num_ops=5, max_value=30, milestone=0.25, invalid=0.5)


@pytest.fixture(scope="module")
def small():
  """A small range (random calls often valid, range edges often hit) with milestone rewards and
  invalid penalties, jitted and vmapped once for the tests below."""
  env = Calculator(**SMALL)
  return {"env": env, "gen": _generator(env), "reset": jax.jit(jax.vmap(env.reset)),
          "step": jax.jit(jax.vmap(env.step))}


def test_plain_python_agrees_with_jax_step_by_step(small, rng):
  plain_cls = _load_plain()
  keys = jax.random.split(jax.random.key(8), 96)
  many = jax.random.split(jax.random.key(8), 256)  # the generator test's shape: one compile
  tasks = jax.tree.map(lambda a, b: jnp.concatenate([a[:48], b[:48]]), small["gen"](many, "test"),
                       small["gen"](many, "ood"))
  states, _ = small["reset"](keys, tasks)
  plains = [plain_cls(**SMALL) for _ in range(96)]
  for plain, task in zip(plains, _rows(tasks)):
    plain.reset(task)
  for t in range(14):
    actions = [_plain_action(rng, plain, SMALL["max_value"]) for plain in plains]
    batch = Action(tool=np.array([a[0] for a in actions], np.int32),
                   args=np.stack([np.pad(np.array(a[1], np.int32), (0, 3 - len(a[1])))
                                  for a in actions]),
                   error=np.array([a[2] for a in actions], np.int32))
    states, ts = small["step"](states, batch)
    ts = jax.tree.map(np.asarray, ts)
    for i, (plain, (tool, args, error)) in enumerate(zip(plains, actions)):
      want = plain.step(tool, args, error)
      got = {"terminated": bool(ts.terminated[i]), "success": bool(ts.success[i]),
             "violation": bool(ts.violation[i]), "invalid": bool(ts.invalid_action[i]),
             "milestones": ts.milestones[i].tolist(),
             "observation": {k: int(v[i]) for k, v in ts.observation.items()}}
      assert float(ts.reward[i]) == pytest.approx(want.pop("reward")), (t, i, tool, args, error)
      assert got == want, (t, i, tool, args, error)
      assert int(states.inner["progress"][i]) == plain.progress
  done = np.asarray(states.done)
  assert 0.2 < done.mean() < 1.0 and np.asarray(states.last.success).any()


def test_batched_step_compiles_once(small, rng, assert_no_retrace):
  keys = jax.random.split(jax.random.key(9), 96)
  tasks = jax.tree.map(lambda a: a[:96], small["gen"](jax.random.split(keys[0], 256), "test"))
  states, _ = small["reset"](keys, tasks)
  calls = [((states, Action(tool=rng.integers(0, 2, 96).astype(np.int32),
                            args=rng.integers(0, 4, (96, 3)).astype(np.int32),
                            error=np.zeros(96, np.int32))), {}) for _ in range(3)]
  assert_no_retrace(small["step"], *calls)


# -------------------------------------------------------------------------- (g) generator
@pytest.mark.parametrize("which", ["default", "small"])
def test_generated_tasks_stay_in_range_and_fold_to_the_answer(env, jitted, small, which):
  # The default environment, and a small range whose edges the generator hits often. (`train` and
  # `test` share one code path: the split only picks N; seeds differ by the caller's keys.)
  if which == "default":
    gen, max_value, splits = jitted["gen"], env.max_value, (("test", 3), ("ood", 6))
  else:
    gen, max_value, splits = small["gen"], SMALL["max_value"], (("test", 3), ("ood", 5))
  width = max(n for _, n in splits)
  seen_ops = set()
  for seed, (split, n) in enumerate(splits):
    tasks = _rows(gen(jax.random.split(jax.random.key(20 + seed), 256), split))
    for task in tasks:
      assert int(task["num_ops"]) == n and 0 <= int(task["story"]) < 4
      ops, operands = task["ops"], task["operands"]
      assert ops.shape == (width,) and task["values"].shape == (width + 1,)
      values = _fold(task["start"], ops[:n], operands[:n], max_value)
      assert values[0] >= 1
      assert (operands[:n] >= 1).all() and (operands[:n][ops[:n] >= MUL] >= 2).all()
      np.testing.assert_array_equal(task["values"][:n + 1], values)
      assert int(task["answer"]) == values[-1]
      assert (ops[n:] == 0).all() and (operands[n:] == 0).all()
      assert (task["values"][n + 1:] == -1).all()
      seen_ops |= set(ops[:n].tolist())
    problems = {(int(t["start"]), tuple(t["ops"].tolist()), tuple(t["operands"].tolist()))
                for t in tasks}
    assert len(problems) > 200  # different keys, different problems
  assert seen_ops == {ADD, SUB, MUL, DIV}
