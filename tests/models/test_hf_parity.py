"""Model families against HF transformers' torch implementations (the torch reference extra).

For each family a small randomly initialised HF model (`from_config`, no download) is saved as
safetensors, loaded by `checkpoint.load`, and must give the torch logits within 1e-4 (float32);
our `checkpoint.save` of it must load back into torch with the same logits; the KV-cache path
(prefill, then one-token steps) must equal our own full forward pass."""

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.models import Transformer, cached_forward, checkpoint, init_cache

pytestmark = pytest.mark.skipif(
    not importlib.util.find_spec("torch"),
    reason="needs the torch reference extra: pip install -e '.[torch-ref]'")

_SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

# family name -> (transformers config class, extra config fields)
_FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=24, rope_theta=1e6)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e6,
                                         num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True,
                                         router_aux_loss_coef=0.01)),
    # Soft-capping small enough to bind on a random model (its logits reach ~0.5, its scaled
    # attention scores ~1 once q/k are scaled up in `_hf_model`); 5 layers, sliding and full alternating (transformers' default).
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=0.5, final_logit_softcapping=0.3,
                                    rope_parameters={"rope_type": "default",
                                                     "rope_theta": 1e4})),
    # 5 layers: 3 sliding-window (window 4, shorter than the test sequences) and 2 full.
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=4,
                                             query_pre_attn_scalar=24, layer_types=[
                                                 "sliding_attention", "full_attention",
                                                 "sliding_attention", "sliding_attention",
                                                 "full_attention"],
                                             rope_parameters={
                                                 "full_attention": {"rope_type": "default",
                                                                    "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 1e4}})),
}


def _hf_model(name, seed=0):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  config_class, extra = _FAMILIES[name]
  small = dict(_SMALL, num_hidden_layers=5) if name.startswith("gemma") else _SMALL
  config = getattr(transformers, config_class)(**small, **extra)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
  with torch.no_grad():  # norms start at 1 (or 0): randomise them so a missed norm shows
    for pname, p in model.named_parameters():
      if "norm" in pname:
        p.add_(0.3 * torch.randn_like(p))
      if name == "gemma2" and pname.endswith(("q_proj.weight", "k_proj.weight")):
        p.mul_(8.0)  # scaled attention scores of order 1, so the attention cap binds
  return model


def _torch_logits(model, tokens):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.from_numpy(np.array(tokens)).long()).logits.numpy()


def _tokens(shape=(2, 11), seed=3):
  return np.random.default_rng(seed).integers(0, _SMALL["vocab_size"], size=shape)


@pytest.mark.parametrize("name", sorted(_FAMILIES))
def test_logits_match_transformers(tmp_path, name):
  model = _hf_model(name)
  model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
  config, params, _ = checkpoint.load(tmp_path / "hf")
  assert config.model_type == name and config.qk_norm == (name in ("qwen3", "qwen3_moe",
                                                                    "gemma3_text"))
  assert config.num_experts == (4 if name == "qwen3_moe" else 0)
  tokens = _tokens()
  ours = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(tokens)).logits)
  np.testing.assert_allclose(ours, _torch_logits(model, tokens), atol=1e-4)


@pytest.mark.parametrize("name", sorted(_FAMILIES))
def test_save_back_loads_in_transformers(tmp_path, name):
  import transformers  # pylint: disable=g-import-not-at-top
  model = _hf_model(name, seed=1)
  model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
  config, params, _ = checkpoint.load(tmp_path / "hf")
  checkpoint.save(tmp_path / "ours", config, params)
  again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
  tokens = _tokens(seed=4)
  np.testing.assert_allclose(_torch_logits(again, tokens), _torch_logits(model, tokens), atol=1e-5)


@pytest.mark.parametrize("name", sorted(_FAMILIES))
@pytest.mark.slow  # over 10 s on a 2-core AMD EPYC with the test compile settings (BUILD_NOTES)
def test_kv_cache_equals_the_full_forward_pass(tmp_path, name):
  model = _hf_model(name, seed=2)
  model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
  config, params, _ = checkpoint.load(tmp_path / "hf")
  tokens = jnp.asarray(_tokens((2, 9), seed=5))
  full = np.asarray(Transformer(config).apply({"params": params}, tokens).logits)
  out = cached_forward(params, config, tokens[:, :6], init_cache(config, 2, 16), compute_logits=True)
  steps, cache = [np.asarray(out.logits)], out.cache
  for t in range(6, 9):
    out = cached_forward(params, config, tokens[:, t:t + 1], cache, compute_logits=True)
    steps.append(np.asarray(out.logits))
    cache = out.cache
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-4)


def test_moe_routing_and_load_balancing_loss_match_transformers(tmp_path):
  """Qwen3-MoE: our per-token experts are transformers' router top-k, and our load-balancing loss
  is its `aux_loss` (over the real tokens of right-padded rows)."""
  import torch  # pylint: disable=g-import-not-at-top
  model = _hf_model("qwen3_moe", seed=3)
  model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
  config, params, _ = checkpoint.load(tmp_path / "hf")
  tokens = _tokens((2, 10), seed=6)
  lengths = np.array([10, 7])
  mask = np.arange(10)[None] < lengths[:, None]
  with torch.no_grad():
    ref = model(torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long(),
                output_router_logits=True)
  ours = Transformer(config).apply({"params": params}, jnp.asarray(tokens),
                                   lengths=jnp.asarray(lengths))
  for layer, logits in enumerate(ref.router_logits):
    want = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices.numpy().reshape(2, 10, 2)
    got = np.asarray(ours.routing[:, :, layer])
    np.testing.assert_array_equal(np.sort(got, -1)[mask], np.sort(want, -1)[mask])
  np.testing.assert_allclose(float(ours.aux_loss), float(ref.aux_loss), rtol=1e-5)


def test_gemma2_soft_capping_binds(tmp_path):
  """Each of Gemma 2's caps changes these logits: dropping either one breaks the parity above."""
  model = _hf_model("gemma2")
  model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
  config, params, _ = checkpoint.load(tmp_path / "hf")
  assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (0.5, 0.3)
  tokens = jnp.asarray(_tokens())
  want = _torch_logits(model, np.asarray(tokens))
  for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
    ours = Transformer(config.replace(**{cap: 0.0})).apply({"params": params}, tokens).logits
    assert np.abs(np.asarray(ours) - want).max() > 1e-2, cap
