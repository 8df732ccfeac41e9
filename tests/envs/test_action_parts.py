"""`envs.action_parts`: the parts of a tool-call action (tool name, arguments, free text, final
answer) per character and per token, by hand in both styles and with a real BPE tokenizer, and as
the rollout writes them into `EpisodeBatch.action_part` for the learner's per-part weights."""

import jax
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.envs import testing
from longhorizon.envs.action_parts import ANSWER, ARGS, TEXT, TOOL, char_parts, token_parts
from longhorizon.train import algorithms


def test_compact_parts_by_hand():
  text = "lookup 12 7"
  want = [TOOL] * 6 + [TEXT] + [ARGS] * 2 + [TEXT] + [ARGS]
  np.testing.assert_array_equal(char_parts(text, "compact"), want)


def test_tool_call_parts_by_hand():
  text = 'ok <tool_call>{"name": "refund", "arguments": {"order": "A-7", "n": 12}}</tool_call>'
  parts = char_parts(text, "tool_call")
  labelled = lambda part: "".join(c for c, p in zip(text, parts) if p == part)
  assert labelled(TOOL) == "refund"
  assert labelled(ARGS) == '"A-7"12'  # the values only: keys, quotes of keys, braces are text
  assert labelled(TEXT).startswith('ok <tool_call>{"name": "')


def test_token_parts_word_tokenizer():
  env = envs.make("pointer_chain", horizon=2)
  codec = env.codec(style="compact")
  ids = codec.tokenizer.encode("lookup 12", add_special_tokens=False) + list(
      codec.stop_token_ids[:1])
  np.testing.assert_array_equal(token_parts(codec.decode, ids, "compact", codec.stop_token_ids),
                                [TOOL, ARGS, TEXT])
  # Without naming the end of turn it would read as a third word (an argument).
  np.testing.assert_array_equal(token_parts(codec.decode, ids, "compact"), [TOOL, ARGS, ARGS])


def test_token_parts_bpe_tokenizer():
  """With SmolLM2's byte-level BPE tokenizer a word may be several tokens and a token may carry a
  quote with a letter: every token of the name is the tool's, every token of a value an
  argument's."""
  import gguf  # pylint: disable=g-import-not-at-top
  from longhorizon.models import checkpoint  # pylint: disable=g-import-not-at-top
  from longhorizon.text import tokenizer_from_gguf  # pylint: disable=g-import-not-at-top
  tok = tokenizer_from_gguf(gguf.GGUFReader(str(checkpoint.resolve("smollm2"))))
  text = '<tool_call>{"name": "lookup", "arguments": {"key": 12}}</tool_call>'
  ids = tok.encode(text, add_special_tokens=False)
  parts = token_parts(lambda x: tok.decode(list(x)), ids, "tool_call")
  pieces = [tok.decode([i]) for i in ids]
  assert "".join(p for p, k in zip(pieces, parts) if k == TOOL).strip(' "') == "lookup"
  assert "".join(p for p, k in zip(pieces, parts) if k == ARGS).strip(' :}"') == "12"


def test_rollout_labels_parts_and_the_learner_weights_them():
  env = envs.TimeLimit(envs.make("pointer_chain", horizon=2), 5)
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(0), 3)
  rc = rollout.RolloutConfig(group_size=2, context_length=128, max_steps=5, turn_tokens=5,
                             label_parts=True)
  batch, _ = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys, rc,
                             sampling_seed=0, scripted=rollout.oracle_turns(env, codec, 0.3))
  part, mask = np.asarray(batch.action_part), np.asarray(batch.loss_mask)
  assert not part[~mask].any()  # prompt, observations, padding: 0
  for r in range(batch.batch_size):
    for t in range(batch.num_steps[r]):
      got = part[r][mask[r] & (batch.turn[r] == t)]
      last = t == batch.num_steps[r] - 1 and batch.terminated[r]
      np.testing.assert_array_equal(got, [ANSWER] * 3 if last else [TOOL, ARGS, TEXT])
  weights = (0.5, 1.0, 2.0, 3.0)
  batch = batch.replace(score=np.random.default_rng(0).normal(size=batch.batch_size)
                        .astype(np.float32))
  plain = algorithms.compute_advantages(batch, None, algorithms.AlgorithmOptions())
  out = algorithms.compute_advantages(batch, None, algorithms.AlgorithmOptions(part_weights=weights))
  np.testing.assert_allclose(out.advantages, np.asarray(plain.advantages)
                             * np.asarray(weights)[part], atol=1e-6)
  assert not np.allclose(out.advantages, plain.advantages)
