"""`EnvPool`: steps `B` host environments concurrently, with timeouts, retries, rate limits, a
circuit breaker, and record / replay.

    pool = EnvPool(lambda: make("back_office"), backend="thread", timeout_s=10, retries=2)
    observations = pool.reset(tasks, seeds)            # [B] Observation (or an env error)
    results = pool.step({row: action_text, ...})       # {row: StepResult} for the active rows

One instance per row (episode slot). A turn's calls run concurrently, so a turn of `B` calls of
latency `L` takes about `max(L)`, not `B x L`:

* backend `thread`: each call on a thread of the pool (I/O-bound environments: services, databases,
  subprocess sandboxes);
* backend `process`: rows are spread over `workers` processes (a `forkserver` context: workers fork
  from a clean server, never from the JAX process), each running its rows' calls one at a time
  (isolation; CPU-bound Python environments);
* backend `serial`: one call after another in the calling thread (the reference for benchmarks);
* backend `ray`: rows spread over Ray actors (`envs/ray_pool.py`, the `[ray]` extra), to scale
  environment workers out over a cluster.

A call that fails (raises, exceeds `timeout_s`, returns `env_error=True`, or meets a rate-limit
error) is retried up to `retries` times (seed §3.4: retry, and only if still failing mask it),
from the pre-step snapshot when the environment has one (`snapshot`/`restore`: the failed attempt
leaves no trace); a row whose instance is lost (a timed-out thread still runs, a worker process
died) or whose failed step left an unknown state (no snapshot) is rebuilt on a fresh instance by
`reset(task, seed)` and replaying the row's actions so far; each replayed step must answer what
it answered the first time (its observation, ending and success), else the rebuild fails
(`ReplayDiverged`, retried, then an environment error): a state that cannot be reproduced is never
continued silently. An environment whose answers are not a function of (task, seed, actions)
needs `snapshot`/`restore`, and still fails the check when it loses an instance.
After the budget the row's answer is an environment error (`StepResult(env_error=True)`); the loop
ends the episode as `ENV_ERROR`, kept in the batch with weight 0. A crashed worker process is
replaced.

Rate limits: token buckets per environment (`rate_limit` calls/s, `burst`) and per tool
(`tool_rate_limits`, by the tool name of the call); an environment that raises
`RateLimited(retry_after_s)` is waited for and retried (within the budget). Circuit breaker: after
`breaker_failures` consecutive failed calls the pool stops calling the environment for
`breaker_cooldown_s` (calls fail fast as environment errors), then lets one trial call through; a
success closes it. `stats()` reports calls, failures, retries, timeouts, crashes, rate-limit waits,
breaker openings and rejections, and the validity rate (the latest batch's episodes that ended
without an environment error).

Record / replay: with `record_path`, every reset and step (task, seed, action, result) is appended
to a JSON-lines file, one line per finished episode; `ReplayEnvironment` serves a recorded episode
again without the live environment.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import importlib
import itertools
import json
import multiprocessing
import os
import signal
import threading
import time
import traceback
import zlib
from typing import Any, Callable

from longhorizon.envs.host import HostEnvironment, Observation, StepResult, parse_call

__all__ = ["EnvPool", "RateLimited", "ReplayEnvironment", "BACKENDS", "load_records",
           "factory_of", "configure_pool", "pool_for", "close_pools", "TokenBucket",
           "CircuitBreaker"]

BACKENDS = ("thread", "process", "serial", "ray")  # "ray": envs/ray_pool.py (optional extra)
# Backends in modules of their own, imported when chosen (ray_pool builds on this module).
_PLUGIN_BACKENDS = {"ray": "longhorizon.envs.ray_pool:RayBackend"}


class RateLimited(Exception):
  """Raised by an environment (or its service client) when it is rate limited: the pool waits
  `retry_after_s` and retries the call (within its retry budget)."""

  def __init__(self, retry_after_s: float = 0.1, message: str = "rate limited"):
    super().__init__(message)
    self.retry_after_s = float(retry_after_s)


class CallTimeout(Exception):
  """A call exceeded the pool's per-call timeout."""


class ReplayDiverged(RuntimeError):
  """Rebuilding a lost row: a replayed action answered otherwise than it did the first time."""


class WorkerCrashed(Exception):
  """The worker process that held the row died."""


class _Lost(Exception):
  """The row's instance is gone (its worker was replaced) before the call was made: rebuild it and
  make the call (not a failure of the environment)."""


class CircuitOpen(Exception):
  """The pool's circuit breaker is open: the call was not made."""


def factory_of(env: HostEnvironment) -> Callable[[], HostEnvironment]:
  """A picklable factory of fresh instances like `env`: its class with its constructor parameters
  (public attributes, or what its `_constructor_params()` returns) and reward spec."""
  params = getattr(env, "_constructor_params", env.params)()
  return _Factory(type(env), params, env.reward_spec)


@dataclasses.dataclass(frozen=True)
class _Factory:
  cls: type
  params: dict
  reward: Any

  def __call__(self) -> HostEnvironment:
    return self.cls(reward=self.reward, **self.params)


# ------------------------------------------------------------------------------ worker-side calls
def _guarded_step(env: HostEnvironment, action: str) -> StepResult:
  """`env.step(action)`; on an exception or an `env_error` answer the pre-step snapshot is restored
  (when the environment has one), so a retry starts from the same state."""
  snap = env.snapshot() if env.can_snapshot else None
  try:
    result = env.step(action)
  except BaseException:
    if snap is not None:
      env.restore(snap)
    raise
  if not isinstance(result, StepResult):
    if snap is not None:
      env.restore(snap)
    raise TypeError(f"{type(env).__name__}.step returned {type(result).__name__}, not StepResult")
  if result.env_error and snap is not None:
    env.restore(snap)
  return result


def _digest(result: StepResult) -> int:
  """What a replayed step must answer again: its observation, ending and success."""
  return zlib.crc32(f"{result.observation}\x00{result.terminated}\x00{result.success}".encode())


def _rebuild(factory, old: HostEnvironment | None, task: dict, seed: int,
             history: list) -> HostEnvironment:
  """A fresh instance at the row's state: `reset(task, seed)` and the actions so far replayed.
  `history` holds `(action, digest of its answer)` pairs (`_digest`; digest None where it is not
  known: the prefix a branch row got from its parent), or bare actions, replayed unchecked. Raises
  `ReplayDiverged` when a replayed step answers otherwise."""
  if old is not None:
    try:
      old.close()
    except Exception:  # the old instance is being discarded because it failed
      pass
  env = factory()
  env.reset(task, seed)
  for i, entry in enumerate(history):
    action, digest = entry if isinstance(entry, (tuple, list)) else (entry, None)
    result = env.step(action)
    if digest is not None and (not isinstance(result, StepResult) or _digest(result) != digest):
      _quiet_close(env)
      answer = result.observation if isinstance(result, StepResult) else result
      raise ReplayDiverged(
          f"rebuilding a lost row of {type(env).__name__}: replayed action {i} {action!r:.60} "
          f"answered {str(answer)!r:.80}, not what it answered before; its answers are not a "
          "function of (task, seed, actions), so the row's state cannot be rebuilt.")
  return env


# Calls that set a row's whole state (a lost row needs no rebuild before them).
_STARTS = ("reset", "restore_from")


def _apply(env, method: str, args: tuple):
  if method == "step":
    return _guarded_step(env, *args)
  if method == "restore_from":  # a branch row: another episode's saved state
    task, seed, snapshot = args
    env.reset(task, seed)
    env.restore(snapshot)
    return True
  if method == "reset":
    out = env.reset(*args)
    if not isinstance(out, Observation):
      raise TypeError(f"{type(env).__name__}.reset returned {type(out).__name__}, not Observation")
    return out
  return getattr(env, method)(*args)


# ------------------------------------------------------------------------------------ backends
class _ThreadBackend:
  """Calls on threads, at most `workers` at a time (0: one per row). Each call runs on a thread of
  its own (a daemon); a timed-out call's thread is abandoned, still running, with its instance
  (rebuilt before the row's next call): it gives its slot back at once, so later calls never wait
  behind it, and it never keeps the interpreter from exiting."""

  def __init__(self, factory, rows: int, workers: int, timeout_s: float):
    self.factory, self.timeout_s = factory, timeout_s
    self.envs: list[HostEnvironment | None] = [None] * rows
    self.slots = threading.BoundedSemaphore(max(workers or rows, 1))

  def _run(self, fn, args: tuple, timeout_s: float, what: str):
    """`fn(*args)` on a new thread within `timeout_s` (`CallTimeout` past it)."""
    future, lock, state = concurrent.futures.Future(), threading.Lock(), {"slot": True}

    def give_back_slot():
      with lock:
        if state["slot"]:
          state["slot"] = False
          self.slots.release()

    def run():
      try:
        future.set_result(fn(*args))
      except BaseException as e:  # handed to the caller
        future.set_exception(e)
      finally:
        give_back_slot()

    self.slots.acquire()
    threading.Thread(target=run, name="envpool-call", daemon=True).start()
    try:
      return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
      give_back_slot()  # abandoned: it runs on without holding a slot
      raise CallTimeout(f"{what} took longer than {timeout_s:g} s") from None

  def call(self, row: int, method: str, args: tuple, timeout_s: float):
    if self.envs[row] is None:
      self.envs[row] = self.factory()
    try:
      return self._run(_apply, (self.envs[row], method, args), timeout_s, method)
    except CallTimeout:
      self.envs[row] = None  # abandoned: rebuilt before its next call
      raise

  def rebuild(self, row: int, task: dict, seed: int, history: list[str], timeout_s: float):
    old, self.envs[row] = self.envs[row], None
    self.envs[row] = self._run(_rebuild, (self.factory, old, task, seed, history),
                               timeout_s * (1 + len(history)), "rebuilding the row")

  def lost(self, row: int) -> bool:
    return self.envs[row] is None

  def lose(self, row: int) -> None:
    """Drops the row's instance (its state is unknown): rebuilt before its next call."""
    env, self.envs[row] = self.envs[row], None
    if env is not None:
      _quiet_close(env)

  def close(self):
    for env in self.envs:
      if env is not None:
        _quiet_close(env)


class _SerialBackend(_ThreadBackend):
  """One call after another in the calling thread (no timeout can interrupt it)."""

  def __init__(self, factory, rows: int, workers: int, timeout_s: float):
    del workers
    self.factory, self.timeout_s = factory, timeout_s
    self.envs = [None] * rows

  def call(self, row, method, args, timeout_s):
    if self.envs[row] is None:
      self.envs[row] = self.factory()
    return _apply(self.envs[row], method, args)

  def rebuild(self, row, task, seed, history, timeout_s):
    old, self.envs[row] = self.envs[row], None
    self.envs[row] = _rebuild(self.factory, old, task, seed, history)



def _alarm(signum, frame):
  raise CallTimeout("the call exceeded its time limit in the worker")


def _worker_main(conn, factory):
  """A worker process: holds its rows' instances, runs one call at a time. Each call is bounded
  by SIGALRM (interrupts Python code and sleeps); the parent kills a worker stuck past it. It says
  "ready" once started (imports done), so its start-up does not count against a call's timeout."""
  signal.signal(signal.SIGALRM, _alarm)
  envs: dict[int, HostEnvironment] = {}
  conn.send(("ready", os.getpid()))
  while True:
    try:
      message = conn.recv()
    except (EOFError, KeyboardInterrupt):
      break
    op, row, payload, timeout_s = message
    try:
      signal.setitimer(signal.ITIMER_REAL, timeout_s)
      try:
        if op == "rebuild":
          task, seed, history = payload
          envs[row] = _rebuild(factory, envs.pop(row, None), task, seed, history)
          value = None
        elif op == "close":
          for env in envs.values():
            _quiet_close(env)
          conn.send(("ok", None))
          break
        elif row not in envs and op not in _STARTS:
          conn.send(("lost", None))  # the instance went with a replaced worker: rebuild first
          continue
        else:
          if row not in envs:
            envs[row] = factory()
          value = _apply(envs[row], op, payload)
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
      conn.send(("ok", value))
    except CallTimeout as e:
      envs.pop(row, None)  # interrupted mid-call: its state is unknown, rebuild it
      conn.send(("timeout", str(e)))
    except BaseException as e:  # reported to the parent, which decides (retry / env error)
      conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
  # Seconds a new worker may take to start (fork from the server, unpickle the factory, import the
  # environment's module) before it counts as crashed; not part of any call's timeout.
  STARTUP_S = 120.0

  def __init__(self, context, factory):
    self.conn, child = context.Pipe()
    self.process = context.Process(target=_worker_main, args=(child, factory), daemon=True)
    self.process.start()
    child.close()
    self.lock = threading.Lock()
    try:
      ready = self.conn.poll(self.STARTUP_S) and self.conn.recv()[0] == "ready"
    except (EOFError, OSError):
      ready = False
    if not ready:
      self.kill()
      raise WorkerCrashed(f"a worker process did not start within {self.STARTUP_S:g} s")

  def kill(self):
    try:
      self.process.kill()
      self.process.join(timeout=5)
    except Exception:
      pass
    self.conn.close()


class _ProcessBackend:
  """Rows spread over `workers` processes (row r on worker r % W)."""

  def __init__(self, factory, rows: int, workers: int, timeout_s: float):
    self.factory, self.timeout_s = factory, timeout_s
    self.context = multiprocessing.get_context("forkserver")
    self.workers = [None] * max(1, min(workers or os.cpu_count() or 1, rows))
    self.rows = rows
    self.missing = set(range(rows))  # rows with no instance in their worker
    self.lock = threading.Lock()  # guards `workers`: the rows of one worker call concurrently
    self.starting = [threading.Lock() for _ in self.workers]  # one start per slot at a time

  def _rows_of(self, i: int) -> set:
    return {r for r in range(self.rows) if r % len(self.workers) == i}

  def _worker(self, row) -> _Worker:
    i = row % len(self.workers)
    with self.starting[i]:  # workers of different slots start in parallel
      if self.workers[i] is None:
        worker = _Worker(self.context, self.factory)
        with self.lock:
          self.missing |= self._rows_of(i)  # a new worker holds no instance
          self.workers[i] = worker
      return self.workers[i]

  def _send(self, row, op, payload, timeout_s):
    while True:
      worker = self._worker(row)
      with worker.lock:
        if worker is self.workers[row % len(self.workers)]:
          return self._send_locked(worker, row, op, payload, timeout_s)
      # The worker was replaced (another of its rows crashed it) while this call waited for it:
      # the call was not made; make it on the new worker.

  def _send_locked(self, worker, row, op, payload, timeout_s):
    try:
      worker.conn.send((op, row, payload, timeout_s))
      # The worker's own alarm fires at timeout_s; allow it a grace period before killing it.
      if not worker.conn.poll(timeout_s * 1.5 + 1.0):
        self._replace(worker)
        raise CallTimeout(f"{op} took longer than {timeout_s:g} s (worker killed)")
      status, value = worker.conn.recv()
    except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as e:
      self._replace(worker)
      raise WorkerCrashed(f"the worker process of row {row} died ({type(e).__name__})") from None
    if status == "lost":
      self.missing.add(row)
      raise _Lost(f"row {row} has no instance in its worker")
    if status == "timeout":
      self.missing.add(row)
      raise CallTimeout(value)
    if status == "error":
      raise RuntimeError(value)
    return value

  def _replace(self, worker: _Worker):
    worker.kill()
    with self.lock:
      for i, current in enumerate(self.workers):
        if current is worker:
          self.workers[i] = None
          self.missing |= self._rows_of(i)

  def call(self, row, method, args, timeout_s):
    value = self._send(row, method, args, timeout_s)
    if method in _STARTS:
      self.missing.discard(row)
    return value

  def rebuild(self, row, task, seed, history, timeout_s):
    self._send(row, "rebuild", (task, seed, history), timeout_s * (1 + len(history)))
    self.missing.discard(row)

  def lost(self, row) -> bool:
    return row in self.missing

  def lose(self, row) -> None:
    self.missing.add(row)

  def close(self):
    for worker in self.workers:
      if worker is not None:
        worker.kill()


def _quiet_close(env):
  try:
    env.close()
  except Exception:
    pass


_BACKEND_CLASSES = {"thread": _ThreadBackend, "process": _ProcessBackend, "serial": _SerialBackend}


# ---------------------------------------------------------------------------------- rate limits
class TokenBucket:
  """`rate` calls per second with bursts of up to `burst`; `acquire` waits for a token and
  returns the seconds it waited."""

  def __init__(self, rate: float, burst: int = 1):
    if rate <= 0:
      raise ValueError(f"rate must be > 0 calls/s, got {rate}.")
    self.rate, self.capacity = float(rate), float(max(burst, 1))
    self.tokens, self.last = self.capacity, time.monotonic()
    self.lock = threading.Lock()

  def acquire(self) -> float:
    waited = 0.0
    while True:
      with self.lock:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
          self.tokens -= 1
          return waited
        pause = (1 - self.tokens) / self.rate
      time.sleep(pause)
      waited += pause


class CircuitBreaker:
  """Opens after `failures` consecutive failed calls; stays open `cooldown_s`, then lets one
  trial call through (half open); a success closes it, a failure opens it again."""

  def __init__(self, failures: int, cooldown_s: float):
    self.threshold, self.cooldown_s = failures, cooldown_s
    self.consecutive, self.opened_at, self.trial = 0, None, False
    self.openings = 0
    self.lock = threading.Lock()

  def allow(self) -> bool:
    if self.threshold <= 0:
      return True
    with self.lock:
      if self.opened_at is None:
        return True
      if time.monotonic() - self.opened_at >= self.cooldown_s and not self.trial:
        self.trial = True  # half open: one call goes through
        return True
      return False

  def record(self, ok: bool) -> None:
    if self.threshold <= 0:
      return
    with self.lock:
      if ok:
        self.consecutive, self.opened_at, self.trial = 0, None, False
        return
      self.consecutive += 1
      if self.trial or (self.opened_at is None and self.consecutive >= self.threshold):
        self.opened_at, self.trial = time.monotonic(), False
        self.openings += 1

  @property
  def is_open(self) -> bool:
    return self.opened_at is not None


# ------------------------------------------------------------------------------------- the pool
def _tool_name(env: HostEnvironment, action: str) -> str:
  if not env.tools:
    return ""
  style = "tool_call" if "<tool_call>" in action else "compact"
  return parse_call(action, env.tools, style).name


@dataclasses.dataclass
class _Row:
  task: dict
  seed: int
  history: list = dataclasses.field(default_factory=list)  # actions applied so far
  # the digest of each action's answer (`_digest`; None where not known: a forked row's prefix)
  answers: list = dataclasses.field(default_factory=list)
  log: list = dataclasses.field(default_factory=list)  # recorded calls (record mode)
  failed: bool = False
  record: bool = True  # written to record_path (not a branch row: it has no reset of its own)


class EnvPool:
  """`rows` host-environment slots stepped concurrently (see the module docstring).

  Args:
    factory: `() -> HostEnvironment` (picklable for the process backend: `factory_of(env)`).
    backend: "thread", "process", "serial" or "ray" (Ray actors; `envs/ray_pool.py`).
    workers: threads (0: one per row) or processes (0: one per CPU).
    timeout_s: per-call time limit.
    retries: further attempts of a failed call before the row is an environment error.
    rate_limit, burst: calls/s over all rows (0: none), and the bucket's size.
    tool_rate_limits: `{tool name: calls/s}` (tools named by the environment's schemas).
    breaker_failures, breaker_cooldown_s: the circuit breaker (0 failures: off).
    record_path: JSON-lines file the finished episodes' calls are appended to ("" : off).
  """

  def __init__(self, factory: Callable[[], HostEnvironment], *, backend: str = "thread",
               workers: int = 0, timeout_s: float = 30.0, retries: int = 2,
               rate_limit: float = 0.0, burst: int = 1, tool_rate_limits: dict | None = None,
               breaker_failures: int = 0, breaker_cooldown_s: float = 5.0,
               record_path: str = ""):
    if backend not in BACKENDS:
      raise ValueError(f"EnvPool backend must be one of {BACKENDS}, got {backend!r}.")
    if timeout_s <= 0 or retries < 0:
      raise ValueError(f"EnvPool needs timeout_s > 0 and retries >= 0, got {timeout_s}, {retries}.")
    self.factory, self.backend_name, self.workers = factory, backend, workers
    self.timeout_s, self.retries = float(timeout_s), int(retries)
    self.bucket = TokenBucket(rate_limit, burst) if rate_limit else None
    self.tool_buckets = {name: TokenBucket(rate, burst)
                         for name, rate in (tool_rate_limits or {}).items()}
    self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
    self.record_path = record_path
    self._probe = None  # an instance for the tool names of calls (rate limits per tool)
    self._can_snapshot = None
    self.backend = None
    self.rows: list[_Row] = []
    self.counts = collections.Counter()
    self.latency: dict[int, float] = {}  # row -> seconds of its latest step call
    self.lock = threading.Lock()
    self.driver = None

  # ------------------------------------------------------------------------------------ API
  def reset(self, tasks: list[dict], seeds: list[int]) -> list[Observation | StepResult]:
    """Starts one episode per row (`len(tasks)` rows). A row whose reset failed within the retry
    budget gets a `StepResult(env_error=True)` instead of an `Observation`."""
    if len(tasks) != len(seeds):
      raise ValueError(f"{len(tasks)} tasks but {len(seeds)} seeds.")
    self._ensure(len(tasks))
    self.rows = [_Row(task=dict(t), seed=int(s)) for t, s in zip(tasks, seeds)]
    out = self._map({r: ("reset", (self.rows[r].task, self.rows[r].seed))
                     for r in range(len(tasks))})
    for r, value in out.items():
      self._log(r, {"reset": {"task": self.rows[r].task, "seed": self.rows[r].seed},
                    "observation": _as_json(value)})
    return [out[r] for r in range(len(tasks))]

  def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
    """Steps each row in `actions` with its text, concurrently; `{row: StepResult}`. A row whose
    reset failed answers an environment error without a call."""
    failed = {r: StepResult("environment error: the episode could not start", terminated=True,
                            env_error=True) for r in actions if self.rows[r].failed}
    self.latency = {}
    out = self._map({r: ("step", (a,)) for r, a in actions.items() if r not in failed})
    out.update(failed)
    for r, result in out.items():
      if not result.env_error:
        self.rows[r].history.append(actions[r])
        self.rows[r].answers.append(_digest(result))
      self._log(r, {"action": actions[r], "result": _as_json(result)})
    return out

  def snapshot(self, rows) -> dict[int, object]:
    """Each of `rows`' `snapshot()` of its current state; None for every row when the
    environment has no snapshots, and for a row whose call failed."""
    if not self._snapshots():
      return {int(r): None for r in rows}
    return self._map({int(r): ("snapshot", ()) for r in rows}, oracle=True)

  def fork(self, sources: list[tuple[dict, int, list[str], object]]) -> None:
    """Starts one row per source `(task, seed, actions so far, snapshot or None)` in the state the
    source describes (branch rollouts): reset and `restore(snapshot)` where there is a snapshot,
    else (or when restoring fails) rebuilt before its first step by replaying the actions from
    `reset(task, seed)`, as a lost row is. Branch rows are not written to `record_path` (a replay
    needs an episode's own reset)."""
    self._ensure(len(sources))
    self.rows = [_Row(task=dict(t), seed=int(s), history=list(h), answers=[None] * len(h),
                      record=False)
                 for t, s, h, _ in sources]
    done = self._map({r: ("restore_from", (src[0], src[1], src[3]))
                      for r, src in enumerate(sources) if src[3] is not None}, oracle=True)
    for r in range(len(sources)):
      if done.get(r) is not True:
        self.backend.lose(r)  # rebuilt by replaying its actions before its first call

  def oracle(self, rows) -> dict[int, str | None]:
    """The oracle's next action of each of `rows` (None where it has none or failed)."""
    out = self._map({r: ("oracle", ()) for r in rows}, oracle=True)
    return {r: (v if isinstance(v, str) else None) for r, v in out.items()}

  def state_texts(self, rows) -> dict[int, str | None]:
    """Each of `rows`' state summary (`HostEnvironment.state_text`; None where the call failed)."""
    return self._map({int(r): ("state_text", ()) for r in rows}, oracle=True)

  def random_actions(self, seeds: dict[int, int]) -> dict[int, str | None]:
    """Each row's `random_action(seed)` (None where it has none or failed)."""
    out = self._map({r: ("random_action", (s,)) for r, s in seeds.items()}, oracle=True)
    return {r: (v if isinstance(v, str) else None) for r, v in out.items()}

  def finish(self, rows=None) -> None:
    """Writes the finished episodes of `rows` (all by default) to `record_path`."""
    if not self.record_path:
      return
    rows = range(len(self.rows)) if rows is None else rows
    os.makedirs(os.path.dirname(os.path.abspath(self.record_path)), exist_ok=True)
    with open(self.record_path, "a") as f:
      for r in rows:
        row = self.rows[r]
        if row.log and row.record:
          f.write(json.dumps({"task": row.task, "seed": row.seed, "calls": row.log}) + "\n")
          row.log = []

  def stats(self) -> dict:
    """Counters since the pool started (`pool/...`), and the validity rate: the fraction of the
    latest batch's episodes (rows of the last `reset`) that met no environment error."""
    c = self.counts
    return {"pool/calls": c["calls"], "pool/failures": c["failures"], "pool/retries": c["retries"],
            "pool/timeouts": c["timeouts"], "pool/crashes": c["crashes"],
            "pool/rate_limited": c["rate_limited"], "pool/rate_wait_s": c["rate_wait_s"],
            "pool/breaker_openings": self.breaker.openings,
            "pool/breaker_rejected": c["breaker_rejected"], "pool/env_errors": c["env_errors"],
            "pool/validity_rate": (1.0 - sum(row.failed for row in self.rows) / len(self.rows)
                                   if self.rows else 1.0)}

  def close(self) -> None:
    if self.backend is not None:
      self.backend.close()
      self.backend = None
    if self.driver is not None:
      self.driver.shutdown(wait=False, cancel_futures=True)
      self.driver = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ------------------------------------------------------------------------------- internals
  def _ensure(self, rows: int) -> None:
    if self.backend is not None and len(self._backend_rows) == rows:
      return
    self.close()
    cls = _BACKEND_CLASSES.get(self.backend_name)
    if cls is None:  # a plug-in backend named by import path (the optional Ray one)
      module, _, name = _PLUGIN_BACKENDS[self.backend_name].partition(":")
      cls = getattr(importlib.import_module(module), name)
    self.backend = cls(self.factory, rows, self.workers, self.timeout_s)
    self._backend_rows = range(rows)
    if self.backend_name != "serial":
      self.driver = concurrent.futures.ThreadPoolExecutor(max(rows, 1),
                                                          thread_name_prefix="envpool-row")

  def _map(self, calls: dict, oracle: bool = False) -> dict:
    if self.backend_name == "serial" or len(calls) <= 1:
      return {r: self._attempts(r, *call, oracle=oracle) for r, call in calls.items()}
    futures = {r: self.driver.submit(self._attempts, r, *call, oracle=oracle)
               for r, call in calls.items()}
    return {r: f.result() for r, f in futures.items()}

  def _count(self, **kw):
    with self.lock:
      self.counts.update(kw)

  def _attempts(self, r: int, method: str, args: tuple, oracle: bool = False):
    """One row's call with retries (see the module docstring); never raises. A step's wall time,
    retries and waits included, goes to `latency[r]`."""
    start = time.perf_counter()
    try:
      return self._attempts_inner(r, method, args, oracle)
    finally:
      if method == "step":
        self.latency[r] = time.perf_counter() - start

  def _attempts_inner(self, r: int, method: str, args: tuple, oracle: bool):
    row, problem = self.rows[r], ""
    for attempt in range(self.retries + 1):
      if attempt:
        self._count(retries=1)
      if not self.breaker.allow():
        self._count(breaker_rejected=1)
        problem = "circuit breaker open: the environment failed repeatedly"
        break
      self._wait_rate(method, args)
      self._count(calls=1)
      try:
        value = self._call(r, method, args)
      except RateLimited as e:
        self._count(rate_limited=1, failures=1)
        self.breaker.record(False)
        problem = f"rate limited ({e})"
        time.sleep(e.retry_after_s)
        continue
      except Exception as e:  # the environment's failure, never the policy's
        self._count(failures=1, timeouts=int(isinstance(e, CallTimeout)),
                    crashes=int(isinstance(e, WorkerCrashed)))
        self.breaker.record(False)
        problem = f"{type(e).__name__}: {e}"
        if (isinstance(e, (CallTimeout, WorkerCrashed)) or method == "reset"
            or (method == "step" and not self._snapshots())):
          self._mark_lost(r)  # its state is unknown: rebuilt by replay before the retry
        continue
      if isinstance(value, StepResult) and value.env_error:
        self._count(failures=1)
        self.breaker.record(False)
        problem = value.observation or "the environment reported an error"
        if method == "step" and not self._snapshots():
          self._mark_lost(r)  # the failed attempt may have changed its state
        continue
      self.breaker.record(True)
      if not oracle:
        self._count(rows_answered=1)
      return value
    if oracle:
      return None
    self._count(rows_answered=1, env_errors=1)
    row.failed = True
    return StepResult(observation=f"environment error: {problem}", terminated=True,
                      env_error=True, info={"pool_error": problem})

  def _call(self, r: int, method: str, args: tuple):
    """One attempt: rebuilds the row's instance first where it is lost."""
    row = self.rows[r]
    for _ in range(3):
      if method not in _STARTS and self.backend.lost(r):
        replay = list(itertools.zip_longest(row.history, row.answers[:len(row.history)]))
        self.backend.rebuild(r, row.task, row.seed, replay, self.timeout_s)
      try:
        return self.backend.call(r, method, args, self.timeout_s)
      except _Lost:
        continue  # another row's crash took its worker before this call was made
    raise WorkerCrashed(f"row {r} lost its instance repeatedly")

  def _mark_lost(self, r: int):
    self.backend.lose(r)

  def _snapshots(self) -> bool:
    """Whether the environment has `snapshot` / `restore` (a failed step is undone in place)."""
    if self._can_snapshot is None:
      cls = getattr(self.factory, "cls", None)
      if isinstance(cls, type) and issubclass(cls, HostEnvironment):
        self._can_snapshot = cls.snapshot is not HostEnvironment.snapshot
      else:
        self._can_snapshot = self._probe_env().can_snapshot
    return self._can_snapshot

  def _probe_env(self) -> HostEnvironment:
    if self._probe is None:
      self._probe = self.factory()
    return self._probe

  def _wait_rate(self, method: str, args: tuple):
    if method not in ("step", "reset"):
      return
    waited = 0.0
    if self.bucket is not None:
      waited += self.bucket.acquire()
    if method == "step" and self.tool_buckets:
      bucket = self.tool_buckets.get(_tool_name(self._probe_env(), args[0]))
      if bucket is not None:
        waited += bucket.acquire()
    if waited:
      self._count(rate_wait_s=waited)

  def _log(self, r: int, entry: dict):
    if self.record_path:
      self.rows[r].log.append(entry)


def _as_json(value):
  if isinstance(value, (Observation, StepResult)):
    out = dataclasses.asdict(value)
    out["kind"] = type(value).__name__
    return json.loads(json.dumps(out, default=str))
  return value


# -------------------------------------------------------------------------------------- replay
def load_records(path: str) -> list[dict]:
  """The recorded episodes of a JSON-lines file written by `EnvPool(record_path=...)`; a damaged
  line raises naming the file and line."""
  out = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i}: not a recorded episode ({e}); the file is damaged.") from e
  return out


class ReplayEnvironment(HostEnvironment):
  """Serves recorded episodes (`load_records`) without the live environment: `reset(task, seed)`
  takes the episodes of that task and seed (the rollouts of a group share both), and each `step`
  keeps those whose recorded action at this step is the action and returns the recorded result;
  an action no recorded episode took there is an environment error (the replay diverged), naming
  the step."""

  name = "replay"

  def __init__(self, records: list[dict], milestone_names=(), tools=None, reward=None):
    super().__init__(reward=reward)
    self._records, self.milestone_names, self.tools = records, tuple(milestone_names), tools
    self._candidates, self._i = [], 0

  def params(self) -> dict:
    return {}

  def _constructor_params(self) -> dict:
    """What `factory_of` passes to build copies (the pool's instances, its worker processes)."""
    return {"records": self._records, "milestone_names": self.milestone_names,
            "tools": self.tools}

  def tasks(self, split, num, seed):
    return [r["task"] for r in self._records[:num]]

  def reset(self, task, seed):
    found = [r["calls"] for r in self._records if r["task"] == task and r["seed"] == seed]
    started = [calls for calls in found if calls and calls[0].get("observation", {}).get("kind")
               == "Observation"]
    if not started:
      raise KeyError(f"no recorded episode of task {task} with seed {seed}" +
                     (" that started" if found else "") + ".")
    first = started[0][0]["observation"]
    self._candidates, self._i = [calls[1:] for calls in started], 0
    return Observation(first["text"], first.get("info", {}))

  def step(self, action):
    left = [calls for calls in self._candidates if self._i < len(calls)]
    if not left:
      return StepResult("replay: no more recorded steps", terminated=True, env_error=True)
    same = [calls for calls in left if calls[self._i]["action"] == action]
    if not same:
      return StepResult(f"replay diverged at step {self._i}: recorded "
                        f"{sorted({c[self._i]['action'] for c in left})!r}, got {action!r}",
                        terminated=True, env_error=True)
    result = dict(same[0][self._i]["result"])
    self._candidates, self._i = same, self._i + 1
    result.pop("kind", None)
    result["milestones"] = tuple(result.get("milestones", ()))
    return StepResult(**result)


# ------------------------------------------------------------------------- pools of environments
_POOLS_LOCK = threading.Lock()


def configure_pool(env: HostEnvironment, **options) -> HostEnvironment:
  """Sets the `EnvPool` options (its keyword arguments) the rollout loop uses for `env`; returns
  `env`. Without it the defaults apply, with the environment's `default_backend`."""
  env._pool_options = dict(options)
  return env


def pool_for(env: HostEnvironment) -> EnvPool:
  """The pool that steps copies of `env` for the calling thread (one per thread: the async
  pipeline's actors collect concurrently), created on first use and kept across batches."""
  with _POOLS_LOCK:
    pools = env.__dict__.setdefault("_pools", {})
    key = threading.get_ident()
    if key not in pools:
      options = dict(getattr(env, "_pool_options", {}))
      options["backend"] = options.get("backend") or env.default_backend
      pools[key] = EnvPool(factory_of(env), **options)
    return pools[key]


def close_pools(env: HostEnvironment) -> None:
  """Closes every pool of `env` (workers, threads, instances)."""
  with _POOLS_LOCK:
    for pool in env.__dict__.pop("_pools", {}).values():
      pool.close()
