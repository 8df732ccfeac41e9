"""The parts of a tool-call action, per token: which tokens chose the tool, which gave its arguments,
which are the final answer, which are free text or syntax (hierarchical credit).

A turn's text is labelled character by character, then each token takes the label of its
characters (`token_parts`):

* **compact** style (`lookup 12`): the first word is the tool name, the other words its arguments.
* **tool_call** style (`<tool_call>{"name": "lookup", "arguments": {"key": 12}}</tool_call>`): the
  characters of the name's string are the tool; those of the values inside `"arguments": {...}`
  are the arguments; tags, keys, braces, quotes and text outside the call are free text.
* A token that covers characters of two parts takes the tool over the arguments over free text.
* The final answer: `EpisodeBuffer.label_answers` relabels every token of a terminated episode's
  last action as `ANSWER` (the action that ended the task, whatever its tool).
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

__all__ = ["TEXT", "TOOL", "ARGS", "ANSWER", "PART_NAMES", "char_parts", "token_parts"]

TEXT, TOOL, ARGS, ANSWER = 0, 1, 2, 3
PART_NAMES = ("text", "tool", "args", "answer")

_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*\{')
# A JSON value inside the arguments object: a string, or a run of non-delimiter characters.
_VALUE = re.compile(r':\s*("(?:[^"\\]|\\.)*"|[^,}\s]+)')


def char_parts(text: str, style: str) -> np.ndarray:
  """`[len(text)]` int32 part of each character (`TEXT`, `TOOL` or `ARGS`) in `style`."""
  out = np.full(len(text), TEXT, np.int32)
  if style == "compact":
    words = [m.span() for m in re.finditer(r"\S+", text)]
    for k, (a, b) in enumerate(words):
      out[a:b] = TOOL if k == 0 else ARGS
    return out
  name = _NAME.search(text)
  if name:
    out[name.start(1):name.end(1)] = TOOL
  args = _ARGUMENTS.search(text)
  if args:
    end = _matching_brace(text, args.end() - 1)
    for value in _VALUE.finditer(text, args.end(), end):
      out[value.start(1):value.end(1)] = ARGS
  return out


def _matching_brace(text: str, open_at: int) -> int:
  """The index of the `}` closing the `{` at `open_at` (strings skipped), or `len(text)`."""
  depth, in_string, escaped = 0, False, False
  for i in range(open_at, len(text)):
    c = text[i]
    if in_string:
      if escaped:
        escaped = False
      elif c == "\\":
        escaped = True
      elif c == '"':
        in_string = False
      continue
    if c == '"':
      in_string = True
    elif c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return i
  return len(text)


def token_parts(decode: Callable[[Sequence[int]], str], ids: Sequence[int], style: str,
                stop_ids: Sequence[int] = ()) -> np.ndarray:
  """`[len(ids)]` int32 part of each token of one turn. The end-of-turn tokens (`stop_ids`) are
  free text, and the others are decoded without them: token `k` covers the characters it adds to
  the text before it, and takes `TOOL` if any of them is the tool's, else `ARGS` if any is an
  argument's, else `TEXT`."""
  ids, stop = list(ids), set(int(i) for i in stop_ids)
  kept = [k for k, i in enumerate(ids) if int(i) not in stop]
  words = [ids[k] for k in kept]
  text = decode(words)
  chars = char_parts(text, style)
  out = np.full(len(ids), TEXT, np.int32)
  start = 0
  for n, k in enumerate(kept):
    end = len(decode(words[:n + 1])) if n + 1 < len(words) else len(text)
    covered = chars[start:max(end, start)]
    if (covered == TOOL).any():
      out[k] = TOOL
    elif (covered == ARGS).any():
      out[k] = ARGS
    start = max(end, start)
  return out
