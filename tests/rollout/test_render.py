"""Turn-by-turn rendering: a hand-made episode laid out exactly, and mask colours on a real rollout."""

import re

import jax
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.core import episode
from longhorizon.core.episode import Termination
from longhorizon.envs import testing
from longhorizon.rollout import render

_GREEN, _RESET = render.ANSI_COLORS[render.SAMPLED], "\x1b[0m"


@pytest.fixture(scope="module")
def codec():
  return envs.make("pointer_chain", horizon=1).codec(style="compact")


def _hand_made(codec):
  """One 1-hop episode: prompt, `lookup 1` + observation, `answer 2`; then padding."""
  encode = lambda text: codec.tokenizer.encode(text, add_special_tokens=False)
  pieces = [("<bos> start 1 hops 1 <act>", -1, False), ("lookup 1 <eot>", 0, True),
            ("1 -> 2 <act>", 0, False), ("answer 2 <eot>", 1, True)]
  length = sum(len(encode(text)) for text, _, _ in pieces) + 3
  batch = episode.empty(1, length, 3)
  fields = {k: np.array(getattr(batch, k)) for k in ("tokens", "attention_mask", "loss_mask", "turn")}
  p = 0
  for text, turn, sampled in pieces:
    ids = encode(text)
    fields["tokens"][0, p:p + len(ids)] = ids
    fields["attention_mask"][0, p:p + len(ids)] = True
    fields["loss_mask"][0, p:p + len(ids)] = sampled
    fields["turn"][0, p:p + len(ids)] = turn
    p += len(ids)
  return batch.replace(
      **fields, rewards=np.array([[0.0, 1.0, 0.0]], np.float32),
      step_mask=np.array([[True, True, False]]), milestones=np.array([[1, 2, 0]], np.int32),
      group=np.array([7], np.int32), success=np.array([True]), terminated=np.array([True]),
      termination=np.array([Termination.SUCCESS], np.int32), num_steps=np.array([2], np.int32),
      score=np.array([1.0], np.float32)).validate()


def test_hand_made_episode_plain(codec):
  text = render.render_episode(_hand_made(codec), 0, codec.tokenizer, markup="plain",
                               milestone_names=("halfway", "chain_end"))
  assert text.splitlines() == [
      "episode 0 (group 7): SUCCESS after 2 steps, score 1.00",
      " prompt | <bos> start 1 hops 1 <act>",
      " turn 0 | \u00ablookup 1 <eot>\u00bb 1 -> 2 <act>   reward +0.00   milestone halfway",
      " turn 1 | \u00abanswer 2 <eot>\u00bb   reward +1.00   milestone chain_end",
  ]


def test_hand_made_episode_ansi_colours_exactly_the_sampled_tokens(codec):
  text = render.render_episode(_hand_made(codec), 0, codec.tokenizer)
  assert re.findall(re.escape(_GREEN) + r"(.*?)" + re.escape(_RESET), text) == [
      "lookup 1 <eot>", "answer 2 <eot>"]
  observation = render.ANSI_COLORS[render.OBSERVATION]
  prompt = render.ANSI_COLORS[render.PROMPT]
  assert f"{observation}1 -> 2 <act>{_RESET}" in text
  assert f"{prompt}<bos> start 1 hops 1 <act>{_RESET}" in text


def test_html_escapes_and_styles(codec):
  text = render.render_episode(_hand_made(codec), 0, codec.tokenizer, markup="html")
  assert text.startswith("<pre>") and text.endswith("</pre>")
  sampled = render.HTML_STYLES[render.SAMPLED]
  assert f'<span style="{sampled}">lookup 1 &lt;eot&gt;</span>' in text
  assert "&lt;bos&gt;" in text and "<bos>" not in text
  assert text.count(f'style="{sampled}"') == 2


def test_token_kinds(codec):
  kinds = render.token_kinds(_hand_made(codec), 0)
  assert kinds.tolist() == [1] * 6 + [2] * 3 + [3] * 4 + [2] * 3 + [0] * 3


def test_rollout_sampled_colour_covers_exactly_the_loss_mask(codec):
  """On a real (scripted) multi-turn rollout, the green runs decode to exactly the loss-mask tokens
  of each turn, and the uncoloured text is everything else."""
  env = envs.TimeLimit(envs.make("pointer_chain", horizon=2), 4)
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(0), 2)
  rc = rollout.RolloutConfig(group_size=2, context_length=96, max_steps=4, turn_tokens=4)
  batch, _ = rollout.collect(None, None, env, codec, testing.tasks_from_keys(env, keys), keys, rc,
                             sampling_seed=0, scripted=rollout.oracle_turns(env, codec, 0.5, seed=1))
  for i in range(batch.batch_size):
    text = render.render_episode(batch, i, codec.tokenizer)
    lines = text.splitlines()[2:]
    assert len(lines) == int(batch.num_steps[i])
    for t, line in enumerate(lines):
      ids = batch.tokens[i][batch.loss_mask[i] & (batch.turn[i] == t)]
      green = re.findall(re.escape(_GREEN) + r"(.*?)" + re.escape(_RESET), line)
      assert green == [codec.decode(ids)]
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    assert plain == render.render_episode(batch, i, codec.tokenizer, markup="plain").replace(
        "\u00ab", "").replace("\u00bb", "")


def test_errors_name_the_problem(codec):
  batch = _hand_made(codec)
  with pytest.raises(ValueError, match="out of range for a batch of 1"):
    render.render_episode(batch, 1, codec.tokenizer)
  with pytest.raises(ValueError, match="markup must be one of"):
    render.render_episode(batch, 0, codec.tokenizer, markup="latex")
  assert "sampled (loss_mask = 1)" in render.legend("plain")
