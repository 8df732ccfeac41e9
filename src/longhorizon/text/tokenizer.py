"""Tokenizers built without torch, as `transformers.PreTrainedTokenizerFast` objects.

- `tokenizer_from_gguf(reader_or_path)`: the byte-level BPE tokenizer a GGUF file describes
  (vocabulary, merges, special tokens, chat template).
- `word_level_tokenizer(words)`: a whitespace-split word vocabulary for environment-only policies.
- `char_tokenizer()`: one token per UTF-8 byte (no merges), so any text round-trips exactly.
- `unknown_words(tokenizer, text)`: the pieces of `text` a tokenizer can only encode as its unknown
  token (a word missing from a word-level vocabulary).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from longhorizon.text.gguf_file import open_gguf

__all__ = ["tokenizer_from_gguf", "word_level_tokenizer", "char_tokenizer", "unknown_words",
           "PRE_TOKENIZERS"]


# ------------------------------------------------------------------------------------- GGUF BPE

def _byte_level(use_regex: bool = True):
  return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _split_then_bytes(pattern: str):
  return lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                          _byte_level(use_regex=False)])


def _smollm():
  # SmolLM/StarCoder: every digit alone, then the GPT-2 split. This is SmolLM2's tokenizer.json and
  # llama.cpp's `smollm` pre-tokenizer ("\p{N}", then the GPT-2 regex).
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
  """The `PreTrainedTokenizerFast` a GGUF file (a path or a `gguf.GGUFReader`) describes.

  Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): the GGUF vocabulary is already spelled in the
  GPT-2 byte alphabet, merges are `"a b"` strings. Control tokens (type 3: `<|im_start|>`, ...) become
  special added tokens so they are matched whole in text; user-defined ones (type 4) plain added
  tokens. bos/eos/unk/pad and the chat template come from the metadata. Ids equal transformers'
  own GGUF conversion (`transformers.integrations.gguf.gguf_tokenizer_mapping`).
  """
  reader = reader_or_path
  if isinstance(reader, (str, os.PathLike)):
    reader = open_gguf(reader)
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
                     f"Add its split to longhorizon.text.tokenizer.PRE_TOKENIZERS.")
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
  if special_tokens is None:
    special_tokens = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<bos>",
                      "eos_token": "<eos>"}
  specials, vocab = _vocab_with_specials(special_tokens, extra_special_tokens,
                                         pre_tokenizers.ByteLevel.alphabet())
  backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=special_tokens.get("unk_token")))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  backend.decoder = decoders.ByteLevel()
  return _wrap(backend, specials, special_tokens, extra_special_tokens, chat_template)


