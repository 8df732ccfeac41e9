"""Tool-call parsing: one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` from a reply.

`parse_tool_call(text, tools)` returns `({"name", "arguments"} | None, error message)` and never
raises; the message names what is wrong and what was expected, so it can be shown to the policy as
an observation. The syntax is the one `chat.TOOL_CALL_TEMPLATE` asks for.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Sequence

__all__ = ["parse_tool_call"]

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
