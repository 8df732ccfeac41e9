"""Checkpoints of the training state: a thin wrapper over orbax's `CheckpointManager`.

    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=3, save_interval_steps=50)
    if ckpt.latest_step() is not None:
      state, meta = ckpt.restore(template=state)   # newest good step, in `state`'s dtypes/shardings
    for step in range(start, num_steps):
      ...
      ckpt.save(step, state, {"step": step, "env_steps": env_steps})
    ckpt.close()

Layout: `<directory>/<step>/` holds three orbax items: `state` (the pytree, `StandardSave`), `meta`
(the caller's JSON dict) and `prng_keys` (where the typed PRNG keys of `state` sit and their
implementation). Typed keys are saved as their `uint32` key data (`jax.random.key_data`) and wrapped
again on restore (`jax.random.wrap_key_data`).

Atomicity: orbax writes a step into `<step>.orbax-checkpoint-tmp-<time>/`, writes
`commit_success.txt` into it when every item is written and only then renames it to `<step>/`. A
crash mid-save therefore leaves at worst a temporary folder, which is ignored, and removed by the
next Checkpointer on that directory (in the background; its first save waits for that). A step
folder without `commit_success.txt` (hand-made, a copy cut short) is not counted by `latest_step()`
and is skipped by `restore()`; a committed step whose files are damaged fails to restore, and
`restore()` falls back to the newest older step that does, logging a warning that names the bad step
and the error, and moves the bad step's folder aside to `<directory>.damaged/<step>.<time>/` (kept,
never deleted), so a resumed run can write that step again. Incomplete steps at or after a step
being saved are moved there too.

Saving is asynchronous: `save` returns once the arrays are copied to host memory (so the caller may
donate or overwrite `state` right after), and the files are written in a background thread. `wait()`
blocks until they are; `restore` and `close` wait by themselves.

Multi-host: create the Checkpointer and call `latest_step`, `save`, `restore`, `wait` and `close` on
every process with the same arguments, with `directory` on a file system all processes see. Orbax
writes each process's shards, lets process 0 alone create, commit, rename and delete folders and
write the JSON items (so `meta` must be the same on every process), and synchronises the processes
around it. `latest_step` answers process 0's view on every process, and `restore()` checks that all
processes restored the same step, so they resume together. Process-local arrays (a training loop
that keeps the same parameters on every process, each on its own devices) are saved as global
arrays replicated across the processes (orbax refuses process-local ones), written once, and
restore into the template's process-local placement.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

__all__ = ["Checkpointer", "CheckpointError"]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike

_STATE, _META, _KEYS = "state", "meta", "prng_keys"
# Written by orbax into a step folder as the last act of a save (both of its atomicity modes).
_COMMIT_FILE = "commit_success.txt"
# TensorStore errors quote the whole store spec; logs keep the start of the message.
_MAX_ERROR_CHARS = 400


def _describe(e: Exception) -> str:
  text = str(e)
  if len(text) > _MAX_ERROR_CHARS:
    text = text[:_MAX_ERROR_CHARS] + " ..."
  return f"{type(e).__name__}: {text}"


def _absolute(directory: PathLike) -> str:
  """A local path made absolute (`~` expanded; orbax refuses relative paths); URLs unchanged."""
  directory = os.fspath(directory)
  if "://" in directory:
    return directory
  return os.path.abspath(os.path.expanduser(directory))


# --------------------------------------------------------------------------------------- PRNG keys

def _is_key(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _path(keypath) -> list[str]:
  """A pytree key path as strings, the same for a tuple and the list orbax restores it as."""
  return [str(p) for p in ocp.utils.tuple_path_from_keypath(keypath)]


def _split_keys(state):
  """`state` with typed PRNG keys replaced by their key data, and `[{path, impl}]` of those keys."""
  keys = []

  def replace(keypath, x):
    if not _is_key(x):
      return x
    keys.append({"path": _path(keypath), "impl": str(jax.random.key_impl(x))})
    return jax.random.key_data(x)

  return jax.tree_util.tree_map_with_path(replace, state), keys


# Jitted: eagerly wrapped sharded key data reports the data's sharding (`P('x', None)` for `[N]`
# keys); under jit the key array gets the sharding of its own shape (`P('x')`), as a split key has.
_wrap_key_data = jax.jit(jax.random.wrap_key_data, static_argnames="impl")


def _wrap_keys(tree, keys: list[dict]):
  """Wraps the key data at the recorded paths of `tree` back into typed PRNG keys."""
  impls = {tuple(k["path"]): k["impl"] for k in keys}

  def wrap(keypath, x):
    impl = impls.get(tuple(_path(keypath)))
    return x if impl is None else _wrap_key_data(x, impl=impl)

  return jax.tree_util.tree_map_with_path(wrap, tree)


def _key_data_sharding(sharding, extra_dims: int):
  """The sharding of a key array's `uint32` data (trailing `extra_dims` axes replicated)."""
  if sharding is None or isinstance(sharding, SingleDeviceSharding):
    return sharding
  if isinstance(sharding, NamedSharding):
    spec = PartitionSpec(*sharding.spec, *([None] * extra_dims))
    return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
  raise ValueError(f"cannot derive the sharding of PRNG key data from {sharding!r}; give the "
                   f"template's key leaves a NamedSharding or SingleDeviceSharding.")


def _abstract(template):
  """The restore target orbax expects: shape, dtype and sharding per leaf, key leaves as key data.

  `jax.Array` leaves become `ShapeDtypeStruct`s with their sharding (restored as jax arrays placed
  like them); `ShapeDtypeStruct`, NumPy and Python scalar leaves are passed on (NumPy leaves restore
  as NumPy arrays; a `ShapeDtypeStruct` without sharding restores as the type that was saved).
  NumPy scalars become 0-d arrays: orbax saves them so and rejects them as restore targets.
  """

  def leaf(x):
    if isinstance(x, np.generic):
      return np.asarray(x)
    if _is_key(x):
      data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
      sharding = _key_data_sharding(getattr(x, "sharding", None), data.ndim - len(x.shape))
      return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    if isinstance(x, jax.Array):
      return ocp.utils.to_shape_dtype_struct(x)
    return x

  return jax.tree.map(leaf, template)


# --------------------------------------------------------------------------------------- multi-host

def _replicated_across_processes(x):
  """A process-local `jax.Array` as a global array replicated over the processes (else `x`).

  Every process must hold the same values in the same local layout (one device, or a NamedSharding
  over a mesh of its own devices); that layout is repeated on each process along a new leading mesh
  axis, which the spec leaves replicated, so orbax writes the array once.
  """
  if jax.process_count() == 1 or not isinstance(x, jax.Array) or not x.is_fully_addressable:
    return x
  sharding = x.sharding
  if isinstance(sharding, SingleDeviceSharding):
    local, names, spec = np.array(list(sharding.device_set)), ("local",), PartitionSpec()
  elif isinstance(sharding, NamedSharding):
    local, names, spec = sharding.mesh.devices, sharding.mesh.axis_names, sharding.spec
  else:
    raise ValueError(f"cannot save a process-local array with {sharding!r} in a multi-host run; "
                     f"place it with a NamedSharding or on one device.")
  position = {d: i for i, d in enumerate(jax.local_devices())}
  positions = np.vectorize(position.__getitem__, otypes=[int])(local)
  by_process = [np.array([d for d in jax.devices() if d.process_index == p], dtype=object)
                for p in range(jax.process_count())]
  mesh = Mesh(np.stack([devices[positions] for devices in by_process]), ("processes", *names))
  return jax.make_array_from_single_device_arrays(
      x.shape, NamedSharding(mesh, spec, memory_kind=sharding.memory_kind),
      [shard.data for shard in x.addressable_shards])


def _process_zero_step(step: int | None) -> int | None:
  """Process 0's `step` on every process (a file-system view may lag on the others)."""
  if jax.process_count() == 1:
    return step
  step = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if step is None else step)))
  return None if step < 0 else step


# --------------------------------------------------------------------------------------------- meta

def _to_json(value, where: str):
  """`value` in plain JSON types (NumPy/JAX scalars as Python ones), or a TypeError naming it."""
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      if not isinstance(k, str):
        raise TypeError(f"{where} has the key {k!r} ({type(k).__name__}); JSON keys must be str.")
      out[k] = _to_json(v, f"{where}[{k!r}]")
    return out
  if isinstance(value, (list, tuple)):
    return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(value) == 0:
    return np.asarray(value).item()
  raise TypeError(f"{where} = {value!r} ({type(value).__name__}) cannot be written as JSON; meta "
                  f"holds Python/NumPy scalars, strings, lists and dicts (arrays go in `state`).")


# ------------------------------------------------------------------------------------ Checkpointer

class CheckpointError(RuntimeError):
  """No checkpoint of a directory can be restored (the message names each step and its error)."""


class _TemplateMismatchError(ValueError):
  """The restore template does not fit the checkpoint (a caller error, not a damaged step)."""


class Checkpointer:
  """Saves and restores `(state, meta)` per training step under one directory (see module doc).

  Args:
    directory: root folder of the step folders; created if missing (a local path, relative or with
      `~`, is made absolute; or `gs://...`).
    max_to_keep: number of newest steps kept on disk (older ones are deleted after a save); None
      keeps all.
    save_interval_steps: `save` writes only steps that are multiples of this (unless `force`) and
      steps at which JAX's distributed runtime reports a preemption notice.

  Attributes:
    restored_step: the step the last `restore` returned (after any fallback), else None.
  """

  def __init__(self, directory: PathLike, *, max_to_keep: int | None = 3,
               save_interval_steps: int = 1):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep}.")
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}.")
    self.directory = epath.Path(_absolute(directory))
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        # Orbax's default policy also saves the first step of a run whatever its number
        # (`InitialSavePolicy`); here only multiples of the interval are due, and the steps at which
        # a multi-host job received a preemption notice.
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(save_interval_steps),
            policies.PreemptionCheckpointingPolicy()]),
        preservation_policy=policies.LatestN(max_to_keep),
        # Removes `<step>.orbax-checkpoint-tmp-*` folders a crashed save left behind.
        cleanup_tmp_directories=True,
        create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._saved_steps: set[int] = set()  # committed once the background write ends
    self._bad_steps: set[int] = set()  # committed steps that failed to restore
    self.restored_step: int | None = None

  # ------------------------------------------------------------------------------------- queries

  def _is_committed(self, step: int) -> bool:
    return step in self._saved_steps or (self.directory / str(step) / _COMMIT_FILE).exists()

  def latest_step(self) -> int | None:
    """The newest committed step (it may still turn out damaged; `restore` then falls back).

    Multi-host: process 0's answer, on every process (call it on all of them)."""
    steps = [s for s in self._manager.all_steps() if self._is_committed(s)]
    return _process_zero_step(max(steps) if steps else None)

  # -------------------------------------------------------------------------------------- saving

  @property
  def quarantine(self) -> epath.Path:
    """Where damaged or incomplete steps are moved (`<directory>.damaged/`); nothing is deleted."""
    return self.directory.parent / f"{self.directory.name}.damaged"

  def _set_aside(self, steps: list[int], why: Mapping[int, str]):
    """Moves `steps` out of the step folders into `quarantine` (process 0), keeping their files."""
    if not steps:
      return
    if jax.process_index() == 0:
      self.quarantine.mkdir(parents=True, exist_ok=True)
      stamp = time.strftime("%Y%m%d-%H%M%S")
      for s in steps:
        target = self.quarantine / f"{s}.{stamp}"
        try:
          (self.directory / str(s)).rename(target)
        except OSError as e:  # e.g. deleted meanwhile by the run that owns the directory
          logger.warning("checkpoint step %d in %s is %s but could not be moved aside (%s).", s,
                         self.directory, why[s], _describe(e))
          continue
        logger.warning("checkpoint step %d in %s is %s; moved it to %s (kept for inspection, "
                       "not deleted).", s, self.directory, why[s], target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"longhorizon.checkpoints.set_aside.{steps}")
    self._bad_steps.difference_update(steps)
    self._manager.reload()

  def _set_aside_bad_steps(self, from_step: int):
    """Sets aside incomplete or damaged steps >= `from_step`, which would block saving it again."""
    bad, why = [], {}
    for s in sorted(self._manager.all_steps()):
      if s < from_step or s in self._saved_steps:
        continue
      if s in self._bad_steps or not self._is_committed(s):
        bad.append(s)
        why[s] = "damaged" if s in self._bad_steps else f"incomplete (no {_COMMIT_FILE})"
    self._set_aside(bad, why)

  def save(self, step: int, state: Any, meta: Mapping[str, Any], force: bool = False) -> bool:
    """Saves `state` and `meta` as `step` if it is due; returns whether a save was started.

    A step is due when it is a multiple of `save_interval_steps` (or a preemption was signalled) and
    newer than the newest step on disk; `force=True` saves regardless of the interval (a step that
    already exists still raises orbax's `StepAlreadyExistsError`).

    Args:
      step: the training step (update count) this state is after.
      state: pytree of `jax.Array` / NumPy arrays (any dtype, typed PRNG keys included) and Python
        scalars.
      meta: small JSON dict saved beside it (e.g. `{"step": 10, "env_steps": 12800}`); NumPy and JAX
        scalars are converted to Python numbers.
    """
    step = operator.index(step)
    meta = _to_json(dict(meta), "meta")
    self._set_aside_bad_steps(step)
    data, keys = _split_keys(state)
    data = jax.tree.map(_replicated_across_processes, data)
    args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(data),
                                 _META: ocp.args.JsonSave(meta),
                                 _KEYS: ocp.args.JsonSave({"keys": keys})})
    saved = self._manager.save(step, args=args, force=force)
    if saved:
      self._saved_steps.add(step)
    return saved

  # ------------------------------------------------------------------------------------ restoring

  def _restore_step(self, step: int, template):
    if template is None:
      out = self._manager.restore(step, args=ocp.args.Composite(
          **{_STATE: ocp.args.StandardRestore(), _META: ocp.args.JsonRestore(),
             _KEYS: ocp.args.JsonRestore()}))
      return _wrap_keys(out[_STATE], out[_KEYS]["keys"]), out[_META]
    keys = self._manager.restore(step, args=ocp.args.Composite(
        **{_KEYS: ocp.args.JsonRestore()}))[_KEYS]["keys"]
    template_paths = sorted(_path(p) for p, x in jax.tree_util.tree_flatten_with_path(template)[0]
                            if _is_key(x))
    saved_paths = sorted(k["path"] for k in keys)
    if template_paths != saved_paths:
      raise _TemplateMismatchError(
          f"the template has typed PRNG keys at {template_paths} but step {step} in "
          f"{self.directory} has them at {saved_paths}; pass a template with the saved structure.")
    out = self._manager.restore(step, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardRestore(_abstract(template)), _META: ocp.args.JsonRestore()}))
    state = jax.tree.map(lambda t, x: t.dtype.type(x) if isinstance(t, np.generic) else x,
                         template, out[_STATE])
    return _wrap_keys(state, keys), out[_META]

  def restore(self, step: int | None = None, template: Any = None) -> tuple[Any, dict]:
    """Restores `(state, meta)` of `step`, by default of the newest step that restores.

    With `step=None`, committed steps are tried newest first; each one that fails (damaged or
    missing files) is logged as a warning and the next older one is tried. An explicit `step` is
    restored or raises.

    Args:
      step: the step to restore, or None for the newest good one.
      template: a pytree like the saved state (concrete arrays, or `jax.ShapeDtypeStruct`s e.g. from
        `jax.eval_shape`) giving structure, dtypes and, for jax leaves with a `sharding`, the
        placement of the restored arrays; its typed-key leaves mark where keys go. Without it the
        state comes back in the saved shardings, with dicts for dataclasses and lists for tuples.

    Returns:
      `(state, meta)`; `self.restored_step` is set to the step restored.
    """
    self.wait()
    if step is not None:
      step = operator.index(step)
      if step not in self._manager.all_steps():
        raise FileNotFoundError(f"no checkpoint step {step} in {self.directory}; steps there: "
                                f"{list(self._manager.all_steps())}.")
      if not self._is_committed(step):
        raise ValueError(f"checkpoint step {step} in {self.directory} is incomplete (no "
                         f"{_COMMIT_FILE}): its save was cut short; restore another step.")
      try:
        state, meta = self._restore_step(step, template)
      except Exception as e:
        e.add_note(f"while restoring checkpoint step {step} from {self.directory}")
        raise
      self.restored_step = step
      return state, meta

    steps = sorted(self._manager.all_steps(), reverse=True)
    candidates = [s for s in steps if self._is_committed(s)]
    for s in steps:
      if s not in candidates and s > (candidates[0] if candidates else -1):
        logger.warning("skipping checkpoint step %d in %s: incomplete (no %s), its save was cut "
                       "short.", s, self.directory, _COMMIT_FILE)
    if not candidates:
      raise FileNotFoundError(f"no committed checkpoint in {self.directory} (steps found: "
                              f"{steps}); check `latest_step() is not None` before restoring.")
    errors = []
    for s in candidates:
      try:
        state, meta = self._restore_step(s, template)
      except _TemplateMismatchError:
        raise
      except Exception as e:  # damaged files raise all sorts: OSError, JSON, TensorStore errors
        logger.warning("checkpoint step %d in %s could not be restored (%s); falling back to an "
                       "older step.", s, self.directory, _describe(e))
        self._bad_steps.add(s)
        errors.append((s, e))
        continue
      if jax.process_count() > 1:
        multihost_utils.assert_equal(
            np.int32(s), f"processes restored different checkpoint steps from {self.directory} "
            f"(this one: {s}); is the directory on a file system every process sees?")
      self.restored_step = s
      self._set_aside([b for b, _ in errors], {b: f"damaged ({_describe(e)})" for b, e in errors})
      return state, meta
    summary = "; ".join(f"step {s}: {_describe(e)}" for s, e in errors)
    raise CheckpointError(f"none of the checkpoints in {self.directory} could be restored "
                       f"({summary}); if every step fails the same way, check that `template` "
                       f"matches the saved state.") from errors[0][1]

  # ---------------------------------------------------------------------------------- lifecycle

  def wait(self):
    """Blocks until the background writes of all started saves are committed."""
    self._manager.wait_until_finished()

  def close(self):
    """Waits for pending saves, deletions and the start-up clean-up, and releases orbax's threads."""
    # Orbax removes crashed saves' temporary folders in a background thread started with the
    # manager and awaited only by the first save; a process that restores (or finds nothing) and
    # exits at once would otherwise kill that thread mid-way, with a traceback after its own output.
    await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc):
    self.close()
