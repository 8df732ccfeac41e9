"""Chat rendering: prompt token ids of a conversation, with tools, through a jinja chat template.

- `render_chat(tokenizer, messages, tools)`: prompt token ids of a chat, using the model's own chat
  template when it supports tools and `TOOL_CALL_TEMPLATE` otherwise.
- `chat_text(...)`: the text `render_chat` encodes.
- `template_supports_tools(template)`: whether a template reads the `tools` variable.
- `TOOL_CALL_TEMPLATE`: a ChatML template with tool calling, in the syntax `parse_tool_call` reads.

Token-in, token-out: `render_chat` is for building prompts. Sampled actions stay token ids; text is
decoded from them only to parse tool calls, never re-encoded into the trajectory.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

__all__ = ["TOOL_CALL_TEMPLATE", "template_supports_tools", "render_chat", "chat_text"]

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
