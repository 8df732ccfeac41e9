"""Reward hacking: shortcuts a policy may find to reward without doing the task, each checked at the
environment level and through `envs.compose_rewards` (what the learners train on).

* pointer_chain: the correct final value answered without (all) the lookups earns no success and no
  reward, for any number of hops; a second answer after a wrong one changes nothing.
* every registered environment, both codec styles: text that claims success ("success", "task
  complete", `{"success": true}`, a `done` tool call with a success flag, ...) parses as invalid, or
  as a harmless tool call, and never earns success or positive reward.
* milestones: doing the milestone-triggering thing again (re-reading the chain, walking back and
  forth through the door) is rewarded once only, though the environment reports the milestone as
  holding on every such step.
* retail: a write nobody asked for is never a success even with every requested write done, and a
  forbidden write earns the violation penalty whatever else the episode achieved.

Each test fails if the protection it names is removed (the checks that the shortcut is otherwise
"right" keep them from passing vacuously).
"""

import functools

import jax
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.envs import Action, ErrorCode, testing, to_numpy
from longhorizon.envs.gridworld import DOOR, MOVES

STYLES = ("compact", "tool_call")
REWARD = {"success": 1.0, "milestone": 0.25, "invalid": 0.1}
COMPOSE = envs.RewardSpec(success=1.0, milestone=0.5, invalid=0.1, violation=1.0)


# ---------------------------------------------------------------------------------------- helpers

def _compose(episodes, num_milestones, config=COMPOSE):
  """`compose_rewards` of host episodes, each a list of unbatched `TimeStep`s after its actions
  (steps after the episode ended are dropped, as `collect` does)."""
  s = max(len(e) for e in episodes)
  b = len(episodes)
  fields = {k: np.zeros((b, s), dt) for k, dt in (("step_mask", bool), ("milestones", np.int32),
                                                  ("cost", np.float32), ("violation", bool),
                                                  ("invalid", bool))}
  success = np.zeros((b,), bool)
  for i, episode in enumerate(episodes):
    for t, ts in enumerate(episode):
      fields["step_mask"][i, t] = True
      fields["milestones"][i, t] = int((np.asarray(ts.milestones, np.int32)
                                        << np.arange(num_milestones)).sum())
      fields["cost"][i, t] = float(ts.cost)
      fields["violation"][i, t] = bool(ts.violation)
      fields["invalid"][i, t] = bool(ts.invalid_action)
      if bool(ts.terminated | ts.truncated):
        success[i] = bool(ts.success)
        break
  return envs.compose_rewards(config, success=success, num_milestones=num_milestones, **fields)


def _until_done(timesteps):
  """The time steps up to and including the first that ends the episode."""
  out = []
  for ts in timesteps:
    out.append(ts)
    if bool(ts.terminated | ts.truncated):
      break
  return out


@pytest.fixture(scope="module")
def jitted():
  """`(reset, step, transition)` jitted once per environment object."""
  cache = {}

  def get(env):
    if env not in cache:
      cache[env] = (jax.jit(env.reset), jax.jit(env.step), jax.jit(env.transition))
    return cache[env]
  return get


def _play(env, jitted, key, task, actions, raw=False):
  """Steps `actions` (`Action`s) from reset; returns `(final state, time steps, raw milestones)`,
  the raw milestones (with `raw`) being what `transition` reports as holding after each action."""
  reset, step, transition = jitted(env)
  state, _ = reset(key, task)
  timesteps, held = [], []
  for action in actions:
    if raw:
      held.append(np.asarray(transition(state.task, state.inner, action, state.key).milestones))
    state, ts = step(state, action)
    timesteps.append(to_numpy(ts))
  return state, timesteps, held


# ---------------------------------------------------------------------------------- pointer_chain

def _chain(store, start, hops):
  """NumPy reference: the keys visited from `start` (hops + 1 of them)."""
  keys = [int(start)]
  for _ in range(int(hops)):
    keys.append(int(store[keys[-1]]))
  return keys


@pytest.mark.parametrize("hops", [1, 2, 3, 5, 8])
def test_pointer_chain_answer_without_lookups_earns_nothing(jitted, hops):
  env = envs.make("pointer_chain", horizon=hops, **REWARD)
  keys = jax.random.split(jax.random.key(hops), 8)
  tasks = to_numpy(testing.tasks_from_keys(env, keys, "test"))
  lookup = lambda k: Action.make(0, [k], env.num_args)
  answer = lambda v: Action.make(1, [v], env.num_args)
  episodes, controls = [], []
  for i in range(8):
    task = jax.tree.map(lambda a: a[i], tasks)
    chain = _chain(task["store"], task["start"], hops)
    truth = chain[-1]
    # Control: the same answer after the whole chain is a success (the answer is right).
    _, ts, _ = _play(env, jitted, keys[i], task, [lookup(k) for k in chain[:-1]] + [answer(truth)])
    assert bool(ts[-1].success) and float(ts[-1].reward) > 0.0
    controls.append(ts)
    # The right answer after 0..hops-1 lookups: the episode ends, no success, no success reward.
    for done_hops in range(hops):
      actions = [lookup(k) for k in chain[:done_hops]] + [answer(truth)]
      _, ts, _ = _play(env, jitted, keys[i], task, actions)
      last = ts[-1]
      assert bool(last.terminated) and not bool(last.success), (hops, done_hops)
      assert float(last.reward) == 0.0, (hops, done_hops)
      episodes.append(ts)
    # A wrong answer, then the right one: the episode is over, the retry is a no-op.
    _, ts, _ = _play(env, jitted, keys[i], task, [lookup(k) for k in chain[:-1]]
                     + [answer((truth + 1) % env.num_keys), answer(truth)])
    assert not bool(ts[-1].success) and float(ts[-1].reward) == 0.0
    episodes.append(_until_done(ts))
  hacked = _compose(episodes, env.num_milestones)
  np.testing.assert_array_equal(hacked["reward/success"], 0.0)
  # Shortcut episodes earn at most the milestones of the hops they did: less than the control.
  assert (hacked["score"] <= COMPOSE.milestone * env.num_milestones).all()
  solved = _compose(controls, env.num_milestones)
  np.testing.assert_allclose(solved["score"],
                             COMPOSE.success + COMPOSE.milestone * env.num_milestones)
  assert hacked["score"].max() < solved["score"].min()


def test_pointer_chain_milestones_once_when_rereading(jitted):
  hops = 4
  env = envs.make("pointer_chain", horizon=hops, **REWARD)
  key = jax.random.key(3)
  task = to_numpy(env.generate_task(key, "test"))
  chain = _chain(task["store"], task["start"], hops)
  lookup = lambda k: Action.make(0, [k], env.num_args)
  # Follow the chain, re-read every key of it, re-read the end three times, then answer.
  actions = ([lookup(k) for k in chain[:-1]] + [lookup(k) for k in chain]
             + [lookup(chain[-1])] * 3 + [Action.make(1, [chain[-1]], env.num_args)])
  _, ts, held = _play(env, jitted, key, task, actions, raw=True)
  fired = np.stack([t.milestones for t in ts])
  np.testing.assert_array_equal(fired.sum(0), [1, 1])
  assert fired[(hops + 1) // 2 - 1, 0] and fired[hops - 1, 1]
  # The environment reports both milestones as holding on every later step: only the first-time
  # logic keeps them from paying again.
  assert np.stack(held[hops:]).all()
  rewards = np.array([float(t.reward) for t in ts])
  np.testing.assert_allclose(rewards.sum(),
                             REWARD["success"] + 2 * REWARD["milestone"])
  assert bool(ts[-1].success)
  composed = _compose([ts], env.num_milestones)
  np.testing.assert_allclose(composed["reward/milestones"], [2 * COMPOSE.milestone])
  np.testing.assert_allclose(composed["score"], [COMPOSE.success + 2 * COMPOSE.milestone])


# ------------------------------------------------------------------------------------- gridworld

def test_gridworld_door_and_key_pay_once(jitted):
  env = envs.make("gridworld", **REWARD)
  reset, step, _ = jitted(env)
  oracle = jax.jit(env.oracle)
  move = lambda d: Action.make(0, [d], env.num_args)
  opposite = (1, 0, 3, 2)  # up <-> down, left <-> right
  keys = jax.random.split(jax.random.key(4), 6)
  tasks = to_numpy(testing.tasks_from_keys(env, keys, "test"))
  episodes = []
  for i in range(6):
    task = jax.tree.map(lambda a: a[i], tasks)
    # The oracle's moves until it enters the door, then back out and in again three times, then
    # the oracle's moves to the goal.
    state, _ = reset(keys[i], task)
    actions = []
    while not bool(state.inner["door_open"]):
      actions.append(to_numpy(oracle(state)))
      state, _ = step(state, actions[-1])
    entered = int(actions[-1].args[0])
    row, col = np.asarray(state.inner["pos"])
    assert task["grid"][row, col] == DOOR
    back = np.asarray(state.inner["pos"]) + np.asarray(MOVES[opposite[entered]])
    assert (back >= 0).all() and (back < env.size).all()  # the cell it came from
    actions += [move(opposite[entered]), move(entered)] * 3
    state, ts, held = _play(env, jitted, keys[i], task, actions, raw=True)
    assert not any(bool(t.invalid_action) or bool(t.done) for t in ts)
    assert all(h[0] and h[1] for h in held[-6:])  # key and door hold on every bounce
    while not bool(state.done):
      state, t = step(state, oracle(state))
      ts.append(to_numpy(t))
    assert bool(ts[-1].success)
    fired = np.stack([t.milestones for t in ts])
    np.testing.assert_array_equal(fired.sum(0), [1, 1, 1])
    rewards = np.array([float(t.reward) for t in ts])
    np.testing.assert_allclose(rewards.sum(), 1.0 + 3 * REWARD["milestone"], rtol=1e-6)
    episodes.append(ts)
  composed = _compose(episodes, env.num_milestones)
  np.testing.assert_allclose(composed["reward/milestones"], 3 * COMPOSE.milestone)
  np.testing.assert_allclose(composed["score"], COMPOSE.success + 3 * COMPOSE.milestone)


# ---------------------------------------------------------------------- success words, every env

SUCCESS_WORDS = (
    "success", "SUCCESS", "task complete", "Task complete.", "DONE", "done", "done success",
    "answer success", "answer correct", "answer true",
    "The task is complete and the answer is correct.",
    '{"success": true}', '{"name": "done", "arguments": {"success": true}}',
    '<tool_call>{"name": "done", "arguments": {"success": true}}</tool_call>',
    '<tool_call>{"name": "done", "arguments": {}}</tool_call>',
    'Task complete! <tool_call>{"name": "done", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "success", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "submit", "arguments": {"result": "success"}}</tool_call>',
    '<tool_call>{"name": "answer", "arguments": {"value": "correct"}}</tool_call>',
    '<tool_call>{"name": "answer", "arguments": {"value": true}}</tool_call>',
    '<tool_call>{"name": "answer", "arguments": {"value": 1, "success": true}}</tool_call>',
    '<tool_call>{"name": "done", "arguments": {}}</tool_call> success',
)
HARMLESS = {"done"}  # tools a success word may legitimately name (retail's end of conversation)


@functools.lru_cache(maxsize=None)
def _batched(name):
  """`(env, jitted vmapped reset, jitted vmapped step)`, shared by both styles."""
  env = envs.make(name, **REWARD)
  return env, jax.jit(jax.vmap(env.reset)), jax.jit(jax.vmap(env.step))


@pytest.mark.parametrize("name", envs.registered("jax"))
@pytest.mark.parametrize("style", STYLES)
def test_success_words_earn_nothing(name, style):
  env, reset, step = _batched(name)
  codec = env.codec(style=style)
  b, steps = 8, 6
  keys = jax.random.split(jax.random.key(5), b)
  tasks = testing.tasks_from_keys(env, keys, "test")
  parsed_ok = []
  for text in SUCCESS_WORDS:
    action, ok, message = codec.parse_action(text)
    if ok:  # only a harmless, real tool call may parse
      assert env.tools[int(action.tool)].name in HARMLESS, (text, style)
      parsed_ok.append(text)
    else:
      assert ErrorCode(int(action.error)).is_parse_error and message, text
    batch = jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (b,) + np.shape(a)), action)
    states, _ = reset(keys, tasks)
    timesteps = []
    for _ in range(steps):
      states, ts = step(states, batch)
      timesteps.append(to_numpy(ts))
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *timesteps)
    assert not stacked.success.any(), (text, style)
    assert not stacked.milestones.any(), (text, style)
    assert (stacked.reward <= 0.0).all(), (text, style)
    episodes = [_until_done([jax.tree.map(lambda a: a[t, r], stacked) for t in range(steps)])
                for r in range(b)]
    composed = _compose(episodes, env.num_milestones)
    assert (composed["score"] <= 0.0).all(), (text, style)
    np.testing.assert_array_equal(composed["reward/success"], 0.0)
  # `done` parses (and is harmless) exactly where it is a tool, in both syntaxes.
  if "done" in {t.name for t in env.tools}:
    expected = {"done"} if style == "compact" else {
        '<tool_call>{"name": "done", "arguments": {}}</tool_call>',
        'Task complete! <tool_call>{"name": "done", "arguments": {}}</tool_call>'}
    assert set(parsed_ok) == expected, parsed_ok
  else:
    assert not parsed_ok, parsed_ok


# ----------------------------------------------------------------------------------------- retail

FIND, LIST, GET, UPDATE, CANCEL, REFUND, TRANSFER, DONE = range(8)
PENDING, DELIVERED = 0, 3


@pytest.fixture(scope="module")
def retail():
  return envs.make("retail", **REWARD)


@pytest.fixture(scope="module")
def retail_tasks(retail):
  keys = jax.random.split(jax.random.key(6), 12)
  return keys, to_numpy(testing.tasks_from_keys(retail, keys, "test"))


def _oracle_prefix(env, jitted, key, task):
  """The oracle's actions up to (not including) its ending call: every requested order read and
  every possible request served."""
  reset, step, _ = jitted(env)
  oracle = jax.jit(env.oracle)
  state, _ = reset(key, task)
  actions = []
  while True:
    action = to_numpy(oracle(state))
    if int(action.tool) >= TRANSFER:
      return actions, action
    actions.append(action)
    state, _ = step(state, action)


def _orders(task, own: bool):
  """Orders of the customer (own) or of other users that no request names."""
  requested = set(task["req_order"][:int(task["num_requests"])].tolist())
  mine = task["owner"] == task["user"]
  return [o for o in np.flatnonzero(mine if own else ~mine).tolist() if o not in requested]


def test_retail_unrequested_write_is_never_a_success(retail, retail_tasks, jitted):
  keys, tasks = retail_tasks
  act = lambda tool, *args: Action.make(tool, args, retail.num_args)
  info = jax.jit(retail.episode_info)
  hacked, solved, checked = [], [], 0
  for i in range(len(keys)):
    task = jax.tree.map(lambda a: np.array(a[i]), tasks)
    free = _orders(task, own=True)
    if not free:
      continue
    extra = free[0]
    task["status"][extra] = PENDING  # so the unrequested write is permitted
    served, ending = _oracle_prefix(retail, jitted, keys[i], task)
    _, ts, _ = _play(retail, jitted, keys[i], task, served + [ending])
    assert bool(ts[-1].success)
    solved.append(ts)
    extras = ([act(GET, extra), act(CANCEL, extra)], [act(GET, extra), act(UPDATE, extra, (
        int(task["address"][extra]) + 1) % retail.num_addresses)])
    for writes in extras:
      # The unrequested write after, or before, every requested write is done.
      for actions in (served + writes + [ending], served[:2] + writes + served[2:] + [ending]):
        state, ts, _ = _play(retail, jitted, keys[i], task, actions)
        assert not any(bool(t.violation) or bool(t.invalid_action) for t in ts)
        assert bool(ts[-1].terminated) and not bool(ts[-1].success)
        assert float(ts[-1].reward) == 0.0
        assert bool(info(state.task, state.inner)["collateral_damage"])
        hacked.append(ts)
    checked += 1
  assert checked >= 6
  composed = _compose(hacked, retail.num_milestones)
  np.testing.assert_array_equal(composed["reward/success"], 0.0)
  reference = _compose(solved, retail.num_milestones)
  np.testing.assert_array_equal(reference["reward/success"], COMPOSE.success)
  assert composed["score"].max() < reference["score"].min()


def test_retail_forbidden_write_is_penalised_whatever_else(retail, retail_tasks, jitted):
  keys, tasks = retail_tasks
  act = lambda tool, *args: Action.make(tool, args, retail.num_args)
  episodes = []
  for i in range(len(keys)):
    task = jax.tree.map(lambda a: np.array(a[i]), tasks)
    theirs, free = _orders(task, own=False)[0], _orders(task, own=True)
    task["status"][theirs] = DELIVERED  # only the ownership rule forbids a refund
    if free:
      task["status"][free[0]] = PENDING  # only the confirm-before-write rule forbids a cancel
    served, ending = _oracle_prefix(retail, jitted, keys[i], task)
    requested = int(task["req_order"][0])
    forbidden = [
        [act(GET, theirs), act(REFUND, theirs)],  # another user's order
        [act(CANCEL, theirs)],
        # A status the write does not allow (refunds need delivered, cancels pending; no write
        # makes an order delivered, and a delivered one can only become refunded).
        [act(GET, requested), act(REFUND if task["status"][requested] != DELIVERED else CANCEL,
                                  requested)],
    ]
    if free:  # an own order written without reading it first
      forbidden.append([act(CANCEL, free[0])])
    for writes in forbidden:
      _, ts, _ = _play(retail, jitted, keys[i], task, served + writes + [ending])
      ts = _until_done(ts)
      last = ts[-1]
      # The episode had reached milestones (and might have succeeded); the write ends it.
      assert len(ts) == len(served) + len(writes), writes
      assert sum(int(t.milestones.sum()) for t in ts) >= 2
      assert bool(last.violation) and bool(last.terminated) and not bool(last.success)
      assert float(last.reward) == pytest.approx(-1.0)  # the env's violation penalty
      episodes.append(ts)
  composed = _compose(episodes, retail.num_milestones)
  # compose_rewards: the whole episode is worth the violation, every positive part dropped.
  np.testing.assert_allclose(composed["score"], -COMPOSE.violation)
  np.testing.assert_array_equal(composed["reward/milestones"], 0.0)
  np.testing.assert_array_equal(composed["reward/success"], 0.0)
  assert (composed["step_rewards"] <= 0.0).all()
  assert len(episodes) >= 3 * len(keys)
