"""Llama-family policy and critic models, their configs, caches and sharding rules."""

import flax.linen as nn
import jax.numpy as jnp

from longhorizon.models.config import ModelConfig, RopeScaling, tiny_config
from longhorizon.models.llama import (Critic, DecodeParams, DecoderOutput, KVCache, PolicyWithValue,
                                      Transformer, ValueHead, cached_forward, decode_logits,
                                      init_cache, prepare_decode_params, unembedding)

__all__ = ["ModelConfig", "RopeScaling", "tiny_config", "Transformer", "Critic", "PolicyWithValue",
           "ValueHead", "KVCache", "DecodeParams", "DecoderOutput", "init_cache", "unembedding",
           "init_params", "prepare_decode_params", "cached_forward", "decode_logits"]


def init_params(config: ModelConfig, key):
  """Randomly initialised (unboxed) parameters of `Transformer(config)`."""
  variables = Transformer(config).init(key, jnp.zeros((1, 1), jnp.int32))
  return nn.meta.unbox(variables["params"])
