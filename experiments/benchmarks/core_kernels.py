r"""Times every public kernel of `longhorizon.core` and checks the DESIGN.md advantage-kernel bars.

  python experiments/benchmarks/core_kernels.py --config=configs/kernels_benchmark.py --out=results/kernels.json
  python experiments/benchmarks/core_kernels.py --config=configs/kernels_benchmark.py:smoke

Token-level kernels run at `[B, T]` (default 1024 x 512) on multi-turn masks (a prompt span, then
alternating action and observation spans, padding; different per row); grpo/rloo on `N = B` scores in
groups of 8; GiGPO at 256 groups x 8 rollouts x 20 steps. Inputs are device arrays before timing (no
host->device copy is timed); each kernel is run once to compile, then timed `repeats` times, each run
ending in `jax.block_until_ready`; the median is reported.

Baselines in the same run, each checked against the JAX kernel (allclose, atol 1e-4) before it is
timed so a wrong baseline cannot inflate the ratio:
  * GAE (target row): verl's multi-turn GAE loop (`compute_gae_advantage_return`) ported from torch to
    NumPy: a reverse loop over time vectorised over rows, batch-major column slices, mask blending.
  * GAE (informational row): a hand-tuned NumPy loop on contiguous time-major copies with in-place
    updates (no per-step allocation), faster than the verl-style loop.
  * GiGPO (target row): the reference implementation's structure (verl-agent `gigpo/core_gigpo.py`):
    flat step rows, per-row Python loops, `np.where` per group and per trajectory, dict clustering of
    anchors with uuid4 ids; our conventions so the outputs can be compared.
  * GiGPO (informational row): a leaner pure-Python version with dicts keyed by group and by
    (group, anchor) and per-trajectory loops over lists, faster than the reference's structure.
Prints one table; `--out` writes the same rows as JSON.
"""

from __future__ import annotations

import collections
import math
import pathlib
import statistics
import time
import uuid

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np

import results_io
from longhorizon.core import advantages as adv_lib
from longhorizon.core import logprobs as logprobs_lib
from longhorizon.core import losses as losses_lib

_ROOT = pathlib.Path(__file__).resolve().parents[2]

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(_ROOT / "configs" / "kernels_benchmark.py"), "Benchmark config file.",
    lock_config=True)
_OUT = flags.DEFINE_string("out", None, "Optional JSON path for the result rows (parents created).")

# DESIGN.md "Performance bars": minimum speedup over the baseline.
_TARGETS = {"gae": 5.0, "gigpo": 20.0}


# ----------------------------------------------------------------------------------------------------
# Synthetic inputs.


def _multiturn_layout(rng, batch, length, masks):
  """`loss_mask[B, T]` and `turn[B, T]` of rows laid out as prompt, (action, observation)*, padding.

  Every span length is drawn per row and span; a row stops at a length drawn in `[min_fill*T, T]` or
  after `max_steps` actions. Observation tokens carry the step index of the action they answer.
  """
  loss_mask = np.zeros((batch, length), np.int32)
  turn = np.full((batch, length), -1, np.int32)
  for b in range(batch):
    end = int(rng.integers(int(masks.min_fill * length), length + 1))
    pos = int(rng.integers(masks.prompt_span[0], masks.prompt_span[1] + 1))
    for step in range(masks.max_steps):
      action = int(rng.integers(masks.action_span[0], masks.action_span[1] + 1))
      if pos + action > end:
        if step > 0:
          break
        action = max(1, end - pos)  # every row keeps at least one policy token
      loss_mask[b, pos:pos + action] = 1
      turn[b, pos:pos + action] = step
      pos += action
      obs = int(rng.integers(masks.obs_span[0], masks.obs_span[1] + 1))
      if step == masks.max_steps - 1 or pos + obs > end:
        break
      turn[b, pos:pos + obs] = step
      pos += obs
  return loss_mask, turn


def _token_inputs(config, rng):
  batch, length, vocab, hidden = config.batch, config.length, config.vocab, config.hidden
  loss_mask, turn = _multiturn_layout(rng, batch, length, config.masks)
  num_steps = config.masks.max_steps
  f32 = np.float32
  logp = -np.abs(rng.normal(size=(batch, length))).astype(f32)
  group_labels = rng.permutation(batch // config.group_size) * 7919 + 13  # arbitrary integer labels
  inputs = {
      "logits": (2.0 * rng.normal(size=(batch, length, vocab))).astype(f32),
      "targets": rng.integers(0, vocab, size=(batch, length)).astype(np.int32),
      "hidden": rng.normal(size=(batch, length, hidden)).astype(f32),
      "unembed": (rng.normal(size=(hidden, vocab)) / math.sqrt(hidden)).astype(f32),
      "rewards": rng.normal(size=(batch, length)).astype(f32),
      "values": rng.normal(size=(batch, length)).astype(f32),
      "old_values": rng.normal(size=(batch, length)).astype(f32),
      "loss_mask": loss_mask,
      "turn": turn,
      "step_values": rng.normal(size=(batch, num_steps)).astype(f32),
      "step_rewards": rng.normal(size=(batch, num_steps)).astype(f32),
      "scores": rng.integers(0, 2, size=batch).astype(f32),
      "groups": rng.permutation(np.repeat(group_labels, config.group_size)).astype(np.int32),
      "logp": logp,
      "old_logp": (logp + 0.1 * rng.normal(size=logp.shape)).astype(f32),
      "ref_logp": (logp + 0.3 * rng.normal(size=logp.shape)).astype(f32),
      "rollout_logp": (logp + 0.05 * rng.normal(size=logp.shape)).astype(f32),
      "token_adv": rng.normal(size=(batch, length)).astype(f32),
      "seq_adv": rng.normal(size=batch).astype(f32),
  }
  return inputs


def _gigpo_inputs(cfg, rng):
  """256 groups x 8 rollouts x 20 steps: variable trajectory lengths, repeated anchors, shuffled rows."""
  num = cfg.groups * cfg.rollouts
  steps = cfg.steps
  lengths = rng.integers(cfg.min_steps, steps + 1, size=num)
  step_mask = (np.arange(steps)[None, :] < lengths[:, None]).astype(np.int32)
  group_index = np.repeat(np.arange(cfg.groups), cfg.rollouts)
  labels = (rng.permutation(cfg.groups) * 104729 + 7).astype(np.int32)  # arbitrary integer labels
  # Anchor hashes: each group has `anchors_per_group` states; every rollout starts in the first one.
  table = rng.integers(0, 2**32, size=(cfg.groups, cfg.anchors_per_group), dtype=np.uint64)
  which = rng.integers(0, cfg.anchors_per_group, size=(num, steps))
  which[:, 0] = 0
  anchors = np.where(step_mask > 0, table[group_index[:, None], which], 0).astype(np.uint32)
  success = rng.integers(0, 2, size=num).astype(np.float32)
  # Continuous shaping on every valid step plus the outcome on the last one: step returns are spread,
  # so the std normalisation is well conditioned and float32 vs float64 agree to 1e-4.
  step_rewards = rng.uniform(-0.5, 0.5, size=(num, steps)) * step_mask
  step_rewards[np.arange(num), lengths - 1] += success
  order = rng.permutation(num)
  return {
      "episode_returns": success[order],
      "step_rewards": step_rewards.astype(np.float32)[order],
      "step_mask": step_mask[order],
      "groups": labels[group_index][order],
      "anchors": anchors[order],
  }


# ----------------------------------------------------------------------------------------------------
# Baselines.


def gae_numpy(rewards, values, mask, gamma, lam):
  """GAE as a NumPy reverse loop over time, vectorised over rows (semantics of `advantages.gae`).

  Time-major contiguous copies first, then per step a handful of in-place vector ops on `[B]` rows
  (no allocation inside the loop). Mask-0 positions leave the next value and running advantage
  unchanged; bootstrap 0 after the last valid position.
  """
  r_tb = np.ascontiguousarray(rewards.T, dtype=np.float32)
  v_tb = np.ascontiguousarray(values.T, dtype=np.float32)
  m_tb = np.ascontiguousarray(mask.T != 0)
  mf_tb = m_tb.astype(np.float32)
  num_t, num_b = r_tb.shape
  gamma, gamma_lam = np.float32(gamma), np.float32(gamma * lam)
  adv_tb = np.empty((num_t, num_b), np.float32)
  value_tp1 = np.zeros(num_b, np.float32)
  running = np.zeros(num_b, np.float32)
  delta = np.empty(num_b, np.float32)
  for t in range(num_t - 1, -1, -1):
    np.multiply(value_tp1, gamma, out=delta)
    delta += r_tb[t]
    delta -= v_tb[t]
    a_t = adv_tb[t]
    np.multiply(running, gamma_lam, out=a_t)
    a_t += delta
    np.copyto(running, a_t, where=m_tb[t])
    np.copyto(value_tp1, v_tb[t], where=m_tb[t])
    a_t *= mf_tb[t]
  returns_tb = (adv_tb + v_tb) * mf_tb
  return adv_tb.T, returns_tb.T


def gae_numpy_verl_style(rewards, values, mask, gamma, lam):
  """verl's multi-turn GAE (`compute_gae_advantage_return`) ported line by line from torch to NumPy.

  Batch-major column slices, fresh temporaries every step, a list of per-step columns stacked at the
  end; observation tokens skipped by blending with the mask. Positions with mask 0 are zeroed at the
  end (verl leaves the carried value there; only valid positions are ever used).
  """
  num_t = rewards.shape[-1]
  mask = mask.astype(np.float32)
  nextvalues = 0.0
  lastgaelam = 0.0
  advantages_reversed = []
  for t in reversed(range(num_t)):
    delta = rewards[:, t] + gamma * nextvalues - values[:, t]
    lastgaelam_ = delta + gamma * lam * lastgaelam
    nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
    lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
    advantages_reversed.append(lastgaelam)
  advantages = np.stack(advantages_reversed[::-1], axis=1)
  returns = advantages + values
  return advantages * mask, returns * mask


def gigpo_python(episode_returns, step_rewards, step_mask, groups, anchors, *, gamma, step_weight,
                 normalize_std, eps=1e-6):
  """GiGPO with Python dicts and per-trajectory loops (the verl-agent approach).

  Episode level: dict group -> trajectory returns, mean/std per group. Step level: per-trajectory
  reverse loop for discounted step returns, dict (group, anchor) -> step returns, mean/std per step
  group, then one lookup per step. Same conventions as `advantages.gigpo` (unbiased std, eps on the
  std, groups of one get 0, invalid steps 0).
  """
  num, num_steps = step_rewards.shape
  returns, rewards = episode_returns.tolist(), step_rewards.tolist()
  masks, labels, anchor_rows = step_mask.tolist(), groups.tolist(), anchors.tolist()

  def moments(xs):
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean)**2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return n, mean, std

  def normalised(x, stats):
    n, mean, std = stats
    if n < 2:
      return 0.0
    return (x - mean) / (std + eps) if normalize_std else x - mean

  group_scores = collections.defaultdict(list)
  for i in range(num):
    group_scores[labels[i]].append(returns[i])
  group_stats = {g: moments(xs) for g, xs in group_scores.items()}
  episode_adv = [normalised(returns[i], group_stats[labels[i]]) for i in range(num)]

  step_returns = []
  for i in range(num):
    row, running = [0.0] * num_steps, 0.0
    for s in range(num_steps - 1, -1, -1):
      if masks[i][s]:
        running = rewards[i][s] + gamma * running
        row[s] = running
    step_returns.append(row)

  step_groups = collections.defaultdict(list)
  for i in range(num):
    for s in range(num_steps):
      if masks[i][s]:
        step_groups[(labels[i], anchor_rows[i][s])].append(step_returns[i][s])
  step_stats = {key: moments(xs) for key, xs in step_groups.items()}

  out = np.zeros((num, num_steps), np.float32)
  for i in range(num):
    for s in range(num_steps):
      if masks[i][s]:
        a_step = normalised(step_returns[i][s], step_stats[(labels[i], anchor_rows[i][s])])
        out[i, s] = episode_adv[i] + step_weight * a_step
  return out


def gigpo_verl_agent_style(episode_returns, step_rewards, step_mask, groups, anchors, *, gamma,
                           step_weight, normalize_std, eps=1e-6):
  """GiGPO structured as the reference implementation (verl-agent `gigpo/core_gigpo.py`) computes it.

  As there, the batch is a flat list of step rows (one per valid step) carrying the task-group label
  (`index`), the trajectory id (`traj_index`) and the anchor observation; then
    * episode level: a Python loop over rows with a seen-(group, trajectory) set, a dict group -> list
      of returns, NumPy mean/std per group, and a per-row loop writing the normalised scores;
    * step groups: for each group label `np.where(index == label)`, a dict keyed by the hashable anchor
      clustering the rows, and a fresh uuid4 string per cluster;
    * discounted step returns: for each trajectory `np.where(traj_index == traj)` and a reverse loop;
    * step level: a dict uuid -> list of returns, NumPy mean/std, and a per-row normalising loop.
  Conventions are ours, not verl-agent's (a group of one gets 0 instead of its raw score), so the
  output can be checked against `advantages.gigpo`; the cost structure is the reference's.
  """
  num, num_steps = step_rewards.shape
  rows_i, rows_s = np.nonzero(step_mask)  # one row per valid step, trajectory-major
  index = groups[rows_i]
  traj_index = rows_i
  anchor_obs = anchors[rows_i, rows_s]
  row_rewards = step_rewards[rows_i, rows_s].astype(np.float64)
  bsz = len(rows_i)

  def moments(values):
    values = np.asarray(values, np.float64)
    if len(values) < 2:
      return None
    return values.mean(), values.std(ddof=1)

  def normalise(score, stats):
    if stats is None:
      return 0.0
    mean, std = stats
    return (score - mean) / (std + eps) if normalize_std else score - mean

  # Episode level (rows of one trajectory counted once).
  scores = episode_returns[rows_i].astype(np.float64)
  id2score, seen = collections.defaultdict(list), set()
  for i in range(bsz):
    if (index[i], traj_index[i]) in seen:
      continue
    id2score[index[i]].append(scores[i])
    seen.add((index[i], traj_index[i]))
  id2stats = {idx: moments(v) for idx, v in id2score.items()}
  episode_adv = np.zeros(bsz)
  for i in range(bsz):
    episode_adv[i] = normalise(scores[i], id2stats[index[i]])

  # Step groups: cluster identical anchors within each group label.
  step_group_uids = np.empty(bsz, dtype=object)
  for idx in np.unique(index):
    indices = np.where(index == idx)[0]
    clusters = collections.defaultdict(list)
    for i, obs in enumerate(anchor_obs[indices]):
      clusters[obs.item()].append(indices[i])
    for original_indices in clusters.values():
      uid = str(uuid.uuid4())
      for original_idx in original_indices:
        step_group_uids[original_idx] = uid

  # Discounted step returns per trajectory.
  step_returns = np.zeros(bsz)
  for traj in np.unique(traj_index):
    indices = np.where(traj_index == traj)[0]
    running = 0.0
    for i in indices[::-1]:
      running = row_rewards[i] + gamma * running
      step_returns[i] = running

  # Step level.
  uid2score = collections.defaultdict(list)
  for i in range(bsz):
    uid2score[step_group_uids[i]].append(step_returns[i])
  uid2stats = {uid: moments(v) for uid, v in uid2score.items()}
  step_adv = np.zeros(bsz)
  for i in range(bsz):
    step_adv[i] = normalise(step_returns[i], uid2stats[step_group_uids[i]])

  out = np.zeros((num, num_steps), np.float32)
  out[rows_i, rows_s] = episode_adv + step_weight * step_adv
  return out


# ----------------------------------------------------------------------------------------------------
# Timing.


def _time_jax(fn, repeats):
  """(median ms, compile ms, output) of `fn()`: one warm-up call (compiles), then `repeats` runs."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  compile_ms = 1e3 * (time.perf_counter() - start)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times), compile_ms, out


def _time_host(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def _shape(*dims):
  return "x".join(str(d) for d in dims)


def run_benchmark(config):
  """Measures every kernel (and the two baselines); returns the result rows."""
  rng = np.random.default_rng(config.seed)
  logging.info("Building inputs (B=%d, T=%d, V=%d, D=%d)...", config.batch, config.length,
               config.vocab, config.hidden)
  host = _token_inputs(config, rng)
  g_cfg = config.gigpo
  host_gigpo = _gigpo_inputs(g_cfg, rng)
  dev = {k: jnp.asarray(v) for k, v in host.items()}
  dev_gigpo = {k: jnp.asarray(v) for k, v in host_gigpo.items()}
  jax.block_until_ready((dev, dev_gigpo))

  b, t, v, d, s = config.batch, config.length, config.vocab, config.hidden, config.masks.max_steps
  bt = _shape(b, t)
  mask = dev["loss_mask"]
  gamma, lam = config.gamma, config.lam
  gigpo_kwargs = dict(gamma=g_cfg.gamma, step_weight=g_cfg.step_weight,
                      normalize_std=g_cfg.normalize_std)

  kernels = [
      ("token_logprobs", _shape(b, t, v),
       lambda: logprobs_lib.token_logprobs(dev["logits"], dev["targets"])),
      ("entropy", _shape(b, t, v), lambda: logprobs_lib.entropy(dev["logits"])),
      ("token_logprobs_from_hidden", f"{_shape(b, t, d)} @ {_shape(d, v)} c{config.chunk_size}",
       lambda: logprobs_lib.token_logprobs_from_hidden(dev["hidden"], dev["unembed"], dev["targets"],
                                                       chunk_size=config.chunk_size)),
      ("gae", bt, lambda: adv_lib.gae(dev["rewards"], dev["values"], mask, gamma=gamma, lam=lam)),
      ("length_adaptive_gae", bt,
       lambda: adv_lib.length_adaptive_gae(dev["rewards"], dev["values"], mask, gamma=gamma)),
      ("masked_whiten", bt, lambda: adv_lib.masked_whiten(dev["token_adv"], mask)),
      ("grpo", f"N={b} (g={config.group_size})", lambda: adv_lib.grpo(dev["scores"], dev["groups"])),
      ("rloo", f"N={b} (g={config.group_size})", lambda: adv_lib.rloo(dev["scores"], dev["groups"])),
      ("reinforce_pp", bt, lambda: adv_lib.reinforce_pp(dev["rewards"], mask, gamma=gamma)),
      ("gigpo", _shape(g_cfg.groups, g_cfg.rollouts, g_cfg.steps),
       lambda: adv_lib.gigpo(*dev_gigpo.values(), **gigpo_kwargs)),
      ("broadcast_steps", f"{_shape(b, s)} -> {bt}",
       lambda: adv_lib.broadcast_steps(dev["step_values"], dev["turn"])),
      ("place_step_rewards", f"{_shape(b, s)} -> {bt}",
       lambda: adv_lib.place_step_rewards(dev["step_rewards"], dev["turn"], mask)),
      ("policy_loss", bt,
       lambda: losses_lib.policy_loss(dev["logp"], dev["old_logp"], dev["token_adv"], mask)),
      ("gspo_loss", bt,
       lambda: losses_lib.gspo_loss(dev["logp"], dev["old_logp"], dev["seq_adv"], mask)),
      ("kl", f"{bt} k3", lambda: losses_lib.kl(dev["logp"], dev["ref_logp"], "k3")),
      ("value_loss", bt,
       lambda: losses_lib.value_loss(dev["values"], dev["old_values"], dev["rewards"], mask)),
      ("truncated_is_weights", bt,
       lambda: losses_lib.truncated_is_weights(dev["old_logp"], dev["rollout_logp"], mask)),
  ]

  # kernel -> [(label, baseline fn, output as tuple, DESIGN.md target or None)].
  baselines = {
      "gae": [("numpy loop, verl-style",
               lambda: gae_numpy_verl_style(host["rewards"], host["values"], host["loss_mask"],
                                            gamma, lam),
               lambda out: out, _TARGETS["gae"]),
              ("numpy loop, tuned",
               lambda: gae_numpy(host["rewards"], host["values"], host["loss_mask"], gamma, lam),
               lambda out: out, None)],
      "gigpo": [("verl-agent-style loops",
                 lambda: gigpo_verl_agent_style(*host_gigpo.values(), **gigpo_kwargs),
                 lambda out: (out,), _TARGETS["gigpo"]),
                ("lean python dicts",
                 lambda: gigpo_python(*host_gigpo.values(), **gigpo_kwargs),
                 lambda out: (out,), None)],
  }

  rows = []
  for name, shape, fn in kernels:
    logging.info("Measuring %s [%s]...", name, shape)
    median_ms, compile_ms, out = _time_jax(fn, config.repeats)
    row = {"kernel": name, "shape": shape, "time_ms": median_ms, "compile_ms": compile_ms,
           "baseline": None, "baseline_ms": None, "speedup": None, "target": None, "pass": None}
    for label, base_fn, as_tuple, target in baselines.get(name, []):
      logging.info("  checking baseline '%s' against the kernel...", label)
      for e, g in zip(as_tuple(out), as_tuple(base_fn())):
        np.testing.assert_allclose(g, np.asarray(e), rtol=1e-5, atol=config.check_atol,
                                   err_msg=f"{name} baseline '{label}' disagrees with the JAX kernel")
      logging.info("  timing baseline '%s' (%d runs)...", label, config.baseline_repeats)
      base_ms = _time_host(base_fn, config.baseline_repeats)
      base_row = dict(row, baseline=label, baseline_ms=base_ms, speedup=base_ms / median_ms)
      if config.targets and target is not None:
        base_row.update(target=target, **{"pass": base_ms / median_ms >= target})
      rows.append(base_row)
    if name not in baselines:
      rows.append(row)
  return rows


def run_scaling(config):
  """Times gae over batch sizes and gigpo over group counts (`config.scaling` multipliers of the main
  sizes): the cost per element should stay flat (linear) or grow like log n (sorting)."""
  rng = np.random.default_rng(config.seed + 1)
  rows = []
  for factor in config.scaling:
    batch = max(1, int(config.batch * factor))
    sized = ml_collections.ConfigDict(config.to_dict())  # an unlocked copy
    sized.batch = batch
    lengths = config.length
    loss_mask, _ = _multiturn_layout(rng, batch, lengths, config.masks)  # multi-turn layout
    rewards = jnp.asarray(rng.normal(size=(batch, lengths)).astype(np.float32))
    values = jnp.asarray(rng.normal(size=(batch, lengths)).astype(np.float32))
    mask = jnp.asarray(loss_mask)
    logging.info("Scaling: gae at B=%d...", batch)
    ms, _, _ = _time_jax(lambda: adv_lib.gae(rewards, values, mask, gamma=config.gamma,
                                             lam=config.lam), config.repeats)
    rows.append({"kernel": "gae", "size": f"B={batch}, T={lengths}", "elements": batch * lengths,
                 "time_ms": ms})
    sized.gigpo.groups = max(1, int(config.gigpo.groups * factor))
    gigpo_inputs = {k: jnp.asarray(v) for k, v in _gigpo_inputs(sized.gigpo, rng).items()}
    logging.info("Scaling: gigpo at %d groups...", sized.gigpo.groups)
    ms, _, _ = _time_jax(lambda: adv_lib.gigpo(*gigpo_inputs.values(), gamma=config.gigpo.gamma,
                                               normalize_std=config.gigpo.normalize_std),
                         config.repeats)
    steps = sized.gigpo.groups * config.gigpo.rollouts * config.gigpo.steps
    rows.append({"kernel": "gigpo", "size": f"{sized.gigpo.groups}x{config.gigpo.rollouts}x"
                 f"{config.gigpo.steps}", "elements": steps, "time_ms": ms})
  return rows


def _format_scaling(rows):
  lines = ["kernel | size | elements | time ms | ns / element",
           "-------+------+----------+---------+-------------"]
  for r in sorted(rows, key=lambda r: (r["kernel"], r["elements"])):
    lines.append(f"{r['kernel']} | {r['size']} | {r['elements']} | {r['time_ms']:.3f} | "
                 f"{1e6 * r['time_ms'] / r['elements']:.2f}")
  return "\n".join(lines)


def _format_table(rows):
  header = ["kernel", "shape", "time ms", "baseline", "baseline ms", "speedup", "target", "pass/fail"]

  def fmt(row):
    def num(x, spec):
      return "" if x is None else format(x, spec)
    verdict = "" if row["pass"] is None else ("PASS" if row["pass"] else "FAIL")
    return [row["kernel"], row["shape"], num(row["time_ms"], ".3f"), row["baseline"] or "",
            num(row["baseline_ms"], ".3f"),
            "" if row["speedup"] is None else f"{row['speedup']:.1f}x",
            "" if row["target"] is None else f">= {row['target']:.0f}x", verdict]

  body = [fmt(r) for r in rows]
  widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
  lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths)),
           "-+-".join("-" * w for w in widths)]
  lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in body]
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  devices = jax.devices()
  logging.info("jax %s, backend %s, %d device(s): %s", jax.__version__, jax.default_backend(),
               len(devices), devices)
  start = time.perf_counter()
  rows = run_benchmark(config)
  scaling = run_scaling(config) if config.scaling else []
  total_s = time.perf_counter() - start
  print(f"jax {jax.__version__} | backend {jax.default_backend()} | devices {jax.device_count()} "
        f"({devices[0].device_kind}) | repeats {config.repeats} (median) | total {total_s:.1f} s")
  print(_format_table(rows), flush=True)
  if scaling:
    print("\nScaling (cost per element should stay roughly flat):")
    print(_format_scaling(scaling), flush=True)
  if _OUT.value:
    out = results_io.write_json(_OUT.value, {"total_s": total_s, "config": config.to_dict(),
                                             "rows": rows, "scaling": scaling})
    logging.info("Wrote %s", out)


if __name__ == "__main__":
  app.run(main)
