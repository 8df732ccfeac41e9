"""Rollouts split over the processes of a multi-host JAX run and gathered back into one batch.

With `P = jax.process_count()` processes, `collect_across_processes` gives process `p` the tasks
`[p*N/P, (p+1)*N/P)` of the `N` it is called with, and their environment keys. It collects them
with `row_offset` and `group_offset` set so that every row samples with the key it has in the
whole batch (`fold_in(key(sampling_seed), row)`) and carries the whole batch's group label, then
gathers the rows of all processes (one collective, process 0's rows first). Every process therefore returns the
`[N*G]` batch one process would have collected with the same seeds; with `P = 1` it is `collect`.

Every process gets the whole batch, so the learner runs the same update on the same data everywhere
(parameters replicated across hosts, possibly sharded over each host's own devices). That keeps the
multi-host run equal to the single-process one; at pod scale the batch would instead stay
data-sharded (`jax.make_array_from_process_local_data` over a mesh whose data axis spans the hosts).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np

from longhorizon.rollout.collect import RolloutStats, collect

__all__ = ["process_share", "allgather_rows", "collect_across_processes"]

# RolloutStats fields merged across processes: wall times by their maximum (the slowest process
# sets the pace), counts by their sum (turns, the number of decode rounds, by the maximum).
_MAX_FIELDS = ("generation_s", "env_s", "host_s", "turns")
_SUM_FIELDS = ("sampled_tokens", "env_steps", "episodes", "unknown_words")


def process_share(n: int, what: str = "tasks") -> tuple[int, int]:
  """`[lo, hi)`: this process's equal share of `n` items (all of them with one process).

  Raises:
    ValueError if `n` is not a multiple of the number of processes.
  """
  count = jax.process_count()
  if n % count:
    raise ValueError(f"{n} {what} cannot be split evenly over {count} JAX processes; use a "
                     f"multiple of {count} (e.g. {-(-n // count) * count}).")
  share = n // count
  return jax.process_index() * share, (jax.process_index() + 1) * share


def allgather_rows(tree: Any) -> Any:
  """`tree` with every leaf's rows (leading axis) concatenated over the processes, in order.

  Leaves are arrays (NumPy or JAX) with at least one axis, of the same shapes and dtypes on every
  process. They travel packed in one byte buffer: one collective for the whole tree. Returns NumPy
  leaves; with one process, the leaves as NumPy arrays.
  """
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [np.asarray(x) for x in leaves]
  for x in leaves:
    if x.ndim == 0:
      raise ValueError(f"allgather_rows gathers rows; got a scalar leaf ({x.dtype}). Give it a "
                       f"leading axis of size 1.")
  leaves = [np.ascontiguousarray(x) for x in leaves]
  count = jax.process_count()
  if count == 1:
    return jax.tree.unflatten(treedef, leaves)
  packed = np.concatenate([x.reshape(-1).view(np.uint8) for x in leaves] or
                          [np.zeros((0,), np.uint8)])
  gathered = np.asarray(multihost_utils.process_allgather(packed))  # [P, bytes]
  out, offset = [], 0
  for x in leaves:
    parts = [gathered[p, offset:offset + x.nbytes].copy().view(x.dtype).reshape(x.shape)
             for p in range(count)]
    out.append(np.concatenate(parts, axis=0))
    offset += x.nbytes
  return jax.tree.unflatten(treedef, out)


def collect_across_processes(params, model_config, env, codec, tasks: Any, env_keys: jax.Array,
                             config, *, sampling_seed: int, group_offset: int = 0, scripted=None,
                             **kwargs):
  """`collect` of `[N]` tasks x `G` rollouts, each process running its share (see module doc).

  Same arguments and result as `collect` (`(EpisodeBatch [N*G], RolloutStats)`, the same on every
  process). `RolloutStats` holds the maximum wall times and the summed counts of the processes,
  and the gathered per-episode `episode_info`. A `scripted` source (e.g. `oracle_turns`) draws
  its noise for the whole batch at once, so its rows are not slice-stable: it runs whole on every
  process.

  Raises:
    ValueError if `N` is not a multiple of the number of processes.
  """
  if jax.process_count() == 1 or scripted is not None:
    return collect(params, model_config, env, codec, tasks, env_keys, config,
                   sampling_seed=sampling_seed, group_offset=group_offset, scripted=scripted,
                   **kwargs)
  if config.context_mode != "full":
    raise ValueError(f"context_mode={config.context_mode!r} collects in a single process: the "
                     f"context segments are not gathered across processes.")
  n = len(tasks) if isinstance(tasks, (list, tuple)) else jax.tree.leaves(tasks)[0].shape[0]
  lo, hi = process_share(n)
  local_tasks = (tasks[lo:hi] if isinstance(tasks, (list, tuple))
                 else jax.tree.map(lambda a: a[lo:hi], tasks))
  batch, stats = collect(params, model_config, env, codec, local_tasks, env_keys[lo:hi], config,
                         sampling_seed=sampling_seed, group_offset=group_offset + lo,
                         row_offset=lo * config.group_size, **kwargs)
  fields = _MAX_FIELDS + _SUM_FIELDS
  scalars = np.array([[getattr(stats, f) for f in fields]], np.float64)
  batch, info, scalars = allgather_rows((batch, stats.episode_info, scalars))
  # A branch's parent is a row index of its process's share: make it one of the whole batch.
  share = (hi - lo) * config.group_size
  first_row = np.arange(batch.parent.shape[0]) // share * share
  batch = batch.replace(parent=np.where(batch.parent >= 0, batch.parent + first_row,
                                        batch.parent).astype(np.int32))
  merged = {f: scalars[:, i].max() if f in _MAX_FIELDS else scalars[:, i].sum()
            for i, f in enumerate(fields)}
  merged = {f: int(v) if isinstance(getattr(stats, f), int) else float(v)
            for f, v in merged.items()}
  return batch, RolloutStats(**merged, episode_info=info)
