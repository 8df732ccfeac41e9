"""pointer_chain: hand case, oracle through text, random floor, determinism, anchors, plain-Python
agreement, reward hacking."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import envs
from longhorizon.envs import testing
from longhorizon.envs.pointer_chain import follow_numpy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "benchmarks"))
from plain_envs.pointer_chain import PlainPointerChain  # noqa: E402

LOOKUP, ANSWER = 0, 1


@pytest.fixture(scope="module")
def env():
  return envs.make("pointer_chain", horizon=3, milestone=0.25, invalid=0.1)


@pytest.fixture(scope="module")
def step(env):
  return jax.jit(env.step)


def _hand_task():
  # 0 -> 5 -> 2 -> 7 ; other keys point to 1.
  store = np.ones((16,), np.int32)
  store[0], store[5], store[2] = 5, 2, 7
  return {"store": jnp.asarray(store), "start": jnp.int32(0), "horizon": jnp.int32(3)}


def _act(env, tool, arg):
  return envs.Action.make(tool, [arg], env.num_args)


def test_hand_case(env, step):
  state, ts = env.reset(jax.random.key(0), _hand_task())
  assert int(ts.observation["key"]) == 0 and int(ts.observation["value"]) == 3
  # An off-chain lookup reveals a value but does not advance: same anchor.
  state, ts1 = step(state, _act(env, LOOKUP, 9))
  assert int(ts1.observation["value"]) == 1 and int(state.inner["progress"]) == 0
  assert int(ts1.anchor) == int(ts.anchor) and float(ts1.reward) == 0.0
  state, ts2 = step(state, _act(env, LOOKUP, 0))
  assert int(ts2.observation["value"]) == 5 and int(state.inner["progress"]) == 1
  state, ts3 = step(state, _act(env, LOOKUP, 5))
  # progress 2 >= ceil(3/2): "halfway" fires once, rewarded 0.25.
  np.testing.assert_array_equal(ts3.milestones, [True, False])
  assert float(ts3.reward) == pytest.approx(0.25)
  state, ts4 = step(state, _act(env, LOOKUP, 5))  # repeat: no progress, no milestone again
  np.testing.assert_array_equal(ts4.milestones, [False, False])
  state, ts5 = step(state, envs.Action.invalid(envs.ErrorCode.BAD_JSON, env.num_args))
  assert bool(ts5.invalid_action) and float(ts5.reward) == pytest.approx(-0.1)
  assert int(ts5.observation["error"]) == envs.ErrorCode.BAD_JSON and int(ts5.step) == 5
  state, ts6 = step(state, _act(env, LOOKUP, 2))
  np.testing.assert_array_equal(ts6.milestones, [False, True])
  state, ts7 = step(state, _act(env, ANSWER, 7))
  assert bool(ts7.terminated) and bool(ts7.success) and not bool(ts7.truncated)
  assert float(ts7.reward) == pytest.approx(1.0)
  # Finished: stepping is a no-op with zero reward.
  state2, ts8 = step(state, _act(env, LOOKUP, 0))
  assert float(ts8.reward) == 0.0 and bool(ts8.terminated) and int(ts8.step) == 7
  jax.tree.map(np.testing.assert_array_equal, envs.to_numpy(state2), envs.to_numpy(state))


def test_out_of_range_keys_are_refused_not_clipped(env, step):
  """Key 16 of a 16-key store used to be clipped to key 15 (a lookup of 15, or an answer recorded as
  16 that ended the episode); now it is refused like out-of-range ids in every environment."""
  state, ts0 = env.reset(jax.random.key(0), _hand_task())
  codec = env.codec(style="compact")
  for tool, key in ((LOOKUP, 16), (LOOKUP, -1), (ANSWER, 16)):
    new, ts = step(state, _act(env, tool, key))
    assert {k: int(v) for k, v in ts.observation.items()} == {
        "kind": 1 if tool == LOOKUP else 2, "key": key, "value": -1,
        "error": envs.ErrorCode.INVALID_ARGUMENT}
    assert bool(ts.invalid_action) and float(ts.reward) == pytest.approx(-0.1)
    assert not bool(ts.terminated) and int(ts.anchor) == int(ts0.anchor)
    jax.tree.map(np.testing.assert_array_equal, envs.to_numpy(new.inner), envs.to_numpy(state.inner))
    assert codec.observation_text(ts) == "error : invalid argument"
  assert env.codec(style="tool_call").observation_text(ts) == (
      "Error: invalid argument: there is no key 16 (keys are 0 to 15).")
  # The refused answer did not end the episode: the chain can still be solved.
  for key in (0, 5, 2):
    state, _ = step(state, _act(env, LOOKUP, key))
  state, ts = step(state, _act(env, ANSWER, 7))
  assert bool(ts.success)


def test_milestones_holding_at_reset_never_fire(env, step):
  """A 0-hop task ("answer the start key"): both milestones hold before any action. They used to
  fire on the first action, whatever it was (0.25 each); now they are reached at reset."""
  task = dict(_hand_task(), horizon=jnp.int32(0))
  state, ts = env.reset(jax.random.key(0), task)
  np.testing.assert_array_equal(state.milestones, [True, True])
  np.testing.assert_array_equal(ts.milestones, [False, False])
  state, ts = step(state, _act(env, LOOKUP, 9))  # any action: nothing to earn
  np.testing.assert_array_equal(ts.milestones, [False, False])
  assert float(ts.reward) == 0.0
  state, ts = step(state, _act(env, ANSWER, 0))
  assert bool(ts.success) and float(ts.reward) == pytest.approx(1.0)
  assert not bool(ts.milestones.any())
  # Generated tasks (N >= 1) start with nothing reached.
  states, _ = jax.vmap(lambda k: env.reset(k))(jax.random.split(jax.random.key(1), 64))
  assert not bool(states.milestones.any())


def test_guessing_the_answer_earns_nothing(env, step):
  """The right value answered without following the chain is not a success."""
  state, _ = env.reset(jax.random.key(0), _hand_task())
  state, ts = step(state, _act(env, ANSWER, 7))
  assert bool(ts.terminated) and not bool(ts.success) and float(ts.reward) == 0.0
  state, _ = env.reset(jax.random.key(0), _hand_task())
  for key in (0, 5):
    state, _ = step(state, _act(env, LOOKUP, key))
  state, ts = step(state, _act(env, ANSWER, 7))  # one hop short
  assert not bool(ts.success)


def test_generated_chains(env):
  keys = jax.random.split(jax.random.key(1), 64)
  for split, hops in (("train", 3), ("ood", 6)):
    tasks = jax.tree.map(np.asarray, testing.tasks_from_keys(env, keys, split))
    assert (tasks["horizon"] == hops).all()
    for i in range(64):
      visited = [int(tasks["start"][i])]
      for _ in range(hops):
        visited.append(int(tasks["store"][i][visited[-1]]))
      assert len(set(visited)) == hops + 1  # no cycles: N hops are N distinct lookups
      assert visited[-1] == follow_numpy(tasks["store"][i], tasks["start"][i], hops)


@pytest.mark.parametrize("style", ["compact", "tool_call"])
@pytest.mark.parametrize("split", ["test", "ood"])
def test_oracle_through_text(env, style, split):
  codec = env.codec(style=style)
  keys = jax.random.split(jax.random.key(2), 12)
  tasks = testing.tasks_from_keys(env, keys, split)
  unk = codec.tokenizer.unk_token_id
  for i in range(12):
    episode = testing.text_episode(env, codec, keys[i], envs.row(tasks, i))
    assert bool(episode["final"].success), episode["actions"]
    assert all(episode["parsed_ok"])
    assert len(episode["actions"]) == int(tasks["horizon"][i]) + 1  # exactly N lookups + answer
    assert unk not in episode["ids"]


def test_structured_oracle_and_random_floor(env):
  keys = jax.random.split(jax.random.key(3), 256)
  for split in ("test", "ood"):
    tasks = testing.tasks_from_keys(env, keys, split)
    summary = testing.episode_summary(testing.structured_rollout(env, keys, tasks, "oracle", 16))
    assert summary["success"].all()
    random = testing.episode_summary(testing.structured_rollout(env, keys, tasks, "random", 16))
    assert random["success"].mean() < 0.02


def test_same_key_same_trajectory(env):
  keys = jax.random.split(jax.random.key(4), 32)
  a = testing.structured_rollout(env, keys, None, "random", 8)
  b = testing.structured_rollout(env, keys, None, "random", 8)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_anchors_equal_exactly_when_states_equal(env):
  keys = jax.random.split(jax.random.key(5), 8)
  tasks = testing.tasks_from_keys(env, keys[:2], "train")  # few tasks: many repeated states
  tasks = jax.tree.map(lambda a: jnp.concatenate([a] * 4), tasks)
  step = jax.jit(jax.vmap(env.step))
  states, ts = jax.vmap(env.reset)(keys, tasks)
  seen = {}
  rng = np.random.default_rng(0)
  for _ in range(12):
    canon = jax.vmap(env.canonical_state)(states.task, states.inner)
    for i in range(8):
      state_bytes = b"".join(np.asarray(leaf[i]).tobytes() for leaf in jax.tree.leaves(canon))
      anchor = int(states.last.anchor[i])
      assert seen.setdefault(state_bytes, anchor) == anchor
    tools = rng.integers(0, 1, 8)  # lookups only, so episodes keep going
    follow = rng.random(8) < 0.5  # half follow the chain, half look up a random key
    args = np.where(follow, np.asarray(states.inner["current"]), rng.integers(0, 16, 8))[:, None]
    states, ts = step(states, envs.Action(tool=jnp.asarray(tools, jnp.int32),
                                          args=jnp.asarray(args, jnp.int32),
                                          error=jnp.zeros(8, jnp.int32)))
  anchors = list(seen.values())
  assert len(set(anchors)) == len(anchors) >= 6  # distinct states, distinct anchors


def test_plain_python_agrees(env):
  plain_env = envs.make("pointer_chain", horizon=3)
  step = jax.jit(plain_env.step)
  rng = np.random.default_rng(6)
  keys = jax.random.split(jax.random.key(6), 24)
  tasks = testing.tasks_from_keys(plain_env, keys, "train")
  for i in range(24):
    task = envs.row(tasks, i)
    state, _ = plain_env.reset(keys[i], task)
    plain = PlainPointerChain(horizon=3)
    plain.reset(task)
    current = int(task["start"])
    for t in range(10):
      u = rng.random()
      if u < 0.1:
        tool, args, error = -1, [0], int(rng.integers(1, 6))
      elif u < 0.8:  # mostly follow the chain, sometimes a random key
        tool, args, error = LOOKUP, [current if rng.random() < 0.7 else int(rng.integers(-2, 18))], 0
      else:  # keys are 0-15: -2, -1, 16 and 17 are refused by both
        tool, args, error = ANSWER, [int(rng.integers(-2, 18)) if rng.random() < 0.5 else current], 0
      state, ts = step(state, envs.Action.make(tool, args, 1, error))
      out = plain.step(tool, args, error)
      current = int(state.inner["current"])
      assert float(ts.reward) == pytest.approx(out["reward"])
      assert bool(ts.terminated) == out["terminated"] and bool(ts.success) == out["success"]
      assert bool(ts.invalid_action) == out["invalid"]
      np.testing.assert_array_equal(ts.milestones, out["milestones"])
      for k, v in out["observation"].items():
        assert int(ts.observation[k]) == v, (k, t)


def test_jitted_step_does_not_retrace(env, assert_no_retrace):
  batch_step = jax.jit(jax.vmap(env.step))
  keys = jax.random.split(jax.random.key(7), 4)
  states, _ = jax.vmap(lambda k: env.reset(k))(keys)
  def action(arg):
    return envs.Action(tool=jnp.zeros(4, jnp.int32), args=jnp.full((4, 1), arg, jnp.int32),
                       error=jnp.zeros(4, jnp.int32))
  assert_no_retrace(batch_step, ((states, action(1)), {}), ((states, action(2)), {}))


def test_bad_params_raise():
  with pytest.raises(ValueError, match="horizon"):
    envs.make("pointer_chain", horizon=0)
  with pytest.raises(ValueError, match="num_keys"):
    envs.make("pointer_chain", horizon=8, num_keys=5)
  with pytest.raises(ValueError, match="unknown environment"):
    envs.make("pointer_chains")
