"""EnvPool backend `ray`: environment workers as Ray actors (local machine or a Ray cluster).

    pool = EnvPool(factory_of(env), backend="ray", workers=8, timeout_s=30)
    configure_pool(env, backend="ray", workers=8)   # or: the rollout loop's pool for `env`

Rows are spread over `W` actors (`workers`; 0: one per row, at most the cluster's CPUs), row `r`
on actor `r % W`. Each actor holds its rows' environment instances and runs the pool's worker-side
calls (`pool._apply`: step from the pre-step snapshot, reset, oracle; `pool._rebuild`: a fresh
instance replaying the row's actions), one call at a time; the calls of one turn run concurrently
across actors (`EnvPool` calls the backend from one thread per row; the driver side of each actor
is locked, so an actor's rows queue there and a call's timeout counts its own run only; a row
whose actor was replaced while it waited is rebuilt before its call is made).

Failures, as the process backend reports them: a call that exceeds its time limit
(`ray.get(..., timeout=...)`) raises `CallTimeout`, and its actor is killed (`ray.kill`: the call
may be stuck anywhere) and its rows marked lost; an actor that died (`RayActorError`: the process
exited, was OOM-killed, or its node went away) raises `WorkerCrashed`, and its rows are marked lost.
`EnvPool` rebuilds a lost row on a fresh actor (created on first use) by resetting its task and
replaying its actions, and retries the call within its budget. An exception of the environment
itself is re-raised as it was (so `RateLimited` is waited for and retried).

Ray is an optional dependency (the `[ray]` extra: `pip install -e .[ray]`), imported when the
backend starts. When Ray is not initialised, the backend starts a local instance (CPUs: at most the
number of workers, no dashboard, workers' logs not forwarded) that stays up for later pools; to run
the workers on a cluster, call `ray.init(address="auto")` (or the cluster's address) before the
first pool starts. The factory must be importable (or picklable by value) on the cluster's nodes:
`factory_of(env)` pickles the environment class by reference, so the package must be installed
there (a class defined in a module the workers cannot import, e.g. a script or a test, travels by
value after `ray.cloudpickle.register_pickle_by_value(module)`). An actor's start (a process that
imports the environment's package, seconds) never counts against a call's time limit. Actors run
with `JAX_PLATFORMS=cpu`: environments never need the accelerator, which stays with the learner.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from longhorizon.envs.host import HostEnvironment
from longhorizon.envs.pool import (_STARTS, CallTimeout, WorkerCrashed, _apply, _Lost,
                                   _quiet_close, _rebuild)

__all__ = ["RayBackend", "import_ray"]

# Seconds `close` waits for the actors to close their instances before it kills them.
_CLOSE_WAIT_S = 5.0
# Seconds an actor may take to start (a process that imports the environment's package).
_START_TIMEOUT_S = 120.0
# Object store of a local instance started here: calls carry text, never large arrays.
_LOCAL_OBJECT_STORE_BYTES = 256 * 2**20


def import_ray():
  """The `ray` module, or an ImportError that names the extra to install."""
  try:
    import ray  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("EnvPool backend 'ray' needs Ray, an optional dependency: install the [ray] "
                      "extra (pip install -e .[ray]) or choose backend 'thread' or 'process'."
                      ) from e
  return ray


class _EnvActor:
  """A Ray actor's state: the instances of the rows it holds (created on first use)."""

  def __init__(self, factory: Callable[[], HostEnvironment]):
    self.factory = factory
    self.envs: dict[int, HostEnvironment] = {}

  def call(self, row: int, method: str, args: tuple) -> Any:
    if row not in self.envs:
      self.envs[row] = self.factory()
    try:
      return _apply(self.envs[row], method, args)
    except BaseException:
      if method in _STARTS:  # a failed start leaves the instance unknown: a retry gets a new one
        _quiet_close(self.envs.pop(row))
      raise

  def rebuild(self, row: int, task: dict, seed: int, history: list[str]) -> None:
    self.envs[row] = _rebuild(self.factory, self.envs.pop(row, None), task, seed, history)

  def pid(self) -> int:
    return os.getpid()

  def close(self) -> None:
    for env in self.envs.values():
      _quiet_close(env)
    self.envs.clear()


class RayBackend:
  """`EnvPool` backend: rows on Ray actors (see the module docstring). Thread-safe: `EnvPool`
  calls `call` and `rebuild` from one thread per row."""

  def __init__(self, factory, rows: int, workers: int, timeout_s: float):
    self.ray = ray = import_ray()
    self.factory, self.timeout_s, self.rows = factory, timeout_s, rows
    if not ray.is_initialized():
      ray.init(num_cpus=max(1, min(os.cpu_count() or 1, workers or rows)),
               object_store_memory=_LOCAL_OBJECT_STORE_BYTES, include_dashboard=False,
               log_to_driver=False, ignore_reinit_error=True)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    count = max(1, min(workers, rows) if workers else min(rows, cpus))
    self.remote_class = ray.remote(_EnvActor).options(
        max_restarts=0, max_concurrency=1, runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})
    self.actors: list[Any] = [None] * count
    self.locks = [threading.Lock() for _ in range(count)]
    self.lock = threading.Lock()  # guards `missing`
    self.missing = set(range(rows))  # rows with no instance on their actor

  # ---------------------------------------------------------------------------------- calls
  def call(self, row: int, method: str, args: tuple, timeout_s: float):
    value = self._run(row, "call", (row, method, args), timeout_s, method)
    if method in _STARTS:
      with self.lock:
        self.missing.discard(row)
    return value

  def rebuild(self, row: int, task: dict, seed: int, history: list[str], timeout_s: float):
    self._run(row, "rebuild", (row, task, seed, list(history)), timeout_s * (1 + len(history)),
              "rebuilding the row")
    with self.lock:
      self.missing.discard(row)

  def lost(self, row: int) -> bool:
    with self.lock:
      return row in self.missing

  def lose(self, row: int) -> None:
    """Marks the row's instance lost (its state is unknown): rebuilt before its next call (the
    actor closes the old instance then)."""
    with self.lock:
      self.missing.add(row)

  def actor_of(self, row: int):
    """The handle of the actor that holds `row` (created on first use)."""
    i = row % len(self.actors)
    with self.locks[i]:
      return self._actor(i)

  def close(self):
    actors = [a for a in self.actors if a is not None]
    self.actors = [None] * len(self.actors)
    if not actors:
      return
    ray = self.ray
    try:
      ray.wait([a.close.remote() for a in actors], num_returns=len(actors),
               timeout=_CLOSE_WAIT_S)
    except Exception:  # a dead actor or a Ray already shut down: nothing left to close
      pass
    for actor in actors:
      self._kill(actor)

  # ------------------------------------------------------------------------------ internals
  def _actor(self, i: int):
    """Actor `i`, started and waited for when missing (its start, a new process importing the
    environment, never counts against a call's time limit); the caller holds `locks[i]`."""
    if self.actors[i] is None:
      ray = self.ray
      actor = self.remote_class.remote(self.factory)
      try:
        ray.get(actor.pid.remote(), timeout=_START_TIMEOUT_S)
      except Exception as e:  # the factory could not be unpickled or built, or no resources
        self._kill(actor)
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise WorkerCrashed(f"the Ray actor of rows {i}::{len(self.actors)} failed to start "
                            f"(limit {_START_TIMEOUT_S:g} s): {message}") from None
      self.actors[i] = actor
    return self.actors[i]

  def _run(self, row: int, op: str, args: tuple, timeout_s: float, what: str):
    ray, i = self.ray, row % len(self.actors)
    errors = ray.exceptions
    with self.locks[i]:
      if op == "call" and what != "reset" and self.lost(row):
        # Its actor was replaced while this call waited for it (another of its rows failed there):
        # the call was not made; the pool rebuilds the row and makes it (not a failure).
        raise _Lost(f"row {row} has no instance on its Ray actor")
      actor = self._actor(i)
      try:
        return ray.get(getattr(actor, op).remote(*args), timeout=timeout_s)
      except errors.GetTimeoutError:
        self._replace(i)
        raise CallTimeout(f"{what} took longer than {timeout_s:g} s (Ray actor killed)") from None
      except (errors.RayActorError, errors.WorkerCrashedError) as e:
        self._replace(i)
        raise WorkerCrashed(f"the Ray actor of row {row} died ({type(e).__name__})") from None
      except errors.RayTaskError as e:  # the environment's own exception
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
          raise cause from None
        raise RuntimeError(str(e)) from None

  def _replace(self, i: int):
    """Kills actor `i` (a new one is created on its next call) and marks its rows lost; the
    caller holds `locks[i]`."""
    actor, self.actors[i] = self.actors[i], None
    if actor is not None:
      self._kill(actor)
    with self.lock:
      self.missing |= set(range(i, self.rows, len(self.actors)))

  def _kill(self, actor):
    try:
      self.ray.kill(actor, no_restart=True)
    except Exception:  # already dead
      pass
