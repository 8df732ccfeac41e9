"""`HostCodec`: the text framing of a host environment, with the same conventions as `Codec`.

A host environment speaks text in both directions, so its codec only frames and tokenises: the
prompt is `system_text(style)` and the reset observation (a chat with a system and a user turn when
the tokenizer has a chat template, with the tool schemas in tool_call style; else
`<bos> {system} {observation} <act>`), each later observation is framed as the next turn, exactly as
`Codec` frames a JAX environment's. Observations are tokenised on their own and appended (no
re-tokenisation). The policy's turn is decoded and handed to the environment's `step` without its
end-of-turn token; the environment parses it (`host.parse_call`).
"""

from __future__ import annotations

import functools

from longhorizon.envs.codec import _CODEC_WORDS, ACT, BOS, EOT, STYLES, observation_frame
from longhorizon.text import char_tokenizer, chat_text, unknown_words, word_level_tokenizer

__all__ = ["HostCodec", "host_default_tokenizer"]


@functools.lru_cache(maxsize=32)
def _tokenizer(words: tuple[str, ...] | None):
  specials = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": BOS, "eos_token": EOT}
  if words is None:
    return char_tokenizer(special_tokens=specials, extra_special_tokens=[ACT])
  return word_level_tokenizer(list(words), special_tokens=specials, extra_special_tokens=[ACT])


def host_default_tokenizer(env, style: str = "compact"):
  """Word-level over `env.vocabulary()` (and the codec's words) in compact style when the
  environment lists its words; byte-level otherwise."""
  if style not in STYLES:
    raise ValueError(f"style must be one of {STYLES}, got {style!r}.")
  words = env.vocabulary() if style == "compact" else None
  if words is None:
    return _tokenizer(None)
  return _tokenizer(tuple(dict.fromkeys([*words, *_CODEC_WORDS])))


class HostCodec:
  """Frames and tokenises a host environment's text (see the module docstring)."""

  def __init__(self, env, tokenizer=None, style: str = "compact"):
    if style not in STYLES:
      raise ValueError(f"style must be one of {STYLES}, got {style!r}.")
    self.env, self.style = env, style
    self.tokenizer = host_default_tokenizer(env, style) if tokenizer is None else tokenizer
    self.chat = bool(getattr(self.tokenizer, "chat_template", None))
    self.tool_schemas = list(env.tools or [])
    if self.chat:
      eos = self.tokenizer.eos_token
      self.end_of_turn = "<|im_end|>" if "<|im_end|>" in self.tokenizer.get_vocab() else eos
    else:
      self.end_of_turn = EOT
    self.stop_token_ids = tuple(self.tokenizer.convert_tokens_to_ids([self.end_of_turn]))
    tools = self.tool_schemas or None
    self._frame = (observation_frame(self.tokenizer, style, tools, self.end_of_turn)
                   if self.chat else None)

  def prompt_text(self, observation: str) -> str:
    system = self.env.system_text(self.style)
    if self.chat:
      messages = ([{"role": "system", "content": system}] if system else []) + [
          {"role": "user", "content": observation}]
      tools = self.tool_schemas if self.style == "tool_call" and self.tool_schemas else None
      return chat_text(self.tokenizer, messages, tools)
    return f"{BOS} {system} {observation} {ACT}" if system else f"{BOS} {observation} {ACT}"

  def summary_prompt_text(self, summary: str) -> str:
    """The context a summary segment starts from (`rollout/context.py`): the prompt's framing with
    `summary` (the environment's `state_text`) in the first observation's place."""
    return self.prompt_text(summary)

  def render_prompt(self, observation: str) -> list[int]:
    return self._encode(self.prompt_text(observation))

  def observation_turn_text(self, observation: str) -> str:
    if self.chat:
      before, after = self._frame
      return before + observation + after
    return f" {observation} {ACT}"

  def render_observation(self, observation: str) -> list[int]:
    return self._encode(self.observation_turn_text(observation))

  def action_text(self, ids) -> str:
    """The text the environment's `step` gets: the turn decoded, end-of-turn token removed."""
    text = self.decode(ids)
    ends = {self.end_of_turn, EOT, self.tokenizer.eos_token or EOT}
    changed = True
    while changed:
      changed = False
      stripped = text.rstrip()
      for end in ends:
        if end and stripped.endswith(end):
          text, changed = stripped[:-len(end)], True
    return text.strip()

  def encode_action(self, text: str) -> list[int]:
    """Ids of an action text plus the end-of-turn token (a scripted turn, e.g. the oracle's)."""
    return self._encode(text) + list(self.stop_token_ids[:1])

  def unknown_words(self, text: str) -> list[str]:
    return unknown_words(self.tokenizer, text)

  def _encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False)

  def decode(self, ids) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=False)
