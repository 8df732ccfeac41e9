"""The model-family lookup (`models.family`, `models/families.py`) and the `ModelConfig` fields that
select the implementation (`family`) and the decode-step attention kernel (`decode_kernel`)."""

import dataclasses

import jax
import numpy as np
import pytest

from longhorizon import models
from longhorizon import sampling
from longhorizon.models import families
from longhorizon.models import llama
from longhorizon.models.config import ModelConfig

BONUS = 7  # the token the test family makes (nearly) certain
VOCAB = 31


class _BiasedTransformer(llama.Transformer):
  """The llama decoder with +1e4 on token BONUS's logit: same parameters, different outputs."""

  def logits(self, hidden):
    return super().logits(hidden).at[..., BONUS].add(1e4)


def _biased_decode_logits(params, config, hidden):
  return llama.decode_logits(params, config, hidden).at[..., BONUS].add(1e4)


@pytest.fixture
def biased(monkeypatch):
  """Registers "llama_biased" (in a copy of the registry, restored after the test); yields the names
  of the family functions called, in order."""
  monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
  calls = []

  def recorded(name, fn):
    def wrapper(*args, **kwargs):
      calls.append(name)
      return fn(*args, **kwargs)
    return wrapper

  models.register_family(dataclasses.replace(
      families.family(models.tiny_config()), name="llama_biased", transformer=_BiasedTransformer,
      init_cache=recorded("init_cache", llama.init_cache),
      prepare_decode_params=recorded("prepare_decode_params", llama.prepare_decode_params),
      cached_forward=recorded("cached_forward", llama.cached_forward),
      position_tables=recorded("position_tables", llama.rope_tables),
      decode_logits=recorded("decode_logits", _biased_decode_logits)))
  yield calls


def test_the_default_family_is_llama():
  config = models.tiny_config()
  assert config.family == "llama" and "llama" in models.registered_families()
  found = models.family(config)
  assert found.transformer is llama.Transformer and found.cached_forward is llama.cached_forward
  assert isinstance(models.Transformer(config), llama.Transformer)
  assert isinstance(models.Critic(config), llama.Critic)


def test_unknown_family_names_the_registered_ones():
  with pytest.raises(ValueError, match=r"family='gemma9' is not a registered.*\['llama'\]"):
    models.family(models.tiny_config(family="gemma9"))
  with pytest.raises(ValueError, match="registered model family name"):
    models.tiny_config(family="")


def test_generate_calls_the_configs_family(biased):
  # The sampler reaches the model only through `family(config)`: with the biased family every greedy
  # token is BONUS and every family function ran; the same params under "llama" sample otherwise.
  config = models.tiny_config(vocab_size=VOCAB, family="llama_biased")
  params = models.init_params(config, jax.random.key(0))
  rule = sampling.SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=())
  prompts = [[1, 2, 3], [4], [5, 6]]
  out = sampling.generate(params, config, prompts, rule)
  assert [tokens for tokens, _ in out] == [[BONUS] * 5] * 3
  assert set(biased) == {"init_cache", "prepare_decode_params", "cached_forward", "position_tables",
                         "decode_logits"}
  plain = sampling.generate(params, config.replace(family="llama"), prompts, rule)
  assert [tokens for tokens, _ in plain] != [[BONUS] * 5] * 3
  # Sampled (temperature 1): the bonus leaves ~no mass elsewhere, so BONUS with log-prob ~0.
  hot = sampling.generate(params, config, prompts, rule.replace(temperature=1.0), seed=3)
  assert all(t == [BONUS] * 5 and np.all(np.abs(lp) < 1e-3) for t, lp in hot)


def test_module_level_names_dispatch_through_the_lookup(biased):
  config = models.tiny_config(vocab_size=VOCAB, family="llama_biased")
  assert isinstance(models.Transformer(config), _BiasedTransformer)
  params = models.init_params(config, jax.random.key(0))  # the variant's module, llama's tree
  assert jax.tree.structure(params) == jax.tree.structure(
      models.init_params(config.replace(family="llama"), jax.random.key(0)))
  logits = models.Transformer(config).apply({"params": params}, np.array([[1, 2, 3]], np.int32)).logits
  assert (np.argmax(np.asarray(logits), -1) == BONUS).all()
  cache = models.init_cache(config, 1, 8)
  models.cached_forward(models.prepare_decode_params(params, config), config,
                        np.array([[1, 2]], np.int32), cache)
  assert biased == ["init_cache", "prepare_decode_params", "cached_forward"]
  assert models.unembedding(params, config) is params["embed_tokens"]["embedding"]


def test_registering_a_taken_name_raises(biased):
  llama_family = models.family(models.tiny_config())
  assert models.register_family(llama_family) is llama_family  # the same family again: no-op
  with pytest.raises(ValueError, match="'llama' is already registered"):
    models.register_family(dataclasses.replace(llama_family, transformer=_BiasedTransformer))


def test_loaded_configs_name_their_family():
  hf = models.tiny_config(model_type="qwen2", attention_bias=True).to_hf()
  assert ModelConfig.from_hf(hf).family == "llama"
  assert ModelConfig.from_hf(models.tiny_config().to_hf()).family == "llama"


def test_decode_kernel_choice_is_validated():
  assert models.tiny_config().decode_kernel == "auto" and models.DECODE_KERNELS == ("auto", "xla",
                                                                                      "cpu")
  with pytest.raises(ValueError, match=r"decode_kernel must be one of \('auto', 'xla', 'cpu'\)"):
    models.tiny_config(decode_kernel="gpu")
  with pytest.raises(ValueError, match="decode_kernel='cpu' needs dtype='float32'.*'bfloat16'"):
    models.tiny_config(decode_kernel="cpu", dtype="bfloat16")
  with pytest.raises(ValueError, match="at most 8 query heads per kv head.*9 query heads"):
    models.tiny_config(decode_kernel="cpu", hidden_size=72, num_attention_heads=9,
                       num_key_value_heads=1)


def test_configs_differing_in_decode_kernel_are_distinct_static_arguments():
  # What makes the jit cache key on the choice: equal configs hash equal, the choice breaks equality.
  base = models.tiny_config()
  assert base == models.tiny_config() and hash(base) == hash(models.tiny_config())
  assert base != base.replace(decode_kernel="xla") != base.replace(decode_kernel="cpu")


def test_gemma2_config_round_trips_and_soft_capping_is_validated():
  """Gemma 2 from a HF config.json: its caps, alternating sliding layers (transformers' default
  when `layer_types` is absent) and one RoPE base; `to_hf` writes them back."""
  hf = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=97,
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=1e4)
  config = ModelConfig.from_hf(hf)
  assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
  assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
  assert config.rope_local_theta == 0.0 and not config.qk_norm and config.norm_plus_one
  again = ModelConfig.from_hf(config.to_hf())
  assert again == config
  with pytest.raises(ValueError, match="soft-capping is Gemma 2's.*'llama'"):
    models.tiny_config(final_logit_softcapping=30.0)
  with pytest.raises(ValueError, match="not supported for gemma3_text"):
    ModelConfig.from_hf(dict(hf, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text"))
