"""Host environments for the `EnvPool` tests (`test_pool.py`), in an importable module so that the
process backend's workers can unpickle their factories.

`Counter`: the policy says `up` until the counter reaches the task's `length` (success), `stay`
wastes a step, `crash` makes the environment fail (every time: a persistent environment error).
The observation names the position and the number of steps taken, so a step applied twice, or a
failed attempt that left a trace, shows in the text. `FaultyCounter` adds `snapshot` / `restore`.

Faults come from a schedule `{(task id, step): kind}` (`fault_schedule` draws one from a seed; step
-1 is the reset). Every kind but `persist` fires once per `(task id, seed, step)` over all instances,
threads and processes (a marker file in `marker_dir` is created when it fires), so a retry succeeds:

* `raise`: raises an exception; `mutate`: changes the state, then raises (non-repeatable state);
* `rate`: raises `RateLimited(0.01)`; `error`: answers `StepResult(env_error=True)`;
* `hang`: sleeps `hang_s` (past the pool's timeout), then goes on;
* `exit`: `os._exit(1)`, the worker process dies (process backend only);
* `persist`: raises on every attempt, so the row ends as an environment error.

Every step first counts itself (`_steps += 1`), before any fault: state that a failed attempt
changes, which only the pre-step snapshot (or a replay on a fresh instance) undoes.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from longhorizon.envs.host import HostEnvironment, Observation, StepResult, invalid_action
from longhorizon.envs.pool import RateLimited

ONCE_KINDS = ("raise", "mutate", "rate", "error", "hang")
WORDS = ["pos", "step", "start", "task", "up", "stay", "crash", "error", ":", "environment"]


def fault_schedule(seed: int, num_tasks: int, length: int, kinds=ONCE_KINDS, count: int = 4,
                   first_task: int = 0) -> tuple:
  """`count` faults at distinct `(task id, step)` of `num_tasks` tasks (ids from `first_task`) whose episodes take `length`
  steps, kinds taken in turn from a permutation of `kinds`, a function of `seed` only:
  `((task, step, kind), ...)`."""
  rng = np.random.default_rng(seed)
  cells = [(first_task + t, s) for t in range(num_tasks) for s in range(length)]
  chosen = sorted(rng.choice(len(cells), size=count, replace=False))
  kinds = [str(k) for k in rng.permutation(list(kinds))]  # each kind once when count >= len(kinds)
  return tuple((*cells[int(i)], kinds[j % len(kinds)]) for j, i in enumerate(chosen))


class Counter(HostEnvironment):
  """Counts `up` actions to the task's length (module docstring); no snapshot."""

  name = "counter"
  milestone_names = ("half",)

  def __init__(self, faults=(), marker_dir: str = "", hang_s: float = 1.0, latency_s: float = 0.0,
               reward=None, **reward_kwargs):
    super().__init__(reward, **reward_kwargs)
    self.faults = tuple(tuple(f) for f in faults)
    self.marker_dir, self.hang_s, self.latency_s = marker_dir, float(hang_s), float(latency_s)
    self._schedule = {(int(t), int(s)): str(k) for t, s, k in self.faults}
    self._task, self._seed, self._pos, self._steps = {}, 0, 0, 0

  def tasks(self, split, num, seed):
    return [{"id": i, "length": 3} for i in range(num)]

  def vocabulary(self):
    return WORDS + [str(i) for i in range(64)]

  def reset(self, task, seed):
    self._task, self._seed, self._pos, self._steps = dict(task), int(seed), 0, 0
    self._fault(-1)
    return Observation(f"task {task['id']} start")

  def step(self, action):
    if self.latency_s:
      time.sleep(self.latency_s)
    self._steps += 1  # a trace every attempt leaves (undone by restore or replay only)
    fault = self._fault(self._steps - 1)
    if fault is not None:
      return fault
    if action == "crash":
      raise RuntimeError("the service crashed")
    if action not in ("up", "stay"):
      return invalid_action(1, observation=f"error : pos {self._pos} step {self._steps}")
    self._pos += action == "up"
    done = self._pos >= self._task["length"]
    half = ("half",) if 2 * self._pos >= self._task["length"] else ()
    return StepResult(f"pos {self._pos} step {self._steps}", reward=0.1 * (action == "up"),
                      terminated=done, success=done, milestones=half)

  def oracle(self):
    return "up"

  def _fault(self, step: int):
    kind = self._schedule.get((int(self._task["id"]), step))
    if kind is None:
      return None
    if kind != "persist":
      try:
        marker = os.path.join(self.marker_dir, f"{self._task['id']}-{self._seed}-{step}")
        with open(marker, "x"):
          pass
      except FileExistsError:
        return None  # fired before: the retry (or another row of the group) goes through
    if kind in ("raise", "persist"):
      raise RuntimeError(f"injected {kind} fault at step {step}")
    if kind == "mutate":
      self._pos += 7
      self._steps += 5
      raise RuntimeError(f"injected fault after changing the state at step {step}")
    if kind == "rate":
      raise RateLimited(0.01)
    if kind == "error":
      return StepResult("injected environment error", env_error=True)
    if kind == "hang":
      time.sleep(self.hang_s)
      return None
    if kind == "exit":
      os._exit(1)
    raise ValueError(f"unknown fault kind {kind!r}")


class Drifting(Counter):
  """`Counter` whose answers name the instance (a count of instances made in this process): not a
  function of (task, seed, actions), so a lost row cannot be rebuilt by replay."""

  name = "drifting"
  made = 0

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    type(self).made += 1
    self._instance = type(self).made

  def step(self, action):
    result = super().step(action)
    return dataclasses.replace(result, observation=f"{result.observation} step {self._instance}")


class FaultyCounter(Counter):
  """`Counter` with `snapshot` / `restore`: a failed attempt is undone in place."""

  name = "faulty_counter"

  def snapshot(self):
    return (self._pos, self._steps)

  def restore(self, snapshot):
    self._pos, self._steps = snapshot


class Slow(HostEnvironment):
  """Every step sleeps `latency_s` (a remote tool); it raises while the file `down_file` exists
  (a service that is down, then back)."""

  name = "slow"

  def __init__(self, latency_s: float = 0.1, down_file: str = "", reward=None):
    super().__init__(reward)
    self.latency_s, self.down_file = float(latency_s), down_file

  def tasks(self, split, num, seed):
    return [{"id": i} for i in range(num)]

  def reset(self, task, seed):
    return Observation("ready")

  def step(self, action):
    time.sleep(self.latency_s)
    if self.down_file and os.path.exists(self.down_file):
      raise RuntimeError("the service is down")
    return StepResult(f"did {action}", terminated=True, success=True)
