"""LoRA adapters (models/lora.py, llama.LoraDense): the adapter math by hand, identity at init,
merging, the KV-cache path, partitioning, dropout, adapter files, merged HF export, and HF peft
loading our adapters (the torch extra)."""

import importlib.util
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.models import (Transformer, cached_forward, checkpoint, init_cache, init_params,
                                lora, tiny_config)
from longhorizon.models.llama import LoraDense


def _config(**changes):
  return tiny_config(lora_rank=4, lora_alpha=8.0, **changes)


def _trained_like(params, scale=0.05, seed=0):
  """`params` with non-zero adapters (as after training): every lora_b gets random entries."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x + scale * rng.normal(size=x.shape).astype(np.float32)
      if path[-1].key == "lora_b" else x, params)


def _tokens(shape=(2, 9), seed=1):
  return jax.random.randint(jax.random.key(seed), shape, 0, 256)


def test_lora_dense_by_hand():
  """x = [1, 2], W = I, A = [[1], [1]], B = [[0.5, -0.5]], alpha / r = 2 / 1:
  x W = [1, 2]; x A B = 3 * [0.5, -0.5]; times 2 -> [3, -3]; y = [4, -1]."""
  config = tiny_config(lora_rank=1, lora_alpha=2.0)
  layer = LoraDense(2, ("embed", "mlp"), config)
  params = {"kernel": jnp.eye(2), "lora_a": jnp.array([[1.0], [1.0]]),
            "lora_b": jnp.array([[0.5, -0.5]])}
  y = layer.apply({"params": params}, jnp.array([[1.0, 2.0]]))
  np.testing.assert_allclose(np.asarray(y), [[4.0, -1.0]], rtol=0, atol=1e-6)


def test_adapter_tree_and_identity_at_init():
  """Adapters sit on every target projection with peft's shapes (A [D_in, r], B [r, D_out] per
  layer, float32), B starts at 0, so the fresh LoRA model equals its base exactly."""
  config = _config(lora_targets=("q_proj", "v_proj", "down_proj"))
  params = init_params(config, jax.random.key(0))
  attn, mlp = params["layers"]["self_attn"], params["layers"]["mlp"]
  assert attn["q_proj"]["lora_a"].shape == (2, 64, 4) and attn["q_proj"]["lora_b"].shape == (2, 4, 64)
  assert attn["v_proj"]["lora_b"].shape == (2, 4, 32) and mlp["down_proj"]["lora_a"].shape == (2, 128, 4)
  assert "lora_a" not in attn["k_proj"] and "lora_a" not in mlp["up_proj"]
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(lora.adapters(params)))
  assert float(jnp.abs(attn["q_proj"]["lora_a"]).max()) <= 1 / np.sqrt(64)
  tokens = _tokens()
  with_adapters = Transformer(config).apply({"params": params}, tokens).logits
  base = Transformer(lora.base_config(config)).apply({"params": lora.base_params(params)}, tokens)
  np.testing.assert_array_equal(np.asarray(with_adapters), np.asarray(base.logits))


def test_merge_equals_the_adapted_model_and_switching_off_gives_the_base():
  config = _config()
  params = _trained_like(init_params(config, jax.random.key(0)))
  tokens = _tokens()
  adapted = np.asarray(Transformer(config).apply({"params": params}, tokens).logits)
  merged = lora.merge(params, config)
  assert not lora.adapters(merged)
  base_config = lora.base_config(config)
  np.testing.assert_allclose(
      np.asarray(Transformer(base_config).apply({"params": merged}, tokens).logits), adapted,
      atol=1e-5)
  off = np.asarray(Transformer(base_config).apply({"params": lora.base_params(params)},
                                                  tokens).logits)
  assert np.abs(off - adapted).max() > 1e-2  # the adapters matter, and switching them off works
  # Switching off copies nothing: the base arrays are the same objects.
  assert lora.base_params(params)["embed_tokens"]["embedding"] is params["embed_tokens"]["embedding"]


def test_kv_cache_path_equals_the_full_forward_pass():
  """The sampler's path (merged kernels in `prepare_decode_params`) gives the whole-sequence
  logits of the adapted model, prefill then one-token steps."""
  config = _config()
  params = _trained_like(init_params(config, jax.random.key(0)))
  tokens = _tokens((2, 8))
  full = np.asarray(Transformer(config).apply({"params": params}, tokens).logits)
  cache = init_cache(config, 2, 16)
  out = cached_forward(params, config, tokens[:, :5], cache, compute_logits=True)
  steps = [np.asarray(out.logits)]
  cache = out.cache
  for t in range(5, 8):
    out = cached_forward(params, config, tokens[:, t:t + 1], cache, compute_logits=True)
    steps.append(np.asarray(out.logits))
    cache = out.cache
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=2e-5)


def test_partition_and_combine():
  config = _config()
  params = init_params(config, jax.random.key(0))
  trainable, frozen = lora.partition(params, config)
  flat_t = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(trainable)[0]]
  assert flat_t and all("lora_" in p for p in flat_t)
  assert len(flat_t) == 2 * len(config.lora_targets)
  assert not any("lora_" in jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_flatten_with_path(frozen)[0])
  jax.tree.map(np.testing.assert_array_equal, lora.combine(trainable, frozen), params)
  # Full fine-tuning keeps the tree as it is (optimiser states and checkpoints unchanged).
  plain = tiny_config()
  plain_params = init_params(plain, jax.random.key(0))
  assert lora.partition(plain_params, plain) == (plain_params, None)
  with pytest.raises(ValueError, match="no adapter at layers/self_attn/q_proj/lora_a"):
    lora.partition(plain_params, config)


def test_add_adapters_to_a_loaded_model_keeps_its_function():
  plain = tiny_config()
  params = init_params(plain, jax.random.key(0))
  config = _config()
  with_adapters = lora.add_adapters(params, config, jax.random.key(5))
  assert lora.partition(with_adapters, config)[0]  # every adapter present
  tokens = _tokens()
  np.testing.assert_array_equal(
      np.asarray(Transformer(config).apply({"params": with_adapters}, tokens).logits),
      np.asarray(Transformer(plain).apply({"params": params}, tokens).logits))
  assert lora.add_adapters(params, plain, jax.random.key(5)) is params


def test_dropout_only_with_a_dropout_rng():
  config = _config(lora_dropout=0.5)
  params = _trained_like(init_params(config, jax.random.key(0)), scale=0.5)
  tokens, model = _tokens(), Transformer(config)
  plain = model.apply({"params": params}, tokens).logits
  again = model.apply({"params": params}, tokens).logits
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(again))
  d1 = model.apply({"params": params}, tokens, rngs={"dropout": jax.random.key(1)}).logits
  d2 = model.apply({"params": params}, tokens, rngs={"dropout": jax.random.key(2)}).logits
  assert np.abs(np.asarray(d1) - np.asarray(plain)).max() > 1e-4
  assert np.abs(np.asarray(d1) - np.asarray(d2)).max() > 1e-4


def test_adapters_save_and_load(tmp_path):
  config = _config(lora_targets=("q_proj", "up_proj"))
  params = _trained_like(init_params(config, jax.random.key(0)))
  folder = lora.save_adapters(tmp_path / "adapters", params, config, base_model="tiny")
  saved = json.loads((folder / "adapter_config.json").read_text())
  assert saved["r"] == 4 and saved["lora_alpha"] == 8.0 and saved["peft_type"] == "LORA"
  assert sorted(saved["target_modules"]) == ["q_proj", "up_proj"]
  fresh = init_params(config, jax.random.key(9))
  loaded = lora.load_adapters(folder, fresh, config)
  jax.tree.map(np.testing.assert_array_equal, lora.adapters(loaded), lora.adapters(params))
  jax.tree.map(np.testing.assert_array_equal, lora.base_params(loaded), lora.base_params(fresh))
  with pytest.raises(ValueError, match=r"adapter_config.json: r is 4, the model config has 8"):
    lora.load_adapters(folder, fresh, config.replace(lora_rank=8))
  with pytest.raises(FileNotFoundError, match="adapter_model.safetensors: missing"):
    lora.load_adapters(tmp_path, fresh, config)


def test_merged_export_reloads_to_the_same_logits(tmp_path):
  """`checkpoint.save` of a LoRA model writes the merged weights as a plain HF model."""
  config = _config()
  params = _trained_like(init_params(config, jax.random.key(0)))
  folder = checkpoint.save(tmp_path / "merged", config, params)
  hf = json.loads((folder / "config.json").read_text())
  assert "lora_rank" not in hf
  loaded_config, loaded, _ = checkpoint.load(folder)
  assert loaded_config.lora_rank == 0
  tokens = _tokens()
  np.testing.assert_allclose(
      np.asarray(Transformer(loaded_config).apply({"params": loaded}, tokens).logits),
      np.asarray(Transformer(config).apply({"params": params}, tokens).logits), atol=1e-5)


_HAVE_PEFT = all(importlib.util.find_spec(m) for m in ("torch", "peft"))


@pytest.mark.skipif(not _HAVE_PEFT, reason="needs the torch reference extra: "
                    "pip install -e '.[torch-ref]' (torch, transformers, peft)")
def test_peft_loads_our_adapters(tmp_path):
  """HF transformers + peft load the base model and our adapter folder and compute our logits."""
  import peft  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  config = _config(lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"))
  params = _trained_like(init_params(config, jax.random.key(0)), scale=0.1)
  base = checkpoint.save(tmp_path / "base", lora.base_config(config), lora.base_params(params))
  adapters = lora.save_adapters(tmp_path / "adapters", params, config, base_model=str(base))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(model, str(adapters)).eval()
  tokens = np.array(_tokens((2, 9)))  # a writable copy for torch
  with torch.no_grad():
    want = model(torch.from_numpy(tokens).long()).logits.numpy()
  got = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(tokens)).logits)
  no_adapter = np.asarray(Transformer(lora.base_config(config)).apply(
      {"params": lora.base_params(params)}, jnp.asarray(tokens)).logits)
  assert np.abs(no_adapter - got).max() > 1e-2  # the adapters change the logits
  np.testing.assert_allclose(got, want, atol=1e-4)
