"""`pointer_chain`: follow N lookups through a key-value store, then answer the final value.

A store maps each of `num_keys` keys to another key. The task gives a start key and a number of
hops N; the policy calls `lookup(key)` to read a key's value and must follow the chain
`start -> store[start] -> ...` for N hops, then call `answer(value)` with the key reached. The
horizon is exactly N + 1 actions, which makes this the environment for success-versus-horizon
studies (an independent per-step accuracy p predicts success p^(N+1)).

State: `progress` (hops followed correctly), `current` (the key the chain has reached) and the
answer. Looking up any other key is allowed (it reveals a value) but does not advance the chain,
so the canonical state, and the anchor, stay the same: repeated visits group together for GiGPO.

The verifier accepts only a correct answer given after the whole chain was followed: guessing the
value without doing the lookups earns nothing.

A key outside [0, num_keys) (in `lookup` or `answer`; only a hand-built `Action` can carry one, the
codec refuses such text as BAD_ARGUMENT) is refused as in every environment: `Transition.rejected`
(counted invalid), observation error INVALID_ARGUMENT, state unchanged, the episode goes on.

Splits: `train`/`test` draw tasks with `horizon` hops (different seeds, so different stores);
`ood` uses `ood_horizon` hops (default 2N): longer chains than any seen in training.

Milestones: `halfway` (N/2 hops followed, rounded up) and `chain_end` (all N hops). Both hold at
reset in a 0-hop task (a hand-made one: "answer the start key"; generated tasks have N >= 1), and are
then marked reached at reset (`milestones_at_reset`): they never fire.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.envs.base import Environment, Transition
from longhorizon.envs.types import Action, Arg, ErrorCode, Tool

__all__ = ["PointerChain"]

_LOOKUP, _ANSWER = 0, 1


class PointerChain(Environment):
  """Args:
    horizon: hops N of train/test tasks (>= 1).
    ood_horizon: hops of `ood` tasks (default 2N).
    num_keys: store size (default `max(16, 2 * max hops + 2)`); keys are 0..num_keys-1.
    **reward: `RewardSpec` fields (success, milestone, cost, invalid, violation; envs/rewards.py).
  """

  name = "pointer_chain"
  version = "1"
  milestone_names = ("halfway", "chain_end")

  @classmethod
  def horizon_settings(cls, horizon: int) -> dict:
    """N hops, then the answer: N + 1 actions; "lookup 12 <eot>" + "12 -> 7" per turn."""
    return {"params": {"horizon": horizon, "ood_horizon": horizon}, "actions": horizon + 1,
            "turn_tokens": 8}

  def __init__(self, horizon: int = 4, ood_horizon: int | None = None, num_keys: int | None = None,
               **reward):
    super().__init__(**reward)
    if horizon < 1:
      raise ValueError(f"pointer_chain: horizon must be >= 1, got {horizon}.")
    self.horizon = int(horizon)
    self.ood_horizon = int(ood_horizon if ood_horizon is not None else 2 * horizon)
    if self.ood_horizon < 1:
      raise ValueError(f"pointer_chain: ood_horizon must be >= 1, got {self.ood_horizon}.")
    longest = max(self.horizon, self.ood_horizon)
    self.num_keys = int(num_keys if num_keys is not None else max(16, 2 * longest + 2))
    if self.num_keys < longest + 1:
      raise ValueError(f"pointer_chain: num_keys={self.num_keys} cannot hold a chain of "
                       f"{longest} hops without repeating a key; use num_keys >= {longest + 1}.")

  @property
  def tools(self):
    key = Arg("key", "int", 0, self.num_keys - 1, description="the key to read")
    value = Arg("value", "int", 0, self.num_keys - 1, description="the final value of the chain")
    return (Tool("lookup", "Read the value stored under a key.", (key,)),
            Tool("answer", "Give the final value of the chain and end the task.", (value,)))

  # ------------------------------------------------------------------------------- tasks
  def generate_task(self, key, split: str = "train"):
    hops = self.ood_horizon if split == "ood" else self.horizon
    k_order, k_rest = jax.random.split(key)
    # The chain visits hops + 1 distinct keys in a random order; every other key points anywhere.
    order = jax.random.permutation(k_order, self.num_keys)
    store = jax.random.randint(k_rest, (self.num_keys,), 0, self.num_keys, jnp.int32)
    nxt = jnp.roll(order, -1)
    on_chain = jnp.arange(self.num_keys) < hops
    store = store.at[jnp.where(on_chain, order, self.num_keys)].set(nxt, mode="drop")
    return {"store": store, "start": order[0].astype(jnp.int32),
            "horizon": jnp.asarray(hops, jnp.int32)}

  def task_difficulty(self, task):
    return task["horizon"]

  def split_params(self, split):
    return {}

  # ------------------------------------------------------------------------------- dynamics
  def init(self, task, key):
    del key
    inner = {"progress": jnp.zeros((), jnp.int32), "current": task["start"],
             "answered": jnp.zeros((), bool), "answer": jnp.full((), -1, jnp.int32)}
    return inner, self._observation(kind=0, key=task["start"], value=task["horizon"])

  def _observation(self, kind, key, value, error=ErrorCode.NONE):
    # kind: 0 = task start (key = start, value = hops), 1 = lookup result, 2 = answer received.
    return {"kind": jnp.asarray(kind, jnp.int32), "key": jnp.asarray(key, jnp.int32),
            "value": jnp.asarray(value, jnp.int32), "error": jnp.asarray(error, jnp.int32)}

  def transition(self, task, inner, action: Action, key):
    del key
    arg = action.args[0]
    is_lookup = action.tool == _LOOKUP
    exists = (arg >= 0) & (arg < self.num_keys)
    value = task["store"][jnp.clip(arg, 0, self.num_keys - 1)]  # clipped to index; refused below
    follows = (is_lookup & exists & (arg == inner["current"])
               & (inner["progress"] < task["horizon"]))
    answers = ~is_lookup & exists
    progress = inner["progress"] + follows.astype(jnp.int32)
    new_inner = {"progress": progress,
                 "current": jnp.where(follows, value, inner["current"]),
                 "answered": inner["answered"] | answers,
                 "answer": jnp.where(answers, arg, inner["answer"])}
    observation = self._observation(
        jnp.where(is_lookup, 1, 2), arg,
        jnp.where(exists, jnp.where(is_lookup, value, arg), -1),
        jnp.where(exists, ErrorCode.NONE, ErrorCode.INVALID_ARGUMENT))
    return Transition(inner=new_inner, observation=observation, terminated=answers,
                      milestones=self._milestones(task, new_inner), rejected=~exists)

  def milestones_at_reset(self, task, inner):
    return self._milestones(task, inner)

  def _milestones(self, task, inner):
    half = (task["horizon"] + 1) // 2
    return jnp.stack([inner["progress"] >= half, inner["progress"] >= task["horizon"]])

  def error_observation(self, task, inner, error):
    return self._observation(3, -1, -1, error)

  def canonical_state(self, task, inner):
    return (task["store"], task["start"], task["horizon"], inner["progress"], inner["answered"],
            inner["answer"])

  def verify(self, task, inner):
    target = _follow(task["store"], task["start"], task["horizon"])
    return inner["answered"] & (inner["progress"] == task["horizon"]) & (inner["answer"] == target)

  def oracle(self, state):
    inner = state.inner
    done_hops = inner["progress"] >= state.task["horizon"]
    tool = jnp.where(done_hops, _ANSWER, _LOOKUP).astype(jnp.int32)
    return Action(tool=tool, args=inner["current"][None].astype(jnp.int32),
                  error=jnp.zeros((), jnp.int32))

  # ------------------------------------------------------------------------------- text
  def system_text(self, style):
    if style == "compact":
      return "follow the chain : lookup the start key , then each value as the next key , then answer the last value ."
    return ("You are exploring a key-value store. Starting from the start key, look up the key, "
            "then look up the value you got as the next key, for the given number of hops. Then "
            "answer with the last value you reached. One tool call per turn.")

  def task_text(self, task, style):
    start, hops = int(task["start"]), int(task["horizon"])
    if style == "compact":
      return f"start {start} hops {hops}"
    return f"Start key: {start}. Number of hops: {hops}."

  def observation_text(self, observation, style):
    kind, key, value, error = (int(observation[k]) for k in ("kind", "key", "value", "error"))
    if kind in (1, 2) and error == ErrorCode.INVALID_ARGUMENT:
      if style == "compact":
        return "error : invalid argument"  # codec words only: the vocabulary (token ids) is unchanged
      return f"Error: invalid argument: there is no key {key} (keys are 0 to {self.num_keys - 1})."
    if kind == 0:
      return self.task_text({"start": key, "horizon": value}, style)
    if kind == 1:
      return f"{key} -> {value}" if style == "compact" else f"The value of key {key} is {value}."
    if kind == 2:
      return f"answer {value}" if style == "compact" else f"Answer {value} received."
    return "error" if style == "compact" else f"Error {error}."

  def state_text(self, task, inner, style):
    """The task restated from where the chain stands: start at the key reached, with the hops
    left (after the last hop, "hops 0": answer the start key)."""
    left = int(task["horizon"]) - int(inner["progress"])
    return self.task_text({"start": int(inner["current"]), "horizon": max(left, 0)}, style)

  def vocabulary(self):
    words = set(self.system_text("compact").split())
    # The error observation's other words (":", "invalid", "argument") come with the codec; adding
    # them here would reorder the sorted word ids and change every trained model's inputs.
    words |= {"start", "hops", "->", "answer", "error"}
    words |= {str(i) for i in range(max(self.num_keys, self.ood_horizon + 1, self.horizon + 1))}
    return sorted(words)


def _follow(store, start, hops):
  """The key reached after `hops` lookups from `start` (hops is a traced scalar)."""
  return jax.lax.fori_loop(0, hops, lambda _, k: store[k], start)


def follow_numpy(store, start, hops) -> int:
  """NumPy reference of `_follow` (for tests)."""
  key = int(start)
  for _ in range(int(hops)):
    key = int(np.asarray(store)[key])
  return key
