"""Text codecs: the host-side bridge between token ids and an environment's structured actions.

One `Codec` serves every environment: the environment supplies its tools (`Tool`/`Arg`), the text
of a task and of an observation (`task_text`, `observation_text`) and its vocabulary; the codec
supplies the two action syntaxes and the framing.

Styles:
* `compact`: `lookup 12` — the tool name and its arguments as words (for tiny models with word-level
  tokenizers);
* `tool_call`: `<tool_call>{"name": "lookup", "arguments": {"key": 12}}</tool_call>` (chat models).

Framing: with a tokenizer that has a chat template, the prompt is the chat (system turn listing the
tools, user turn with the task) and observations are the template's next turn (a `tool` message for
tool calls, a `user` message for compact actions), rendered as the text the template adds after the
policy's end-of-turn token. Without a chat template (the environment's default tokenizers), the
prompt is `<bos> {system} {task} <act>`, the policy answers `{action} <eot>` and an observation is
` {text} <act>`.

Observations are tokenised on their own and appended: the history is never re-tokenised. A word the
tokenizer does not know (one missing from the environment's `vocabulary()`) would become `<unk>`:
`Codec.unknown_words(text)` names such words, `envs.testing` raises on them and `rollout.collect`
counts them (`RolloutStats.unknown_words`). Parsing never raises: malformed text becomes `Action.invalid(code)` with a message naming the problem.

What the parser accepts (the same in every environment; anything else is a parse error, never a
different action):
* both styles: whitespace (any kind) and end-of-turn tokens around the action are ignored; an int
  argument is written in canonical decimal: ASCII digits `0-9` only, no leading zeros, no `+`, no
  `-0` (compact `lookup 7`, JSON `7`; `lookup ３`, `lookup ٣`, `lookup 007`, `lookup +7`,
  `lookup -0` and JSON `-0` are BAD_ARGUMENT, while JSON with leading zeros, `+` or non-ASCII digits
  does not parse: BAD_JSON); an argument outside its `Arg` range, or an enum word not among its
  choices, is BAD_ARGUMENT.
* compact: the tool name and its arguments are separated by ASCII spaces (U+0020, one or more);
  another whitespace character between them (TAB, NBSP, newline, ...) is BAD_ARGUMENT, naming it.
* tool_call: `parse_tool_call`'s syntax; a key repeated in the JSON (`{"key": 1, "key": 2}`) is
  BAD_JSON naming the key; an int argument must be a JSON integer (not `7.0`, `"7"` or `true`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jax
import numpy as np

from longhorizon.envs.types import ERROR_MESSAGES, Action, ErrorCode
from longhorizon.text import (chat_text, char_tokenizer, parse_tool_call, unknown_words,
                              word_level_tokenizer)

__all__ = ["Codec", "STYLES", "default_tokenizer", "observation_frame", "ACT", "EOT", "BOS"]

STYLES = ("compact", "tool_call")
BOS, ACT, EOT = "<bos>", "<act>", "<eot>"
# Words the codec itself writes (error observations, usage lines) in compact style.
_CODEC_WORDS = ("error", ":", "actions", "|", "no", "action", "found", "unknown", "tool", "bad",
                "argument", "unexpected", "text", "after", "the", "invalid", "not", "allowed",
                "timed", "out", "returned", "nothing", "permission", "denied", "unavailable",
                "is", "valid", "JSON", "call", "-", ".")
_MARK = "\u2063ACTION\u2063"  # a placeholder assistant message when cutting template turns
# An int argument in compact text: canonical decimal in ASCII digits (what `format_action` writes).
_INTEGER = re.compile(r"0|-?[1-9][0-9]{0,11}")


def _usage_word(arg) -> str:
  return arg.name.upper()


@functools.lru_cache(maxsize=64)
def _default_tokenizer(env_key, words: tuple[str, ...], style: str):
  del env_key
  specials = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": BOS, "eos_token": EOT}
  if style == "compact":
    return word_level_tokenizer(list(words), special_tokens=specials, extra_special_tokens=[ACT])
  return char_tokenizer(special_tokens=specials, extra_special_tokens=[ACT])


def default_tokenizer(env, style: str = "compact"):
  """The environment's own tokenizer: word-level over its vocabulary (compact) or byte-level
  (tool_call). Cached per environment class, parameters and style."""
  if style not in STYLES:
    raise ValueError(f"style must be one of {STYLES}, got {style!r}.")
  return _default_tokenizer((type(env).__name__, repr(sorted(vars(env).items(), key=str))),
                            tuple(compact_vocabulary(env)), style)


def compact_vocabulary(env) -> list[str]:
  """Every word the compact codec of `env` may write or read."""
  words = list(env.vocabulary()) + list(_CODEC_WORDS)
  for tool in env.tools:
    words.append(tool.name)
    for arg in tool.args:
      words.append(_usage_word(arg))
      if arg.kind == "enum":
        words.extend(arg.choices)
      else:
        if arg.high - arg.low > 100_000:
          raise ValueError(f"{env.name}: argument {arg.name!r} spans {arg.high - arg.low} values, "
                           f"too many for a word-level vocabulary.")
        words.extend(str(i) for i in range(arg.low, arg.high + 1))
  return list(dict.fromkeys(w for w in words if w))


class Codec:
  """Renders prompts and observations to token ids and parses actions from text (host side).

  Args:
    env: the environment.
    tokenizer: a `transformers` tokenizer; None for the environment's default.
    style: `compact` or `tool_call`.
  """

  def __init__(self, env, tokenizer=None, style: str = "compact"):
    if style not in STYLES:
      raise ValueError(f"style must be one of {STYLES}, got {style!r}.")
    self.env = env
    self.style = style
    self.tokenizer = default_tokenizer(env, style) if tokenizer is None else tokenizer
    self.chat = bool(getattr(self.tokenizer, "chat_template", None))
    self._tools = {t.name: (i, t) for i, t in enumerate(env.tools)}
    self.tool_schemas = [t.json_schema() for t in env.tools]
    eos = self.tokenizer.eos_token
    if self.chat:
      self.end_of_turn = "<|im_end|>" if "<|im_end|>" in self.tokenizer.get_vocab() else eos
    else:
      self.end_of_turn = EOT
    self.stop_token_ids = tuple(self.tokenizer.convert_tokens_to_ids([self.end_of_turn]))
    self._observation_frame = (observation_frame(
        self.tokenizer, style, self.tool_schemas, self.end_of_turn) if self.chat else None)

  # ----------------------------------------------------------------------------- rendering
  def usage(self) -> str:
    """One line listing the actions, in this style's syntax."""
    if self.style == "compact":
      return "actions : " + " | ".join(
          " ".join([t.name] + [_usage_word(a) for a in t.args]) for t in self.env.tools)
    return "tools : " + ", ".join(t.name for t in self.env.tools)

  def system_text(self) -> str:
    intro = self.env.system_text(self.style)
    return f"{intro} {self.usage()}" if self.style == "compact" else intro

  def prompt_text(self, state) -> str:
    """The text `render_prompt` encodes: system + task (framed) for one (unbatched) `EnvState` or
    task pytree."""
    task = getattr(state, "task", state)
    task = _to_numpy(task)
    return self._framed_prompt(self.env.task_text(task, self.style))

  def summary_prompt_text(self, summary: str) -> str:
    """The context a summary segment starts from (`rollout/context.py`): the prompt's framing with
    `summary` (the environment's `state_text`) in the task's place."""
    return self._framed_prompt(summary)

  def _framed_prompt(self, user: str) -> str:
    system = self.system_text()
    if self.chat:
      messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
      tools = self.tool_schemas if self.style == "tool_call" else None
      return chat_text(self.tokenizer, messages, tools)
    return f"{BOS} {system} {user} {ACT}"

  def render_prompt(self, state) -> list[int]:
    """Token ids of system + task for one (unbatched) `EnvState` or task pytree."""
    return self._encode(self.prompt_text(state))

  def unknown_words(self, text: str) -> list[str]:
    """The words of `text` this codec's tokenizer can only encode as its unknown token (in order,
    repeats kept; none for a byte-level tokenizer)."""
    return unknown_words(self.tokenizer, text)

  def observation_text(self, timestep, message: str | None = None) -> str:
    """The text of one (unbatched) time step's observation; `message` (from `parse_action`) adds
    the detail of a parse error."""
    observation = _to_numpy(getattr(timestep, "observation", timestep))
    code = int(observation["error"])
    if code and (ErrorCode(code).is_parse_error or ErrorCode(code).is_fault):
      text = f"error : {ERROR_MESSAGES[ErrorCode(code)]}"
      if message and self.style == "tool_call":
        text += f" - {message}"
      return f"{text} . {self.usage()}"
    return self.env.observation_text(observation, self.style)

  def observation_turn_text(self, timestep, message: str | None = None) -> str:
    """The text `render_observation` encodes: the observation framed as the next turn."""
    text = self.observation_text(timestep, message)
    if self.chat:
      before, after = self._observation_frame
      return before + text + after
    return f" {text} {ACT}"

  def render_observation(self, timestep, message: str | None = None) -> list[int]:
    """Token ids appended after the policy's turn: the observation and the cue for the next action.
    Only the new text is tokenised."""
    return self._encode(self.observation_turn_text(timestep, message))

  def _encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False)

  def decode(self, ids) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=False)

  # ------------------------------------------------------------------------------ actions
  def format_action(self, action: Action) -> str:
    """The text of a well-formed (unbatched) action in this style, without the end-of-turn token."""
    action = _to_numpy(action)
    name = self.env.tools[int(action.tool)].name
    tool = self._tools[name][1]
    values = [a.choices[int(v)] if a.kind == "enum" else int(v)
              for a, v in zip(tool.args, action.args)]
    if self.style == "compact":
      return " ".join([name] + [str(v) for v in values])
    arguments = {a.name: v for a, v in zip(tool.args, values)}
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"

  def parse_action(self, text: Any) -> tuple[Action, bool, str]:
    """`(action, ok, message)`; never raises. A failed parse gives `Action.invalid(code)`."""
    try:
      if not isinstance(text, str):
        return self._fail(ErrorCode.GARBAGE, f"expected text, got {type(text).__name__}")
      text = self._strip_end(text)
      if self.style == "compact":
        return self._parse_compact(text)
      return self._parse_tool_call(text)
    except Exception as e:  # a guarantee, not a code path we expect
      return self._fail(ErrorCode.GARBAGE, f"could not parse the action ({type(e).__name__})")

  def _strip_end(self, text: str) -> str:
    ends = {self.end_of_turn, EOT, self.tokenizer.eos_token or EOT, "<|endoftext|>"}
    text = text.strip()
    changed = True
    while changed:
      changed = False
      for end in ends:
        if end and text.endswith(end):
          text = text[:-len(end)].rstrip()
          changed = True
    return text

  def _fail(self, code: ErrorCode, message: str):
    return Action.invalid(code, self.env.num_args), False, f"{ERROR_MESSAGES[code]}: {message}"

  def _parse_compact(self, text: str):
    words = text.split()
    if not words:
      return self._fail(ErrorCode.GARBAGE, f"empty action; {self.usage()}")
    name = words[0]
    if name not in self._tools:
      return self._fail(ErrorCode.UNKNOWN_TOOL, f"{_snip(name)}; {self.usage()}")
    index, tool = self._tools[name]
    given = words[1:]
    if len(given) < len(tool.args):
      missing = [_usage_word(a) for a in tool.args[len(given):]]
      return self._fail(ErrorCode.BAD_ARGUMENT, f"{name} is missing {' '.join(missing)}")
    if len(given) > len(tool.args):
      return self._fail(ErrorCode.EXTRA_TEXT, _snip(" ".join(given[len(tool.args):])))
    if re.sub(" +", " ", text) != " ".join(words):  # a separator other than ASCII spaces
      odd = next(c for c in text if c.isspace() and c != " ")
      return self._fail(ErrorCode.BAD_ARGUMENT, f"separate {name} and its arguments with spaces, "
                                                f"not {odd!r} (U+{ord(odd):04X})")
    values = []
    for arg, word in zip(tool.args, given):
      value, problem = _coerce(arg, word, from_json=False)
      if problem:
        return self._fail(ErrorCode.BAD_ARGUMENT, problem)
      values.append(value)
    return Action.make(index, values, self.env.num_args), True, ""

  def _parse_tool_call(self, text: str):
    call, message = parse_tool_call(text, parse_int=_json_int)
    if call is None:
      return Action.invalid(tool_call_error(message), self.env.num_args), False, message
    name, arguments = call["name"], call["arguments"]
    if name not in self._tools:
      return self._fail(ErrorCode.UNKNOWN_TOOL,
                        f"{_snip(name)}; available tools: {sorted(self._tools)}")
    index, tool = self._tools[name]
    known = {a.name for a in tool.args}
    extra = sorted(set(arguments) - known)
    if extra:
      return self._fail(ErrorCode.BAD_ARGUMENT, f"{name} takes no argument(s) {extra}")
    values = []
    for arg in tool.args:
      if arg.name not in arguments:
        return self._fail(ErrorCode.BAD_ARGUMENT, f"{name} is missing argument {arg.name!r}")
      value, problem = _coerce(arg, arguments[arg.name], from_json=True)
      if problem:
        return self._fail(ErrorCode.BAD_ARGUMENT, problem)
      values.append(value)
    return Action.make(index, values, self.env.num_args), True, ""


def tool_call_error(message: str) -> ErrorCode:
  """The `ErrorCode` of a failed `parse_tool_call`, from its message (shared by the JAX codecs
  and `host.parse_call`)."""
  if message.startswith("no <tool_call>") or message.startswith("tool call must be text"):
    return ErrorCode.GARBAGE
  if message.startswith("unexpected text after") or message.startswith("more than one"):
    return ErrorCode.EXTRA_TEXT
  return ErrorCode.BAD_JSON


def observation_frame(tokenizer, style: str, tool_schemas, end_of_turn: str) -> tuple[str, str]:
  """`(before, after)`: the chat template's text around an observation turn that follows the
  policy's end-of-turn token (a `tool` message in tool_call style, a `user` message in compact)."""
  role = "tool" if style == "tool_call" else "user"
  tools = tool_schemas if style == "tool_call" else None
  base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": _MARK}]
  full = chat_text(tokenizer, base + [{"role": role, "content": _MARK}], tools,
                   add_generation_prompt=True)
  first = full.index(_MARK) + len(_MARK)
  second = full.index(_MARK, first)
  before, after = full[first:second], full[second + len(_MARK):]
  if before.startswith(end_of_turn):  # the policy's sampled stop token already wrote it
    before = before[len(end_of_turn):]
  return before, after


def _json_int(literal: str):
  """`parse_int` of tool-call JSON: `-0` becomes the float -0.0, so it fails as a non-integer."""
  return -0.0 if literal == "-0" else int(literal)


def _show_json(value) -> str:
  if isinstance(value, float) and value == 0 and str(value).startswith("-"):
    return "-0"
  return _snip(json.dumps(value))


def _coerce(arg, value, from_json: bool) -> tuple[int, str]:
  """(coded value, problem message or '')."""
  if arg.kind == "enum":
    if not isinstance(value, str) or value not in arg.choices:
      shown = _show_json(value) if from_json else _snip(str(value))
      return 0, f"{arg.name} must be one of {list(arg.choices)[:8]}, got {shown}"
    return arg.choices.index(value), ""
  if from_json:
    if isinstance(value, bool) or not isinstance(value, int):
      return 0, f"{arg.name} must be an integer, got {_show_json(value)}"
  else:
    if not _INTEGER.fullmatch(value):
      return 0, (f"{arg.name} must be an integer in [{arg.low}, {arg.high}] in ASCII digits 0-9, "
                 f"without leading zeros or a sign on 0, got {_snip(value)}")
    value = int(value)
  if not arg.low <= value <= arg.high:
    return 0, f"{arg.name} must be in [{arg.low}, {arg.high}], got {value}"
  return int(value), ""


def _snip(text: str, limit: int = 40) -> str:
  return repr(text if len(text) <= limit else text[:limit] + "...")


def _to_numpy(tree):
  return jax.tree.map(np.asarray, tree)
