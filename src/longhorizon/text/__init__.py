"""Text tooling shared by environments and models; it imports neither.

- `tokenizer`: tokenizers built without torch (byte-level BPE from a GGUF vocabulary, word-level,
  byte-per-token) and `unknown_words`;
- `chat`: `render_chat` / `chat_text` through a jinja chat template, `TOOL_CALL_TEMPLATE`;
- `tool_calls`: `parse_tool_call`, which never raises;
- `gguf_file`: `open_gguf`, the one GGUF reader (the tokenizer reads its vocabulary, the model
  checkpoint loader its weights).
"""

from longhorizon.text.chat import TOOL_CALL_TEMPLATE, chat_text, render_chat, template_supports_tools
from longhorizon.text.gguf_file import GGUFFile, has_gguf_magic, open_gguf
from longhorizon.text.tokenizer import (PRE_TOKENIZERS, char_tokenizer, tokenizer_from_gguf,
                                        unknown_words, word_level_tokenizer)
from longhorizon.text.tool_calls import parse_tool_call

__all__ = ["tokenizer_from_gguf", "word_level_tokenizer", "char_tokenizer", "unknown_words",
           "PRE_TOKENIZERS", "TOOL_CALL_TEMPLATE", "render_chat", "chat_text",
           "template_supports_tools", "parse_tool_call", "GGUFFile", "open_gguf", "has_gguf_magic"]
