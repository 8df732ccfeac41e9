"""Pure-functional Flax (Linen) decoder for the Llama family, with an optional KV cache, and critics.

`Transformer` runs whole sequences (training, scoring) with its layers under `nn.scan`;
`cached_forward` runs the same layer math one layer at a time on per-layer weights and KV caches for
sampling (prefill / decode / extend are all "append `T` new tokens to a cache"): the weights are
re-laid out once per policy version by `prepare_decode_params` (fused q|k|v and gate|up matrices),
and the tests hold the two paths to the same logits. Masks come from per-row lengths and slot indices, never from token
values: a pad id may be a real token (SmolLM2 pads with `<|im_end|>`, which also ends every turn).

Parameter tree (HF-like names, so checkpoint mapping is mechanical; layer params stacked on axis 0):
  embed_tokens/embedding [V, D]
  layers/input_layernorm/scale [L, D]
  layers/self_attn/{q,k,v}_proj/kernel [L, D, H*hd | KV*hd] (+ bias when attention_bias)
  layers/self_attn/o_proj/kernel [L, H*hd, D]
  layers/post_attention_layernorm/scale [L, D]
  layers/mlp/{gate,up}_proj/kernel [L, D, F], layers/mlp/down_proj/kernel [L, F, D]
  norm/scale [D]
  lm_head/kernel [D, V] (only when embeddings are untied)
Every parameter carries logical axis names (see `sharding.py`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.core import matmul
from longhorizon.models import cpu_kernels
from longhorizon.models import quant
from longhorizon.models import lora
from longhorizon.models.config import ModelConfig

__all__ = ["KVCache", "DecodeParams", "DecoderOutput", "PrefixMask", "Transformer", "ValueHead",
           "Critic", "PolicyWithValue", "init_cache", "prepare_decode_params", "cached_forward", "decode_logits",
           "rope_frequencies", "rope_tables", "unembedding"]

_F32 = jnp.float32


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer for `S` slots per row; slot `i` holds the token at position `i`.

  One array per layer (not one stacked `[L, ...]` array): a decode step then updates each layer's
  cache in place instead of slicing a copy out of, and writing it back into, a stacked array.
  Keys and values are `[B, KV, S, hd]`: each (row, kv-head) keeps its filled slots as one contiguous
  prefix, which the CPU decode kernel (`cpu_kernels.decode_attention`) reads and nothing more."""
  k: tuple  # L x [B, KV, S, hd] compute dtype
  v: tuple  # L x [B, KV, S, hd] compute dtype
  end: jax.Array  # [B] int32: number of filled slots (next write slot) per row
  # Mixture of experts only (else None): `[B, S, L, k]` int32, the experts each slot's token was
  # routed to in every layer, written with its keys and values (routing replay, R3: the episode's
  # record of which experts the rollout used, prompt and observations included).
  routing: jax.Array | None = None

  @property
  def capacity(self) -> int:
    return self.v[0].shape[2]


@flax.struct.dataclass
class DecodeParams:
  """Parameters laid out for cached decoding (see `prepare_decode_params`): every layer's weights
  as separate arrays in the compute dtype, with the q|k|v and gate|up matrices fused.

  Why: a `lax.scan` over stacked weights slices (copies) each layer's matrices every step, which at
  batch 1 costs as much as the matmul that reads them; and one `[D, (H + 2 KV) hd]` matmul keeps both
  CPU threads busy where three small ones ran one after another."""
  embed: jax.Array  # [V, D]
  norm: dict  # {"scale": [D]}
  lm_head: Any  # [D, V] when embeddings are untied, else None; with `decode_quant="int8"` always
  #              a `quant.Int8Weight` [D, V] (for tied embeddings, of the table's transpose)
  layers: tuple  # L dicts: input_norm [D], out_norms (Gemma: the norms of the attention and MLP
  #               outputs, 2 x [D], else None), post_norm [D] (before the MLP), qk_norm [H+KV, hd]
  #               (Qwen3 / Gemma 3, else None), qkv [D, (H+2KV)hd], qkv_bias (or None),
  #               o [H hd, D], gate_up [D, 2F], down [F, D], router (None; for MoE [D, E], and
  #               then gate_up [E, D, 2F] and down [E, F, D] per expert)


@flax.struct.dataclass
class DecoderOutput:
  hidden: jax.Array  # [B, T, D] final-normed hidden states (compute dtype)
  logits: jax.Array | None  # [B, T, V] float32, None when not requested
  cache: KVCache | None  # updated cache, None without one
  # Mixture-of-experts models only (None for dense ones):
  routing: jax.Array | None = None  # [B, T, L, k] int32 experts each token was routed to per layer
  aux_loss: jax.Array | None = None  # [] float32 load-balancing loss over the real tokens


def init_cache(config: ModelConfig, batch_size: int, capacity: int) -> KVCache:
  """An empty cache of `capacity` slots per row."""
  b, kv, hd, layers = batch_size, config.num_key_value_heads, config.dims_per_head, config.num_hidden_layers
  dtype = jnp.dtype(config.dtype)
  routing = None
  if config.num_experts:
    routing = jnp.zeros((b, capacity, layers, config.num_experts_per_tok), jnp.int32)
  return KVCache(k=tuple(jnp.zeros((b, kv, capacity, hd), dtype) for _ in range(layers)),
                 v=tuple(jnp.zeros((b, kv, capacity, hd), dtype) for _ in range(layers)),
                 end=jnp.zeros((b,), jnp.int32), routing=routing)


def prepare_decode_params(params, config: ModelConfig) -> DecodeParams:
  """Re-lays `Transformer` params out for `cached_forward`: per-layer arrays in the compute dtype,
  q|k|v and gate|up fused along their output axis.

  Do it once per policy version (it copies the weights); jitted callers may also pass raw params,
  which are then re-laid out inside the compiled function on every call."""
  if isinstance(params, DecodeParams):
    return params
  params = lora.merge(params, config)  # adapters folded into the kernels (a no-op without them)
  dtype = jnp.dtype(config.dtype)
  cast = lambda a: jnp.asarray(a).astype(dtype)
  attn, mlp = params["layers"]["self_attn"], params["layers"]["mlp"]
  qkv = jnp.concatenate([attn[n]["kernel"] for n in ("q_proj", "k_proj", "v_proj")], axis=-1)
  qkv_bias = (jnp.concatenate([attn[n]["bias"] for n in ("q_proj", "k_proj", "v_proj")], axis=-1)
              if config.attention_bias else None)
  if config.num_experts:  # MoE: the router and the [E, ...] expert stacks, gate|up fused
    gate_up = jnp.concatenate([mlp["gate_proj"], mlp["up_proj"]], axis=-1)  # [L, E, D, 2F]
    down, router = mlp["down_proj"], mlp["gate"]["kernel"]  # [L, E, F, D], [L, D, E]
  else:
    gate_up = jnp.concatenate([mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"]], axis=-1)
    down, router = mlp["down_proj"]["kernel"], None
  qk_norm = None
  if config.qk_norm:  # one [H + KV, hd] scale: q heads then k heads, as the fused q|k columns
    h, kv = config.num_attention_heads, config.num_key_value_heads
    qk_norm = jnp.concatenate(
        [jnp.repeat(jnp.asarray(attn["q_norm"]["scale"])[:, None], h, axis=1),
         jnp.repeat(jnp.asarray(attn["k_norm"]["scale"])[:, None], kv, axis=1)], axis=1)
  norms = {k: params["layers"][k]["scale"] for k in params["layers"] if k.endswith("layernorm")}
  if config.sandwich_norms:  # Gemma: the pre-MLP norm is pre_feedforward_layernorm
    pre_mlp = norms["pre_feedforward_layernorm"]
    out_norms = (norms["post_attention_layernorm"], norms["post_feedforward_layernorm"])
  else:
    pre_mlp, out_norms = norms["post_attention_layernorm"], None
  layers = tuple(
      {"input_norm": jnp.asarray(norms["input_layernorm"][l]),
       "out_norms": None if out_norms is None else tuple(jnp.asarray(n[l]) for n in out_norms),
       "qk_norm": None if qk_norm is None else qk_norm[l],
       "qkv": cast(qkv[l]),
       "qkv_bias": None if qkv_bias is None else cast(qkv_bias[l]),
       "o": cast(attn["o_proj"]["kernel"][l]),
       "post_norm": jnp.asarray(pre_mlp[l]),
       "gate_up": cast(gate_up[l]),
       "down": cast(down[l]),
       "router": None if router is None else cast(router[l])}
      for l in range(config.num_hidden_layers))
  out = DecodeParams(
      embed=cast(params["embed_tokens"]["embedding"]),
      norm={"scale": jnp.asarray(params["norm"]["scale"])},
      lm_head=None if config.tie_word_embeddings else cast(params["lm_head"]["kernel"]),
      layers=layers)
  return _quantized(out, params, config) if config.decode_quant == "int8" else out


def _quantized(out: DecodeParams, params, config: ModelConfig) -> DecodeParams:
  """`out` with its dense matrices as `quant.Int8Weight`s: q|k|v, o, gate|up, down of every layer
  and the unembedding (for tied embeddings an int8 copy of the table's transpose; the float table
  stays for the embedding lookup)."""
  names = ("qkv", "o", "gate_up", "down")
  layers = tuple(dict(w, **{n: quant.quantize_int8(w[n]) for n in names}) for w in out.layers)
  head = (params["embed_tokens"]["embedding"].T if config.tie_word_embeddings
          else params["lm_head"]["kernel"])
  return out.replace(layers=layers, lm_head=quant.quantize_int8(head))


def rope_frequencies(config: ModelConfig, theta: float | None = None) -> np.ndarray:
  """`[hd/2]` float32 inverse frequencies `theta^(-2i/hd)` (default `config.rope_theta`), with
  Llama-3 scaling when configured."""
  hd = config.dims_per_head
  theta = config.rope_theta if theta is None else theta
  inv_freq = 1.0 / (theta**(np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq.astype(np.float32)
  old_len = scaling.original_max_position_embeddings
  low_wavelen = old_len / scaling.low_freq_factor
  high_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions, config: ModelConfig):
  """`(cos, sin)`, each `[B, T, 1, hd]` float32, for `positions [B, T]`; computed once per forward
  pass and shared by every layer. With `rope_local_theta` (Gemma 3), a pair of them: `(full,
  sliding)`, the sliding-window layers' tables rotating with their own base."""
  def tables(theta):
    inv_freq = jnp.asarray(rope_frequencies(config, theta))  # [hd/2]
    freqs = positions.astype(_F32)[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb), jnp.sin(emb)
  if config.rope_local_theta:
    return tables(config.rope_theta), tables(config.rope_local_theta)
  return tables(config.rope_theta)


def _layer_rope(rope, config: ModelConfig, sliding):
  """The `(cos, sin)` a layer rotates with: `rope` itself, or for Gemma 3 the full or sliding pair
  (`sliding` a bool, or a traced one inside the layer scan)."""
  if not config.rope_local_theta:
    return rope
  full, local = rope
  if isinstance(sliding, bool):
    return local if sliding else full
  return jax.tree.map(lambda f, l: jnp.where(sliding, l, f), full, local)


def _apply_rope(x, rope):
  """Rotary embedding in the HF "rotate half" layout. x: [B, T, N, hd], rope: `rope_tables(...)`."""
  cos, sin = rope
  x32 = x.astype(_F32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


def dense_product(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                  **kwargs):
  """`nn.Dense`'s product `x [..., D] @ W [D, F]` through `core.matmul.einsum` (its backward pass
  keeps XLA:CPU from transposing the large cotangent, and runs bf16 products for bf16 compute)."""
  del precision, preferred_element_type, kwargs
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  if (tuple(lhs_contract), tuple(rhs_contract)) != ((lhs.ndim - 1,), (0,)) or lhs_batch or rhs_batch:
    raise ValueError(f"dense_product: only x[..., D] @ W[D, F] is supported, got "
                     f"{dimension_numbers}.")
  return matmul.einsum("...d,df->...f", lhs, rhs)


def _dense(features, names, config, *, use_bias=False, name=None):
  if config.lora_rank and name in config.lora_targets:
    return LoraDense(features, names, config, use_bias=use_bias, name=name)
  return nn.Dense(
      features, use_bias=use_bias, dtype=jnp.dtype(config.dtype),
      param_dtype=jnp.dtype(config.param_dtype), dot_general=dense_product,
      kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), names),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), names[1:]), name=name)


class LoraDense(nn.Module):
  """A projection with a LoRA adapter: `x W (+ b) + (alpha / r) * dropout(x) A B`.

  `kernel` / `bias` are named and initialised as `nn.Dense`'s (so checkpoints map unchanged);
  `lora_a [D_in, r]` starts like peft's (uniform, bound `1/sqrt(D_in)`), `lora_b [r, D_out]` at 0,
  so a fresh adapter leaves the model unchanged. Adapters are float32 (their own master weights)
  and multiply in the compute dtype. Dropout needs a "dropout" rng (training losses only)."""
  features: int
  names: tuple
  config: ModelConfig
  use_bias: bool = False

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dtype, r = jnp.dtype(cfg.dtype), cfg.lora_rank
    part = nn.with_logical_partitioning
    kernel = self.param("kernel", part(nn.initializers.normal(0.02), self.names),
                        (x.shape[-1], self.features), jnp.dtype(cfg.param_dtype))
    y = matmul.einsum("...d,df->...f", x.astype(dtype), kernel.astype(dtype))
    if self.use_bias:
      bias = self.param("bias", part(nn.initializers.zeros_init(), self.names[1:]),
                        (self.features,), jnp.dtype(cfg.param_dtype))
      y = y + bias.astype(dtype)
    a = self.param("lora_a", part(nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
                                  (self.names[0], "lora")), (x.shape[-1], r), _F32)
    b = self.param("lora_b", part(nn.initializers.zeros_init(), ("lora", self.names[1])),
                   (r, self.features), _F32)
    h = x
    if cfg.lora_dropout and self.has_rng("dropout"):
      h = nn.Dropout(cfg.lora_dropout, deterministic=False)(h)
    delta = matmul.einsum("...d,dr->...r", h.astype(dtype), a.astype(dtype))
    delta = matmul.einsum("...r,rf->...f", delta, b.astype(dtype))
    return y + (cfg.lora_scale * delta).astype(y.dtype)


class RMSNorm(nn.Module):
  """RMSNorm; `plus_one` (Gemma) stores `w` and scales by `1 + w` (initialised at 0)."""
  eps: float
  param_dtype: str = "float32"
  plus_one: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros_init() if self.plus_one else nn.initializers.ones
    scale = self.param("scale", nn.with_logical_partitioning(init, ("norm",)),
                       (x.shape[-1],), jnp.dtype(self.param_dtype))
    return _rms_norm(x, scale, self.eps, self.plus_one)


def _norm(cfg: ModelConfig, name: str):
  return RMSNorm(cfg.rms_norm_eps, cfg.param_dtype, cfg.norm_plus_one, name=name)


def _rms_norm(x, scale, eps, plus_one: bool = False):
  """RMSNorm in float32, returned in `x`'s dtype (shared by `RMSNorm` and `cached_forward`)."""
  x32 = x.astype(_F32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = scale.astype(_F32) + (1.0 if plus_one else 0.0)
  return (y * scale.reshape((1,) * (y.ndim - 1) + (-1,))).astype(x.dtype)


def softcap(x, cap: float):
  """Gemma 2's soft-capping `cap * tanh(x / cap)` (identity when `cap` is 0)."""
  return cap * jnp.tanh(x / cap) if cap else x


def _activation(cfg: ModelConfig, x):
  if cfg.hidden_act == "gelu_pytorch_tanh":
    return jax.nn.gelu(x, approximate=True)
  return nn.silu(x)


ATTENTION_BLOCK = 128  # query rows per block of `causal_attention`


def causal_attention(q, keys, values, mask, cfg: ModelConfig, block: int = ATTENTION_BLOCK,
                     key_offset: int = 0):
  """Grouped-query attention of whole causal sequences, by blocks of `block` queries.

  q `[B, T, KV, G, hd]`, keys / values `[B, KV, key_offset + T, hd]`, mask `[B, T, key_offset +
  T]` (query `i` sits at key slot `key_offset + i` and never sees a later key; `key_offset` keys
  before the queries are a shared prefix's, see `PrefixMask`). Query block `i` scores only keys
  `[0, key_offset + end_i)`, `end_i` its last query + 1: the blocks
  above the diagonal, which the causal mask hides whole, are never computed (about half of the
  `T x T` matrix at many blocks). Scores, probabilities and their cotangents stay in the head-major
  layout `[B, KV, G * block, keys]` that the batched products read without a transpose; only the
  small `[B, T, H, hd]` queries and outputs are transposed. Equal to one masked softmax over the
  full matrix (the hidden keys get probability 0 either way), except for a query that sees no key
  at all (a padding row past a sliding window), whose output is never used. Returns
  `[B, T, H * hd]`."""
  b, t, kv, g, hd = q.shape
  qh = q.transpose(0, 2, 3, 1, 4)  # [B, KV, G, T, hd]
  outs = []
  for start in range(0, t, block):
    end = min(start + block, t)
    c, seen = end - start, key_offset + end
    scores = jnp.einsum("bkqd,bksd->bkqs", qh[:, :, :, start:end].reshape(b, kv, g * c, hd),
                        keys[:, :, :seen], preferred_element_type=_F32).reshape(b, kv, g, c, seen)
    if cfg.query_pre_attn_scalar:  # Gemma: scaled by query_pre_attn_scalar^-0.5
      scores = scores * cfg.attention_scale
    else:
      scores = scores / math.sqrt(hd)
    scores = softcap(scores, cfg.attn_logit_softcapping)
    scores = jnp.where(mask[:, None, None, start:end, :seen], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(b, kv, g * c, seen)
    outs.append(jnp.einsum("bkqs,bksd->bkqd", probs, values[:, :, :seen]).reshape(b, kv, g, c, hd))
  out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g * hd)


class PrefixMask(NamedTuple):
  """The visibility of a batch whose rows share their first `P` tokens, laid out as one flat
  sequence `[1, P + B * S]`: the prefix once, then each row's `S` remaining tokens (see
  `Transformer(prefix_length=P)`). `prefix` `[1, P, P]` is the prefix's causal mask; `suffix`
  `[B, S, P + S]` is each row's suffix queries over the prefix keys then the row's own keys."""
  prefix: jax.Array
  suffix: jax.Array


def _prefix_shared_attention(q, k, v, mask: PrefixMask, cfg: ModelConfig):
  """Attention of the flat shared-prefix layout (`PrefixMask`): q `[1, N, H, hd]`, k / v
  `[1, N, KV, hd]`, `N = P + B * S`. The prefix attends to itself once; every row's suffix attends
  to the prefix's keys (broadcast, so their cotangents from every row add up) and to its own.
  Returns `[1, N, H * hd]`."""
  p, (b, s) = mask.prefix.shape[-1], mask.suffix.shape[:2]
  _, _, h, hd = q.shape
  kv = k.shape[2]
  heads = lambda x: x.transpose(0, 2, 1, 3)  # [rows, KV, T, hd]
  rows = lambda x: x[0, p:].reshape(b, s, kv, hd)
  kp, vp = heads(k[:, :p]), heads(v[:, :p])
  out_p = causal_attention(q[:, :p].reshape(1, p, kv, h // kv, hd), kp, vp, mask.prefix, cfg)
  shared = lambda x: jnp.broadcast_to(x, (b, kv, p, hd))
  keys = jnp.concatenate([shared(kp), heads(rows(k))], axis=2)
  values = jnp.concatenate([shared(vp), heads(rows(v))], axis=2)
  out_s = causal_attention(q[0, p:].reshape(b, s, kv, h // kv, hd), keys, values, mask.suffix, cfg,
                           key_offset=p)
  return jnp.concatenate([out_p[0], out_s.reshape(b * s, h * hd)], axis=0)[None]


class Attention(nn.Module):
  """Causal grouped-query self-attention over whole sequences (`mask [B, T, T]`), or over the flat
  shared-prefix layout (`mask` a `PrefixMask`)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, rope, mask):
    cfg = self.config  # `rope`: this layer's (cos, sin); `mask`: its [B, T, T] visibility
    b, t, _ = x.shape
    h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dims_per_head
    q = _dense(h * hd, ("embed", "heads"), cfg, use_bias=cfg.attention_bias, name="q_proj")(x)
    k = _dense(kv * hd, ("embed", "kv_heads"), cfg, use_bias=cfg.attention_bias, name="k_proj")(x)
    v = _dense(kv * hd, ("embed", "kv_heads"), cfg, use_bias=cfg.attention_bias, name="v_proj")(x)
    q, k = q.reshape(b, t, h, hd), k.reshape(b, t, kv, hd)
    if cfg.qk_norm:  # Qwen3 / Gemma 3: RMSNorm over each head's dimensions, before RoPE
      q = _norm(cfg, "q_norm")(q)
      k = _norm(cfg, "k_norm")(k)
    q, k = _apply_rope(q, rope), _apply_rope(k, rope)
    if isinstance(mask, PrefixMask):
      out = _prefix_shared_attention(q, k, v.reshape(b, t, kv, hd), mask, cfg)
      return _dense(cfg.hidden_size, ("heads", "embed"), cfg, name="o_proj")(out)
    keys, values = k.transpose(0, 2, 1, 3), v.reshape(b, t, kv, hd).transpose(0, 2, 1, 3)
    out = causal_attention(q.reshape(b, t, kv, h // kv, hd), keys, values, mask, cfg,
                           block=ATTENTION_BLOCK)
    return _dense(cfg.hidden_size, ("heads", "embed"), cfg, name="o_proj")(out)


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    gate = _dense(cfg.intermediate_size, ("embed", "mlp"), cfg, name="gate_proj")(x)
    up = _dense(cfg.intermediate_size, ("embed", "mlp"), cfg, name="up_proj")(x)
    return _dense(cfg.hidden_size, ("mlp", "embed"), cfg, name="down_proj")(_activation(cfg, gate) * up)


def _route(logits, k: int, normalize: bool, routing=None):
  """Top-`k` routing: `(weights [..., k] float32, experts [..., k] int32, probs [..., E])`.

  `probs = softmax(logits)` in float32; the experts are its `k` largest, or `routing` when given
  (routing replay: the experts a rollout used); weights are their probabilities, renormalised to
  sum to 1 when `normalize` (Qwen3-MoE's `norm_topk_prob`)."""
  probs = jax.nn.softmax(logits.astype(_F32), axis=-1)
  if routing is None:
    weights, experts = jax.lax.top_k(probs, k)
  else:
    experts = routing.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts.astype(jnp.int32), probs


def _moe_combine(x, weights, experts, gate, up, down, num_experts: int):
  """Sum over each token's experts of `weight * down(silu(gate x) * up x)`; `gate`/`up` are
  `[E, D, F]`, `down` `[E, F, D]`. Every expert runs on every token and unselected ones get weight
  0: exact, and simple to shard, but E / k times the routed FLOPs (a grouped matmul is the
  accelerator-scale version)."""
  combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=_F32) * weights[..., None], axis=-2)
  h = nn.silu(jnp.einsum("btd,edf->btef", x, gate)) * jnp.einsum("btd,edf->btef", x, up)
  out = jnp.einsum("btef,efd->bted", h, down)
  return jnp.einsum("bte,bted->btd", combine.astype(x.dtype), out)


class MoE(nn.Module):
  """A sparse mixture-of-experts MLP (Qwen3-MoE): a linear router `gate` over `num_experts`
  SwiGLU experts, top-`num_experts_per_tok` routing. Returns `(y, experts [B, T, k], probs
  [B, T, E])`; `routing` (`[B, T, k]`) replays given experts instead of the router's top-k."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, routing=None):
    cfg = self.config
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    logits = _dense(e, ("embed", "experts"), cfg, name="gate")(x)
    weights, experts, probs = _route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, routing)
    init = lambda names: nn.with_logical_partitioning(nn.initializers.normal(0.02), names)
    gate = self.param("gate_proj", init(("experts", "embed", "mlp")), (e, d, f), pdtype)
    up = self.param("up_proj", init(("experts", "embed", "mlp")), (e, d, f), pdtype)
    down = self.param("down_proj", init(("experts", "mlp", "embed")), (e, f, d), pdtype)
    y = _moe_combine(x.astype(dtype), weights, experts, gate.astype(dtype), up.astype(dtype),
                     down.astype(dtype), e)
    return y, experts, probs


class Block(nn.Module):
  """One pre-norm decoder block; the scan carry is the residual stream (`cached_forward` runs the
  same math on `DecodeParams`, see `_cached_block`)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, per_layer, rope, mask):
    """`per_layer`: this layer's `(routing, sliding)`: `[B, T, k]` experts to replay (MoE) or None,
    and whether it is a sliding-window layer. `rope`, `mask`: every kind's (see `Transformer`).
    Returns `(x, None)`, or for MoE `(x, (experts [B, T, k], probs [B, T, E]))` (stacked over
    layers by the scan)."""
    cfg = self.config
    routing, sliding = per_layer
    x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
    h = _norm(cfg, "input_layernorm")(x)
    if cfg.sliding_window:
      full, window = mask
      mask = jax.tree.map(lambda f, w: jnp.where(sliding, w, f), full, window)
    attn = Attention(cfg, name="self_attn")(h, _layer_rope(rope, cfg, sliding), mask)
    if cfg.sandwich_norms:  # Gemma: norms after attention and around the MLP
      x = x + _norm(cfg, "post_attention_layernorm")(attn)
      h = _norm(cfg, "pre_feedforward_layernorm")(x)
      return x + _norm(cfg, "post_feedforward_layernorm")(MLP(cfg, name="mlp")(h)), None
    x = x + attn
    h = _norm(cfg, "post_attention_layernorm")(x)
    if cfg.num_experts:
      y, experts, probs = MoE(cfg, name="mlp")(h, routing)
      return x + y, (experts, probs)
    return x + MLP(cfg, name="mlp")(h), None


_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _embed(x, config: ModelConfig):
  """Token embeddings, times sqrt(hidden_size) for Gemma (rounded to the compute dtype first, as
  HF does)."""
  if not config.scale_embeddings:
    return x
  return x * jnp.asarray(config.hidden_size**0.5, x.dtype)


def _window(mask, query_slots, key_slots, window: int):
  """`mask` limited to each query's last `window` positions (the query's own included)."""
  return mask & (key_slots[None, None, :] > query_slots[:, :, None] - window)


def _attention_mask(start, lengths, t, key_slots):
  """`[B, T, S]` bool: a key is visible if it is a real, already written token at or before the query.

  Queries of row `b` sit at slots `start[b] + t`; `lengths[b]` of the `T` new tokens are real."""
  query_slots = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  new_end = start + lengths.astype(jnp.int32)
  mask = (key_slots[None, None, :] < new_end[:, None, None]) & (
      key_slots[None, None, :] <= query_slots[:, :, None])
  return mask, query_slots, new_end


class Transformer(nn.Module):
  """Llama-family decoder over whole sequences (training, scoring); layers under `nn.scan`.

  Call: `Transformer(config).apply({"params": params}, tokens, ...)`. Cached incremental decoding
  (prefill / decode / extend) is `cached_forward`, which runs the same `Block`s.

  Args (of `__call__`):
    tokens: `[B, T]` int token ids.
    positions: `[B, T]` int position ids; default `arange(T)`.
    lengths: `[B]` int number of real tokens at the start of each row (right padding); default `T`.
      Padding tokens never act as keys, whatever their id.
    compute_logits: also return float32 `[B, T, V]` logits.
    prefix_length: `P > 0` when every row's first `P` tokens and positions are the same and real
      (a shared system prompt): the prefix is computed once, as a flat sequence `[1, P + B * S]`
      (`PrefixMask`), and every row's other `S = T - P` tokens attend to its keys, so the forward
      and backward passes cost `P + B * S` tokens instead of `B * T` and the gradient is the same
      (the prefix's cotangents from every row add up). Static; 0 < P < T; not for
      mixture-of-experts models. The outputs then cover positions `P - 1 .. T - 1` only.

  Returns:
    `DecoderOutput(hidden, logits, cache=None)`: `[B, T, ...]`, or `[B, T - P + 1, ...]` (positions
    `P - 1 .. T - 1`) with a `prefix_length`.
  """
  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embed_tokens = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")))
    block = Block
    if cfg.remat != "none":
      block = nn.remat(Block, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    self.layers = nn.scan(
        block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
        in_axes=(0, nn.broadcast, nn.broadcast), length=cfg.num_hidden_layers,
        metadata_params={nn.PARTITION_NAME: "layers"})(cfg)
    self.norm = RMSNorm(cfg.rms_norm_eps, cfg.param_dtype, cfg.norm_plus_one)
    if not cfg.tie_word_embeddings:
      self.lm_head = _dense(cfg.vocab_size, ("embed", "vocab"), cfg)

  def __call__(self, tokens, positions=None, lengths=None, compute_logits: bool = True,
               routing=None, prefix_length: int = 0) -> DecoderOutput:
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if lengths is None:
      lengths = jnp.full((b,), t, jnp.int32)
    if prefix_length:
      return self._shared_prefix(tokens, positions, lengths, compute_logits, prefix_length)
    mask, _, _ = _attention_mask(jnp.zeros((b,), jnp.int32), lengths, t,
                                 jnp.arange(t, dtype=jnp.int32))
    x = _embed(self.embed_tokens(tokens), self.config)
    replay = None if routing is None else jnp.moveaxis(jnp.asarray(routing, jnp.int32), 2, 0)
    sliding = jnp.asarray(self.config.sliding_layers)
    if self.config.sliding_window:
      mask = (mask, _window(mask, jnp.arange(t, dtype=jnp.int32)[None, :],
                            jnp.arange(t, dtype=jnp.int32), self.config.sliding_window))
    x, per_layer = self.layers(x, (replay, sliding), rope_tables(positions, self.config), mask)
    hidden = self.norm(x)
    logits = self.logits(hidden) if compute_logits else None
    if not self.config.num_experts:
      return DecoderOutput(hidden=hidden, logits=logits, cache=None)
    experts, probs = per_layer  # [L, B, T, k], [L, B, T, E]
    real = jnp.arange(t)[None, :] < lengths[:, None]
    return DecoderOutput(hidden=hidden, logits=logits, cache=None,
                         routing=jnp.moveaxis(experts, 0, 2),
                         aux_loss=load_balancing_loss(experts, probs, real, self.config.num_experts))

  def _shared_prefix(self, tokens, positions, lengths, compute_logits, p: int) -> DecoderOutput:
    """`__call__` with `prefix_length=p`: the flat layout `[prefix, row 0's suffix, row 1's, ...]`
    through the same layers (every op but attention is per token; attention reads `PrefixMask`)."""
    cfg = self.config
    b, t = tokens.shape
    if cfg.num_experts:
      raise ValueError("prefix_length: not for mixture-of-experts models (routing is per row).")
    if not 0 < p < t:
      raise ValueError(f"prefix_length must be in (0, {t}) for {t}-token rows, got {p}.")
    s = t - p
    flat = lambda x: jnp.concatenate([x[0, :p], x[:, p:].reshape(b * s)])[None]
    prefix_slots, keys = jnp.arange(p, dtype=jnp.int32), jnp.arange(p + s, dtype=jnp.int32)
    query_slots = p + jnp.arange(s, dtype=jnp.int32)[None, :]
    prefix = (prefix_slots[None, :] <= prefix_slots[:, None])[None]
    suffix = ((keys[None, None, :] <= query_slots[:, :, None])
              & (keys[None, None, :] < lengths.astype(jnp.int32)[:, None, None]))
    mask = PrefixMask(prefix, jnp.broadcast_to(suffix, (b, s, p + s)))
    if cfg.sliding_window:
      w = cfg.sliding_window
      mask = (mask, PrefixMask(_window(prefix, prefix_slots[None, :], prefix_slots, w),
                               _window(mask.suffix, query_slots, keys, w)))
    x = _embed(self.embed_tokens(flat(tokens)), cfg)
    sliding = jnp.asarray(cfg.sliding_layers)
    x, _ = self.layers(x, (None, sliding), rope_tables(flat(positions), cfg), mask)
    hidden = self.norm(x)[0]  # [P + B * S, D]
    d = hidden.shape[-1]
    hidden = jnp.concatenate([jnp.broadcast_to(hidden[p - 1], (b, 1, d)),
                              hidden[p:].reshape(b, s, d)], axis=1)
    return DecoderOutput(hidden=hidden, logits=self.logits(hidden) if compute_logits else None,
                         cache=None)

  def logits(self, hidden):
    """float32 `[..., V]` logits of final-normed hidden states."""
    cap = self.config.final_logit_softcapping
    if self.config.tie_word_embeddings:
      table = self.embed_tokens.embedding
      return softcap(jnp.einsum("...d,vd->...v", hidden, table.astype(hidden.dtype),
                                preferred_element_type=_F32), cap)
    return softcap(self.lm_head(hidden).astype(_F32), cap)


def load_balancing_loss(experts, probs, real, num_experts: int):
  """Switch-Transformer load balancing (HF `load_balancing_loss_func`): `E * sum_e f_e P_e`, with
  `f_e` the share of routed (token, slot) pairs that chose expert `e` and `P_e` its mean router
  probability, both averaged over the real tokens of every layer. experts `[L, B, T, k]`, probs
  `[L, B, T, E]`, real `[B, T]` bool."""
  w = jnp.broadcast_to(real[None].astype(_F32), experts.shape[:3])
  rows = jnp.maximum(jnp.sum(w), 1.0)
  counts = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=_F32) * w[..., None, None],
                   axis=(0, 1, 2, 3))
  mean_probs = jnp.sum(probs * w[..., None], axis=(0, 1, 2))
  return num_experts * jnp.sum((counts / rows) * (mean_probs / rows))


def decode_logits(params: DecodeParams, config: ModelConfig, hidden):
  """float32 `[..., V]` logits of final-normed hidden states, from `DecodeParams`."""
  if isinstance(params.lm_head, quant.Int8Weight):  # quantised decoding (tied or not)
    logits = quant.matmul(hidden, params.lm_head, config.decode_kernel).astype(_F32)
  elif config.tie_word_embeddings:
    logits = jnp.einsum("...d,vd->...v", hidden, params.embed.astype(hidden.dtype),
                        preferred_element_type=_F32)
  else:
    logits = jnp.einsum("...d,dv->...v", hidden, params.lm_head.astype(hidden.dtype),
                        preferred_element_type=_F32)
  return softcap(logits, config.final_logit_softcapping)


def _xla_step_attention(q1, layer_k, layer_v, mask, _=None):
  """XLA einsums over all `S` slots (masked): q1 `[B, KV, G, hd]` float32 (scaled), mask `[B, 1, S]`."""
  scores = jnp.einsum("bkgd,bksd->bkgs", q1, layer_k.astype(_F32))
  scores = jnp.where(mask[:, 0][:, None, None, :], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("bkgs,bksd->bkgd", probs, layer_v.astype(_F32))


def _decode_step_attention(q1, layer_k, layer_v, mask, decode_kernel: str):
  """One-token attention `[B, KV, G, hd]` float32, by `ModelConfig.decode_kernel`.

  "auto" chooses the CPU kernel through `lax.platform_dependent` (other platforms lower the XLA
  einsums); "cpu" calls it directly (its FFI target is registered for the CPU platform only, so the
  call has no lowering for another one).
  """
  if not cpu_kernels.use_kernel(decode_kernel, layer_k.dtype, q1.shape[2]):
    return _xla_step_attention(q1, layer_k, layer_v, mask)
  visible = jnp.sum(mask[:, 0], axis=-1, dtype=jnp.int32)  # the mask is a prefix
  if decode_kernel == "cpu":
    return cpu_kernels.decode_attention(q1, layer_k, layer_v, visible)
  return jax.lax.platform_dependent(
      q1, layer_k, layer_v, mask, visible, default=_xla_step_attention,
      cpu=lambda q1, k, v, _, n: cpu_kernels.decode_attention(q1, k, v, n))


def _cached_attention(q, layer_k, layer_v, mask, decode_kernel: str, scale: float | None = None,
                      cap: float = 0.0):
  """Grouped-query attention of new queries against a cache.

  q: `[B, T, KV, G, hd]`; layer_k, layer_v: `[B, KV, S, hd]`; mask `[B, T, S]`, for a decode step
  (`T == 1`) a prefix of each row's slots (as `_attention_mask` builds it). Returns
  `[B, T, KV, G, hd]` in q's dtype; computed in float32 (a bfloat16 cache is upcast as it is read).

  A decode step runs, as `decode_kernel` (`ModelConfig.decode_kernel`) chooses, the CPU kernel
  `cpu_kernels.decode_attention`: it reads each row's visible prefix only, where XLA reads all `S`
  slots of every layer every step (the sampler's largest cost after the matmuls at batch 64). Longer
  appends (prefill, observations) and soft-capped scores (`cap`, Gemma 2) run einsums.
  """
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  if q.shape[1] == 1 and not cap:
    q1 = q[:, 0].astype(_F32) * scale  # [B, KV, G, hd]
    out = _decode_step_attention(q1, layer_k, layer_v, mask, decode_kernel)
    return out[:, None].astype(q.dtype)
  scores = softcap(jnp.einsum("btkgd,bksd->bkgts", q.astype(_F32), layer_k.astype(_F32)) * scale,
                   cap)
  scores = jnp.where(mask[:, None, None, :, :], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bksd->bkgtd", probs, layer_v.astype(_F32))
  return out.transpose(0, 3, 1, 2, 4).astype(q.dtype)


def _cached_block(w, config: ModelConfig, x, layer_k, layer_v, rope, mask, slots,
                  sliding: bool = False):
  """`Block` on `DecodeParams` weights with a KV cache: writes the new keys/values at `slots`
  (`[B, T]`; slots past the capacity are dropped, never wrapped) and attends to the cache.
  `rope` and `mask` are this layer's (`sliding`: a sliding-window layer)."""
  b, t, _ = x.shape
  h, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.dims_per_head
  y = _rms_norm(x, w["input_norm"], config.rms_norm_eps, config.norm_plus_one)
  mm = lambda a, m: quant.matmul(a, m, config.decode_kernel)  # a float or an int8 matrix
  qkv = mm(y, w["qkv"])
  if w["qkv_bias"] is not None:
    qkv = qkv + w["qkv_bias"][None, None, :]
  qk = qkv[..., :(h + kv) * hd].reshape(b, t, h + kv, hd)
  if w["qk_norm"] is not None:  # the per-head norm (`Attention`): scale [H + KV, hd]
    qk32 = qk.astype(_F32)
    qk32 = qk32 * jax.lax.rsqrt(jnp.mean(qk32 * qk32, axis=-1, keepdims=True) + config.rms_norm_eps)
    scale = w["qk_norm"].astype(_F32) + (1.0 if config.norm_plus_one else 0.0)
    qk = (qk32 * scale[None, None]).astype(qk.dtype)
  qk = _apply_rope(qk, rope)  # one pass for q and k
  q, k = qk[:, :, :h], qk[:, :, h:]
  v = qkv[..., (h + kv) * hd:].reshape(b, t, kv, hd)
  rows = jnp.arange(b)[:, None]
  # Advanced indices (rows, slots) lead the indexed shape: [B, T, KV, hd], as k and v are.
  layer_k = layer_k.at[rows, :, slots].set(k.astype(layer_k.dtype), mode="drop")
  layer_v = layer_v.at[rows, :, slots].set(v.astype(layer_v.dtype), mode="drop")
  # A sliding-window mask is not a prefix of the slots: the CPU kernel (prefix reads) cannot run it.
  kernel = "xla" if sliding else config.decode_kernel
  out = _cached_attention(q.reshape(b, t, kv, h // kv, hd), layer_k, layer_v, mask, kernel,
                          config.attention_scale if config.query_pre_attn_scalar else None,
                          config.attn_logit_softcapping)
  attn = mm(out.reshape(b, t, h * hd), w["o"])
  eps, plus_one = config.rms_norm_eps, config.norm_plus_one
  if w["out_norms"] is not None:  # Gemma: norms after attention and around the MLP
    x = x + _rms_norm(attn, w["out_norms"][0], eps, plus_one)
    y = _rms_norm(x, w["post_norm"], eps, plus_one)
    gate, up = jnp.split(mm(y, w["gate_up"]), 2, axis=-1)
    mlp = mm(_activation(config, gate) * up, w["down"])
    return x + _rms_norm(mlp, w["out_norms"][1], eps, plus_one), layer_k, layer_v, None
  x = x + attn
  y = _rms_norm(x, w["post_norm"], config.rms_norm_eps)
  if w["router"] is not None:  # MoE (`MoE`): the same routing and expert math
    weights, experts, _ = _route(jnp.dot(y, w["router"]), config.num_experts_per_tok,
                                 config.norm_topk_prob)
    gate, up = jnp.split(w["gate_up"], 2, axis=-1)
    return (x + _moe_combine(y, weights, experts, gate, up, w["down"], config.num_experts),
            layer_k, layer_v, experts)
  gate, up = jnp.split(mm(y, w["gate_up"]), 2, axis=-1)
  return x + mm(nn.silu(gate) * up, w["down"]), layer_k, layer_v, None


def cached_forward(params, config: ModelConfig, tokens, cache: KVCache, positions=None,
                   lengths=None, compute_logits: bool = False, rope=None) -> DecoderOutput:
  """Appends `tokens[B, T]` to `cache` and returns their hidden states (and optionally logits).

  The `T` tokens of row `b` are written at slots `cache.end[b] + t` (slots past the capacity are
  dropped) and attend to every filled slot up to their own; `lengths[b]` of them are real (right
  padding; default `T`), and the returned cache has `end += lengths`. Positions default to the slots.
  The layers are `Transformer`'s blocks, applied one by one on `DecodeParams` weights and per-layer
  caches, so results equal `Transformer` on the whole sequence (tested to 1e-4).

  Args:
    params: `DecodeParams` (from `prepare_decode_params`) or raw `Transformer` params.
    config: the model config.
    tokens: `[B, T]` int ids.
    cache: the `KVCache` to extend.
    positions: optional `[B, T]` position ids.
    lengths: optional `[B]` int real tokens per row.
    compute_logits: also return `[B, T, V]` float32 logits.
    rope: optional `rope_tables(positions, config)`, computed by the caller (then `positions` is
      unused). A decode loop passes slices of one table built before the loop: computed here, XLA:CPU
      fused the cos/sin into every layer's rotation and evaluated them once per layer.
  """
  params = prepare_decode_params(params, config)
  b, t = tokens.shape
  if lengths is None:
    lengths = jnp.full((b,), t, jnp.int32)
  mask, query_slots, new_end = _attention_mask(cache.end, lengths, t,
                                               jnp.arange(cache.capacity, dtype=jnp.int32))
  if positions is None:
    positions = query_slots
  x = _embed(jnp.take(params.embed, tokens, axis=0).astype(jnp.dtype(config.dtype)), config)
  if rope is None:
    rope = rope_tables(positions, config)
  window = None
  if config.sliding_window:
    window = _window(mask, query_slots, jnp.arange(cache.capacity, dtype=jnp.int32),
                     config.sliding_window)
  new_k, new_v, routing = [], [], []
  for w, k, v, sliding in zip(params.layers, cache.k, cache.v, config.sliding_layers):
    x, k, v, experts = _cached_block(w, config, x, k, v, _layer_rope(rope, config, sliding),
                                     window if sliding else mask, query_slots, sliding)
    new_k.append(k)
    new_v.append(v)
    routing.append(experts)
  hidden = _rms_norm(x, params.norm["scale"], config.rms_norm_eps, config.norm_plus_one)
  logits = decode_logits(params, config, hidden) if compute_logits else None
  routing = jnp.stack(routing, axis=2) if config.num_experts else None  # [B, T, L, k]
  recorded = cache.routing
  if recorded is not None and routing is not None:  # written at the tokens' slots, as k and v
    recorded = recorded.at[jnp.arange(b)[:, None], query_slots].set(routing, mode="drop")
  return DecoderOutput(hidden=hidden, logits=logits,
                       cache=KVCache(k=tuple(new_k), v=tuple(new_v), end=new_end,
                                     routing=recorded),
                       routing=routing)


def unembedding(params, config: ModelConfig):
  """The unembedding matrix for `core.logprobs.token_logprobs_from_hidden`: `[V, D]` (tied) or
  `[D, V]` (untied)."""
  if config.tie_word_embeddings:
    return params["embed_tokens"]["embedding"]
  return params["lm_head"]["kernel"]


class ValueHead(nn.Module):
  """One float32 value per token from hidden states: `[B, T, D] -> [B, T]`."""

  @nn.compact
  def __call__(self, hidden):
    dense = nn.Dense(1, dtype=_F32, param_dtype=_F32,
                     kernel_init=nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                              ("embed", "value")),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("value",)))
    return dense(hidden.astype(_F32))[..., 0]


class Critic(nn.Module):
  """A separately parameterised critic: its own decoder trunk and a value head. `[B, T] -> [B, T]`."""
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions=None, lengths=None):
    out = Transformer(self.config, name="trunk")(tokens, positions, lengths, compute_logits=False)
    return ValueHead(name="value_head")(out.hidden)


class PolicyWithValue(nn.Module):
  """Policy and critic sharing one trunk: returns `(DecoderOutput, values[B, T])`.

  Its parameters are `{"trunk": <Transformer params>, "value_head": <ValueHead params>}`, so a
  policy's parameters serve as the trunk unchanged (the learner's shared critic,
  `algorithm.critic='shared'`, keeps only the head in `TrainState.critic_params`). `routing`
  replays a mixture-of-experts rollout's experts, as in `Transformer`."""
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions=None, lengths=None, compute_logits=True, routing=None):
    out = Transformer(self.config, name="trunk")(tokens, positions, lengths, compute_logits,
                                                 routing=routing)
    return out, ValueHead(name="value_head")(out.hidden)
