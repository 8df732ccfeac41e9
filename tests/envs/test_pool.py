"""`EnvPool` (envs/pool.py) under injected faults, through `rollout.collect`, and its record / replay,
rate limits, circuit breaker and concurrency.

The environments are in `host_fixtures.py` (importable, so the process backend's workers can
unpickle them). Faults fire once per `(task, seed, step)` (marker files in `tmp_path`), so a run
with faults is compared row by row with a fault-free run of the same scripted policy: a recovered
row has the same tokens and rewards; a row whose fault persists past the retry budget is
`ENV_ERROR`, with row weight 0 and no effect on the other rows' advantages.
"""

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_fixtures as hf  # noqa: E402  (the process backend's workers import it by this name)

from longhorizon import rollout  # noqa: E402
from longhorizon.core import losses  # noqa: E402
from longhorizon.core.episode import Termination  # noqa: E402
from longhorizon.envs.pool import (EnvPool, ReplayEnvironment, close_pools,  # noqa: E402
                                   configure_pool, load_records)
from longhorizon.models import init_params, tiny_config  # noqa: E402
from longhorizon.train.algorithms import AlgorithmOptions, compute_advantages  # noqa: E402

REWARD = dict(success=1.0, milestone=0.5)  # + the environment's own 0.1 per `up`


def _mixed_turns(codec, group_size: int, crash_rows=()):
  """A scripted source with different scores within a group: the oracle (`up`), except that row
  `r % G == 1` stays at turn 0, row `r % G == 2` at turns 0 and 1 (times out half way), and the
  rows in `crash_rows` say `crash` at turn 1 (a persistent environment error)."""
  calls = [0]

  def turns(states):
    t, calls[0] = calls[0], calls[0] + 1
    texts = states.pool.oracle(np.nonzero(states.active)[0])
    out = []
    for r, active in enumerate(states.active):
      text = texts.get(r) if active else None
      if text and r in crash_rows and t == 1:
        text = "crash"
      elif text and ((r % group_size == 1 and t == 0) or (r % group_size == 2 and t < 2)):
        text = "stay"
      out.append(codec.encode_action(text) if text else [])
    return out

  return turns


def _collect(env, n: int, g: int, crash_rows=()):
  """`n` tasks x `g` rollouts of `_mixed_turns`; closes the env's pools after."""
  codec = env.codec()
  config = rollout.RolloutConfig(group_size=g, context_length=96, max_steps=4, turn_tokens=4)
  try:
    return rollout.collect(None, None, env, codec, env.tasks("train", n, 0),
                           jax.random.split(jax.random.key(0), n), config, sampling_seed=0,
                           scripted=_mixed_turns(codec, g, set(crash_rows)))
  finally:
    close_pools(env)


def _check_rows(batch, clean, n: int, g: int, errors: set):
  """No row lost or duplicated; rows outside `errors` equal the fault-free run's, rows inside are
  ENV_ERROR."""
  assert batch.batch_size == clean.batch_size == n * g
  np.testing.assert_array_equal(batch.group, np.repeat(np.arange(n), g))
  np.testing.assert_array_equal(batch.env_seed, clean.env_seed)
  assert len(set(np.asarray(batch.env_seed).tolist())) == n  # one environment seed per group
  err = np.asarray(batch.env_error).any(-1)
  assert set(np.nonzero(err)[0].tolist()) == errors
  assert (np.asarray(batch.termination)[err] == Termination.ENV_ERROR).all()
  assert not (np.asarray(batch.termination)[~err] == Termination.ENV_ERROR).any()
  ok = np.asarray(~err & ~np.asarray(clean.env_error).any(-1))
  for field in ("tokens", "loss_mask", "rewards", "score", "success", "termination", "num_steps",
                "milestones"):
    np.testing.assert_array_equal(np.asarray(getattr(batch, field))[ok],
                                  np.asarray(getattr(clean, field))[ok], err_msg=field)
  return err


def _check_masking(batch, err):
  """Env-error rows: row weight 0, no gradient, and the other rows' GRPO advantages are those of
  the batch without them (they are not in any group baseline)."""
  options = AlgorithmOptions(name="grpo")
  out = compute_advantages(batch, None, options)
  weight = np.asarray(out.row_weight)
  assert (weight[err] == 0).all() and (weight[~err] == 1).all()
  assert (np.asarray(out.advantages)[err] == 0).all()
  keep = np.nonzero(~err)[0]
  without = compute_advantages(jax.tree.map(lambda x: np.asarray(x)[keep], batch), None, options)
  np.testing.assert_allclose(np.asarray(out.advantages)[keep], np.asarray(without.advantages),
                             atol=1e-6)
  assert np.abs(np.asarray(without.advantages)).max() > 0.1  # scores differ within the groups
  # No gradient: the update weights the loss mask by row_weight (train/update.py), so the policy
  # loss does not depend on an env-error row's log-probs.
  mask = jnp.asarray(batch.loss_mask, jnp.float32) * out.row_weight[:, None]
  logp = jnp.full(batch.tokens.shape, -1.0)
  grad = jax.grad(lambda lp: losses.policy_loss(lp, jax.lax.stop_gradient(lp), out.advantages,
                                                mask)[0])(logp)
  assert (np.asarray(grad)[err] == 0).all() and np.abs(np.asarray(grad)[~err]).max() > 0


@pytest.fixture(scope="module")
def clean_runs():
  """Fault-free runs of the mixed policy: `{(n, g, crash rows): (batch, stats)}`."""
  cache = {}

  def run(n, g, crash_rows=()):
    key = (n, g, tuple(sorted(crash_rows)))
    if key not in cache:
      cache[key] = _collect(hf.FaultyCounter(**REWARD), n, g, crash_rows)
    return cache[key]

  return run


def test_thread_faults_retried_masked_and_counted(tmp_path, clean_runs):
  n, g = 4, 4
  # Once-faults of every kind on tasks 1-2 (a seeded schedule), a failing reset, and task 3's
  # second step failing on every attempt; row 3 (task 0) makes the environment crash itself.
  schedule = hf.fault_schedule(seed=1, num_tasks=2, length=3, count=len(hf.ONCE_KINDS),
                               first_task=1) + ((1, -1, "raise"), (3, 1, "persist"))
  assert sorted(k for _, _, k in schedule[:5]) == sorted(hf.ONCE_KINDS)
  env = configure_pool(hf.FaultyCounter(faults=schedule, marker_dir=str(tmp_path), hang_s=1.0,
                                        **REWARD), backend="thread", timeout_s=0.3, retries=2)
  start = time.perf_counter()
  batch, stats = _collect(env, n, g, crash_rows={3})
  assert time.perf_counter() - start < 10
  clean, clean_stats = clean_runs(n, g, crash_rows={3})
  err = _check_rows(batch, clean, n, g, errors={3, 12, 13, 14, 15})
  metrics = stats.as_dict()
  assert clean_stats.as_dict()["pool/retries"] == 2 and clean_stats.as_dict()["pool/failures"] == 3
  assert metrics["pool/retries"] == 2 + 5 + 1 + 4 * 2  # crash row, once-faults, reset, persist
  assert metrics["pool/failures"] == 3 + 5 + 1 + 4 * 3
  assert metrics["pool/timeouts"] == 1 and metrics["pool/rate_limited"] == 1
  assert metrics["pool/crashes"] == 0 and metrics["pool/env_errors"] == 5
  assert metrics["pool/validity_rate"] == pytest.approx(1 - err.mean())
  assert len(os.listdir(tmp_path)) == 6  # every once-fault fired, exactly once
  _check_masking(batch, err)


def test_no_snapshot_retry_rebuilds_by_replay(tmp_path, clean_runs):
  """Without snapshot/restore a failed attempt's changes (`mutate`, and the step count every
  attempt adds) must not leak into the retry: the row is rebuilt by replay."""
  n, g = 2, 3
  schedule = ((0, 1, "mutate"), (1, 2, "raise"), (1, 0, "error"))
  env = configure_pool(hf.Counter(faults=schedule, marker_dir=str(tmp_path), **REWARD),
                       backend="thread", retries=1)
  batch, stats = _collect(env, n, g)
  clean, _ = clean_runs(n, g)
  err = _check_rows(batch, clean, n, g, errors=set())
  assert not err.any() and stats.as_dict()["pool/retries"] == 3
  assert stats.as_dict()["pool/validity_rate"] == 1.0


def test_a_replay_that_answers_otherwise_is_an_environment_error(tmp_path):
  """The same faults as above on an environment whose answers are not a function of (task, seed,
  actions): the rows that lose their instance cannot be rebuilt (the replayed step answers
  otherwise) and end as environment errors, masked, instead of going on from another state; the
  other rows are untouched."""
  n, g = 2, 3
  env = configure_pool(hf.Drifting(faults=((0, 1, "raise"),), marker_dir=str(tmp_path), **REWARD),
                       backend="thread", retries=1)
  batch, stats = _collect(env, n, g)
  err = np.asarray(batch.env_error).any(-1)
  # The group's rows share the task's seed, so the fault fires once, in whichever of task 0's rows
  # makes its second call first; that row loses its instance. Task 1's rows never fault.
  assert err[:g].sum() == 1 and not err[g:].any()
  assert stats.as_dict()["pool/validity_rate"] == pytest.approx(5 / 6)
  assert stats.as_dict()["pool/retries"] == 1  # the failed call, then its failed rebuild
  _check_masking(batch, err)


def test_process_backend_worker_crash_and_hang(tmp_path, clean_runs):
  n, g = 2, 2
  schedule = ((0, 1, "exit"), (1, 0, "hang"), (1, 2, "mutate"))
  env = configure_pool(hf.FaultyCounter(faults=schedule, marker_dir=str(tmp_path), hang_s=30.0,
                                        **REWARD), backend="process", workers=2, timeout_s=0.5,
                       retries=1)
  start = time.perf_counter()
  batch, stats = _collect(env, n, g)
  assert time.perf_counter() - start < 60  # mostly worker start-up (imports), twice
  clean, _ = clean_runs(n, g)
  err = _check_rows(batch, clean, n, g, errors=set())
  metrics = stats.as_dict()
  assert metrics["pool/crashes"] == 1 and metrics["pool/timeouts"] == 1
  assert metrics["pool/retries"] == 3 and metrics["pool/failures"] == 3
  assert metrics["pool/env_errors"] == 0 and metrics["pool/validity_rate"] == 1.0
  assert not err.any()


@pytest.mark.slow
def test_process_backend_past_budget_is_env_error(tmp_path, clean_runs):
  n, g = 2, 2
  env = configure_pool(hf.FaultyCounter(faults=((1, 1, "persist"),), marker_dir=str(tmp_path),
                                        **REWARD), backend="process", workers=2, retries=1)
  batch, stats = _collect(env, n, g)
  clean, _ = clean_runs(n, g)
  err = _check_rows(batch, clean, n, g, errors={2, 3})
  assert stats.as_dict()["pool/validity_rate"] == pytest.approx(0.5)
  assert stats.as_dict()["pool/retries"] == 2 and stats.as_dict()["pool/env_errors"] == 2
  del err


def test_thread_backend_turn_takes_max_latency_not_sum():
  b, latency = 16, 0.1
  with EnvPool(lambda: hf.Slow(latency), backend="thread", timeout_s=5) as pool:
    pool.reset([{"id": i} for i in range(b)], list(range(b)))
    start = time.perf_counter()
    out = pool.step({r: "go" for r in range(b)})
    elapsed = time.perf_counter() - start
  assert sorted(out) == list(range(b)) and all(o.success for o in out.values())
  assert latency <= elapsed < 0.6, elapsed  # serial would take b x latency = 1.6 s


def test_serial_backend_is_one_call_after_another():
  b, latency = 4, 0.05
  with EnvPool(lambda: hf.Slow(latency), backend="serial") as pool:
    pool.reset([{"id": i} for i in range(b)], list(range(b)))
    start = time.perf_counter()
    pool.step({r: "go" for r in range(b)})
    assert time.perf_counter() - start >= b * latency


def test_thread_backend_timeouts_do_not_starve_later_calls(tmp_path):
  """A timed-out call's thread still runs (sleeping); it must not hold a slot the next calls need,
  or they wait behind it and time out too."""
  b = 4
  schedule = tuple((t, 0, "hang") for t in range(b))
  factory = lambda: hf.FaultyCounter(faults=schedule, marker_dir=str(tmp_path), hang_s=2.0,
                                     latency_s=0.25)
  with EnvPool(factory, backend="thread", timeout_s=0.4, retries=1) as pool:
    pool.reset([{"id": i, "length": 3} for i in range(b)], list(range(b)))
    out = pool.step({r: "up" for r in range(b)})
    assert not any(o.env_error for o in out.values()), out
    assert pool.stats()["pool/timeouts"] == b


def test_rate_limit_token_bucket():
  n, rate, burst = 12, 40.0, 2
  with EnvPool(lambda: hf.Slow(0.0), backend="thread", rate_limit=rate, burst=burst) as pool:
    start = time.perf_counter()
    pool.reset([{"id": i} for i in range(n)], list(range(n)))
    elapsed = time.perf_counter() - start
    assert elapsed >= (n - burst) / rate * 0.95, elapsed
    assert pool.stats()["pool/rate_wait_s"] > 0


def test_rate_limited_error_waits_and_retries(tmp_path):
  env = hf.FaultyCounter(faults=((0, 0, "rate"),), marker_dir=str(tmp_path))
  with EnvPool(lambda: hf.FaultyCounter(**env.params()), backend="serial", retries=1) as pool:
    pool.reset([{"id": 0, "length": 3}], [0])
    out = pool.step({0: "up"})
    assert out[0].observation == "pos 1 step 1" and not out[0].env_error
    stats = pool.stats()
    assert stats["pool/rate_limited"] == 1 and stats["pool/retries"] == 1


def test_circuit_breaker_opens_fails_fast_then_half_opens_and_closes(tmp_path):
  down = tmp_path / "down"
  down.touch()
  b, k, cooldown = 6, 3, 0.3
  with EnvPool(lambda: hf.Slow(0.0, down_file=str(down)), backend="serial", retries=0,
               breaker_failures=k, breaker_cooldown_s=cooldown) as pool:
    pool.reset([{"id": i} for i in range(b)], list(range(b)))
    start = time.perf_counter()
    out = pool.step({r: "go" for r in range(b)})
    assert all(o.env_error for o in out.values())
    assert time.perf_counter() - start < 0.2  # the rejected calls were not made
    stats = pool.stats()
    assert stats["pool/breaker_openings"] == 1 and pool.breaker.is_open
    assert stats["pool/failures"] == k and stats["pool/breaker_rejected"] == b - k
    assert "circuit breaker open" in out[b - 1].observation
    # Still open before the cooldown: a new batch fails fast at reset.
    first = pool.reset([{"id": 0}], [0])
    assert first[0].env_error and pool.stats()["pool/breaker_rejected"] == b - k + 1
    # The service comes back; after the cooldown one trial call goes through and closes it.
    down.unlink()
    time.sleep(cooldown + 0.05)
    pool.reset([{"id": i} for i in range(b)], list(range(b)))
    assert not pool.breaker.is_open
    out = pool.step({r: "go" for r in range(b)})
    assert not any(o.env_error for o in out.values())
    assert pool.stats()["pool/breaker_openings"] == 1


def test_record_then_replay_without_the_environment(tmp_path):
  n, g = 2, 2
  path = str(tmp_path / "calls.jsonl")
  env = configure_pool(hf.Counter(**REWARD), backend="thread", record_path=path)
  codec = env.codec()
  config = dataclasses.replace(tiny_config(), vocab_size=len(codec.tokenizer))
  params = init_params(config, jax.random.key(0))
  rc = rollout.RolloutConfig(group_size=g, context_length=96, max_steps=4, turn_tokens=3)
  tasks, keys = env.tasks("train", n, 0), jax.random.split(jax.random.key(0), n)
  try:
    live, _ = rollout.collect(params, config, env, codec, tasks, keys, rc, sampling_seed=5)
  finally:
    close_pools(env)
  records = load_records(path)
  assert len(records) == n * g
  replay = ReplayEnvironment(records, milestone_names=env.milestone_names,
                             reward=env.reward_spec)
  try:
    again, stats = rollout.collect(params, config, replay, codec, tasks, keys, rc, sampling_seed=5)
  finally:
    close_pools(replay)
  assert stats.as_dict()["pool/env_errors"] == 0
  for field in ("tokens", "loss_mask", "rewards", "score", "success", "termination", "num_steps",
                "milestones", "group", "env_seed"):
    np.testing.assert_array_equal(np.asarray(getattr(again, field)),
                                  np.asarray(getattr(live, field)), err_msg=field)
  # The rows of a group acted differently (the model sampled), so each replays its own record.
  assert any((np.asarray(live.tokens)[2 * i] != np.asarray(live.tokens)[2 * i + 1]).any()
             for i in range(n))
  with open(path, "a") as f:
    f.write('{"task": {"id": 0}, "seed": 0, "calls": [\n')
  with pytest.raises(ValueError, match=f"{path}:{n * g + 1}"):
    load_records(path)
