"""Teacher-forced choice probe: how likely the policy finds the oracle's choice at a decision.

A warm start can copy a demonstration's format perfectly and still get one decision wrong half
the time (SmolLM2 on `calculator`: the operation a phrase asks for, docs/notes/issue-18.md). Its
sampled success mixes every decision of an episode; this probe isolates one. On oracle episodes
(teacher forcing), wherever the policy's own tokens hold `marker` followed by one of `choices`
(e.g. the tokens of `, "op": "` then those of `add` / `sub` / ...), it reads the log-probability
the policy gave that choice's tokens, i.e. log P(oracle choice | the oracle's history). One
log-prob pass over the episodes, no sampling.

Host-side NumPy on token ids and per-token log-probs (`Learner.logprobs`); nothing here imports
JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ChoiceHit:
  row: int
  start: int  # position of the choice's first token
  choice: int  # index into `choices`
  logprob: float  # summed log-prob of the choice's tokens


def find_choices(tokens, loss_mask, marker, choices) -> list[tuple[int, int, int]]:
  """`(row, start, choice)` for every place where the policy tokens (`loss_mask`) of a row hold
  `marker` immediately followed by the tokens of one of `choices` (token-id sequences). The
  longest matching choice wins when one is a prefix of another."""
  tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask, bool)
  marker = tuple(int(t) for t in marker)
  choices = [tuple(int(t) for t in c) for c in choices]
  if not marker or any(not c for c in choices):
    raise ValueError("marker and every choice need at least one token.")
  order = sorted(range(len(choices)), key=lambda i: -len(choices[i]))
  hits = []
  for r in range(tokens.shape[0]):
    row, mask, m = tokens[r], loss_mask[r], len(marker)
    for t in range(len(row) - m):
      if not mask[t:t + m].all() or tuple(row[t:t + m]) != marker:
        continue
      s = t + m
      for i in order:
        c = choices[i]
        if s + len(c) <= len(row) and mask[s:s + len(c)].all() and tuple(row[s:s + len(c)]) == c:
          hits.append((r, s, i))
          break
  return hits


def choice_logprobs(tokens, loss_mask, logprobs, marker, choices) -> list[ChoiceHit]:
  """`find_choices` with each hit's summed token log-prob (`logprobs[r, t]` scores token `t`
  given tokens `< t`, as `Learner.logprobs` returns them)."""
  logprobs = np.asarray(logprobs, np.float64)
  return [ChoiceHit(r, s, i, float(logprobs[r, s:s + len(choices[i])].sum()))
          for r, s, i in find_choices(tokens, loss_mask, marker, choices)]


def summarize(hits: list[ChoiceHit], names) -> dict:
  """Per choice (by `names`) and overall: how many decisions, the mean probability of the oracle's
  choice, and the fraction where it exceeds 1/2 (so no other choice can be more likely)."""
  def stats(sel):
    p = np.exp([h.logprob for h in sel]) if sel else np.zeros(0)
    return {"count": len(sel), "mean_prob": float(p.mean()) if sel else float("nan"),
            "frac_above_half": float((p > 0.5).mean()) if sel else float("nan")}
  out = {"all": stats(hits)}
  for i, name in enumerate(names):
    out[name] = stats([h for h in hits if h.choice == i])
  return out
