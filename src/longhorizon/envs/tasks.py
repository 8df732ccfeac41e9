"""Task suites as TFDS datasets (array_record files, read with `tfds.data_source`, no TensorFlow).

A suite is one environment (name + constructor parameters) and a task seed. Its `train`, `test`
and `ood` splits are generated deterministically: task `i` of split `s` comes from
`generate_task(fold_in(fold_in(key(seed), split_id(s)), i), s)`. Test and OOD tasks that also
occur in `train` (same task hash) are skipped, so evaluation never scores a memorised task.
Task generation uses only this seed; the environment's own randomness comes from the reset key and
verification is deterministic, so the three streams stay separate.

    source = tasks.load("pointer_chain", "test", env_params={"horizon": 8}, sizes={"test": 200})
    batch = tasks.stack(source, range(64))          # task pytree with a leading [64]
    state, timestep = jax.vmap(env.reset)(keys, batch)

Files live under `data_dir` (default `$LONGHORIZON_DATA` or `~/.cache/longhorizon/tasks`), in
`longhorizon_tasks/<suite_name>/1.0.0/`; a suite is generated on first use and read back afterwards.
`load` checks the files it reads before returning (`dataset_info.json` parses, every record of the
split passes array_record's chunk checksums, the record counts match): a damaged suite raises
`CorruptSuiteError` naming the folder to delete, and the next `load` regenerates it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
from typing import Any, Iterable, Mapping

from array_record.python.array_record_module import ArrayRecordReader
import jax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds

from longhorizon import envs
from longhorizon.envs.base import SPLITS
from longhorizon.envs.types import hash_tree, num_tasks

__all__ = ["load", "stack", "build", "suite_name", "suite_dir", "CorruptSuiteError", "DEFAULT_SIZES",
           "default_data_dir"]

DEFAULT_SIZES = {"train": 2048, "test": 256, "ood": 256}
_SPLIT_IDS = {"train": 0, "test": 1, "ood": 2}
_GENERATION_CHUNK = 1024
# The TFDS dataset folder (TFDS names it after the builder class, LonghorizonTasks) and version.
_DATASET, _VERSION = "longhorizon_tasks", "1.0.0"


class CorruptSuiteError(RuntimeError):
  """A task suite's files on disk are damaged (the message names the folder to delete)."""


def default_data_dir() -> str:
  return os.environ.get("LONGHORIZON_DATA", os.path.expanduser("~/.cache/longhorizon/tasks"))


def suite_name(env_name: str, env_params: Mapping[str, Any], seed: int, sizes: Mapping[str, int],
               env_version: str, source: str | None = None) -> str:
  """The TFDS config name (and folder name) of a suite: a readable prefix, the environment's name
  with every character outside `[A-Za-z0-9_]` replaced by `_`, plus a digest of everything that
  defines the suite. `source` is the import path of an environment outside the registry
  (`"package.module:Class"`): it enters the digest, so two such classes that share a `name` never
  share a suite."""
  spec = {"env": env_name, "params": dict(env_params), "seed": int(seed), "sizes": dict(sizes),
          "version": env_version}
  if source is not None:
    spec["source"] = source
  digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]
  prefix = re.sub(r"[^A-Za-z0-9_]+", "_", env_name).strip("_") or "env"
  return f"{prefix}_s{seed}_{digest}"


def suite_dir(data_dir: str, name: str) -> str:
  """The folder holding the files of the suite `name` (see `suite_name`) under `data_dir`."""
  return os.path.join(data_dir, _DATASET, name, _VERSION)


@contextlib.contextmanager
def suite_lock(data_dir: str, name: str):
  """Holds an exclusive `fcntl.flock` on `<data_dir>/.locks/<name>.lock` while a suite is
  checked and generated, so runs that start together with the same new suite take turns: the
  first generates it, the others find it prepared (TFDS renames the generated folder into place,
  and a second rename onto it would fail). The kernel releases the lock if its holder dies."""
  folder = os.path.join(data_dir, ".locks")
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, f"{name}.lock"), "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _flatten(task) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(task)[0]
  return {jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
          for path, leaf in leaves}


def _generate_split(env, split: str, seed: int, count: int, exclude: set[int]) -> dict[str, np.ndarray]:
  """`count` tasks of `split` (flattened, stacked), skipping tasks whose hash is in `exclude`."""
  base = jax.random.fold_in(jax.random.key(seed), _SPLIT_IDS[split])

  @jax.jit
  def make(indices):
    tasks = jax.vmap(lambda i: env.generate_task(jax.random.fold_in(base, i), split))(indices)
    return tasks, jax.vmap(hash_tree)(tasks)

  kept, total, start = [], 0, 0
  seen = set(exclude)
  while total < count:
    if start > 20 * count + 10 * _GENERATION_CHUNK:
      raise RuntimeError(f"{env.name}: could not generate {count} distinct {split} tasks outside "
                         f"train (got {total}); the task space is too small for these sizes: "
                         f"lower the suite sizes (config.tasks.train_size / test_size / ood_size).")
    tasks, hashes = make(jnp.arange(start, start + _GENERATION_CHUNK, dtype=jnp.uint32))
    flat, hashes = _flatten(tasks), np.asarray(hashes)
    take = []
    for j, h in enumerate(hashes.tolist()):
      if h in seen:
        continue
      seen.add(h)
      take.append(j)
      if total + len(take) == count:
        break
    kept.append({k: v[take] for k, v in flat.items()})
    total += len(take)
    start += _GENERATION_CHUNK
  return {k: np.concatenate([c[k] for c in kept]) for k in kept[0]}


@functools.lru_cache(maxsize=None)
def _builder_class():
  class LonghorizonTasks(tfds.core.GeneratorBasedBuilder):
    """Procedurally generated tasks of one longhorizon environment."""
    VERSION = tfds.core.Version(_VERSION)

    def __init__(self, *, env, env_params, seed, sizes, name, **kwargs):
      self._env, self._env_params, self._seed, self._sizes = env, dict(env_params), seed, dict(sizes)
      config = tfds.core.BuilderConfig(
          name=name, description=f"{env.name} {dict(env_params)} seed={seed} sizes={dict(sizes)}")
      super().__init__(config=config, **kwargs)

    def _info(self):
      example = jax.eval_shape(lambda: self._env.generate_task(jax.random.key(0)))
      features = {k: tfds.features.Tensor(shape=v.shape, dtype=np.dtype(v.dtype))
                  for k, v in _flatten(jax.tree.map(
                      lambda s: np.zeros(s.shape, s.dtype), example)).items()}
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features),
                                   metadata=tfds.core.MetadataDict(
                                       env=self._env.name, env_params=self._env_params,
                                       seed=self._seed, env_version=self._env.version))

    def _split_generators(self, dl_manager):
      del dl_manager
      train = _generate_split(self._env, "train", self._seed, self._sizes["train"], set())
      train_hashes = set(np.asarray(jax.jit(jax.vmap(hash_tree))(_unflatten_like(
          self._env, train))).tolist())
      out = {"train": self._generate_examples(train)}
      for split in ("test", "ood"):
        out[split] = self._generate_examples(
            _generate_split(self._env, split, self._seed, self._sizes[split], train_hashes))
      return out

    def _generate_examples(self, arrays):
      n = len(next(iter(arrays.values())))
      for i in range(n):
        yield i, {k: v[i] for k, v in arrays.items()}

  return LonghorizonTasks


def _unflatten_like(env, flat: Mapping[str, np.ndarray]):
  """The task pytree (leading batch axis) from flattened arrays."""
  example = jax.eval_shape(lambda: env.generate_task(jax.random.key(0)))
  paths, treedef = jax.tree_util.tree_flatten_with_path(example)
  leaves = [np.asarray(flat[jax.tree_util.keystr(p, simple=True, separator=".")]) for p, _ in paths]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _remedy(folder: str) -> str:
  return (f"delete the folder {folder} to regenerate it (the suite is deterministic: the same tasks "
          "come back).")


def _check_info(folder: str) -> None:
  """Raises `CorruptSuiteError` if the suite in `folder` has a `dataset_info.json` that does not
  parse (TFDS reads it before anything else)."""
  path = os.path.join(folder, "dataset_info.json")
  if not os.path.exists(path):
    return
  try:
    with open(path) as f:
      info = json.load(f)
    if not isinstance(info, dict) or not isinstance(info.get("splits"), list):
      raise ValueError("expected a JSON object with a 'splits' list")
  except (ValueError, UnicodeDecodeError) as e:
    raise CorruptSuiteError(f"task suite {path} is not valid ({e}); {_remedy(folder)}") from None


def _check_records(builder, split: str) -> None:
  """Reads every record of `split` once (array_record checks each chunk's checksum) and compares
  the record counts with `dataset_info.json`; raises `CorruptSuiteError` naming the file."""
  folder = os.fspath(builder.data_dir)
  info = builder.info.splits[split]
  for path, expected in zip(info.filepaths, info.shard_lengths):
    path = os.fspath(path)
    try:
      reader = ArrayRecordReader(path)
      try:
        count = reader.num_records()
        reader.read_all()
      finally:
        reader.close()
    except (RuntimeError, OSError, ValueError) as e:
      raise CorruptSuiteError(f"task suite file {path} cannot be read ({e}); "
                              f"{_remedy(folder)}") from None
    if count != expected:
      raise CorruptSuiteError(f"task suite file {path} holds {count} records, dataset_info.json "
                              f"says {expected}; {_remedy(folder)}")


def build(env_name: str, env_params: Mapping[str, Any] | None = None, seed: int = 0,
          sizes: Mapping[str, int] | None = None, data_dir: str | None = None):
  """The (prepared) TFDS builder of a suite; generates the files on first use.

  `env_name` is a registered name or an import path `"package.module:Class"` (see `envs.make`).
  Raises `CorruptSuiteError` if the suite's `dataset_info.json` does not parse. Processes that
  build the same suite at once take turns (`suite_lock`).
  """
  env_params = dict(env_params or {})
  sizes = {**DEFAULT_SIZES, **(sizes or {})}
  bad = sorted(set(sizes) - set(SPLITS))
  if bad:
    raise ValueError(f"unknown split(s) {bad}; splits are {list(SPLITS)}.")
  env = envs.make(env_name, **env_params)
  source = None if env_name in envs.registered() else env_name
  name = suite_name(env.name or type(env).__name__, env_params, seed, sizes, env.version, source)
  data_dir = data_dir or default_data_dir()
  with suite_lock(data_dir, name):
    _check_info(suite_dir(data_dir, name))
    builder = _builder_class()(env=env, env_params=env_params, seed=seed, sizes=sizes, name=name,
                               data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare()
  builder.env = env
  return builder


def load(env_name: str, split: str, env_params: Mapping[str, Any] | None = None, seed: int = 0,
         sizes: Mapping[str, int] | None = None, data_dir: str | None = None):
  """A random-access data source over `split`'s tasks (each a dict of flattened arrays).

  The split's files are read once here, so a damaged suite raises `CorruptSuiteError` (naming the
  folder to delete) now rather than at the first task drawn.
  """
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; splits are {list(SPLITS)}.")
  builder = build(env_name, env_params, seed, sizes, data_dir)
  _check_records(builder, split)
  source = builder.as_data_source(split=split)
  source.env = builder.env
  return source


def count(tasks) -> int:
  """The number of tasks in a batch from `stack` (a pytree with a leading axis, or a list)."""
  return num_tasks(tasks)


def difficulties(env, tasks) -> np.ndarray:
  """`[T]` int32 `task_difficulty` of each task of a batch from `stack`."""
  if isinstance(tasks, (list, tuple)):
    return np.array([env.task_difficulty(t) for t in tasks], np.int32)
  return np.asarray(jax.jit(jax.vmap(env.task_difficulty))(tasks))


def stack(source, indices: Iterable[int]):
  """The env's task pytree with a leading batch axis, from records `indices` of a data source; for
  a host environment's task list, the list of those tasks."""
  if isinstance(source, (list, tuple)):
    return [source[int(i)] for i in indices]
  records = [source[int(i)] for i in indices]
  flat = {k: np.stack([r[k] for r in records]) for k in records[0]}
  return _unflatten_like(source.env, flat)
