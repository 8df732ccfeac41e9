r"""Generates a reply from a checkpoint with the KV-cached sampler.

  python experiments/generate.py --checkpoint=smollm2 \
      --messages='[{"role":"user","content":"What is the capital of France? Answer in one sentence."}]' \
      --temperature=0
  python experiments/generate.py --checkpoint=path/to/hf_folder_or.gguf --prompt='Once upon a time'
  python experiments/generate.py --checkpoint=smollm2 --messages='[...]' --dump_logits=/tmp/out.npz

`--messages` is rendered with the model's chat template (generation prompt appended); `--prompt` is raw
text encoded as is. With `--dump_logits` the prompt ids (`input_ids`) and the float32 logits at the
last prompt position (`last_logits`) are written to an .npz file. The reply is printed on stdout.
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

from longhorizon.models import checkpoint
from longhorizon.models import tokenizer as tokenizer_lib
from longhorizon import sampling

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Checkpoint path (HF folder or .gguf) or alias "
                                  f"({', '.join(sorted(checkpoint.ALIASES))}).", required=True)
_MESSAGES = flags.DEFINE_string("messages", None, "Chat as a JSON list of {role, content} objects.")
_PROMPT = flags.DEFINE_string("prompt", None, "Raw text prompt (no chat template).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Most tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k truncation; 0 = off.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus mass; 1.0 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_DUMP_LOGITS = flags.DEFINE_string("dump_logits", None, "Write input_ids and last_logits to this .npz.")


def parse_messages(messages_json: str | None, prompt: str | None) -> list[dict] | None:
  """Validates `--messages` / `--prompt` before anything is loaded; returns the chat or None."""
  if (messages_json is None) == (prompt is None):
    raise app.UsageError("Give exactly one of --messages (a chat) or --prompt (raw text).")
  if messages_json is None:
    return None
  try:
    messages = json.loads(messages_json)
  except json.JSONDecodeError as e:
    raise app.UsageError(f"--messages is not valid JSON ({e}); expected a list like "
                         '[{"role": "user", "content": "..."}].') from e
  if not isinstance(messages, list) or not messages or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
      for m in messages):
    raise app.UsageError('--messages must be a non-empty JSON list of {"role": str, "content": str} '
                         f"objects, got {messages_json!r}.")
  return messages


def prompt_ids(tok, messages: list[dict] | None, prompt: str | None) -> list[int]:
  """Prompt token ids from the chat (its template, generation prompt added) or the raw text."""
  if messages is None:
    return tok.encode(prompt, add_special_tokens=False)
  return list(tokenizer_lib.render_chat(tok, messages, add_generation_prompt=True))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  messages = parse_messages(_MESSAGES.value, _PROMPT.value)
  logging.info("jax %s on %s", jax.__version__, jax.devices())
  start = time.perf_counter()
  config, params, tok = checkpoint.load(_CHECKPOINT.value)
  logging.info("Loaded %s in %.1f s", _CHECKPOINT.value, time.perf_counter() - start)
  ids = prompt_ids(tok, messages, _PROMPT.value)
  if not ids:
    raise app.UsageError("The prompt is empty.")
  stop = tuple(t for t in {tok.eos_token_id} if t is not None)
  params_sampling = sampling.SamplingParams(
      temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
      max_new_tokens=_MAX_NEW_TOKENS.value, stop_token_ids=stop)
  if _DUMP_LOGITS.value:
    cache, last_logits = sampling.prefill(params, config, np.asarray([ids], np.int32),
                                          np.asarray([len(ids)], np.int32), len(ids))
    out = pathlib.Path(_DUMP_LOGITS.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, input_ids=np.asarray(ids, np.int32),
             last_logits=np.asarray(jax.device_get(last_logits)[0], np.float32))
    logging.info("Wrote %s", out)
    del cache
  start = time.perf_counter()
  [(reply_ids, _)] = sampling.generate(params, config, [ids], params_sampling, seed=_SEED.value)
  logging.info("Generated %d tokens in %.1f s (incl. compilation)", len(reply_ids),
               time.perf_counter() - start)
  print(tok.decode(reply_ids, skip_special_tokens=True).strip())


if __name__ == "__main__":
  app.run(main)
