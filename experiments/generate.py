r"""Generates a reply from a checkpoint with the KV-cached sampler.

  python experiments/generate.py --checkpoint=smollm2 \
      --messages='[{"role":"user","content":"What is the capital of France? Answer in one sentence."}]' \
      --temperature=0
  python experiments/generate.py --checkpoint=path/to/hf_folder_or.gguf --prompt='Once upon a time'
  python experiments/generate.py --checkpoint=smollm2 --messages='[...]' --dump_logits=/tmp/out.npz

`--messages` is rendered with the model's chat template (generation prompt appended); `--prompt` is raw
text encoded as is. The flags (ranges, the JSON and roles of `--messages`) are checked when parsed,
before the checkpoint loads; the prompt's tokens plus `--max_new_tokens` must fit the model's context
(`max_position_embeddings`), checked right after tokenising, and the KV cache holds exactly that many
slots. With `--dump_logits` the prompt ids (`input_ids`) and the float32 logits at the
last prompt position (`last_logits`) are written to an .npz file. The reply is printed on stdout.
"""

from __future__ import annotations

import json
import math
import pathlib
import time

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

from longhorizon import models
from longhorizon.models import checkpoint
from longhorizon import sampling
from longhorizon.cli import logs
from longhorizon.text import render_chat

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Checkpoint path (HF folder or .gguf) or alias "
                                  f"({', '.join(sorted(checkpoint.ALIASES))}).", required=True)
_MESSAGES = flags.DEFINE_string("messages", None, "Chat as a JSON list of {role, content} objects; "
                                "roles: system, user, assistant, tool.")
_PROMPT = flags.DEFINE_string("prompt", None, "Raw text prompt (no chat template).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Most tokens to generate (>= 1; prompt + "
                                       "this must fit the model's context).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (>= 0); 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k truncation (>= 0); 0 = off.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus mass in (0, 1]; 1.0 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_DUMP_LOGITS = flags.DEFINE_string("dump_logits", None, "Write input_ids and last_logits to this .npz.")

ROLES = ("system", "user", "assistant", "tool")


def parse_messages(messages_json: str) -> list[dict]:
  """The chat of `--messages`: a non-empty list of `{"role": one of ROLES, "content": str}`.

  Raises:
    ValueError: naming what is wrong (invalid JSON, not a list of objects, an unknown role).
  """
  try:
    messages = json.loads(messages_json)
  except json.JSONDecodeError as e:
    raise ValueError(f"--messages is not valid JSON ({e}); expected a list like "
                     '[{"role": "user", "content": "..."}].') from e
  if not isinstance(messages, list) or not messages:
    raise ValueError('--messages must be a non-empty JSON list of {"role": str, "content": str} '
                     f"objects, got {type(messages).__name__} {messages_json[:200]!r}.")
  for i, m in enumerate(messages):
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      raise ValueError(f'--messages[{i}] must be an object with string "role" and "content", got '
                       f"{json.dumps(m)[:200]}.")
    if m["role"] not in ROLES:
      raise ValueError(f"--messages[{i}] has role {m['role']!r}; allowed roles: {', '.join(ROLES)}.")
  return messages


def _check(condition: bool, message: str) -> bool:
  if not condition:
    raise flags.ValidationError(message)
  return True


def _check_messages(messages_json: str | None) -> bool:
  if messages_json is not None:
    try:
      parse_messages(messages_json)
    except ValueError as e:
      raise flags.ValidationError(str(e)) from e
  return True


# Checked when the flags are parsed, before anything is loaded; absl names the flag and its value.
flags.register_validator(_MAX_NEW_TOKENS, lambda n: _check(
    n is not None and n >= 1, "must be an integer >= 1 (the model's context bounds it from above)."))
flags.register_validator(_TEMPERATURE, lambda t: _check(
    t is not None and math.isfinite(t) and t >= 0, "must be a finite number >= 0 (0 = greedy)."))
flags.register_validator(_TOP_K, lambda k: _check(k is not None and k >= 0,
                                                  "must be an integer >= 0 (0 = off)."))
flags.register_validator(_TOP_P, lambda p: _check(p is not None and 0 < p <= 1,
                                                  "must be in (0, 1] (1.0 = off)."))
flags.register_validator(_MESSAGES, _check_messages)
flags.register_multi_flags_validator(
    [_MESSAGES, _PROMPT], lambda f: _check(
        (f["messages"] is None) != (f["prompt"] is None),
        "give exactly one of --messages (a chat) or --prompt (raw text)."))


def prompt_ids(tok, messages: list[dict] | None, prompt: str | None) -> list[int]:
  """Prompt token ids from the chat (its template, generation prompt added) or the raw text."""
  if messages is None:
    return tok.encode(prompt, add_special_tokens=False)
  return list(render_chat(tok, messages, add_generation_prompt=True))


def check_context(num_prompt_tokens: int, max_new_tokens: int, context: int):
  """Raises a usage error unless prompt + `max_new_tokens` fit the model's `context` positions."""
  if num_prompt_tokens == 0:
    raise app.UsageError("The prompt is empty (0 tokens); give some text.")
  if num_prompt_tokens >= context:
    raise app.UsageError(
        f"The prompt has {num_prompt_tokens} tokens, but the model's context is {context} tokens "
        f"(max_position_embeddings); shorten it to at most {context - 1} tokens.")
  if num_prompt_tokens + max_new_tokens > context:
    raise app.UsageError(
        f"The prompt has {num_prompt_tokens} token{'s' if num_prompt_tokens > 1 else ''} and "
        f"--max_new_tokens={max_new_tokens}: "
        f"{num_prompt_tokens + max_new_tokens} tokens > the model's context of {context} "
        f"(max_position_embeddings); set --max_new_tokens to at most {context - num_prompt_tokens} "
        f"or shorten the prompt.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logs.setup()  # absl at INFO; each record once (huggingface_hub has its own handler)
  messages = None if _MESSAGES.value is None else parse_messages(_MESSAGES.value)
  logging.info("jax %s on %s", jax.__version__, jax.devices())
  start = time.perf_counter()
  config, params, tok = checkpoint.load(_CHECKPOINT.value)
  logging.info("Loaded %s in %.1f s", _CHECKPOINT.value, time.perf_counter() - start)
  if tok is None:
    raise app.UsageError(f"--checkpoint={_CHECKPOINT.value} carries no tokenizer; give a checkpoint "
                         "with tokenizer files (a HF folder with tokenizer.json, or a .gguf).")
  ids = prompt_ids(tok, messages, _PROMPT.value)
  check_context(len(ids), _MAX_NEW_TOKENS.value, config.max_position_embeddings)
  stop = tuple(t for t in {tok.eos_token_id} if t is not None)
  params_sampling = sampling.SamplingParams(
      temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
      max_new_tokens=_MAX_NEW_TOKENS.value, stop_token_ids=stop)
  # The cache holds exactly the prompt and the new tokens (no padding to a bucket width).
  capacity = len(ids) + _MAX_NEW_TOKENS.value
  logging.info("KV cache: 1 x %d slots (%d prompt + %d new tokens of a %d-token context)", capacity,
               len(ids), _MAX_NEW_TOKENS.value, config.max_position_embeddings)
  start = time.perf_counter()
  params = models.prepare_decode_params(params, config)  # once, for prefill and decode
  cache, last_logits = sampling.prefill(params, config, np.asarray([ids], np.int32),
                                        np.asarray([len(ids)], np.int32), capacity)
  if _DUMP_LOGITS.value:
    out = pathlib.Path(_DUMP_LOGITS.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, input_ids=np.asarray(ids, np.int32),
             last_logits=np.asarray(jax.device_get(last_logits)[0], np.float32))
    logging.info("Wrote %s", out)
  keys = sampling.per_row_keys(_SEED.value, np.arange(1))
  result = sampling.decode(params, config, cache, last_logits, keys, params_sampling)
  length = int(jax.device_get(result.lengths)[0])
  reply_ids = jax.device_get(result.tokens)[0, :length].tolist()
  logging.info("Generated %d tokens in %.1f s (incl. compilation)", len(reply_ids),
               time.perf_counter() - start)
  print(tok.decode(reply_ids, skip_special_tokens=True).strip())


if __name__ == "__main__":
  app.run(main)
