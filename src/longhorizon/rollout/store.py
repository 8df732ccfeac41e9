"""`TrajectoryStore`: a persistent, append-only store of `EpisodeBatch`es in Apache Parquet.

    store = TrajectoryStore(f"{workdir}/trajectories")
    store.append(batch, update=7, info=stats.episode_info)         # one Parquet file per call
    batch = store.read(filters=("invalid",), dedup=True)           # one EpisodeBatch back
    batch = store.sample(64, np.random.default_rng(0), weights=Priority(failure=4.0, half_life=10))

A training run with `config.store.enabled` appends every update's training batch to
`<workdir>/trajectories/` (`train/loop.py`); `python -m longhorizon.cli.store WORKDIR` prints the
newest episodes with their masks.

Layout: one file per `append`, `batch-<seq:06d>-update-<update:06d>.parquet`, where `seq` counts the
store's appends (name order is append order). One row per episode:
* every array field of `EpisodeBatch` under its own name, with its declared dtype: the `[B]`
  fields as scalar columns, the `[B, L]` and `[B, S]` fields as list columns (each list `L` or `S`
  long), the optional `routing` `[B, L, layers, k]` as one flattened list per row;
* `reward_components[name]` as the float32 column `reward_components.<name>`;
* `info.<name>`: per-episode facts passed as `append(info=...)` (the loop passes
  `RolloutStats.episode_info`: `invalid_actions`, `tool_calls`, ...);
* store columns: `update` (int64, the learner update the caller names), `written_at` (UTC
  timestamp of the append) and `key` (16 hex digits, the episode's canonical key, see
  `episode_keys`).
The Parquet key-value metadata holds `longhorizon.store.schema_version` ("1", checked on read),
`longhorizon.store.shape` (JSON: `context_length`, `max_steps`, `routing` `[layers, k]` or null) and
`longhorizon.store.meta` (JSON of `append(meta=...)`).

Reading without longhorizon (pyarrow; `.to_pandas()` where pandas is installed):

    import pyarrow.parquet as pq
    table = pq.read_table("runs/run1/trajectories")     # every file; hidden temporary files skipped
    table.select(["update", "policy_version", "success", "score"]).to_pylist()

Atomicity: a file is written under a hidden temporary name (`.batch-....parquet.tmp-<pid>`),
flushed to disk and renamed into place, so a killed writer leaves at most a temporary file, which
is never read (neither here nor by `pq.read_table(dir)`, which skips names starting with "."); each
store object logs a warning counting such leftovers. Files are never rewritten: a killed run loses
nothing already stored, and a resumed run appends. A run resumed from a checkpoint older than its
last stored update collects those updates again and stores them again (under the same `update`);
`dedup=True` keeps one copy of episodes with the same (state, action) sequence.

Corruption: every data file's footer is read when the store is opened, and a new file's when the
store is listed again (`files()`, which `len`, `rows`, `read` and `sample` call). A file that
cannot be read (truncated, damaged, not Parquet) raises `CorruptFileError` naming it, unless the
store was opened with `on_corrupt="skip"`: then it is left out, with a warning, and listed in
`store.skipped`. Damage found later, in a file's data pages while loading episodes, always raises
`CorruptFileError`. A file of another schema version raises `SchemaVersionError`, and a Parquet
file without a schema version (not written by this class) `StoreError`: neither is skipped.

Shapes: files may differ in `L` and `S` (a run whose context budget changed); `read` pads every
episode to the largest (or to `context_length` / `max_steps`), with each field's padding value
(right padding changes no episode). Files that disagree on `routing` (present in one, absent or of
another `[layers, k]` in another) cannot be read together: `StoreError` names them. A reward
component missing from some files reads as 0 there (it added nothing to their rewards), and an
`EpisodeBatch` field added after a file was written reads as its `empty()` value.

Versions: each episode keeps the environment and reward versions it was produced under
(`EpisodeBatch.env_version`, `reward_version`); `rows(versions=...)` selects by them
(`matching_versions`), as the SFT and DPO readers do with their run's.

Host-side NumPy and pyarrow; one writer at a time (the run holding the workdir's lock).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
from typing import Any, Iterator, Mapping, Sequence

from absl import logging
import jax
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from longhorizon.core.episode import RECOVERY, EpisodeBatch, Termination

__all__ = ["TrajectoryStore", "Priority", "Rows", "StoredFile", "StoreError", "CorruptFileError",
           "SchemaVersionError", "FILTERS", "SCHEMA_VERSION", "episode_keys", "take_rows",
           "priority_weights", "drop_mask", "KEEP", "matching_versions"]

SCHEMA_VERSION = "1"
VERSION_KEY = "longhorizon.store.schema_version"
SHAPE_KEY = "longhorizon.store.shape"
META_KEY = "longhorizon.store.meta"
COMPONENT_PREFIX = "reward_components."
INFO_PREFIX = "info."
_NAME = re.compile(r"^batch-(\d+)-update-(\d+)\.parquet$")
_KEY_BYTES = 8  # 16 hex digits: collisions need ~4e9 distinct episodes

# EpisodeBatch's array fields: name -> (dims, dtype, padding value), from its declarations.
_FIELDS = {f.name: f.metadata["spec"] for f in dataclasses.fields(EpisodeBatch)
           if "spec" in f.metadata}

# Validity filters (`read(filters=...)`): name -> what it drops.
FILTERS = {
    "env_error": "episodes with an environment error at any step (not the policy's fault)",
    "timeout": "episodes cut off by the step limit (termination TIMEOUT)",
    "context_overflow": "episodes cut off by the context budget (termination CONTEXT_OVERFLOW)",
    "truncated": "timeout and context_overflow",
    "parse_failure": "episodes with a malformed or rejected action (info.invalid_actions > 0)",
    "invalid": "env_error, truncated and parse_failure",
}
_EXPANDS = {"truncated": ("timeout", "context_overflow"),
            "invalid": ("env_error", "timeout", "context_overflow", "parse_failure")}
# `config.store.keep` (train/loop.py): which episodes of each training batch are stored -> the
# filters applied on append.
KEEP = {"all": (), "valid": ("invalid",)}


class StoreError(ValueError):
  """A trajectory store cannot do what was asked (the message names the file or value)."""


class CorruptFileError(StoreError):
  """A store file cannot be read; `path` names it."""

  def __init__(self, path: str, reason: str):
    super().__init__(f"trajectory store file {path} is corrupt or truncated ({reason}); move it "
                     f"out of the store directory (or open the store with on_corrupt='skip').")
    self.path = path


class SchemaVersionError(StoreError):
  """A store file was written with a schema version this code does not read."""


@dataclasses.dataclass(frozen=True)
class StoredFile:
  """One data file of a store (from its footer)."""
  path: str
  num_rows: int
  context_length: int  # L
  max_steps: int  # S
  routing: tuple[int, int] | None  # (layers, k) of `EpisodeBatch.routing`, None when absent
  columns: tuple[str, ...]
  meta: dict  # `append(meta=...)`


@dataclasses.dataclass(frozen=True)
class Rows:
  """A selection of stored episodes as `[N]` arrays (what `load` reads; `rows()` gives them in
  store order)."""
  path: np.ndarray  # [N] object: the file holding the episode
  row: np.ndarray  # [N] int64: its row in that file
  update: np.ndarray  # [N] int64
  written_at: np.ndarray  # [N] datetime64[us] (UTC)
  key: np.ndarray  # [N] object: `episode_keys`
  success: np.ndarray  # [N] bool
  termination: np.ndarray  # [N] int32 `Termination`
  env_error: np.ndarray  # [N] bool: an environment error at any step
  milestones: np.ndarray  # [N] int64: the milestone bits reached at any step
  invalid_actions: np.ndarray  # [N] int64; -1 where the file has no `info.invalid_actions`
  group: np.ndarray  # [N] int64: `EpisodeBatch.group`, the task-group label within its file
  score: np.ndarray  # [N] float32: `EpisodeBatch.score`, the outcome the group estimators read
  env_version: np.ndarray  # [N] int64: `EpisodeBatch.env_version` (-1 where the file has none)
  reward_version: np.ndarray  # [N] int64: `EpisodeBatch.reward_version` (-1 likewise)

  def __len__(self) -> int:
    return len(self.row)

  def take(self, index) -> "Rows":
    """The rows at `index` (indices or a `[N]` bool mask), in the order given."""
    return Rows(**{f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)})

  @staticmethod
  def concatenate(parts: Sequence["Rows"]) -> "Rows":
    names = [f.name for f in dataclasses.fields(Rows)]
    if not parts:
      return Rows(**{n: np.zeros((0,), _ROW_DTYPES[n]) for n in names})
    return Rows(**{n: np.concatenate([getattr(p, n) for p in parts]) for n in names})


_ROW_DTYPES = {"path": object, "row": np.int64, "update": np.int64, "written_at": "datetime64[us]",
               "key": object, "success": bool, "termination": np.int32, "env_error": bool,
               "milestones": np.int64, "invalid_actions": np.int64, "group": np.int64,
               "score": np.float32, "env_version": np.int64, "reward_version": np.int64}


@dataclasses.dataclass(frozen=True)
class Priority:
  """Sampling weights of `TrajectoryStore.sample`: an episode's weight is the product of

      failure                          if it did not succeed (else 1),
      0.5 ** ((now - update) / half_life)   when half_life > 0 (else 1),
      (1 / f) ** rare_milestones       f: the share of candidate episodes reaching the rarest
                                       milestone bit it reached (1 if it reached none).
  """
  failure: float = 1.0  # weight of a failed episode relative to a successful one (> 0)
  half_life: float = 0.0  # updates for the recency weight to halve (0: off)
  rare_milestones: float = 0.0  # exponent of the inverse milestone frequency (0: off)

  def __post_init__(self):
    for name, zero_ok in (("failure", False), ("half_life", True), ("rare_milestones", True)):
      value = getattr(self, name)
      ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and (value > 0 or (zero_ok and value == 0)))
      if not ok:
        want = ">= 0 (0: off)" if zero_ok else "> 0"
        raise ValueError(f"Priority.{name}={value!r}: expected a finite number {want}.")


# ------------------------------------------------------------------------------- episode keys

def _action_mask(batch) -> np.ndarray:
  """`[B, L]` bool: the tokens of each step's action. A row's own actions are its `loss_mask`; a
  branch row's copied steps (before `branch_step`) take its parent's action positions (the copy is
  token-exact); a recovery row's copied steps, whose parent is not in the batch, count all their
  tokens (action and observation)."""
  loss = np.asarray(batch.loss_mask, bool)
  turn, parent = np.asarray(batch.turn), np.asarray(batch.parent)
  branch_step = np.asarray(batch.branch_step)
  copied = (turn >= 0) & (turn < branch_step[:, None])
  mask = loss | (copied & (parent == RECOVERY)[:, None])
  for i in np.flatnonzero(parent >= 0):  # parents come first: their masks are final
    mask[i] |= mask[parent[i]] & copied[i]
  return mask


def episode_keys(batch) -> np.ndarray:
  """`[B]` object array of hex strings: a hash of each episode's canonical sequence of (state,
  action) pairs, `(anchor[t], action token ids of step t)` for its `num_steps` steps.

  Equal keys mean the same actions taken in the same states (whatever the sampling log-probs,
  rewards or versions); the same actions in different states give different keys. The action
  tokens of a branch's copied steps are its parent's; see `_action_mask` for recovery rows.
  """
  batch = jax.tree.map(np.asarray, batch)
  mask = _action_mask(batch)
  keys = np.empty((batch.batch_size,), object)
  for i in range(batch.batch_size):
    n = int(batch.num_steps[i])
    turns = batch.turn[i][mask[i]]
    h = hashlib.blake2b(digest_size=_KEY_BYTES)
    h.update(np.int64(n).tobytes())
    h.update(batch.anchor[i, :n].astype("<u4").tobytes())
    h.update(np.bincount(turns, minlength=n)[:n].astype("<u4").tobytes())
    h.update(batch.tokens[i][mask[i]].astype("<i4").tobytes())
    keys[i] = h.hexdigest()
  return keys


# ---------------------------------------------------------------------------------- selection

def drop_mask(termination, env_error, invalid_actions, filters: Sequence[str]) -> np.ndarray:
  """`[N]` bool: the episodes the validity `filters` (names of `FILTERS`) drop. `invalid_actions`
  is -1 where unknown; a `parse_failure` filter over such episodes raises StoreError."""
  unknown = [filters] if isinstance(filters, str) else sorted(set(filters) - set(FILTERS))
  if unknown:
    raise StoreError(f"unknown store filter(s) {unknown}; expected a list of names from "
                     f"{sorted(FILTERS)}.")
  kinds = {k for name in filters for k in _EXPANDS.get(name, (name,))}
  termination = np.asarray(termination)
  drop = np.zeros(termination.shape, bool)
  if "env_error" in kinds:
    drop |= np.asarray(env_error, bool) | (termination == Termination.ENV_ERROR)
  if "timeout" in kinds:
    drop |= termination == Termination.TIMEOUT
  if "context_overflow" in kinds:
    drop |= termination == Termination.CONTEXT_OVERFLOW
  if "parse_failure" in kinds:
    invalid = np.asarray(invalid_actions)
    if (invalid < 0).any():
      raise StoreError("the parse_failure filter needs info.invalid_actions, which "
                       f"{int((invalid < 0).sum())} episode(s) lack (EpisodeBatch does not record "
                       "malformed actions: append with info=stats.episode_info).")
    drop |= invalid > 0
  return drop


def _newest_per_key(keys: np.ndarray) -> np.ndarray:
  """Sorted indices of the last occurrence of each key."""
  _, first_from_end = np.unique(keys[::-1].astype(str), return_index=True)
  return np.sort(len(keys) - 1 - first_from_end)


def take_rows(batch: EpisodeBatch, rows) -> EpisodeBatch:
  """Rows `rows` (increasing indices) of `batch`, branch links kept valid: a kept branch row whose
  parent is kept points at the parent's new index; one whose parent was dropped becomes a recovery
  row (parent `RECOVERY`: its copied steps came from an episode not in the batch)."""
  rows = np.asarray(rows, np.int64)
  return _relink(jax.tree.map(lambda x: np.asarray(x)[rows], batch), rows)


def _relink(batch: EpisodeBatch, rows: np.ndarray) -> EpisodeBatch:
  """`batch` holds rows `rows` (increasing indices) of a larger batch, whose `parent` indices it
  still carries: see `take_rows`."""
  rows = np.asarray(rows, np.int64)
  if (np.diff(rows) <= 0).any():
    raise ValueError(f"take_rows: rows must be increasing indices, got {rows[:8]}...")
  new_index = np.full((np.max(rows, initial=-1) + 1,), -1, np.int64)
  new_index[rows] = np.arange(len(rows))
  parent = np.asarray(batch.parent).astype(np.int64)
  linked = parent >= 0
  mapped = np.where(linked, new_index[np.where(linked, parent, 0)], parent)
  return batch.replace(parent=np.where(linked & (mapped < 0), RECOVERY, mapped).astype(np.int32))


# ------------------------------------------------------------------------------------ parquet

def _list_column(x: np.ndarray, large: bool = False) -> pa.Array:
  """`[B, K]` -> a list column of B lists of K values (the dtype kept); `large`: 64-bit offsets
  (a column of more than 2**31 values)."""
  b, k = x.shape
  cls, dtype = (pa.LargeListArray, np.int64) if large else (pa.ListArray, np.int32)
  offsets = pa.array(np.arange(b + 1, dtype=dtype) * k)
  return cls.from_arrays(offsets, pa.array(np.ascontiguousarray(x).reshape(-1)))


def _check_info(info: Mapping[str, Any], b: int) -> dict:
  out = {}
  for name, value in info.items():
    value = np.asarray(value)
    if value.shape != (b,) or value.dtype.kind not in "biuf":
      raise StoreError(f"append: info[{name!r}] must be a [B]=({b},) numeric or bool array (one "
                       f"fact per episode), got shape {value.shape} dtype {value.dtype}.")
    out[name] = value
  return out


def _to_table(batch: EpisodeBatch, keys: np.ndarray, *, update: int, info: dict,
              meta: dict) -> pa.Table:
  """The Parquet table of `batch` (host arrays, validated) with its episodes' `keys`: see the
  module docstring."""
  b, length, steps = batch.batch_size, batch.context_length, batch.max_steps
  now = np.datetime64(time.time_ns() // 1000, "us")
  cols = {"update": pa.array(np.full((b,), update, np.int64)),
          "written_at": pa.array(np.full((b,), now), pa.timestamp("us", tz="UTC")),
          "key": pa.array(list(keys), pa.string())}
  for name, spec in _FIELDS.items():
    x = np.asarray(getattr(batch, name)).astype(spec.dtype, copy=False)
    cols[name] = pa.array(x) if len(spec.dims) == 1 else _list_column(x)
  for name in sorted(batch.reward_components):
    cols[COMPONENT_PREFIX + name] = pa.array(np.asarray(batch.reward_components[name], np.float32))
  routing = None
  if batch.routing is not None:
    r = np.asarray(batch.routing).astype(np.int32, copy=False)
    routing = list(r.shape[2:])
    cols["routing"] = _list_column(r.reshape(b, -1), large=True)  # L x layers x k per row
  for name in sorted(info):
    cols[INFO_PREFIX + name] = pa.array(info[name])
  shape = {"context_length": length, "max_steps": steps, "routing": routing}
  try:
    meta_text = json.dumps(meta, sort_keys=True)
  except TypeError as e:
    raise StoreError(f"append: meta must be JSON-serialisable ({e}).") from None
  return pa.table(cols).replace_schema_metadata(
      {VERSION_KEY: SCHEMA_VERSION, SHAPE_KEY: json.dumps(shape), META_KEY: meta_text})


def _read_footer(path: str) -> StoredFile:
  """A data file's footer, checked: its schema version and shape metadata."""
  try:
    with pq.ParquetFile(path) as f:
      num_rows, schema = f.metadata.num_rows, f.schema_arrow
  except (pa.ArrowException, OSError) as e:
    raise CorruptFileError(path, f"{type(e).__name__}: {e}") from None
  kv = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
  version = kv.get(VERSION_KEY)
  if version is None:
    raise StoreError(f"{path} is a Parquet file without {VERSION_KEY!r}: not written by "
                     f"TrajectoryStore; move it out of the store directory.")
  if version != SCHEMA_VERSION:
    raise SchemaVersionError(
        f"{path} has store schema version {version!r}; this longhorizon reads version "
        f"{SCHEMA_VERSION!r}. Read it with the longhorizon release that wrote it (or with pyarrow "
        f"directly), or move it out of the store directory.")
  try:
    shape, meta = json.loads(kv[SHAPE_KEY]), json.loads(kv.get(META_KEY, "{}"))
    routing = None if shape["routing"] is None else tuple(int(v) for v in shape["routing"])
    return StoredFile(path=path, num_rows=num_rows, context_length=int(shape["context_length"]),
                      max_steps=int(shape["max_steps"]), routing=routing,
                      columns=tuple(schema.names), meta=meta)
  except (KeyError, TypeError, ValueError) as e:
    raise CorruptFileError(path, f"bad {SHAPE_KEY} metadata: {e!r}") from None


def _list_values(table: pa.Table, name: str, width: int, path: str) -> np.ndarray:
  """A list column as a `[N, width]` array; CorruptFileError if a list has another length."""
  column = table.column(name).combine_chunks()
  lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
  if len(lengths) and not (lengths == width).all():
    raise CorruptFileError(path, f"column {name!r} has lists of length {sorted(set(lengths))[:4]}, "
                                 f"expected {width}")
  return column.flatten().to_numpy(zero_copy_only=False).reshape(len(lengths), width)


def _batch_from_table(table: pa.Table, f: StoredFile) -> EpisodeBatch:
  """The EpisodeBatch of `table` (rows of file `f`): fields absent from the file get their padding
  value (fields added to EpisodeBatch after the file was written)."""
  n = table.num_rows
  sizes = {"B": n, "L": f.context_length, "S": f.max_steps}
  fields = {}
  for name, spec in _FIELDS.items():
    shape = tuple(sizes[d] for d in spec.dims)
    if name not in table.column_names:
      fields[name] = np.full(shape, spec.fill, spec.dtype)
    elif len(shape) == 1:
      fields[name] = table.column(name).to_numpy().astype(spec.dtype, copy=False)
    else:
      fields[name] = _list_values(table, name, shape[1], f.path).astype(spec.dtype, copy=False)
  components = {c[len(COMPONENT_PREFIX):]: table.column(c).to_numpy().astype(np.float32)
                for c in table.column_names if c.startswith(COMPONENT_PREFIX)}
  routing = None
  if f.routing is not None:
    width = f.context_length * f.routing[0] * f.routing[1]
    routing = _list_values(table, "routing", width, f.path).astype(np.int32).reshape(
        (n, f.context_length) + f.routing)
  return EpisodeBatch(**fields, reward_components=components, routing=routing)


def _pad(batch: EpisodeBatch, length: int, steps: int) -> EpisodeBatch:
  """`batch` padded on the right to `L = length` and `S = steps` with each field's padding value."""
  sizes = {"L": length, "S": steps}
  out = {}
  for name, spec in _FIELDS.items():
    x = getattr(batch, name)
    widths = [(0, 0)] + [(0, sizes[d] - x.shape[k + 1]) for k, d in enumerate(spec.dims[1:])]
    out[name] = np.pad(x, widths, constant_values=spec.fill)
  if batch.routing is not None:
    extra = length - batch.routing.shape[1]
    out["routing"] = np.pad(batch.routing, [(0, 0), (0, extra), (0, 0), (0, 0)])
  return batch.replace(**out)


# -------------------------------------------------------------------------------------- store

_LIGHT = ("update", "written_at", "key", "success", "termination", "env_error", "milestones",
          "group", "score")
_VERSIONS = ("env_version", "reward_version")


def matching_versions(rows: Rows, what: str, **versions: int) -> Rows:
  """The rows produced under `versions` (`env_version=...`, `reward_version=...`: the reader's
  own, `rollout.versions`). Episodes of another environment or reward are left out with a
  warning counting them; when none is left of a non-empty selection, StoreError names the
  versions the store holds. `what` names the reader in the messages (e.g. "sft.store=...")."""
  unknown = sorted(set(versions) - set(_VERSIONS))
  if unknown:
    raise ValueError(f"matching_versions: unknown version field(s) {unknown}; use {_VERSIONS}.")
  keep = np.ones((len(rows),), bool)
  for name, value in versions.items():
    keep &= getattr(rows, name) == int(value)
  if len(rows) and not keep.any():
    found = {name: dict(zip(*np.unique(getattr(rows, name), return_counts=True)))
             for name in versions}
    found = {name: {int(k): int(v) for k, v in c.items()} for name, c in found.items()}
    raise StoreError(f"{what}: none of its {len(rows)} selected episodes was produced by this "
                     f"run's environment and reward ({dict(versions)}); it holds {found} "
                     "(version: episodes). Episodes of another environment, codec or reward "
                     "would train on other token layouts or outcomes: collect with this config, "
                     "or read them with TrajectoryStore directly.")
  if not keep.all():
    logging.warning("%s: %d of %d selected episodes were produced by another environment or "
                    "reward than this run's %s; left out.", what, int((~keep).sum()), len(rows),
                    dict(versions))
  return rows.take(keep)


class TrajectoryStore:
  """An append-only directory of Parquet files of episodes (see the module docstring).

  Args:
    path: the store directory (created by the first `append`).
    on_corrupt: "raise" (default): opening or listing the store raises `CorruptFileError` naming
      an unreadable file; "skip": such files are left out with a warning and listed in `skipped`.
  """

  def __init__(self, path: str | os.PathLike, *, on_corrupt: str = "raise"):
    if on_corrupt not in ("raise", "skip"):
      raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}.")
    self.path = os.fspath(path)
    self.on_corrupt = on_corrupt
    self.skipped: dict[str, str] = {}  # path -> why it was left out (on_corrupt="skip")
    self.leftovers: list[str] = []  # temporary files of killed writers (never read)
    self._footers: dict[str, StoredFile] = {}  # files never change once renamed into place
    self._rows: dict[str, Rows] = {}
    self.files()  # checks every footer now: a corrupt file is reported on open

  def __repr__(self) -> str:
    return f"TrajectoryStore({self.path!r})"

  # ---------------------------------------------------------------------------------- listing
  def files(self) -> list[StoredFile]:
    """The data files in append order, each footer checked (see the module docstring)."""
    if not os.path.isdir(self.path):
      return []
    names = sorted(os.listdir(self.path))
    leftovers = [n for n in names if n.startswith(".") and ".tmp" in n]
    if len(leftovers) > len(self.leftovers):
      logging.warning("%s: %d temporary file(s) of interrupted appends are ignored (%s).",
                      self.path, len(leftovers), ", ".join(leftovers[:3]))
    self.leftovers = leftovers
    out = []
    for name in names:
      if name.startswith(".") or not name.endswith(".parquet"):
        continue
      path = os.path.join(self.path, name)
      if path not in self._footers and path not in self.skipped:
        try:
          self._footers[path] = _read_footer(path)
        except CorruptFileError as e:
          if self.on_corrupt == "raise":
            raise
          logging.warning("%s", e)
          self.skipped[path] = str(e)
      if path in self._footers:
        out.append(self._footers[path])
    return out

  def __len__(self) -> int:
    """The number of stored episodes."""
    return sum(f.num_rows for f in self.files())

  def __iter__(self) -> Iterator[EpisodeBatch]:
    """Each file's episodes as appended, in append order."""
    for f in self.files():
      yield self._read_file(f, np.arange(f.num_rows))

  # ---------------------------------------------------------------------------------- writing
  def append(self, batch: EpisodeBatch, *, update: int, info: Mapping[str, Any] | None = None,
             meta: Mapping[str, Any] | None = None, filters: Sequence[str] = ()) -> str | None:
    """Writes `batch` as one new file (atomically, see the module docstring); returns its path, or
    None when `filters` left no episode to write.

    Args:
      batch: the episodes (host or device arrays); validated first.
      update: the learner update the batch belongs to, >= 0 (the training loop passes the
        update that trained on it, numbered from 1 as in metrics.jsonl).
      info: per-episode facts, `{name: [B] numeric or bool}` (e.g. `RolloutStats.episode_info`;
        its `invalid_actions` is what the `parse_failure` filter reads).
      meta: JSON-serialisable facts about the whole batch, kept in the file's metadata.
      filters: validity filters (`FILTERS`) applied before writing: the episodes they drop are
        not stored (branch links remapped as `take_rows` does).
    """
    if isinstance(update, bool) or not isinstance(update, (int, np.integer)) or update < 0:
      raise StoreError(f"append: update must be an integer >= 0, got {update!r}.")
    batch = jax.tree.map(np.asarray, batch).validate()
    info = _check_info(info or {}, batch.batch_size)
    keys = episode_keys(batch)  # before filtering: a kept branch's key counts its parent's actions
    if filters:
      invalid = info.get("invalid_actions", np.full((batch.batch_size,), -1))
      keep = np.flatnonzero(~drop_mask(batch.termination, batch.env_error.any(-1), invalid,
                                       filters))
      if not len(keep):
        return None
      batch, keys = take_rows(batch, keep), keys[keep]
      info = {k: v[keep] for k, v in info.items()}
    table = _to_table(batch, keys, update=int(update), info=info, meta=dict(meta or {}))
    os.makedirs(self.path, exist_ok=True)
    name = f"batch-{self._next_seq():06d}-update-{int(update):06d}.parquet"
    final = os.path.join(self.path, name)
    tmp = os.path.join(self.path, f".{name}.tmp-{os.getpid()}")
    try:
      pq.write_table(table, tmp)
      with open(tmp, "rb") as f:
        os.fsync(f.fileno())
      os.replace(tmp, final)
    except BaseException:
      if os.path.exists(tmp):
        os.remove(tmp)
      raise
    _fsync_dir(self.path)
    return final

  def _next_seq(self) -> int:
    seqs = [int(m.group(1)) for m in map(_NAME.match, os.listdir(self.path)) if m]
    return max(seqs, default=0) + 1

  # ---------------------------------------------------------------------------------- reading
  def rows(self, *, filters: Sequence[str] = (), dedup: bool = False,
           last: int | None = None, versions: Mapping[str, int] | None = None) -> Rows:
    """The stored episodes that pass `filters` (names of `FILTERS`, each dropping what it names)
    and, with `versions`, were produced under them (`matching_versions`), then with `dedup` one
    per `key` (the newest: the last appended), then with `last` the newest `last` of those; in
    store order."""
    rows = Rows.concatenate([self._rows_of(f) for f in self.files()])
    rows = rows.take(~drop_mask(rows.termination, rows.env_error, rows.invalid_actions, filters))
    if versions:
      rows = matching_versions(rows, f"trajectory store {self.path}", **versions)
    if dedup:
      rows = rows.take(_newest_per_key(rows.key))
    if last is not None:
      if last < 0:
        raise StoreError(f"last must be >= 0, got {last}.")
      rows = rows.take(np.arange(max(0, len(rows) - last), len(rows)))
    return rows

  def read(self, *, filters: Sequence[str] = (), dedup: bool = False, last: int | None = None,
           context_length: int | None = None, max_steps: int | None = None) -> EpisodeBatch:
    """The episodes of `rows(filters, dedup, last)` as one EpisodeBatch (see `load`)."""
    return self.load(self.rows(filters=filters, dedup=dedup, last=last),
                     context_length=context_length, max_steps=max_steps)

  def load(self, rows: Rows, *, context_length: int | None = None,
           max_steps: int | None = None) -> EpisodeBatch:
    """The episodes of `rows` as one validated EpisodeBatch, in store order, padded to the largest
    `L` and `S` among their files (or to `context_length` / `max_steps`, which must hold them).
    Branch links are remapped as `take_rows` does."""
    if not len(rows):
      raise StoreError(f"no stored episodes selected in {self.path} ({len(self)} stored).")
    files = {f.path: (i, f) for i, f in enumerate(self.files())}
    missing = sorted(set(rows.path) - set(files))
    if missing:
      raise StoreError(f"rows name files that are not in {self.path} now: {missing[:3]}.")
    rank = np.array([files[p][0] for p in rows.path])
    rows = rows.take(np.lexsort((rows.row, rank)))
    chosen = [files[p][1] for p in dict.fromkeys(rows.path)]
    _check_compatible(chosen)
    length = max(f.context_length for f in chosen)
    steps = max(f.max_steps for f in chosen)
    for given, need, what in ((context_length, length, "context_length"),
                              (max_steps, steps, "max_steps")):
      if given is not None and given < need:
        big = max(chosen, key=lambda f: getattr(f, what))
        raise StoreError(f"{what}={given} is smaller than the {need} of {big.path}.")
    length, steps = context_length or length, max_steps or steps
    parts, offset = [], 0
    for f in chosen:
      part = self._read_file(f, rows.row[rows.path == f.path])
      part = _pad(part, length, steps)
      part = part.replace(parent=np.where(part.parent >= 0, part.parent + offset, part.parent))
      parts.append(part)
      offset += part.batch_size
    names = sorted({name for p in parts for name in p.reward_components})
    parts = [p.replace(reward_components={n: p.reward_components.get(
        n, np.zeros((p.batch_size,), np.float32)) for n in names}) for p in parts]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts).validate()

  def _read_file(self, f: StoredFile, rows) -> EpisodeBatch:
    try:
      table = pq.read_table(f.path).take(pa.array(np.asarray(rows, np.int64)))
    except (pa.ArrowException, OSError) as e:
      raise CorruptFileError(f.path, f"{type(e).__name__}: {e}") from None
    return _relink(_batch_from_table(table, f), rows)

  def _rows_of(self, f: StoredFile) -> Rows:
    """The selection columns of file `f` (cached)."""
    if f.path not in self._rows:
      info = INFO_PREFIX + "invalid_actions"
      versions = [name for name in _VERSIONS if name in f.columns]
      columns = list(_LIGHT) + ([info] if info in f.columns else []) + versions
      try:
        t = pq.read_table(f.path, columns=columns)
        env_error = _list_values(t, "env_error", f.max_steps, f.path).astype(bool)
        milestones = _list_values(t, "milestones", f.max_steps, f.path).astype(np.int64)
      except (pa.ArrowException, OSError, KeyError) as e:
        raise CorruptFileError(f.path, f"{type(e).__name__}: {e}") from None
      n = t.num_rows
      col = lambda name: t.column(name).to_numpy(zero_copy_only=False)
      self._rows[f.path] = Rows(
          path=np.full((n,), f.path, object), row=np.arange(n, dtype=np.int64),
          update=col("update").astype(np.int64),
          written_at=col("written_at").astype("datetime64[us]"),
          key=col("key").astype(object), success=col("success").astype(bool),
          termination=col("termination").astype(np.int32), env_error=env_error.any(-1),
          milestones=np.bitwise_or.reduce(milestones, axis=-1),
          invalid_actions=(col(info).astype(np.int64) if info in columns
                           else np.full((n,), -1, np.int64)),
          group=col("group").astype(np.int64), score=col("score").astype(np.float32),
          **{name: (col(name).astype(np.int64) if name in versions
                    else np.full((n,), -1, np.int64)) for name in _VERSIONS})
    return self._rows[f.path]

  # --------------------------------------------------------------------------------- sampling
  def sample_rows(self, n: int, rng: np.random.Generator, *, weights: Priority = Priority(),
                  filters: Sequence[str] = (), dedup: bool = False,
                  now: int | None = None) -> Rows:
    """`n` distinct episodes of `rows(filters, dedup)` drawn without replacement with probability
    proportional to `priority_weights` (each draw among the episodes not drawn yet), returned in
    store order. Deterministic given `rng`'s state."""
    if not isinstance(rng, np.random.Generator):
      raise TypeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got "
                      f"{type(rng).__name__}.")
    rows = self.rows(filters=filters, dedup=dedup)
    w = priority_weights(rows, weights, now)
    available = int((w > 0).sum())
    if not 1 <= n <= available:
      raise StoreError(f"cannot sample n={n} episodes without replacement: {available} of the "
                       f"{len(rows)} selected in {self.path} have a weight > 0.")
    drawn = rng.choice(len(rows), size=n, replace=False, p=w / w.sum())
    return rows.take(np.sort(drawn))

  def sample(self, n: int, rng: np.random.Generator, *, weights: Priority = Priority(),
             filters: Sequence[str] = (), dedup: bool = False, now: int | None = None,
             context_length: int | None = None, max_steps: int | None = None) -> EpisodeBatch:
    """The episodes of `sample_rows(...)` as one EpisodeBatch (see `load`)."""
    return self.load(self.sample_rows(n, rng, weights=weights, filters=filters, dedup=dedup,
                                      now=now),
                     context_length=context_length, max_steps=max_steps)


def priority_weights(rows: Rows, priority: Priority, now: int | None = None) -> np.ndarray:
  """`[N]` float64 sampling weights of `rows` (the formula is `Priority`'s). `now`: the update
  recency is measured from (default the newest update among `rows`); milestone frequencies are
  shares of `rows`."""
  w = np.where(rows.success, 1.0, float(priority.failure))
  if priority.half_life and len(rows):
    now = int(rows.update.max()) if now is None else now
    if (rows.update > now).any():
      raise StoreError(f"now={now} is before the newest selected update {int(rows.update.max())}.")
    w = w * 0.5 ** ((now - rows.update) / priority.half_life)
  if priority.rare_milestones and len(rows):
    reached = ((rows.milestones[:, None] >> np.arange(32)) & 1).astype(bool)  # [N, 32]
    share = reached.mean(0)
    inverse = np.where(reached, 1.0 / np.where(share > 0, share, 1.0), 1.0)  # [N, 32]
    w = w * inverse.max(-1) ** priority.rare_milestones
  return w


def _check_compatible(files: Sequence[StoredFile]):
  """Files read into one batch must agree on `routing` (presence and `[layers, k]`)."""
  first = files[0]
  for f in files[1:]:
    if f.routing != first.routing:
      raise StoreError(f"{first.path} and {f.path} cannot be read into one batch: their routing "
                       f"shapes ([layers, k]) are {first.routing} and {f.routing} (None: absent); "
                       f"read them separately (rows(...).take(...)).")


def _fsync_dir(path: str):
  """Makes a rename in directory `path` durable (where the platform allows opening directories)."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)
