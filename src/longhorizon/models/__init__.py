"""Decoder models behind one lookup: `family(config)` returns the `ModelFamily` `config.family` names.

The families: "llama" (`llama.py`: Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 3;
`ModelConfig.family` defaults to it, and HF / GGUF loading maps `model_type` to it through
`config.MODEL_TYPE_FAMILY`).

Adding a family is one module plus its registration:
  1. `models/<name>.py` defining the parts `ModelFamily` lists (whole-sequence module, critic, policy
     with value head, cache, `prepare_decode_params`, `cached_forward`, position tables,
     `decode_logits`, `unembedding`), with the signatures its docstring gives;
  2. `register_family(ModelFamily(name="<name>", ...))` at the end of `families.py` (or in any module
     imported before use), and `ModelConfig(family="<name>", ...)` to select it. Checkpoint loading
     (`checkpoint.py`) maps HF / GGUF names onto the llama parameter tree only.

The module-level functions and constructors below (`Transformer`, `Critic`, `PolicyWithValue`,
`init_params`, `init_cache`, `prepare_decode_params`, `cached_forward`, `decode_logits`,
`unembedding`) dispatch through the lookup. The types (`KVCache`, `DecodeParams`, `DecoderOutput`,
`ValueHead`) are the llama family's.

LoRA: `ModelConfig.lora_rank > 0` puts adapters on the `lora_targets` projections; `lora.py` splits
trainable from frozen leaves, merges, and saves / loads the adapters in HF peft's layout.

`ModelConfig.decode_kernel` ("auto" | "xla" | "cpu") chooses the decode-step attention (the C++ CPU
kernel of `cpu_kernels.py`, or XLA); see `config.DECODE_KERNELS`.
"""

import flax.linen as nn

from longhorizon.models import lora
from longhorizon.models.config import (DECODE_KERNELS, DECODE_QUANTS, LORA_TARGETS, ModelConfig,
                                       RopeScaling, tiny_config)
from longhorizon.models.families import (DecodeCache, ModelFamily, family, register_family,
                                       registered_families)
from longhorizon.models.llama import DecodeParams, DecoderOutput, KVCache, ValueHead

__all__ = ["ModelConfig", "RopeScaling", "tiny_config", "DECODE_KERNELS", "DECODE_QUANTS",
           "LORA_TARGETS", "lora", "ModelFamily", "DecodeCache",
           "family", "register_family", "registered_families", "Transformer", "Critic",
           "PolicyWithValue", "ValueHead", "KVCache", "DecodeParams", "DecoderOutput", "init_cache",
           "unembedding", "init_params", "prepare_decode_params", "cached_forward", "decode_logits"]


def Transformer(config: ModelConfig, **kwargs) -> nn.Module:  # pylint: disable=invalid-name
  """The family's whole-sequence decoder module: `family(config).transformer(config, **kwargs)`."""
  return family(config).transformer(config, **kwargs)


def Critic(config: ModelConfig, **kwargs) -> nn.Module:  # pylint: disable=invalid-name
  """The family's separately parameterised critic module (`[B, T] -> [B, T]` values)."""
  return family(config).critic(config, **kwargs)


def PolicyWithValue(config: ModelConfig, **kwargs) -> nn.Module:  # pylint: disable=invalid-name
  """The family's policy and critic on one trunk: `-> (DecoderOutput, values[B, T])`."""
  return family(config).policy_with_value(config, **kwargs)


def init_params(config: ModelConfig, key):
  """Randomly initialised (unboxed) parameters of `Transformer(config)`."""
  return family(config).init_params(config, key)


def init_cache(config: ModelConfig, batch_size: int, capacity: int):
  """An empty KV cache of `capacity` slots per row (the family's cache type)."""
  return family(config).init_cache(config, batch_size, capacity)


def prepare_decode_params(params, config: ModelConfig):
  """Params re-laid out for cached decoding (see the family's `prepare_decode_params`)."""
  return family(config).prepare_decode_params(params, config)


def cached_forward(params, config: ModelConfig, tokens, cache, *args, **kwargs):
  """Appends `tokens[B, T]` to `cache` (see the family's `cached_forward`, e.g. `llama.cached_forward`)."""
  return family(config).cached_forward(params, config, tokens, cache, *args, **kwargs)


def decode_logits(params, config: ModelConfig, hidden):
  """float32 `[..., V]` logits of final-normed hidden states, from decode params."""
  return family(config).decode_logits(params, config, hidden)


def unembedding(params, config: ModelConfig):
  """The unembedding matrix for `core.logprobs.token_logprobs_from_hidden`: `[V, D]` (tied) or
  `[D, V]` (untied)."""
  return family(config).unembedding(params, config)
