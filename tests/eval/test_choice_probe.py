"""The teacher-forced choice probe: matching and summing checked by hand."""

import math

import numpy as np
import pytest

from longhorizon.eval import choice_probe


def _case():
  # marker = (7, 8); choices: "add" = (20,), "sub" = (21,), "mul" = (22, 23) (two tokens).
  tokens = np.array([[1, 7, 8, 20, 5, 7, 8, 22, 23, 0],
                     [7, 8, 21, 9, 7, 8, 24, 0, 0, 0],   # 24 is no choice: not a hit
                     [7, 8, 20, 0, 0, 0, 0, 0, 0, 0]])   # a prompt (not policy tokens): not a hit
  loss_mask = np.array([[0, 1, 1, 1, 1, 1, 1, 1, 1, 0],
                        [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], bool)
  logp = np.zeros(tokens.shape)
  logp[0, 3] = math.log(0.8)
  logp[0, 7], logp[0, 8] = math.log(0.5), math.log(0.5)  # mul: 0.25 over its two tokens
  logp[1, 2] = math.log(0.6)
  return tokens, loss_mask, logp


def test_hits_and_logprobs_by_hand():
  tokens, loss_mask, logp = _case()
  hits = choice_probe.choice_logprobs(tokens, loss_mask, logp, (7, 8), [(20,), (21,), (22, 23)])
  assert [(h.row, h.start, h.choice) for h in hits] == [(0, 3, 0), (0, 7, 2), (1, 2, 1)]
  np.testing.assert_allclose([math.exp(h.logprob) for h in hits], [0.8, 0.25, 0.6], rtol=1e-12)
  s = choice_probe.summarize(hits, ["add", "sub", "mul"])
  assert s["all"]["count"] == 3
  np.testing.assert_allclose(s["all"]["mean_prob"], (0.8 + 0.25 + 0.6) / 3)
  np.testing.assert_allclose(s["all"]["frac_above_half"], 2 / 3)
  assert s["mul"] == {"count": 1, "mean_prob": pytest.approx(0.25), "frac_above_half": 0.0}
  assert s["add"]["frac_above_half"] == 1.0


def test_a_choice_partly_outside_the_policy_tokens_is_not_a_hit():
  tokens, loss_mask, _ = _case()
  loss_mask[0, 8] = False  # mul's second token is not the policy's
  hits = choice_probe.find_choices(tokens, loss_mask, (7, 8), [(20,), (21,), (22, 23)])
  assert (0, 7, 2) not in hits and len(hits) == 2


def test_longest_choice_wins_and_empty_tokens_are_refused():
  tokens = np.array([[7, 8, 22, 23]])
  mask = np.ones_like(tokens, bool)
  assert choice_probe.find_choices(tokens, mask, (7, 8), [(22,), (22, 23)]) == [(0, 2, 1)]
  with pytest.raises(ValueError, match="at least one token"):
    choice_probe.find_choices(tokens, mask, (), [(22,)])
