"""Turn-by-turn text of recorded episodes, tokens coloured by who wrote them.

`render_episode(batch, i, tokenizer)` lays out row `i` of an `EpisodeBatch` one turn per line:

    episode 3 (group 1): SUCCESS after 3 steps, score 1.00
     prompt | <bos> follow the chain : ... start 5 hops 2 <act>
     turn 0 | lookup 5 <eot> 5 -> 9 <act>                        reward +0.00
     turn 1 | lookup 9 <eot> 9 -> 2 <act>                        reward +0.00
     turn 2 | answer 2 <eot>                                     reward +1.00

Every token is one of three kinds (`token_kinds`):
* `PROMPT`: system and task text (`turn == -1`);
* `SAMPLED`: the policy's own tokens, exactly where `loss_mask` is 1 (the only tokens that carry a
  loss, the turn-ending token included);
* `OBSERVATION`: every other real token of a turn: the environment's answer, the cue for the next
  action, and an end-of-turn token the rollout appended when a turn ran out of token budget.

Tokens are decoded in runs of one kind (for display only; the trajectory is never re-tokenised)
and the runs are joined by a space, so a byte-level tokenizer's text may show an extra space at a
run boundary. Newlines inside a run are shown as `⏎` to keep one line per turn. Markup: `"ansi"`
colours (terminals and Jupyter stream output), `"html"` (for `IPython.display.HTML`), or `"plain"`
(sampled runs wrapped in `«»`, nothing else marked).

Host-side NumPy; accepts batches on the host or on a device.
"""

from __future__ import annotations

import html as html_lib
from typing import Sequence

import numpy as np

from longhorizon.core.episode import Termination

__all__ = ["render_episode", "token_kinds", "legend", "PAD", "PROMPT", "SAMPLED", "OBSERVATION",
           "MARKUPS", "ANSI_COLORS", "HTML_STYLES"]

PAD, PROMPT, SAMPLED, OBSERVATION = 0, 1, 2, 3
_NAMES = {PROMPT: "prompt", SAMPLED: "sampled (loss_mask = 1)", OBSERVATION: "observation"}
MARKUPS = ("ansi", "html", "plain")
ANSI_COLORS = {PROMPT: "\x1b[90m", SAMPLED: "\x1b[1;32m", OBSERVATION: "\x1b[34m"}
_ANSI_RESET = "\x1b[0m"
HTML_STYLES = {PROMPT: "color:#808080",
               SAMPLED: "color:#006400;background:#d8f5d8;font-weight:bold",
               OBSERVATION: "color:#1f4fbf"}
_PLAIN = {SAMPLED: ("\u00ab", "\u00bb")}


def token_kinds(batch, i: int) -> np.ndarray:
  """`[L]` int32 kind of each token of row `i`: PAD, PROMPT, SAMPLED or OBSERVATION."""
  attention = np.asarray(batch.attention_mask[i], bool)
  loss = np.asarray(batch.loss_mask[i], bool)
  turn = np.asarray(batch.turn[i])
  kinds = np.full(attention.shape, PAD, np.int32)
  kinds[attention & (turn < 0)] = PROMPT
  kinds[attention & (turn >= 0)] = OBSERVATION
  kinds[attention & loss] = SAMPLED
  return kinds


def _mark(text: str, kind: int, markup: str) -> str:
  if markup == "ansi":
    return f"{ANSI_COLORS[kind]}{text}{_ANSI_RESET}"
  if markup == "html":
    return f'<span style="{HTML_STYLES[kind]}">{html_lib.escape(text)}</span>'
  before, after = _PLAIN.get(kind, ("", ""))
  return f"{before}{text}{after}"


def _check_markup(markup: str):
  if markup not in MARKUPS:
    raise ValueError(f"markup must be one of {MARKUPS}, got {markup!r}.")


def legend(markup: str = "ansi") -> str:
  """One line naming the three token kinds in `markup`."""
  _check_markup(markup)
  text = "tokens: " + " | ".join(_mark(name, kind, markup) for kind, name in _NAMES.items())
  return f"<pre>{text}</pre>" if markup == "html" else text


def render_episode(batch, i: int, tokenizer, *, markup: str = "ansi",
                   milestone_names: Sequence[str] = ()) -> str:
  """Row `i` of `batch`, decoded turn by turn with tokens marked by kind (module docstring).

  Args:
    batch: an `EpisodeBatch` (`[B, L]` tokens and masks, `[B, S]` step arrays).
    i: the row to render, `0 <= i < B`.
    tokenizer: the policy's tokenizer (`codec.tokenizer`): anything with
      `decode(ids, skip_special_tokens=False)`.
    markup: "ansi", "html" or "plain".
    milestone_names: names of the milestone bits (e.g. `env.milestone_names`); milestones first
      reached at a step are then listed after its reward.

  Returns:
    The text: a header line (termination kind, steps, score), the prompt, then one line per turn
    ending with the step's reward. With "html", a `<pre>` block.
  """
  _check_markup(markup)
  b = np.asarray(batch.tokens).shape[0]
  if not 0 <= int(i) < b:
    raise ValueError(f"row i={i} is out of range for a batch of {b} episodes.")
  tokens = np.asarray(batch.tokens[i])
  turn = np.asarray(batch.turn[i])
  kinds = token_kinds(batch, i)

  def decode(ids) -> str:
    text = tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)
    return text.replace("\n", "\u23ce")

  # Runs of consecutive real tokens with the same (turn, kind), in order.
  lines: dict[int, list[str]] = {}
  start = None
  for p in range(len(tokens) + 1):
    same = (p < len(tokens) and start is not None and kinds[p] == kinds[start]
            and turn[p] == turn[start])
    if same:
      continue
    if start is not None and kinds[start] != PAD:
      lines.setdefault(int(turn[start]), []).append(
          _mark(decode(tokens[start:p]), int(kinds[start]), markup))
    start = p if p < len(tokens) else None

  termination = Termination(int(np.asarray(batch.termination)[i])).name
  steps = int(np.asarray(batch.num_steps)[i])
  header = (f"episode {i} (group {int(np.asarray(batch.group)[i])}): {termination} after {steps} "
            f"step{'s' if steps != 1 else ''}, score {float(np.asarray(batch.score)[i]):.2f}")
  out = [html_lib.escape(header) if markup == "html" else header]
  if -1 in lines:
    out.append(f"{'prompt':>7} | " + " ".join(lines.pop(-1)))
  rewards = np.asarray(batch.rewards[i])
  step_mask = np.asarray(batch.step_mask[i], bool)
  milestones = np.asarray(batch.milestones[i])
  for t in sorted(lines):
    line = f"{f'turn {t}':>7} | " + " ".join(lines[t])
    if t < len(step_mask) and step_mask[t]:
      line += f"   reward {float(rewards[t]):+.2f}"
      reached = [name for m, name in enumerate(milestone_names) if (int(milestones[t]) >> m) & 1]
      if reached:
        line += "   milestone " + ", ".join(reached)
      if bool(np.asarray(batch.env_error[i])[t]):
        line += "   env error"
      if bool(np.asarray(batch.violation[i])[t]):
        line += "   violation"
    out.append(line)
  text = "\n".join(out)
  return f"<pre>{text}</pre>" if markup == "html" else text
