"""Tokenizers (built without torch), chat rendering and tool calls.

- `tokenizer_from_gguf(reader_or_path)`: the byte-level BPE tokenizer a GGUF file describes
  (vocabulary, merges, special tokens, chat template), as a `transformers.PreTrainedTokenizerFast`.
- `word_level_tokenizer(words)`: a whitespace-split word vocabulary for environment-only policies.
- `render_chat(tokenizer, messages, tools)`: prompt token ids of a chat, using the model's own chat
  template when it supports tools and `TOOL_CALL_TEMPLATE` otherwise.
- `parse_tool_call(text)`: `({"name", "arguments"} | None, error message)`; never raises.
- `unknown_words(tokenizer, text)`: the pieces of `text` a tokenizer can only encode as its unknown
  token (a word missing from a word-level vocabulary).

Token-in, token-out: `render_chat` is for building prompts. Sampled actions stay token ids; text is
decoded from them only to parse tool calls, never re-encoded into the trajectory.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any, Callable, Mapping, Sequence

__all__ = ["tokenizer_from_gguf", "word_level_tokenizer", "TOOL_CALL_TEMPLATE", "render_chat",
           "template_supports_tools", "parse_tool_call", "PRE_TOKENIZERS", "chat_text",
           "char_tokenizer", "unknown_words"]


# ------------------------------------------------------------------------------------- GGUF BPE

def _byte_level(use_regex: bool = True):
  from tokenizers import pre_tokenizers
  return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _split_then_bytes(pattern: str):
  from tokenizers import Regex, pre_tokenizers
  return lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                          _byte_level(use_regex=False)])


def _smollm():
  # SmolLM/StarCoder: every digit alone, then the GPT-2 split. This is SmolLM2's tokenizer.json and
  # llama.cpp's `smollm` pre-tokenizer ("\p{N}", then the GPT-2 regex).
  from tokenizers import pre_tokenizers
  return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# `tokenizer.ggml.pre` -> pre-tokenizer factory. An unknown value raises rather than silently
# splitting text differently from how the merges were learned.
PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "smollm": _smollm,
    "starcoder": _smollm,
    "gpt2": _byte_level,
    "default": _byte_level,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def tokenizer_from_gguf(reader_or_path):
  """The `PreTrainedTokenizerFast` a GGUF file describes; torch is never imported.

  Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): the GGUF vocabulary is already spelled in the
  GPT-2 byte alphabet, merges are `"a b"` strings. Control tokens (type 3: `<|im_start|>`, ...) become
  special added tokens so they are matched whole in text; user-defined ones (type 4) plain added
  tokens. bos/eos/unk/pad and the chat template come from the metadata. Ids equal transformers'
  own GGUF conversion (`transformers.integrations.gguf.gguf_tokenizer_mapping`).
  """
  from tokenizers import AddedToken, Tokenizer, decoders, models, processors
  from transformers import PreTrainedTokenizerFast

  if isinstance(reader_or_path, (str, os.PathLike)):
    from longhorizon.models.checkpoint import _open_gguf
    reader = _open_gguf(pathlib.Path(reader_or_path))
  else:
    reader = reader_or_path
  source = getattr(reader, "path", None) or getattr(getattr(reader, "data", None), "filename", None)
  source = source or "GGUF file"

  def get(key, default=None):
    field = reader.fields.get(f"tokenizer.{key}")
    return default if field is None else field.contents()

  kind = get("ggml.model")
  if kind != "gpt2":
    raise NotImplementedError(f"{source}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') "
                              f"GGUF vocabularies are supported (load the HF folder instead).")
  pre = get("ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise ValueError(f"{source}: unknown tokenizer.ggml.pre={pre!r}; known: {sorted(PRE_TOKENIZERS)}. "
                     f"Add its split to tokenizer.PRE_TOKENIZERS.")
  tokens: list[str] = list(get("ggml.tokens"))
  merges = [tuple(m.split(" ")) for m in get("ggml.merges", [])]
  types = list(get("ggml.token_type", [1] * len(tokens)))
  vocab = {token: i for i, token in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError(f"{source}: tokenizer.ggml.tokens has duplicate entries.")

  backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
  backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
  backend.decoder = decoders.ByteLevel()
  backend.post_processor = processors.ByteLevel(trim_offsets=False)
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t, k in zip(tokens, types) if k == _CONTROL])
  backend.add_tokens([AddedToken(t, special=False, normalized=False)
                      for t, k in zip(tokens, types) if k == _USER_DEFINED])

  specials = {}
  for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    token_id = get(f"ggml.{key}")
    if token_id is not None:
      specials[role] = tokens[int(token_id)]
  if get("ggml.add_bos_token", False) and "bos_token" in specials:
    bos = specials["bos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
  arch = reader.fields.get("general.architecture")
  context = reader.fields.get(f"{arch.contents()}.context_length") if arch is not None else None
  return PreTrainedTokenizerFast(
      tokenizer_object=backend, chat_template=get("chat_template"),
      model_max_length=int(context.contents()) if context is not None else int(1e30),
      clean_up_tokenization_spaces=False, **specials)


# ------------------------------------------------------------------------------------ word level

def word_level_tokenizer(words: Sequence[str], special_tokens: Mapping[str, str] | None = None,
                         extra_special_tokens: Sequence[str] = (), chat_template: str | None = None):
  """A word-level tokenizer over `words` (split on whitespace), for environment vocabularies.

  Ids: the special tokens first, in the order of `special_tokens` (default `pad=0, unk=1, bos=2,
  eos=3`), then `extra_special_tokens` (e.g. `"<|im_start|>"`), then `words` in order (duplicates
  dropped). Unknown words encode to the unk id. `encode` adds no special tokens; `decode` joins words
  with single spaces, so `decode(encode(s)) == " ".join(s.split())` for in-vocabulary `s`.

  Args:
    words: the vocabulary; each a non-empty string without whitespace.
    special_tokens: role -> token for the roles `pad_token`, `unk_token`, `bos_token`, `eos_token`.
    extra_special_tokens: further tokens that are matched whole and skipped by
      `decode(..., skip_special_tokens=True)`.
    chat_template: optional jinja chat template.
  """
  from tokenizers import Tokenizer, models, pre_tokenizers

  if special_tokens is None:
    special_tokens = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<bos>",
                      "eos_token": "<eos>"}
  allowed = {"pad_token", "unk_token", "bos_token", "eos_token"}
  if set(special_tokens) - allowed:
    raise ValueError(f"special_tokens roles {sorted(set(special_tokens) - allowed)} are not known; "
                     f"use {sorted(allowed)} (put other special tokens in extra_special_tokens).")
  if "unk_token" not in special_tokens:
    raise ValueError("special_tokens needs an 'unk_token' (the id of out-of-vocabulary words).")
  bad = [w for w in words if not isinstance(w, str) or not w or any(c.isspace() for c in w)]
  if bad:
    raise ValueError(f"words must be non-empty strings without whitespace; got {bad[:5]!r}.")
  specials, vocab = _vocab_with_specials(special_tokens, extra_special_tokens, words)
  backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special_tokens["unk_token"]))
  backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return _wrap(backend, specials, special_tokens, extra_special_tokens, chat_template)


def unknown_words(tokenizer, text: str) -> list[str]:
  """The pieces of `text` that `tokenizer` encodes as its unknown token, in order (repeats kept).

  For a word-level tokenizer these are the words missing from its vocabulary; a byte-level one has
  none. A literal occurrence of the unknown token's own text (e.g. `"<unk>"`) is not counted, and a
  tokenizer without an unknown token reports none. Needs a fast tokenizer (offsets mapping).
  """
  unk = tokenizer.unk_token_id
  if unk is None or not text:
    return []
  encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
  pieces = (text[start:end] for i, (start, end) in zip(encoding["input_ids"],
                                                        encoding["offset_mapping"]) if i == unk)
  return [piece for piece in pieces if piece != tokenizer.unk_token]


def _vocab_with_specials(special_tokens, extra_special_tokens, symbols):
  """(special token list, token -> id): specials first, then `symbols` (duplicates dropped)."""
  specials = list(dict.fromkeys([*special_tokens.values(), *extra_special_tokens]))
  vocab = {}
  for token in [*specials, *symbols]:
    vocab.setdefault(token, len(vocab))
  return specials, vocab


def _wrap(backend, specials, special_tokens, extra_special_tokens, chat_template):
  """A `PreTrainedTokenizerFast` over a `tokenizers` backend, with the special tokens registered."""
  from tokenizers import AddedToken
  from transformers import PreTrainedTokenizerFast
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template,
                                      clean_up_tokenization_spaces=False, **special_tokens)
  if extra_special_tokens:
    tokenizer.add_special_tokens({"additional_special_tokens": list(extra_special_tokens)})
  return tokenizer


def char_tokenizer(special_tokens: Mapping[str, str] | None = None,
                   extra_special_tokens: Sequence[str] = (), chat_template: str | None = None):
  """A byte-level tokenizer with no merges: one token per UTF-8 byte, plus special tokens.

  Any text round-trips exactly (`decode(encode(s)) == s`), which suits JSON tool calls from tiny
  models. Ids: the special tokens first (default `pad=0, unk=1, bos=2, eos=3`), then the extra
  special tokens, then the 256 byte symbols.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  if special_tokens is None:
    special_tokens = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<bos>",
                      "eos_token": "<eos>"}
  specials, vocab = _vocab_with_specials(special_tokens, extra_special_tokens,
                                         pre_tokenizers.ByteLevel.alphabet())
  backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=special_tokens.get("unk_token")))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  backend.decoder = decoders.ByteLevel()
  return _wrap(backend, specials, special_tokens, extra_special_tokens, chat_template)


# ------------------------------------------------------------------------------- chat and tools

# A ChatML chat template with tool calling, for models whose own template has none (SmolLM2).
#
# - With `tools` (a list of JSON schemas, as `apply_chat_template(tools=...)` passes them), the
#   system turn (the first message if its role is "system", else `default_system`, a template
#   variable defaulting to "You are a helpful assistant.") is followed by the tool list, one JSON
#   schema per line inside <tools></tools>, and the instruction to answer with exactly one
#   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
# - An assistant message's `tool_calls` (OpenAI/HF style `{"function": {"name", "arguments"}}` or
#   bare `{"name", "arguments"}`; arguments a mapping or a JSON string) render after its content in
#   that same form, so the model sees its earlier calls exactly as it is asked to write them.
# - A `tool` message (the environment's observation) renders as a user turn wrapping its content
#   in <tool_response></tool_response>.
# - `add_generation_prompt` appends `<|im_start|>assistant\n`.
TOOL_CALL_TEMPLATE = (
    "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if has_system -%}{%- set system_text = messages[0]['content'] -%}"
    "{%- elif default_system is defined -%}{%- set system_text = default_system -%}"
    "{%- else -%}{%- set system_text = 'You are a helpful assistant.' -%}{%- endif -%}"
    "{%- if tools or has_system -%}"
    "{{- '<|im_start|>system\\n' + system_text -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou can call the following tools. Their JSON schemas:\\n<tools>' -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) -}}"
    "{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a tool, answer with exactly one tool call and nothing after it, "
    "in this form:\\n<tool_call>{\"name\": \"<tool name>\", \"arguments\": {<argument name>: <value>, "
    "...}}</tool_call>\\nThe result comes back in a <tool_response></tool_response> block.' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in (message['tool_calls'] or []) -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + "
    "(fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)) + "
    "'}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def template_supports_tools(template: str | None) -> bool:
  """Whether a chat template renders `tools` (it reads the `tools` variable)."""
  return bool(template) and re.search(r"\btools\b", template) is not None


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
                add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
  """Prompt token ids of `messages` (and `tools`), rendered by a jinja chat template.

  The tokenizer's own template is used when it supports tools, or when no tools are involved (no
  `tools`, no `tool` messages, no assistant `tool_calls`); otherwise `TOOL_CALL_TEMPLATE`. The text
  is encoded without adding special tokens (the template writes them).
  """
  text = chat_text(tokenizer, messages, tools, add_generation_prompt, **template_kwargs)
  return tokenizer.encode(text, add_special_tokens=False)


def chat_text(tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
              add_generation_prompt: bool = True, **template_kwargs) -> str:
  """The text `render_chat` encodes (same template choice)."""
  own = getattr(tokenizer, "chat_template", None)
  uses_tools = bool(tools) or any(
      m.get("role") == "tool" or m.get("tool_calls") for m in messages)
  template = own if own and (not uses_tools or template_supports_tools(own)) else TOOL_CALL_TEMPLATE
  return tokenizer.apply_chat_template(
      [dict(m) for m in messages], tools=list(tools) if tools else None, tokenize=False,
      add_generation_prompt=add_generation_prompt, chat_template=template, **template_kwargs)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
# What may follow the closing tag: whitespace and end-of-turn markers.
_TRAILING_OK = re.compile(r"^(\s|<\|im_end\|>|<\|endoftext\|>|</s>|<\|eot_id\|>)*$")


def parse_tool_call(text: Any, tools: Sequence[Mapping[str, Any]] | None = None, *,
                    parse_int: Callable[[str], Any] | None = None) -> tuple[dict | None, str]:
  """Parses one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` from model output.

  Text before the tag is allowed (the model may explain itself); after the closing tag only
  whitespace and end-of-turn tokens. `arguments` may be an object or a JSON string encoding one; it
  defaults to `{}` when absent. A key repeated in any JSON object of the call (`{"x": 1, "x": 2}`)
  is an error naming the key, never "the last one wins". With `tools` (JSON schemas), the name must
  be one of them and the schema's `required` arguments must be present. `parse_int` (as in
  `json.loads`) maps each JSON integer literal to its value (default `int`).

  Returns:
    `({"name": str, "arguments": dict}, "")` on success, else `(None, message)` where the message
    says what is wrong and what was expected (suitable to show the policy as an observation).
    Never raises.
  """
  try:
    return _parse_tool_call(text, tools, parse_int)
  except Exception as e:  # a guarantee: malformed input is an observation, not a crash
    return None, f"could not parse the tool call: {type(e).__name__}: {e}"


class _DuplicateKey(ValueError):
  def __init__(self, key):
    super().__init__(key)
    self.key = key


def _unique_keys(pairs):
  """`object_pairs_hook` of `json.loads` that refuses a repeated key."""
  out = {}
  for key, value in pairs:
    if key in out:
      raise _DuplicateKey(key)
    out[key] = value
  return out


def _parse_tool_call(text, tools, parse_int):
  expected = f'expected {_OPEN}{{"name": "<tool>", "arguments": {{...}}}}{_CLOSE}'
  if not isinstance(text, str):
    return None, f"tool call must be text, got {type(text).__name__}; {expected}."
  start = text.find(_OPEN)
  if start < 0:
    return None, f"no {_OPEN} tag found; {expected}."
  body_start = start + len(_OPEN)
  end = text.find(_CLOSE, body_start)
  if end < 0:
    return None, f"missing closing {_CLOSE} tag after {_OPEN}; {expected}."
  body = text[body_start:end].strip()
  rest = text[end + len(_CLOSE):]
  if _OPEN in rest:
    return None, f"more than one {_OPEN} found; make exactly one tool call per turn."
  if not _TRAILING_OK.match(rest):
    return None, (f"unexpected text after {_CLOSE}: {_snippet(rest.strip())}; nothing may follow "
                  f"the tool call.")
  if not body:
    return None, f"empty tool call between {_OPEN} and {_CLOSE}; {expected}."
  loads = lambda s: json.loads(s, object_pairs_hook=_unique_keys, parse_int=parse_int)
  try:
    call = loads(body)
  except json.JSONDecodeError as e:
    return None, (f"tool call is not valid JSON ({e.msg} at character {e.pos}): {_snippet(body)}; "
                  f"{expected}.")
  except _DuplicateKey as e:
    return None, f"duplicate key {e.key!r} in the tool call; give each key once."
  if not isinstance(call, dict):
    return None, f"tool call must be a JSON object, got {type(call).__name__}; {expected}."
  extra = sorted(set(call) - {"name", "arguments"})
  if extra:
    return None, f"tool call has unexpected key(s) {extra}; only 'name' and 'arguments' are allowed."
  name = call.get("name")
  if "name" not in call:
    return None, f"tool call has no 'name'; {expected}."
  if not isinstance(name, str) or not name.strip():
    return None, f"tool call 'name' must be a non-empty string, got {json.dumps(name)}."
  arguments = call.get("arguments", {})
  if isinstance(arguments, str):
    try:
      arguments = loads(arguments)
    except json.JSONDecodeError as e:
      return None, f"'arguments' is a string that is not valid JSON ({e.msg}): {_snippet(call['arguments'])}."
    except _DuplicateKey as e:
      return None, f"duplicate key {e.key!r} in the tool call's 'arguments'; give each key once."
  if not isinstance(arguments, dict):
    return None, (f"tool call 'arguments' must be a JSON object of argument name -> value, got "
                  f"{type(arguments).__name__} {_snippet(json.dumps(arguments))}.")
  if tools is not None:
    schemas = {}
    for tool in tools:
      fn = tool.get("function", tool)
      schemas[fn.get("name")] = fn
    if name not in schemas:
      return None, f"unknown tool {name!r}; available tools: {sorted(n for n in schemas if n)}."
    required = (schemas[name].get("parameters") or {}).get("required") or []
    missing = [r for r in required if r not in arguments]
    if missing:
      return None, f"tool {name!r} is missing required argument(s) {missing}."
  return {"name": name, "arguments": arguments}, ""


def _snippet(text: str, limit: int = 80) -> str:
  return repr(text if len(text) <= limit else text[:limit] + "...")
