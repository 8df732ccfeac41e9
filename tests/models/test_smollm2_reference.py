"""SmolLM2-135M-Instruct against HuggingFace: prompt ids, last-position logits, greedy continuations.

The reference values (`tests/data/smollm2_reference.npz`) were produced by torch `transformers` from
the same GGUF file (`python experiments/make_reference.py`); this test needs no torch. The three
chats: the capital-of-France question, a chat with a system message, and a multi-turn chat whose
history holds `<|im_end|>` (SmolLM2's pad id and turn terminator) in the middle of the prompt.

All three prompts are run as one right-padded batch (pad id 2 = `<|im_end|>`), so the padded,
cached path of the sampler is what is compared, not only a single unpadded forward pass.
"""

import json
import pathlib

import jax
import numpy as np
import pytest

from longhorizon import sampling
from longhorizon.models import checkpoint
from longhorizon.text import render_chat

pytestmark = pytest.mark.slow

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "data" / "smollm2_reference.npz"
LOGITS_ATOL = 1e-3  # float32 max-abs over the whole vocabulary; measured ~7e-5
PAD_ID = 2  # <|im_end|>: SmolLM2's pad id, also a real token inside the multi-turn prompt


@pytest.fixture(scope="module")
def reference():
  data = np.load(REFERENCE)
  chats = json.loads(str(data["chats"]))
  return {str(name): dict(messages=chats[str(name)],
                          input_ids=data[f"{name}/input_ids"].tolist(),
                          last_logits=data[f"{name}/last_logits"],
                          greedy=data[f"{name}/greedy"].tolist(),
                          greedy_nostop=data[f"{name}/greedy_nostop"].tolist())
          for name in data["names"]}


@pytest.fixture(scope="module")
def smollm2():
  config, params, tokenizer = checkpoint.load("smollm2")
  return config, jax.device_put(params), tokenizer


def _padded(prompts):
  width = max(len(p) for p in prompts)
  tokens = np.full((len(prompts), width), PAD_ID, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, np.array([len(p) for p in prompts], np.int32)


def _last_logits(config, params, prompts):
  tokens, lengths = _padded(prompts)
  _, logits = sampling.prefill(params, config, tokens, lengths, tokens.shape[1])
  return np.asarray(logits)


@pytest.fixture(scope="module")
def our_logits(smollm2, reference):
  config, params, _ = smollm2
  return _last_logits(config, params, [r["input_ids"] for r in reference.values()])


def test_reference_holds_the_intended_chats(reference):
  assert set(reference) == {"capital", "system", "multi_turn"}
  assert reference["capital"]["messages"][-1]["content"] == (
      "What is the capital of France? Answer in one sentence.")
  assert reference["system"]["messages"][0]["role"] == "system"
  multi = reference["multi_turn"]["input_ids"]
  assert PAD_ID in multi[:-5], "the multi-turn prompt must hold <|im_end|> before its last turn"


def test_prompt_ids_equal_hf(smollm2, reference):
  _, _, tokenizer = smollm2
  for name, ref in reference.items():
    ids = render_chat(tokenizer, ref["messages"], add_generation_prompt=True)
    assert ids == ref["input_ids"], (
        f"{name}: ours {tokenizer.convert_ids_to_tokens(ids)}\n"
        f"HF   {tokenizer.convert_ids_to_tokens(ref['input_ids'])}")


def test_last_position_logits_match_hf(reference, our_logits):
  for row, (name, ref) in enumerate(reference.items()):
    diff = np.abs(our_logits[row] - ref["last_logits"])
    assert diff.max() < LOGITS_ATOL, f"{name}: max |ours - HF| = {diff.max():.3g} at id {diff.argmax()}"
    assert our_logits[row].argmax() == ref["last_logits"].argmax(), name


def test_full_forward_matches_cached_prefill(smollm2, reference, our_logits):
  """The plain (cache-free) model call on one unpadded prompt gives the same logits."""
  from longhorizon.models.llama import Transformer
  config, params, _ = smollm2
  ids = reference["multi_turn"]["input_ids"]
  out = jax.jit(lambda p, t: Transformer(config).apply({"params": p}, t).logits[0, -1])(
      params, np.asarray([ids], np.int32))
  np.testing.assert_allclose(np.asarray(out), reference["multi_turn"]["last_logits"],
                             atol=LOGITS_ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(out), our_logits[2], atol=1e-4, rtol=0)


@pytest.mark.parametrize("stop", [True, False], ids=["stop_at_im_end", "no_stop"])
def test_greedy_continuation_equals_hf(smollm2, reference, stop):
  """Our greedy decode (batched, right-padded prompts) reproduces HF `generate(do_sample=False)`:
  stopping at `<|im_end|>` (HF's default eos), and without a stop token for N tokens, which runs past
  `<|im_end|>` into the next turn."""
  config, params, tokenizer = smollm2
  n = len(next(iter(reference.values()))["greedy_nostop"])
  rule = sampling.SamplingParams(temperature=0.0, max_new_tokens=n,
                                 stop_token_ids=(tokenizer.eos_token_id,) if stop else ())
  outputs = sampling.generate(params, config, [r["input_ids"] for r in reference.values()], rule)
  for (name, ref), (tokens, _) in zip(reference.items(), outputs):
    expected = ref["greedy"] if stop else ref["greedy_nostop"]
    assert tokens == expected, (f"{name}: ours {tokenizer.decode(tokens)!r} {tokens}\n"
                                f"HF {tokenizer.decode(expected)!r} {expected}")


def test_rope_theta_is_honoured(smollm2, reference, our_logits):
  """SmolLM2 uses theta = 1e5; the same weights with theta = 1e4 give clearly different logits (so
  the loaded value reaches the model and the match above is not RoPE-insensitive)."""
  config, params, _ = smollm2
  assert config.rope_theta == 1e5
  wrong = _last_logits(config.replace(rope_theta=1e4), params,
                       [r["input_ids"] for r in reference.values()])
  for row, (name, ref) in enumerate(reference.items()):
    assert np.abs(wrong[row] - ref["last_logits"]).max() > 1e-1, name
    assert np.abs(our_logits[row] - ref["last_logits"]).max() < LOGITS_ATOL, name
