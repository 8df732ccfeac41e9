"""LoRA adapters on a decoder's parameter tree: which leaves train, merging, and the peft layout.

With `ModelConfig.lora_rank = r > 0` each `lora_targets` projection of the decoder holds, beside its
frozen `kernel`, float32 adapters `lora_a [L, D_in, r]` and `lora_b [L, r, D_out]` (stacked over
layers like every layer parameter) and computes `x W + (alpha / r) x A B` (`llama.LoraDense`).

    trainable, frozen = lora.partition(params, config)   # adapters | everything else
    params = lora.combine(trainable, frozen)
    merged = lora.merge(params, config)          # kernels + (alpha/r) A B, adapters dropped
    base = lora.base_params(params)              # adapters switched off (no copy of any weight)
    lora.save_adapters(folder, params, config)   # adapter_model.safetensors + adapter_config.json
    params = lora.load_adapters(folder, params, config)

The learner differentiates and optimises `trainable` only (so the frozen weights get no gradient
computation and no optimiser state); the sampler decodes with merged kernels, re-merged once per
policy version; the KL reference is `base_params` under `base_config` (the base model itself).
`checkpoint.save` of a LoRA model writes the merged weights as a plain HF model.

Why not qwix: qwix adds LoRA by intercepting the matmuls of Flax modules, which reaches our
training forward pass but not the sampler's (`cached_forward` runs on re-laid-out arrays: fused
q|k|v and gate|up matrices, and a C++ decode-attention kernel), and its parameter names are its own;
explicit adapter leaves give one tree for training, merging, checkpoints and the peft export.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file
from safetensors.numpy import save_file

from longhorizon.models.config import ModelConfig

__all__ = ["ADAPTER_KEYS", "is_adapter", "partition", "combine", "adapters", "base_params",
           "base_config", "merge", "add_adapters", "save_adapters", "load_adapters",
           "adapter_digest"]

ADAPTER_KEYS = ("lora_a", "lora_b")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_WEIGHTS = "adapter_model.safetensors"
_CONFIG = "adapter_config.json"


def is_adapter(path: tuple) -> bool:
  """Whether the flattened parameter path `path` (a tuple of keys) is an adapter leaf."""
  return bool(path) and path[-1] in ADAPTER_KEYS


def _flat(params) -> dict:
  return traverse_util.flatten_dict(params)


def partition(params, config: ModelConfig):
  """`(trainable, frozen)`: the adapter leaves and the rest, as two nested dicts. Without LoRA
  every parameter trains: `(params, None)`, the tree unchanged (so optimiser states and
  checkpoints of full fine-tuning keep their layout)."""
  if not config.lora_rank:
    return params, None
  flat = _flat(params)
  missing = [p for p in _adapter_paths(config) if p not in flat]
  if missing:
    raise ValueError(f"ModelConfig.lora_rank={config.lora_rank} but the parameters have no "
                     f"adapter at {'/'.join(missing[0])} (add them with lora.add_adapters).")
  trainable = {p: v for p, v in flat.items() if is_adapter(p)}
  frozen = {p: v for p, v in flat.items() if not is_adapter(p)}
  return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def combine(trainable, frozen):
  """The inverse of `partition`."""
  if frozen is None:
    return trainable
  return traverse_util.unflatten_dict({**_flat(frozen), **_flat(trainable)})


def adapters(params) -> dict:
  """The adapter leaves of `params` (a nested dict; empty without LoRA)."""
  return traverse_util.unflatten_dict({p: v for p, v in _flat(params).items() if is_adapter(p)})


def base_params(params):
  """`params` without adapters: the base model (the arrays are shared, not copied)."""
  flat = _flat(params)
  if not any(is_adapter(p) for p in flat):
    return params
  return traverse_util.unflatten_dict({p: v for p, v in flat.items() if not is_adapter(p)})


def base_config(config: ModelConfig) -> ModelConfig:
  """`config` with LoRA off: the architecture `base_params` and `merge` results run under."""
  return config.replace(lora_rank=0) if config.lora_rank else config


def _adapter_paths(config: ModelConfig) -> list[tuple]:
  return [(*_module(name), key) for name in config.lora_targets for key in ADAPTER_KEYS]


def _module(name: str) -> tuple:
  return ("layers", "self_attn" if name in _ATTENTION else "mlp", name)


def merge(params, config: ModelConfig):
  """Parameters of `base_config(config)` computing the same function: each adapted kernel becomes
  `W + (alpha / r) A B` (in float32, stored in the kernel's dtype), the adapters are dropped."""
  flat = _flat(params)
  if not any(is_adapter(p) for p in flat):
    return params
  out = {p: v for p, v in flat.items() if not is_adapter(p)}
  for name in config.lora_targets:
    module = _module(name)
    kernel = out[(*module, "kernel")]
    delta = jnp.einsum("lir,lro->lio", jnp.asarray(flat[(*module, "lora_a")], jnp.float32),
                       jnp.asarray(flat[(*module, "lora_b")], jnp.float32))
    out[(*module, "kernel")] = (jnp.asarray(kernel, jnp.float32)
                                + config.lora_scale * delta).astype(kernel.dtype)
  return traverse_util.unflatten_dict(out)


def _shapes(params, config: ModelConfig) -> dict:
  """`path -> shape` of every adapter `config` asks for, from the kernels in `params`."""
  flat, r, out = _flat(params), config.lora_rank, {}
  for name in config.lora_targets:
    module = _module(name)
    layers, d_in, d_out = np.shape(flat[(*module, "kernel")])
    out[(*module, "lora_a")] = (layers, d_in, r)
    out[(*module, "lora_b")] = (layers, r, d_out)
  return out


def add_adapters(params, config: ModelConfig, key: jax.Array):
  """`params` (e.g. a loaded checkpoint's) with fresh adapters where `config` asks for them and
  they are missing: `lora_a` uniform in `+-1/sqrt(D_in)` (peft's default), `lora_b` zero, so the
  model's function is unchanged. A no-op without LoRA."""
  if not config.lora_rank:
    return params
  flat = dict(_flat(params))
  for i, (path, shape) in enumerate(sorted(_shapes(params, config).items())):
    if path in flat:
      continue
    if path[-1] == "lora_a":
      bound = 1.0 / np.sqrt(shape[1])
      flat[path] = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound, bound)
    else:
      flat[path] = jnp.zeros(shape, jnp.float32)
  return traverse_util.unflatten_dict(flat)


def _peft_name(name: str, layer: int, which: str) -> str:
  part = "self_attn" if name in _ATTENTION else "mlp"
  return f"base_model.model.model.layers.{layer}.{part}.{name}.lora_{which}.weight"


def save_adapters(folder, params, config: ModelConfig, base_model: str = "") -> pathlib.Path:
  """Writes the adapters alone in the layout HF `peft` loads (`PeftModel.from_pretrained(model,
  folder)` on the base model saved by `checkpoint.save(..., lora.base_params(params))`):
  `adapter_model.safetensors` (`lora_A.weight [r, D_in]`, `lora_B.weight [D_out, r]` per layer
  and projection, float32) and `adapter_config.json`."""
  if not config.lora_rank:
    raise ValueError("save_adapters: ModelConfig.lora_rank is 0, there are no adapters to save.")
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  flat, tensors = _flat(jax.device_get(params)), {}
  for name in config.lora_targets:
    a, b = (np.asarray(flat[(*_module(name), k)], np.float32) for k in ADAPTER_KEYS)
    for layer in range(a.shape[0]):
      tensors[_peft_name(name, layer, "A")] = np.ascontiguousarray(a[layer].T)
      tensors[_peft_name(name, layer, "B")] = np.ascontiguousarray(b[layer].T)
  save_file(tensors, str(folder / _WEIGHTS), metadata={"format": "pt"})
  peft_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
      "r": config.lora_rank, "lora_alpha": config.lora_alpha, "lora_dropout": config.lora_dropout,
      "target_modules": sorted(config.lora_targets), "bias": "none", "fan_in_fan_out": False,
      "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
      "modules_to_save": None}
  (folder / _CONFIG).write_text(json.dumps(peft_config, indent=1))
  return folder


def adapter_digest(folder) -> str:
  """The sha256 (hex) of a peft folder's `adapter_model.safetensors`: which adapters a run
  started from."""
  return hashlib.sha256((pathlib.Path(folder) / _WEIGHTS).read_bytes()).hexdigest()


def load_adapters(folder, params, config: ModelConfig):
  """`params` with the adapters of a `save_adapters` (or peft) folder; raises naming the file and
  the field when its rank, alpha, targets or shapes do not match `config`."""
  folder = pathlib.Path(folder)
  for f in (_WEIGHTS, _CONFIG):
    if not (folder / f).is_file():
      raise FileNotFoundError(f"{folder / f}: missing (a peft adapter folder has {_WEIGHTS} and "
                              f"{_CONFIG}).")
  saved = json.loads((folder / _CONFIG).read_text())
  want = {"r": config.lora_rank, "lora_alpha": config.lora_alpha,
          "target_modules": sorted(config.lora_targets)}
  for field, value in want.items():
    got = sorted(saved.get(field) or []) if field == "target_modules" else saved.get(field)
    if got != value:
      raise ValueError(f"{folder / _CONFIG}: {field} is {got!r}, the model config has {value!r}.")
  tensors, flat = load_file(str(folder / _WEIGHTS)), dict(_flat(params))
  for path, shape in _shapes(params, config).items():
    which = "A" if path[-1] == "lora_a" else "B"
    names = [_peft_name(path[2], layer, which) for layer in range(shape[0])]
    absent = [n for n in names if n not in tensors]
    if absent:
      raise ValueError(f"{folder / _WEIGHTS}: no tensor {absent[0]!r}.")
    stacked = np.stack([tensors[n].T for n in names]).astype(np.float32)
    if stacked.shape != shape:
      raise ValueError(f"{folder / _WEIGHTS}: {path[2]} lora_{which} has shape {stacked.shape} "
                       f"(stacked over layers), the model needs {shape}.")
    flat[path] = jnp.asarray(stacked)
  return traverse_util.unflatten_dict(flat)
