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

Files live under `data_dir` (default `$LONGHORIZON_DATA` or `~/.cache/longhorizon/tasks`); a
suite is generated on first use and read back afterwards.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.envs.base import SPLITS
from longhorizon.envs.types import hash_tree

__all__ = ["load", "stack", "build", "suite_name", "DEFAULT_SIZES", "default_data_dir"]

DEFAULT_SIZES = {"train": 2048, "test": 256, "ood": 256}
_SPLIT_IDS = {"train": 0, "test": 1, "ood": 2}
_GENERATION_CHUNK = 1024


def default_data_dir() -> str:
  return os.environ.get("LONGHORIZON_DATA", os.path.expanduser("~/.cache/longhorizon/tasks"))


def suite_name(env_name: str, env_params: Mapping[str, Any], seed: int, sizes: Mapping[str, int],
               env_version: str) -> str:
  """The TFDS config name of a suite: readable prefix plus a digest of everything that defines it."""
  spec = json.dumps({"env": env_name, "params": dict(env_params), "seed": int(seed),
                     "sizes": dict(sizes), "version": env_version}, sort_keys=True, default=str)
  digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
  return f"{env_name}_s{seed}_{digest}"


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
                         f"train (got {total}); the task space is too small for these sizes.")
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
  import tensorflow_datasets as tfds

  class LonghorizonTasks(tfds.core.GeneratorBasedBuilder):
    """Procedurally generated tasks of one longhorizon environment."""
    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, env, env_params, seed, sizes, **kwargs):
      self._env, self._env_params, self._seed, self._sizes = env, dict(env_params), seed, dict(sizes)
      config = tfds.core.BuilderConfig(
          name=suite_name(env.name, env_params, seed, sizes, env.version),
          description=f"{env.name} {dict(env_params)} seed={seed} sizes={dict(sizes)}")
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


def build(env_name: str, env_params: Mapping[str, Any] | None = None, seed: int = 0,
          sizes: Mapping[str, int] | None = None, data_dir: str | None = None):
  """The (prepared) TFDS builder of a suite; generates the files on first use."""
  from longhorizon import envs
  env_params = dict(env_params or {})
  sizes = {**DEFAULT_SIZES, **(sizes or {})}
  bad = sorted(set(sizes) - set(SPLITS))
  if bad:
    raise ValueError(f"unknown split(s) {bad}; splits are {list(SPLITS)}.")
  env = envs.make(env_name, **env_params)
  builder = _builder_class()(env=env, env_params=env_params, seed=seed, sizes=sizes,
                             data_dir=data_dir or default_data_dir(), file_format="array_record")
  builder.download_and_prepare()
  builder.env = env
  return builder


def load(env_name: str, split: str, env_params: Mapping[str, Any] | None = None, seed: int = 0,
         sizes: Mapping[str, int] | None = None, data_dir: str | None = None):
  """A random-access data source over `split`'s tasks (each a dict of flattened arrays)."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; splits are {list(SPLITS)}.")
  builder = build(env_name, env_params, seed, sizes, data_dir)
  source = builder.as_data_source(split=split)
  source.env = builder.env
  return source


def stack(source, indices: Iterable[int]):
  """The env's task pytree with a leading batch axis, from records `indices` of a data source."""
  records = [source[int(i)] for i in indices]
  flat = {k: np.stack([r[k] for r in records]) for k in records[0]}
  return _unflatten_like(source.env, flat)
