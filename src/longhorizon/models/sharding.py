"""Logical-axis sharding: parameter and activation axis names -> mesh axes (`data`, `fsdp`, `tensor`).

Every parameter of `llama.py` is created with logical axis names (`vocab`, `embed`, `heads`,
`kv_heads`, `mlp`, `norm`, `layers`, `value`); activations are constrained with `batch`, `length`,
`act_embed`. A rule set (from the experiment config) maps each logical name to a mesh axis, a tuple of
mesh axes, or None (replicated). Shardings are derived from `jax.eval_shape` of the initialiser, so no
parameter is materialised unsharded.

Code traced inside `mesh_context(mesh)` honours the activation constraints: flax reads the mesh set by
`jax.set_mesh`, and under the legacy `with mesh:` alone its `with_logical_constraint` does nothing
(activations then follow the parameters: every `data` replica computes the whole batch).

A Python loop over sharded steps must wait for each step (`jax.block_until_ready`) before issuing the
next: the CPU client admits 32 queued computations per device and blocks the launching thread beyond
that; with collectives, the blocked launch threads starve the executions they wait for and the run
aborts in a collective rendezvous (BUILD_NOTES.md, issue 15, "sharded SFT deadlock").
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["MESH_AXES", "DEFAULT_RULES", "make_mesh", "mesh_context", "logical_shardings",
           "param_shardings", "init_sharded_params", "batch_sharding", "shard_batch"]

MESH_AXES = ("data", "fsdp", "tensor")

# FSDP shards the model width of every matrix; tensor parallelism shards heads, MLP and vocabulary;
# batches are split over data x fsdp. A mixture of experts puts its experts on the tensor axis
# (expert parallelism): flax gives each mesh axis to the first rule that claims it, so "experts"
# comes before "mlp", and an expert's own MLP width then stays whole on its device.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("experts", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
    ("value", None),
    ("lora", None),  # the rank axis of LoRA adapters (replicated; their other axis follows the kernel)
)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
  """A `(data, fsdp, tensor)` mesh over the first `data*fsdp*tensor` devices."""
  devices = jax.devices() if devices is None else devices
  need = data * fsdp * tensor
  if need > len(devices):
    raise ValueError(f"mesh (data={data}, fsdp={fsdp}, tensor={tensor}) needs {need} devices, "
                     f"{len(devices)} available (on CPU emulate more with "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={need}).")
  return Mesh(np.asarray(devices[:need]).reshape(data, fsdp, tensor), MESH_AXES)


def _rules(rules):
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


def logical_shardings(boxed_tree, mesh: Mesh, rules: Sequence = DEFAULT_RULES):
  """NamedShardings for a tree of `nn.LogicallyPartitioned` leaves (e.g. from `jax.eval_shape`)."""
  specs = nn.get_partition_spec(boxed_tree)
  mesh_specs = nn.logical_to_mesh(specs, _rules(rules))
  return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), mesh_specs,
                                is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_shardings(module: nn.Module, sample_input, mesh: Mesh, rules: Sequence = DEFAULT_RULES):
  """Shardings of `module`'s params, from the shapes of its initialiser (nothing is allocated)."""
  abstract = jax.eval_shape(lambda: module.init(jax.random.key(0), sample_input))
  return logical_shardings(abstract["params"], mesh, rules)


def init_sharded_params(module: nn.Module, sample_input, key, mesh: Mesh,
                        rules: Sequence = DEFAULT_RULES):
  """Initialises params directly into their shardings (jit with out_shardings)."""
  shardings = param_shardings(module, sample_input, mesh, rules)

  def init():
    return nn.meta.unbox(module.init(key, sample_input)["params"])

  return jax.jit(init, out_shardings=shardings)()


def fit_sharding(sharding: NamedSharding, shape) -> NamedSharding:
  """`sharding` with every dimension that its mesh axes do not divide evenly left unsharded (e.g. a
  69-token vocabulary on a tensor axis of 2)."""
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
  fitted = []
  for dim, axes in zip(shape, spec):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    ways = int(np.prod([sizes[n] for n in names])) if names else 1
    fitted.append(axes if dim % ways == 0 else None)
  return NamedSharding(sharding.mesh, PartitionSpec(*fitted))


def shard_params(params, module: nn.Module, sample_input, mesh: Mesh,
                 rules: Sequence = DEFAULT_RULES):
  """Places existing (unboxed) params, e.g. loaded from a checkpoint, onto their shardings
  (dimensions the mesh does not divide evenly stay unsharded)."""
  shardings = param_shardings(module, sample_input, mesh, rules)
  shardings = jax.tree.map(lambda p, sh: fit_sharding(sh, np.shape(p)), params, shardings)
  return jax.device_put(params, shardings)


def batch_sharding(mesh: Mesh, rank: int = 2, rules: Sequence = DEFAULT_RULES) -> NamedSharding:
  """Sharding of a `[B, ...]` batch array: the batch axis split per the `batch` rule."""
  axes = dict(_rules(rules)).get("batch")
  return NamedSharding(mesh, PartitionSpec(axes, *([None] * (rank - 1))))


def shard_batch(batch, mesh: Mesh, rules: Sequence = DEFAULT_RULES):
  """Places every `[B, ...]` array of a batch pytree (e.g. an `EpisodeBatch`) with its batch axis
  split per the `batch` rule (unsharded where the mesh does not divide `B`); scalars replicated.
  The jitted update then starts from data-parallel inputs instead of replicated ones."""
  def place(x):
    x = jnp.asarray(x)
    if x.ndim == 0:
      return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    return jax.device_put(x, fit_sharding(batch_sharding(mesh, x.ndim, rules), x.shape))
  return jax.tree.map(place, batch)


def mesh_context(mesh: Mesh, rules: Sequence = DEFAULT_RULES) -> contextlib.ExitStack:
  """A context with `mesh` set (`jax.set_mesh`, which flax's `with_logical_constraint` reads) and the
  logical rules active: jitted functions traced inside it shard activations by the rules."""
  stack = contextlib.ExitStack()
  stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(nn.logical_axis_rules(_rules(rules)))
  return stack


def with_rules(fn, mesh: Mesh, rules: Sequence = DEFAULT_RULES):
  """Runs `fn()` inside `mesh_context(mesh, rules)`."""
  with mesh_context(mesh, rules):
    return fn()

