"""A training run's working directory: its path, its single-writer lock and its config record.

    workdir = resolve("~/runs/../runs/a")          # absolute, `~` expanded (orbax needs absolute)
    with WorkdirLock(workdir):                     # a second run on the same workdir refuses
      changes = check_config(workdir, config, resuming=True)  # refuses incompatible changes
      ...                                          # restore the checkpoint of update `start`
      save_config(workdir, config, start, changes)

Lock: `<workdir>/.lock` is held with `fcntl.flock` for the life of the run and names its owner
(pid, host, start time, command). The kernel releases a flock when its process dies, kill -9
included, so a stale lock file never blocks a rerun: the next run takes it over and logs whose it
was. In a multi-host run only process 0 takes the lock (it is the only one writing files besides
the checkpoints) and every process learns the outcome, so all of them refuse together.

Config record: `config.json` is the config the run is using now; `config.<update>.json` is the
config each session started from (`config.0.json` the first one). A resumed run compares its config
with the saved one before writing anything: fields that change what the checkpoints hold or how
the recorded updates were made are refused with the diff; the others (`MUTABLE`: how long to run,
evaluation, logging, checkpoint cadence, the device mesh) are logged and recorded.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from typing import Any, Mapping

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

__all__ = ["resolve", "WorkdirError", "WorkdirLock", "WorkdirLockedError", "ConfigMismatchError", "MUTABLE",
           "config_diff", "check_config", "save_config", "CONFIG_FILE", "LOCK_FILE"]

CONFIG_FILE = "config.json"
LOCK_FILE = ".lock"

# Fields (or `section.` prefixes) a resumed run may change: none of them changes the meaning of a
# recorded update or the shapes in a checkpoint. Everything else is fixed for the life of a workdir
# (start another run with `--init_from` to branch off with other settings).
MUTABLE = ("num_updates", "eval.", "progress", "tensorboard", "checkpoint_every", "keep_checkpoints",
           "alarm.", "mesh.", "tasks.data_dir", "rollout.num_actors", "rollout.queue_size",
           "model.remat", "optim.share_prefix", "store.")  # these change no update beyond rounding

# Fields added after workdirs were made, with the value that reproduces how runs behaved before
# them: a saved config without such a field resumes when the new value is this one.
ADDED_FIELDS: dict[str, Any] = {
    "model.decode_quant": "none", "model.remat": "none", "eval.greedy": True, "optim.share_prefix": 0,
    "model.lora.rank": 0, "model.lora.alpha": 16.0, "model.lora.dropout": 0.0, "model.lora.init": "",
    "model.lora.targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"],
    "model.moe.num_experts": 0, "model.moe.experts_per_token": 2,
    "model.moe.intermediate_size": 64, "model.moe.aux_loss_coef": 0.01, "model.moe.replay": True,
    "algorithm.unit": "token", "algorithm.vapo_length": "tokens", "algorithm.step_lam": 1.0,
    "algorithm.empg": False, "algorithm.empg_k": 1.0, "algorithm.empg_k_future": 1.0,
    "algorithm.empg_zeta": 0.05, "loss.reuse_behaviour_logprobs": False,
    "loss.kl_reference": "auto",
    "rollout.branch_k": 0, "rollout.branch_at": "uniform", "algorithm.time_discount": 0.0,
    "algorithm.time_source": "latency", "algorithm.step_verifier": "",
    "algorithm.verifier_weight": 0.5, "rollout.record_oracle": False,
    "algorithm.part_weights": [1.0, 1.0, 1.0, 1.0], "curriculum.step_budgets": [],
    "curriculum.grow_at": 0.5, "rollout.share_prompts": False, "rollout.recovery_groups": 0,
    "rollout.recovery_from": "first_divergence", "rollout.recovery_capacity": 64,
    "algorithm.critic": "separate",
    "store.enabled": False, "store.keep": "all", "sft.store": "", "store.replay_groups": 0,
    "store.replay_failure": 1.0, "store.replay_half_life": 0.0,
    "rollout.continue_partial": False, "rollout.partial_cache": "keep",
    "context.mode": "full", "context.every": 0, "context.keep": 2, "context.segments": 4,
    "context.summary_by": "env", "context.summary_tokens": 24, "context.offload_words": 32,
    "context.offload_preview": 8, "optim.skip_zero_grad": False,
    **{f"dpo.{k}": v for k, v in {
        "steps": 0, "tasks": 64, "group_size": 8, "branch_k": 0, "branch_at": "uniform",
        "level": "trajectory", "beta": 0.1, "label_smoothing": 0.0, "sft_weight": 0.0, "min_gap": 0.0,
        "learning_rate": 1e-4, "minibatches": 1, "store": "", "keep": "all"}.items()},
}


def resolve(path: str | os.PathLike) -> str:
  """`path` as an absolute local path (`~` expanded, `..` collapsed); URLs (`gs://...`) unchanged."""
  path = os.fspath(path)
  if not path:
    raise ValueError("the workdir is empty; pass --workdir=DIR.")
  if "://" in path:
    return path
  return os.path.abspath(os.path.expanduser(path))


# ------------------------------------------------------------------------------------------ lock

class WorkdirError(Exception):
  """A problem with a workdir that the user fixes (the message names it and the fix); the entry
  points print it without a traceback."""


class WorkdirLockedError(WorkdirError):
  """Another live run holds the workdir."""


class WorkdirLock:
  """Exclusive use of a workdir by one run (see the module docstring). A context manager."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._file = None

  def acquire(self) -> WorkdirLock:
    primary = jax.process_index() == 0
    error = ""
    if primary:
      try:
        self._acquire_local()
      except WorkdirLockedError as e:
        error = str(e)
    if jax.process_count() > 1:
      locked = multihost_utils.broadcast_one_to_all(np.int32(bool(error)))
      if int(locked) and not primary:
        error = f"process 0 could not lock {self.path}: another run is using this workdir."
    if error:
      raise WorkdirLockedError(error)
    return self

  def _acquire_local(self):
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    f = open(self.path, "a+", encoding="utf-8")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      f.seek(0)
      owner = f.read().strip() or "{}"
      f.close()
      raise WorkdirLockedError(
          f"the workdir {os.path.dirname(self.path)} is in use by another run ({_describe(owner)}); "
          f"wait for it to finish or stop it, or pass another --workdir.") from None
    f.seek(0)
    previous = f.read().strip()
    if previous:
      logging.info("taking over the lock of a run that is no longer alive (%s).", _describe(previous))
    f.seek(0)
    f.truncate()
    json.dump({"pid": os.getpid(), "host": socket.gethostname(),
               "started": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": " ".join(sys.argv)}, f)
    f.flush()
    self._file = f

  def release(self):
    if self._file is not None:
      self._file.seek(0)
      self._file.truncate()  # an empty lock file: nobody owns it
      self._file.flush()
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()
      self._file = None

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc):
    self.release()


def _describe(owner: str) -> str:
  try:
    o = json.loads(owner)
    return (f"pid {o.get('pid')} on host {o.get('host')}, started {o.get('started')}: "
            f"{o.get('command', '?')}")
  except (ValueError, AttributeError):
    return f"unreadable lock file contents {owner[:200]!r}"


# -------------------------------------------------------------------------------------- configs

class ConfigMismatchError(WorkdirError, ValueError):
  """A resumed run's config changes fields that are fixed for the life of a workdir."""


def flatten(tree: Mapping[str, Any], prefix: str = "", keep_empty: bool = True) -> dict[str, Any]:
  """`{"a": {"b": 1}, "c": {}}` -> `{"a.b": 1, "c": {}}`, or `{"a.b": 1}` without `keep_empty`."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping) and (value or not keep_empty):
      out.update(flatten(value, f"{prefix}{key}.", keep_empty))
    else:
      out[prefix + key] = value
  return out


def _plain(config) -> dict:
  """A ConfigDict (or dict) as the JSON it is saved as, read back (tuples become lists)."""
  text = config.to_json_best_effort(sort_keys=True) if hasattr(config, "to_json_best_effort") \
      else json.dumps(config, sort_keys=True)
  return json.loads(text)


def config_diff(saved: Mapping, new) -> dict[str, tuple[Any, Any]]:
  """`{field: (saved value, new value)}` of the fields that differ (`"<missing>"` if absent)."""
  a, b = flatten(_plain(saved)), flatten(_plain(new))
  missing = "<missing>"
  return {k: (a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
          if a.get(k, missing) != b.get(k, missing)}


def _is_mutable(field: str) -> bool:
  return any(field == m or (m.endswith(".") and field.startswith(m)) for m in MUTABLE)


def _write_json(path: str, data: dict):
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def check_config(workdir: str, config, *, resuming: bool) -> dict[str, tuple]:
  """Checks `config` against the workdir's saved one; returns the allowed diff (writes nothing).

  Args:
    workdir: the run's (absolute) workdir.
    config: the config this session runs with.
    resuming: whether the workdir holds a checkpoint (a new run is not checked).

  Raises:
    ConfigMismatchError: on resume, when a field outside `MUTABLE` differs; the message lists
      every differing field with its saved and new value.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  if not resuming:
    return {}
  if not os.path.exists(path):
    logging.warning("%s has checkpoints but no %s; this run's config cannot be checked against "
                    "the one the checkpoints were made with.", workdir, CONFIG_FILE)
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigMismatchError(
        f"{path} cannot be read ({type(e).__name__}: {e}); the resumed run cannot be checked "
        f"against the config its checkpoints were made with. Restore the file (each session's "
        f"copy is config.<update>.json) or start a new workdir.") from None
  diff = config_diff(saved, config)
  fixed = {k: v for k, v in diff.items() if not _is_mutable(k)
           and not (v[0] == "<missing>" and k in ADDED_FIELDS and v[1] == ADDED_FIELDS[k])}
  if fixed:
    lines = "\n".join(f"  {k}: {a!r} (saved) -> {b!r} (now)" for k, (a, b) in fixed.items())
    raise ConfigMismatchError(
        f"the config differs from the one the run in {workdir} was started with, in fields that "
        f"cannot change on resume:\n{lines}\nRerun with the saved values, use a new --workdir, or "
        f"start a new run from this one's checkpoint with --init_from={workdir}. Fields that may "
        f"change on resume: {', '.join(MUTABLE)}.")
  if diff:
    logging.warning("resuming %s with changed settings: %s", workdir,
                    "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()))
  return diff


def save_config(workdir: str, config, start_update: int, changes: Mapping | None = None):
  """Records `config` as `config.json` and `config.<start_update>.json` (process 0).

  A new run (`start_update` 0) always writes both; a resumed one only when `changes` (from
  `check_config`) is not empty or `config.json` is missing, so the files list each config the run
  has used and the update it took effect at."""
  path = os.path.join(workdir, CONFIG_FILE)
  if jax.process_index() != 0 or (start_update and not changes and os.path.exists(path)):
    return
  plain = _plain(config)
  _write_json(os.path.join(workdir, f"config.{start_update}.json"), plain)
  _write_json(path, plain)
