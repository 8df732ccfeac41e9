r"""Rollout/learner mismatch of weight-only int8 decoding on SmolLM2-135M-Instruct.

  python experiments/quant_mismatch.py [--batch=16] [--new_tokens=48] [--threshold=2]

For each rollout engine (`decode_quant` "none" = the learner's float32 weights, and "int8"), the
sampler draws `--new_tokens` tokens at temperature 1 for `--batch` rows of chat prompts; the
float32 learner then scores the same sequences with one whole-sequence pass (as the update does).
Reported over the sampled tokens: mean and max |log pi_learner - log pi_sampler|, and the share of
tokens whose truncated-IS weight `pi_learner / pi_sampler` exceeds `--threshold` (truncated by the
TIS correction, `loss.tis_threshold`), with the sampler's tokens/s. Prints one table.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from longhorizon import sampling
from longhorizon.models import Transformer, checkpoint, prepare_decode_params
from longhorizon.text import render_chat

_BATCH = flags.DEFINE_integer("batch", 16, "Rows sampled per engine.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 48, "Tokens sampled per row.")
_THRESHOLD = flags.DEFINE_float("threshold", 2.0, "TIS truncation threshold C.")

_PROMPTS = ["What is the capital of France?", "Add 17 and 25, then explain.",
            "Name three colours of the rainbow.", "Write one sentence about the sea.",
            "Which tool would you call to look up an order?", "Count from one to five."]


def _prompts(tokenizer, batch):
  rows = [render_chat(tokenizer, [{"role": "user", "content": _PROMPTS[i % len(_PROMPTS)]}])
          for i in range(batch)]
  return sampling.pad_rows(rows, minimum=16)


def sample(params, config, tokens, lengths, new_tokens, seed=0):
  """`(sequences [B, W + N], positions of the sampled tokens [B, N], behaviour log-probs [B, N],
  seconds of the decode)` at temperature 1 (no stop tokens)."""
  rule = sampling.SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=())
  dp = prepare_decode_params(params, config)
  cache, last = sampling.prefill(dp, config, tokens, lengths, tokens.shape[1] + new_tokens)
  keys = sampling.per_row_keys(seed, np.arange(tokens.shape[0]))
  jax.block_until_ready(sampling.decode(dp, config, jax.tree.map(jnp.copy, cache), last, keys, rule))
  start = time.perf_counter()
  out = jax.block_until_ready(sampling.decode(dp, config, cache, last, keys, rule))
  seconds = time.perf_counter() - start
  b = tokens.shape[0]
  seq = np.zeros((b, tokens.shape[1] + new_tokens), np.int32)
  where = np.asarray(lengths)[:, None] + np.arange(new_tokens)[None]
  for r in range(b):
    seq[r, :lengths[r]] = tokens[r, :lengths[r]]
    seq[r, where[r]] = np.asarray(out.tokens)[r]
  return seq, where, np.asarray(out.logprobs), seconds


def learner_logprobs(params, config, seq, where):
  """The float32 learner's log-probs of the tokens at `where` (a whole-sequence pass)."""
  logits = Transformer(config).apply({"params": params}, jnp.asarray(seq)).logits
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  rows = np.arange(seq.shape[0])[:, None]
  return logp[rows, where - 1, seq[rows, where]]


def main(argv):
  del argv
  config, params, tokenizer = checkpoint.load("smollm2")
  tokens, lengths = _prompts(tokenizer, _BATCH.value)
  c, n = _THRESHOLD.value, _NEW_TOKENS.value
  print(f"SmolLM2-135M-Instruct, {_BATCH.value} rows x {n} sampled tokens at temperature 1; "
        f"learner float32; TIS threshold C = {c}")
  print(f"{'rollout weights':<16} {'tok/s':>8} {'mean |dlogp|':>13} {'max |dlogp|':>12} "
        f"{'IS > C':>8} {'mean IS':>8}")
  for quant in ("none", "int8"):
    engine = config.replace(decode_quant=quant)
    seq, where, behaviour, seconds = sample(params, engine, tokens, lengths, n)
    learner = learner_logprobs(params, config, seq, where)
    gap = learner - behaviour
    ratio = np.exp(np.clip(gap, -20, 20))
    print(f"{'float32' if quant == 'none' else quant:<16} {tokens.shape[0] * n / seconds:>8.1f} "
          f"{np.abs(gap).mean():>13.5f} {np.abs(gap).max():>12.4f} {(ratio > c).mean():>8.4f} "
          f"{np.minimum(ratio, c).mean():>8.4f}")


if __name__ == "__main__":
  app.run(main)
