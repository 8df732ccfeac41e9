"""KV-cached sampling: jitted prefill / extend / decode, temperature / top-k / top-p, stop rules."""

from longhorizon.sampling.sampler import (PAD_OUTPUT_ID, DecodeResult, SamplingParams,
                                          apply_temperature, decode, extend, fork_cache, generate,
                                          overflowed,
                                          pad_rows, per_row_keys, prefill, process_logits, sample_tokens,
                                          top_k_mask, top_p_mask)

__all__ = ["SamplingParams", "DecodeResult", "prefill", "extend", "decode", "generate",
           "fork_cache", "pad_rows", "per_row_keys", "overflowed", "apply_temperature", "top_k_mask",
           "top_p_mask", "process_logits", "sample_tokens", "PAD_OUTPUT_ID"]
