"""The model-family registry: `family(config)` is the implementation `config.family` names.

A family is one module (the decoder, its critic, its KV cache and its cached decoding) and one
`register_family(ModelFamily(...))` call. Everything model-specific outside `models/` (the sampler,
and the learner through `longhorizon.models`) reaches the model through this lookup, never by
importing a family's module. The families registered here: "llama" (`llama.py`: Llama 2/3.x,
SmolLM2, Qwen2/2.5, and as config fields Qwen3's q/k norm, Qwen3-MoE's experts, Gemma 3's norms,
GELU, scaled embeddings and sliding-window layers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from longhorizon.models import llama
from longhorizon.models.config import ModelConfig

__all__ = ["ModelFamily", "DecodeCache", "register_family", "family", "registered_families"]


class DecodeCache(Protocol):
  """What the sampler reads of a family's KV cache (a pytree, e.g. `llama.KVCache`)."""
  end: jax.Array  # [B] int32: filled slots per row (the next write slot)
  # Mixture-of-experts families: `[B, S, L, k]` int32 experts of each slot's token (routing
  # replay); None for dense ones. `collect` copies it into `EpisodeBatch.routing`.
  routing: Any

  @property
  def capacity(self) -> int:  # S, slots per row
    ...


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  """One decoder family's parts, as `llama.py` defines them for "llama". Signatures:

  transformer(config) -> nn.Module: the whole-sequence policy; `.apply({"params": p}, tokens[B, T],
    positions=None, lengths=None, compute_logits=True) -> llama.DecoderOutput(hidden, logits, None)`.
  critic(config) -> nn.Module: `.apply({"params": p}, tokens, positions, lengths) -> values[B, T]`.
  policy_with_value(config) -> nn.Module: one trunk, `.apply({"params": {"trunk": p, "value_head":
    h}}, tokens, positions, lengths, compute_logits=True, routing=None) -> (DecoderOutput,
    values[B, T])`, `p` the transformer's parameters (the learner's shared critic relies on this).
  init_cache(config, batch_size, capacity) -> cache: an empty `DecodeCache`.
  prepare_decode_params(params, config) -> decode params (a no-op on already-prepared ones).
  cached_forward(params, config, tokens[B, T], cache, positions=None, lengths=None,
    compute_logits=False, rope=None) -> DecoderOutput with the appended cache.
  position_tables(positions[B, T], config) -> a pytree of `[B, T, ...]` arrays `cached_forward`
    accepts as `rope` (the sampler builds them once for every decode step and slices axis 1).
  decode_logits(decode_params, config, hidden[..., D]) -> float32 logits `[..., V]`.
  unembedding(params, config) -> the `[V, D]` (tied) or `[D, V]` (untied) unembedding matrix.
  """
  name: str
  transformer: Callable[..., nn.Module]
  critic: Callable[..., nn.Module]
  policy_with_value: Callable[..., nn.Module]
  init_cache: Callable[..., Any]
  prepare_decode_params: Callable[..., Any]
  cached_forward: Callable[..., Any]
  position_tables: Callable[..., Any]
  decode_logits: Callable[..., jax.Array]
  unembedding: Callable[..., jax.Array]

  def init_params(self, config: ModelConfig, key: jax.Array):
    """Randomly initialised (unboxed) parameters of `transformer(config)`."""
    variables = self.transformer(config).init(key, jnp.zeros((1, 1), jnp.int32))
    return nn.meta.unbox(variables["params"])


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(model_family: ModelFamily) -> ModelFamily:
  """Makes `model_family` what `family(config)` returns for `config.family == model_family.name`.

  Registering a second, different family under a taken name raises (re-registering the same one is
  a no-op)."""
  taken = _FAMILIES.get(model_family.name)
  if taken is not None and taken != model_family:
    raise ValueError(f"a model family named {model_family.name!r} is already registered; choose "
                     f"another name (registered: {registered_families()}).")
  _FAMILIES[model_family.name] = model_family
  return model_family


def registered_families() -> list[str]:
  """The registered family names, sorted."""
  return sorted(_FAMILIES)


def family(config: ModelConfig) -> ModelFamily:
  """The `ModelFamily` named by `config.family`."""
  found = _FAMILIES.get(config.family)
  if found is None:
    raise ValueError(f"ModelConfig.family={config.family!r} is not a registered model family; "
                     f"registered: {registered_families()}. Add one with "
                     f"`models.register_family(ModelFamily(name={config.family!r}, ...))`.")
  return found


register_family(ModelFamily(
    name="llama", transformer=llama.Transformer, critic=llama.Critic,
    policy_with_value=llama.PolicyWithValue, init_cache=llama.init_cache,
    prepare_decode_params=llama.prepare_decode_params, cached_forward=llama.cached_forward,
    position_tables=llama.rope_tables, decode_logits=llama.decode_logits,
    unembedding=llama.unembedding))
