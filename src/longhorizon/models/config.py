"""`ModelConfig`: the architecture of a decoder (the Llama family: Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3,
Qwen3-MoE, Gemma 2 and Gemma 3, each a set of fields on one config).

Field names follow HuggingFace `config.json` where one exists, so `from_hf` / `to_hf` are near
identities and a reader of either file recognises every entry. `family` names the implementation
(looked up in `models/families.py`); `decode_kernel` chooses the decode-step attention kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from longhorizon.models import cpu_kernels

__all__ = ["ModelConfig", "RopeScaling", "tiny_config", "SUPPORTED_ARCHITECTURES", "MODEL_TYPE_FAMILY",
           "DECODE_KERNELS", "DECODE_QUANTS", "LORA_TARGETS"]

# HF `architectures` / `model_type` values this decoder implements exactly.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}

# HF `model_type` -> the model family (`models/families.py`) that implements it.
MODEL_TYPE_FAMILY = {
    "llama": "llama",
    "qwen2": "llama",  # Llama with q/k/v biases and untied embeddings
    "qwen3": "llama",  # Llama with a per-head RMSNorm on queries and keys (`qk_norm`), no biases
    "qwen3_moe": "llama",  # Qwen3 with sparse mixture-of-experts MLPs (`num_experts`)
    "gemma2": "llama",  # Gemma 2: Gemma 3's norms and layout without q/k norm, one RoPE base, and
    #                     tanh soft-capping of attention scores and final logits
    "gemma3_text": "llama",  # Gemma 3: (1 + w) norms around attention and MLP, GELU, scaled
    #                          embeddings, q/k norm, sliding-window layers with their own RoPE base
}

# The Gemma model types: (1 + w) sandwich norms, scaled embeddings, sliding-window layers.
GEMMA_TYPES = ("gemma2", "gemma3_text")
# The model types with a per-head RMSNorm on queries and keys (`ModelConfig.qk_norm`).
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
# Gemma's per-layer attention kinds (`ModelConfig.layer_types`, HF `layer_types`).
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")

# `ModelConfig.decode_kernel` choices: the attention of a one-token decode step.
#   "auto": the C++ kernel (`models/cpu_kernels.py`) when running on CPU with float32 caches, at most
#           `cpu_kernels.MAX_GROUP` query heads per kv head, and a kernel that builds; else XLA (a
#           warning names why the kernel did not build).
#   "xla":  always XLA's einsums.
#   "cpu":  always the kernel: an error if it cannot be built; the call lowers for CPU only.
DECODE_KERNELS = ("auto", "xla", "cpu")
# `ModelConfig.decode_quant` choices: the sampler's weight format.
DECODE_QUANTS = ("none", "int8")

# The projections a LoRA adapter may sit on (`ModelConfig.lora_targets`; HF / peft module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 frequency scaling of RoPE (`rope_type: llama3` in HF configs)."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of the decoder. Frozen and hashable (usable as a static jit argument)."""
  vocab_size: int
  hidden_size: int  # D, model width
  intermediate_size: int  # F, SwiGLU hidden width
  num_hidden_layers: int  # number of decoder blocks (scanned)
  num_attention_heads: int  # H query heads
  num_key_value_heads: int  # KV heads (grouped-query attention: H % KV == 0)
  head_dim: int | None = None  # per-head width; None -> hidden_size // num_attention_heads
  rope_theta: float = 10000.0  # RoPE base (SmolLM2: 1e5, Llama 3: 5e5, Qwen2.5: 1e6)
  rope_scaling: RopeScaling | None = None  # Llama-3 scaling, or None
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = True  # unembedding = embedding table transposed
  attention_bias: bool = False  # bias on q/k/v projections (Qwen2: True)
  qk_norm: bool = False  # RMSNorm over head_dim on each query and key head before RoPE (Qwen3)
  # Mixture of experts (Qwen3-MoE): 0 experts is a dense MLP. Each token goes to its
  # `num_experts_per_tok` most probable experts (router softmax in float32; their weights
  # renormalised when `norm_topk_prob`); `router_aux_loss_coef` weighs the load-balancing loss.
  num_experts: int = 0
  num_experts_per_tok: int = 2
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  router_aux_loss_coef: float = 0.0
  # Gemma 2 / 3 (model_type "gemma2", "gemma3_text"): RMSNorm scales by (1 + w) (`norm_plus_one`);
  # extra norms after attention and around the MLP (`sandwich_norms`); `hidden_act`; embeddings
  # times sqrt(hidden_size); attention scaled by query_pre_attn_scalar^-0.5 (0: head_dim^-0.5);
  # `layer_types[l]` "sliding_attention" layers see the last `sliding_window` positions and (Gemma 3)
  # rotate with `rope_local_theta`. Gemma 2 soft-caps (`cap * tanh(x / cap)`, 0 = off) the scaled
  # attention scores and the final logits (before any sampling temperature).
  norm_plus_one: bool = False
  sandwich_norms: bool = False
  hidden_act: str = "silu"
  scale_embeddings: bool = False
  query_pre_attn_scalar: float = 0.0
  sliding_window: int = 0
  layer_types: tuple = ()
  rope_local_theta: float = 0.0
  attn_logit_softcapping: float = 0.0
  final_logit_softcapping: float = 0.0
  max_position_embeddings: int = 8192
  model_type: str = "llama"  # "llama", "qwen2" or "qwen3" (HF naming on save)
  # Numerics: parameters are stored in `param_dtype`; matmuls run in `dtype`; norms, softmax, logits and
  # log-probs are always float32.
  param_dtype: str = "float32"
  dtype: str = "float32"
  # Layers always run under `nn.scan` (compile time independent of depth). Remat policy for training:
  # "none", "full" (recompute each block in the backward pass) or "dots" (save matmul outputs only).
  remat: str = "none"
  # The implementation: a name registered in `models/families.py` (`family(config)` looks it up).
  # `from_hf` / GGUF loading set it from `model_type` (`MODEL_TYPE_FAMILY`).
  family: str = "llama"
  # Decode-step attention: "auto", "xla" or "cpu" (see `DECODE_KERNELS`). A field of this static jit
  # argument, so the tracing cache keys on it: switching it retraces, never reuses a stale program.
  decode_kernel: str = "auto"
  # Weight-only quantisation of the sampler's copy of the weights (`models/quant.py`): "none" or
  # "int8" (per-output-column scales; dense models only). Training never reads the decode copy, so
  # the learner stays in full precision.
  decode_quant: str = "none"
  # LoRA (`models/lora.py`): rank 0 is off. With rank r > 0 every `lora_targets` projection gains
  # float32 adapters `lora_a [D_in, r]`, `lora_b [r, D_out]` (b starts at 0) and computes
  # `x W + (lora_alpha / r) * dropout(x) A B`; only the adapters train. Dropout (rate `lora_dropout`)
  # applies only where a "dropout" rng is given (the training losses), never when sampling or scoring.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple = LORA_TARGETS
  lora_dropout: float = 0.0

  def __post_init__(self):
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                       f"num_key_value_heads={self.num_key_value_heads}.")
    if self.head_dim is None and self.hidden_size % self.num_attention_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                       f"{self.num_attention_heads}; set head_dim explicitly.")
    if self.remat not in ("none", "full", "dots"):
      raise ValueError(f"remat must be 'none', 'full' or 'dots', got {self.remat!r}.")
    if self.model_type not in SUPPORTED_ARCHITECTURES.values():
      raise ValueError(f"model_type {self.model_type!r} is not supported; expected one of "
                       f"{sorted(SUPPORTED_ARCHITECTURES.values())}.")
    if not isinstance(self.family, str) or not self.family:
      raise ValueError(f"family must be a registered model family name (e.g. 'llama'), got "
                       f"{self.family!r}.")
    if self.qk_norm != (self.model_type in QK_NORM_TYPES):
      raise ValueError(f"qk_norm={self.qk_norm} with model_type={self.model_type!r}: the per-head "
                       f"query/key norm is on exactly for model_type 'qwen3', 'qwen3_moe' and "
                       f"'gemma3_text'.")
    self._check_gemma()
    if bool(self.num_experts) != (self.model_type == "qwen3_moe") or (self.num_experts and (
        not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0)):
      raise ValueError(f"num_experts={self.num_experts}, num_experts_per_tok="
                       f"{self.num_experts_per_tok}, moe_intermediate_size="
                       f"{self.moe_intermediate_size} with model_type={self.model_type!r}: experts "
                       f"are for model_type='qwen3_moe', with 0 < num_experts_per_tok <= "
                       f"num_experts and moe_intermediate_size > 0.")
    self._check_decode_kernel()
    if self.decode_quant not in DECODE_QUANTS or (self.decode_quant != "none" and self.num_experts):
      raise ValueError(f"decode_quant must be one of {DECODE_QUANTS} (int8 for dense models only; "
                       f"num_experts={self.num_experts}), got {self.decode_quant!r}.")
    self._check_lora()
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

  def _check_decode_kernel(self):
    if self.decode_kernel not in DECODE_KERNELS:
      raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {self.decode_kernel!r}.")
    group = self.num_attention_heads // self.num_key_value_heads
    if self.decode_kernel == "cpu" and not cpu_kernels.applies(self.dtype, group):
      raise ValueError(
          f"decode_kernel='cpu' needs dtype='float32' and at most {cpu_kernels.MAX_GROUP} query heads "
          f"per kv head; got dtype={self.dtype!r} and {group} query heads per kv head. Use "
          f"decode_kernel='auto' (the kernel where it applies, else XLA) or 'xla'.")

  def _check_gemma(self):
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    gemma = self.model_type in GEMMA_TYPES
    flags = (self.norm_plus_one, self.sandwich_norms, self.scale_embeddings)
    if any(f != gemma for f in flags):
      raise ValueError(f"norm_plus_one, sandwich_norms and scale_embeddings are Gemma's: on "
                       f"exactly for model_type in {GEMMA_TYPES} (got {flags} for "
                       f"{self.model_type!r}).")
    caps = (self.attn_logit_softcapping, self.final_logit_softcapping)
    if any(c < 0 for c in caps) or (any(caps) and self.model_type != "gemma2"):
      raise ValueError(f"attn_logit_softcapping, final_logit_softcapping = {caps}: soft-capping "
                       f"is Gemma 2's (model_type='gemma2'), each >= 0 (0 = off); got "
                       f"model_type={self.model_type!r}.")
    if self.hidden_act not in HIDDEN_ACTS:
      raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}.")
    if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                             or not set(self.layer_types) <= set(LAYER_TYPES)):
      raise ValueError(f"layer_types must give one of {LAYER_TYPES} for each of the "
                       f"{self.num_hidden_layers} layers, got {self.layer_types!r}.")
    if "sliding_attention" in self.layer_types and self.sliding_window < 1:
      raise ValueError(f"sliding_attention layers need sliding_window >= 1, got "
                       f"{self.sliding_window}.")

  @property
  def sliding_layers(self) -> tuple:
    """`[L]` bools: which layers attend within `sliding_window` (all False without layer types)."""
    return tuple(t == "sliding_attention" for t in self.layer_types) or (False,) * self.num_hidden_layers

  @property
  def attention_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.dims_per_head) ** -0.5

  def _check_lora(self):
    object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
    if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
      raise ValueError(f"lora_rank must be an int >= 0 (0: no adapters), got {self.lora_rank!r}.")
    unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
    if unknown or (self.lora_rank and not self.lora_targets):
      raise ValueError(f"lora_targets={self.lora_targets!r}: each must be one of {LORA_TARGETS} "
                       f"(and at least one when lora_rank > 0); unknown: {unknown}.")
    mlp = sorted(set(self.lora_targets) & {"gate_proj", "up_proj", "down_proj"})
    if self.lora_rank and self.num_experts and mlp:
      raise ValueError(f"lora_targets include {mlp}, but this model's MLPs are mixtures of experts "
                       f"(num_experts={self.num_experts}); adapters on experts are not supported: "
                       f"target the attention projections (q_proj, k_proj, v_proj, o_proj).")
    if not 0.0 <= self.lora_dropout < 1.0 or self.lora_alpha <= 0:
      raise ValueError(f"lora_dropout must be in [0, 1) and lora_alpha > 0; got "
                       f"{self.lora_dropout!r} and {self.lora_alpha!r}.")

  @property
  def lora_scale(self) -> float:
    """`lora_alpha / lora_rank` (peft's scaling without rsLoRA); 0 when LoRA is off."""
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  @property
  def dims_per_head(self) -> int:
    return self.head_dim

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
    """Builds a config from a HuggingFace `config.json` dict; unknown architectures raise."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not known and model_type not in SUPPORTED_ARCHITECTURES.values():
      raise ValueError(f"{source}: unknown architecture {archs or model_type!r}; supported: "
                       f"{sorted(SUPPORTED_ARCHITECTURES)}.")
    model_type = known[0] if known else model_type
    scaling = hf.get("rope_scaling")
    rope_scaling = None
    if scaling:
      kind = scaling.get("rope_type", scaling.get("type"))
      if kind != "llama3":
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported (only 'llama3').")
      rope_scaling = RopeScaling(
          factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
          high_freq_factor=float(scaling["high_freq_factor"]),
          original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
      if key not in hf:
        raise ValueError(f"{source}: missing required field {key!r}.")
    rope_theta = hf.get("rope_theta")
    if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
      rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    gemma = _gemma_fields(hf, model_type)
    if gemma:
      rope_theta = gemma.pop("rope_theta")
    return cls(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=int(hf["num_attention_heads"]),
        num_key_value_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        head_dim=hf.get("head_dim"),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5 if model_type == "llama" else 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in ("llama", *GEMMA_TYPES))),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type in QK_NORM_TYPES,
        **_moe_fields(hf, model_type),
        **gemma,
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        model_type=model_type,
        family=MODEL_TYPE_FAMILY[model_type],
    )

  def to_hf(self) -> dict[str, Any]:
    """The HuggingFace `config.json` dict of this architecture."""
    arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]
    out = {
        "architectures": [arch],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.dims_per_head,
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": self.param_dtype,
    }
    if self.model_type in ("llama", "qwen3", "qwen3_moe"):
      out["attention_bias"] = self.attention_bias
    if self.model_type in GEMMA_TYPES:
      out.update(_gemma_hf(self))
      del out["hidden_act"], out["rope_theta"]
    if self.num_experts:
      out.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                 num_experts_per_tok=self.num_experts_per_tok,
                 moe_intermediate_size=self.moe_intermediate_size,
                 norm_topk_prob=self.norm_topk_prob, router_aux_loss_coef=self.router_aux_loss_coef,
                 decoder_sparse_step=1, mlp_only_layers=[])
    if self.model_type == "llama":
      out["mlp_bias"] = False
    if self.rope_scaling is not None:
      out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
    return out


def _gemma_fields(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
  """Gemma 2 / 3's fields of a HF `config.json`. Gemma 3 has a RoPE base per layer kind
  (transformers >= 5 nests them under `rope_parameters`, older files have `rope_theta` /
  `rope_local_base_freq`); Gemma 2 one base and its soft-capping. Gemma 2 files without
  `layer_types` alternate sliding and full layers, starting with a sliding one (transformers')."""
  if model_type not in GEMMA_TYPES:
    return {}
  rope = hf.get("rope_parameters") or {}
  fields = dict(norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
                hidden_act=hf.get("hidden_activation", "gelu_pytorch_tanh"),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                sliding_window=int(hf.get("sliding_window") or 0),
                layer_types=tuple(hf.get("layer_types") or ()))
  if model_type == "gemma2":
    if rope.get("rope_type", "default") != "default":
      raise ValueError(f"gemma2 rope_type {rope['rope_type']!r} is not supported.")
    layers = int(hf["num_hidden_layers"])
    if not fields["layer_types"] and fields["sliding_window"]:
      fields["layer_types"] = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                    for i in range(layers))
    return dict(fields, rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1e4))),
                attn_logit_softcapping=float(hf.get("attn_logit_softcapping") or 0.0),
                final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0))
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    if hf.get(key):
      raise ValueError(f"{key}={hf[key]} is not supported for gemma3_text (Gemma 2's "
                       f"soft-capping; use model_type 'gemma2').")
  local = (rope.get("sliding_attention") or {}).get("rope_theta", hf.get("rope_local_base_freq"))
  full = (rope.get("full_attention") or {}).get("rope_theta", hf.get("rope_theta", 1e6))
  for kind in ("full_attention", "sliding_attention"):
    if (rope.get(kind) or {}).get("rope_type", "default") != "default":
      raise ValueError(f"gemma3 rope_type {rope[kind]['rope_type']!r} ({kind}) is not supported.")
  return dict(fields, rope_theta=float(full), rope_local_theta=float(local or 10000.0))


def _gemma_hf(config: ModelConfig) -> dict[str, Any]:
  """The Gemma 2 / 3 entries of `config.to_hf()`."""
  scalar = config.query_pre_attn_scalar  # transformers' config wants an int when it is one
  caps = [c or None for c in (config.attn_logit_softcapping, config.final_logit_softcapping)]
  out = dict(hidden_activation=config.hidden_act,
             query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
             sliding_window=config.sliding_window, layer_types=list(config.layer_types),
             attn_logit_softcapping=caps[0], final_logit_softcapping=caps[1])
  if config.model_type == "gemma2":
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
  else:
    out["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": config.rope_theta},
        "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta}}
  return out


def _moe_fields(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
  """The mixture-of-experts fields of a HF `config.json` (Qwen3-MoE); every layer must be sparse."""
  if model_type != "qwen3_moe":
    return {}
  if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
    raise ValueError("qwen3_moe configs with dense layers (mlp_only_layers, decoder_sparse_step "
                     "!= 1) are not supported: every layer must be a mixture of experts.")
  experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers >= 5 writes the latter
  return dict(num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
              moe_intermediate_size=int(hf["moe_intermediate_size"]),
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))


def tiny_config(vocab_size: int = 256, **overrides) -> ModelConfig:
  """A 2-layer, width-64 decoder for tests and fast CPU experiments (~0.1M parameters + embeddings)."""
  base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
              max_position_embeddings=4096, tie_word_embeddings=True)
  base.update(overrides)
  return ModelConfig(**base)
