"""Tokenizers built without torch, chat rendering with and without tools, tool-call parsing."""

import json

import gguf
import pytest

from longhorizon.models import checkpoint
from longhorizon.text import (TOOL_CALL_TEMPLATE, char_tokenizer, parse_tool_call, render_chat,
                              template_supports_tools, tokenizer_from_gguf, unknown_words,
                              word_level_tokenizer)

STRINGS = [
    "Hello world",
    "The year 2024 had 366 days; pi is 3.14159.",
    "  leading spaces, tabs\tand\nnew\n\nlines  ",
    "I'm sure you'll see they've done it, haven't they?",
    "naïve café, Zürich, 東京, emoji 😀👍🏽",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "literal <|im_end|> inside text, and <|endoftext|> too",
]

CHATS = [
    [{"role": "user", "content": "What is 17 * 3?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, with   spaces\tand tabs?"}],
    [{"role": "user", "content": "Schreib «Grüße» 🙂\n\n- a\n- b"}],
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def reader():
  return gguf.GGUFReader(str(checkpoint.resolve("smollm2")))


@pytest.fixture(scope="module")
def tok(reader):
  return tokenizer_from_gguf(reader)


@pytest.fixture(scope="module")
def reference(reader):
  """transformers' own GGUF tokenizer conversion (torch-free part), fed from the same file.

  `AutoTokenizer.from_pretrained(dir, gguf_file=...)` needs torch (its GGUF reader imports it), so
  the converter it calls is used directly.
  """
  from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
  field = lambda key: reader.fields[key].contents()
  tokenizer_dict = dict(
      tokenizer_type=field("tokenizer.ggml.model"), pre_tokenizer_type=field("tokenizer.ggml.pre"),
      tokens=field("tokenizer.ggml.tokens"), merges=field("tokenizer.ggml.merges"),
      token_type=field("tokenizer.ggml.token_type"))
  backend, _ = convert_gguf_tokenizer(field("general.architecture"), tokenizer_dict)
  return backend


def test_special_tokens(tok):
  assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
  assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
      "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
  assert len(tok) == 49152
  assert tok.encode("Hello", add_special_tokens=True) == tok.encode("Hello", add_special_tokens=False)


def test_hand_checked_ids(tok):
  assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
  # SmolLM2 splits every digit: "12345" is five tokens, one per digit.
  digits = tok.encode("12345", add_special_tokens=False)
  assert [tok.decode([i]) for i in digits] == list("12345")
  ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
  assert ids == [1, 4093, 198, 6004, 2, 198]


def test_im_end_is_one_token_inside_a_prompt(tok):
  ids = tok.encode("The answer is 4.<|im_end|>\nnext", add_special_tokens=False)
  assert ids.count(2) == 1
  assert tok.decode(ids[ids.index(2):ids.index(2) + 1]) == "<|im_end|>"


@pytest.mark.parametrize("text", STRINGS)
def test_ids_equal_transformers_gguf_conversion(tok, reference, text):
  assert tok.encode(text, add_special_tokens=False) == reference.encode(
      text, add_special_tokens=False).ids
  assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("chat", CHATS)
def test_chat_ids_equal_transformers_gguf_conversion(tok, reference, chat):
  text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
  assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
  ids = tok.encode(text, add_special_tokens=False)
  assert ids == reference.encode(text, add_special_tokens=False).ids
  assert ids[0] == 1 and ids.count(2) == len(chat) + (chat[0]["role"] != "system")


def test_tokenizer_from_gguf_path_and_save_round_trip(tmp_path, tok):
  from transformers import PreTrainedTokenizerFast
  from_path = tokenizer_from_gguf(checkpoint.resolve("smollm2"))
  assert from_path.encode(STRINGS[1]) == tok.encode(STRINGS[1])
  tok.save_pretrained(tmp_path)
  reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
  for text in STRINGS:
    assert reloaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
  assert reloaded.chat_template == tok.chat_template and reloaded.eos_token_id == 2


# ------------------------------------------------------------------------------ word level

def test_word_level_round_trip():
  tok = word_level_tokenizer(["go", "north", "south", "take", "key", "go"],
                             extra_special_tokens=["<|im_start|>", "<|im_end|>"])
  assert [tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id] == [0, 1, 2, 3]
  assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [4, 5]
  assert len(tok) == 11  # 6 specials + 5 distinct words (the second "go" is dropped)
  ids = tok.encode("go  north\ttake key", add_special_tokens=False)
  assert ids == [6, 7, 9, 10]
  assert tok.decode(ids) == "go north take key"
  assert tok.encode("go west", add_special_tokens=False) == [6, 1]  # unknown -> <unk>
  ids = tok.encode("<|im_start|>go<|im_end|>", add_special_tokens=False)
  assert ids == [4, 6, 5]
  assert tok.decode(ids, skip_special_tokens=True) == "go"


def test_unknown_words_names_what_becomes_unk():
  tok = word_level_tokenizer(["go", "north"], extra_special_tokens=["<act>"])
  # Unknown words in order, repeats kept; the literal unk token and special tokens are not unknown.
  assert unknown_words(tok, "go west <unk> north <act> west  up") == ["west", "west", "up"]
  assert unknown_words(tok, "go north <act>") == [] and unknown_words(tok, "") == []
  assert unknown_words(char_tokenizer(), "any text at all, \u00e9\u4e2d") == []  # byte level


def test_word_level_custom_specials_and_errors():
  tok = word_level_tokenizer(["a", "b"], special_tokens={"unk_token": "[UNK]", "pad_token": "[PAD]"})
  assert (tok.unk_token_id, tok.pad_token_id, tok.convert_tokens_to_ids("a")) == (0, 1, 2)
  with pytest.raises(ValueError, match=r"without whitespace.*'two words'"):
    word_level_tokenizer(["ok", "two words"])
  with pytest.raises(ValueError, match=r"needs an 'unk_token'"):
    word_level_tokenizer(["a"], special_tokens={"pad_token": "<pad>"})
  with pytest.raises(ValueError, match=r"\['sep_token'\] are not known"):
    word_level_tokenizer(["a"], special_tokens={"unk_token": "<unk>", "sep_token": "<sep>"})


# ------------------------------------------------------------------------------ chat + tools

def test_tool_template_lists_tools_in_system_turn(tok):
  messages = [
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "",
       "tool_calls": [{"type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "sunny, 21C"},
  ]
  ids = render_chat(tok, messages, tools=[WEATHER_TOOL])
  text = tok.decode(ids)
  system = text[:text.index("<|im_end|>")]
  assert system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
  assert json.dumps(WEATHER_TOOL["function"]) in system
  assert "<tool_call>" in system  # the instruction shows the call format
  assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '</tool_call><|im_end|>\n') in text
  assert "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n" in text
  assert text.endswith("<|im_start|>assistant\n")
  # ChatML framing tokens are single special tokens.
  assert ids.count(1) == ids.count(2) + 1 == 5
  # The rendered assistant call parses back to the same call.
  call_text = text.split("<|im_start|>assistant\n")[1].split("<|im_start|>")[0]
  assert parse_tool_call(call_text, tools=[WEATHER_TOOL]) == (
      {"name": "get_weather", "arguments": {"city": "Paris"}}, "")


def test_tool_template_keeps_given_system_and_string_arguments(tok):
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Weather?"},
              {"role": "assistant", "content": "Checking.",
               "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]}]
  text = tok.decode(render_chat(tok, messages, tools=[WEATHER_TOOL], add_generation_prompt=False))
  assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
  assert text.count("Be brief.") == 1
  assert text.endswith('<|im_start|>assistant\nChecking.<tool_call>{"name": "get_weather", '
                       '"arguments": {"city": "Oslo"}}</tool_call><|im_end|>\n')


def test_render_chat_uses_own_template_without_tools(tok):
  chat = CHATS[1]
  expected = tok.encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
  assert render_chat(tok, chat) == expected
  assert not template_supports_tools(tok.chat_template)
  assert template_supports_tools(TOOL_CALL_TEMPLATE)


def test_render_chat_prefers_a_tool_capable_model_template():
  own = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
         "{% if tools %}[tools:{{ tools | length }}]{% endif %}")
  tok = word_level_tokenizer(["[user]hi[tools:1]", "[user]hi"], chat_template=own)
  ids = render_chat(tok, [{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
  assert tok.decode(ids) == "[user]hi[tools:1]"


def test_tool_template_without_tools_is_plain_chatml(tok):
  text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                 add_generation_prompt=True, chat_template=TOOL_CALL_TEMPLATE)
  assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------ parse_tool_call

@pytest.mark.parametrize("text,expected", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
     {"name": "get_weather", "arguments": {"city": "Paris"}}),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
     '</tool_call><|im_end|>\n', {"name": "get_weather", "arguments": {"city": "Rome"}}),
    ('<tool_call>{"name": "noop"}</tool_call>', {"name": "noop", "arguments": {}}),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
     {"name": "f", "arguments": {"x": 1}}),
])
def test_parse_tool_call_good(text, expected):
  assert parse_tool_call(text) == (expected, "")


@pytest.mark.parametrize("text,message", [
    ("I think it is sunny.", r"no <tool_call> tag"),
    ("\x00\xff garbage }{ ][", r"no <tool_call> tag"),
    ('<tool_call>{"name": "f", "arguments": {}}', r"missing closing </tool_call>"),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', r"not valid JSON"),
    ("<tool_call>get_weather(city='Paris')</tool_call>", r"not valid JSON"),
    ("<tool_call></tool_call>", r"empty tool call"),
    ('<tool_call>["f", {}]</tool_call>', r"must be a JSON object, got list"),
    ('<tool_call>{"arguments": {"x": 1}}</tool_call>', r"no 'name'"),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', r"'name' must be a non-empty string"),
    ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', r"'arguments' must be a JSON object.*list"),
    ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', r"'arguments' is a string that is not valid JSON"),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call> and then more', r"unexpected text after </tool_call>: 'and then more'"),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>', r"more than one <tool_call>"),
    ('<tool_call>{"name": "f", "args": {}}</tool_call>', r"unexpected key\(s\) \['args'\]"),
    (None, r"must be text, got NoneType"),
])
def test_parse_tool_call_malformed_never_raises(text, message):
  call, error = parse_tool_call(text)
  assert call is None
  assert error and __import__("re").search(message, error), error


@pytest.mark.parametrize("text,key", [
    ('<tool_call>{"name": "f", "arguments": {"x": 1, "x": 2}}</tool_call>', "x"),
    ('<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>', "name"),
    ('<tool_call>{"name": "f", "arguments": {"x": {"y": 1, "y": 1}}}</tool_call>', "y"),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1, \\"x\\": 2}"}</tool_call>', "x"),
])
def test_parse_tool_call_refuses_duplicate_keys(text, key):
  """A repeated key used to parse with the last value winning; it is an error naming the key."""
  call, error = parse_tool_call(text)
  assert call is None and f"duplicate key {key!r}" in error, error


def test_parse_tool_call_parse_int():
  text = '<tool_call>{"name": "f", "arguments": {"x": -0, "y": 7}}</tool_call>'
  assert parse_tool_call(text) == ({"name": "f", "arguments": {"x": 0, "y": 7}}, "")
  call, error = parse_tool_call(text, parse_int=lambda s: f"int:{s}")
  assert call == {"name": "f", "arguments": {"x": "int:-0", "y": "int:7"}} and error == ""


def test_parse_tool_call_checks_against_tools():
  call, error = parse_tool_call('<tool_call>{"name": "get_wether", "arguments": {}}</tool_call>',
                                tools=[WEATHER_TOOL])
  assert call is None and "unknown tool 'get_wether'" in error and "get_weather" in error
  call, error = parse_tool_call('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
                                tools=[WEATHER_TOOL])
  assert call is None and "missing required argument(s) ['city']" in error
