"""Context management for long episodes: window and summary segments, token-exact.

`config.context.mode` (`RolloutConfig.context_mode`):

* `full`: the episode's whole history stays in one context (the KV cache); a row whose next turn
  would not fit is truncated (`CONTEXT_OVERFLOW`).
* `window`: at a segment boundary the context is rewritten as the prompt plus the last
  `context_keep` turns (each step's action and observation, copied id for id) and the newest
  observation.
* `summary`: at a segment boundary the context is rewritten as the system text plus the
  environment's state summary (`Environment.state_text`, written in the task's place), from which
  the policy goes on as from a fresh task. With `context_summary_by="policy"` the policy writes
  the summary itself: at the boundary the row gets the observation and a request
  (`summary_request`), the policy samples a turn of at most `context_summary_tokens` (loss 1,
  behaviour log-probs, the step's turn: trained with the episode's advantage like any action),
  and the new context is the prompt's framing around exactly the sampled ids. The boundary then
  comes while the request and a whole summary still fit. Demonstrations (a scripted policy) write
  the environment's `state_text` there.

A boundary comes after every `context_every` steps of a segment, or (`context_every` 0, or
sooner) when the next observation and turn would not fit. An episode holds at most
`context_segments` segments; past that it is truncated on overflow as in `full`.

Token-exactness: a rewritten context is not an extension of the cached one, so the row's cache is
prefilled again from its new context; the row then samples on from it. Each segment is kept as
its own training row holding exactly the tokens the policy saw while it sampled that segment's
turns (copied history with loss 0, its own turns with loss 1 and their behaviour log-probs).
`collect` returns the episodes' last segments as the batch (one row per episode, with every step-
and episode-level field) and the earlier ones in `RolloutStats.segments`, which repeat their
episode's step- and episode-level fields and point to its row (`EpisodeBatch.segment_of`). The
learner trains on both (`episode.join_segments`) with advantages computed once per episode and
placed on every segment's tokens by step (`algorithms.segment_advantages`): the segments of one
episode share its return, its group and its step credit.

A row in its `k`-th segment (k >= 1) samples with its row key folded with `k`, so a rewritten
context's positions do not reuse the draws of the segment before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.core.episode import EpisodeBatch, empty
from longhorizon.envs.pool import factory_of

__all__ = ["CONTEXT_MODES", "SUMMARY_BY", "Segmenter", "rewrite_pairs", "offload_pairs",
           "segment_keys", "summary_request"]

CONTEXT_MODES = ("full", "window", "summary")
SUMMARY_BY = ("env", "policy")  # who writes a summary segment's summary


class Segmenter:
  """Decides and carries out the context segment boundaries of one `collect` (window / summary).

  Args:
    config: the `RolloutConfig` (context_mode, context_every, context_keep, context_segments,
      context_length, turn_tokens).
    codec: the rows' codec (the summary's prompt framing).
    rows: the collect's environment rows (`state_text(r)` for the summary).
    prompts: each row's prompt ids (the start of a window segment).
  """

  def __init__(self, config, codec, rows, prompts):
    self.config, self.codec, self.rows = config, codec, rows
    self.prompts = [list(p) for p in prompts]
    b = len(self.prompts)
    self.index = np.zeros((b,), np.int64)  # the segment each row is in (0 = the first)
    self.first_step = np.zeros((b,), np.int64)  # the first step of that segment
    self.saved: list[tuple[int, dict]] = []  # (row, its finished segment's token fields)
    self.unknown_words = 0
    # What `full` would hold: each row's prompt, every turn and every observation, in order; the
    # current segment's own tokens (after its rewritten context) start at `own_start`.
    self.history = [list(p) for p in self.prompts]
    self.own_start = np.array([len(p) for p in self.prompts], np.int64)
    self.rewrites: list[tuple[int, list[int], int]] = []  # (row, full history, rewritten length)
    # summary_by="policy": the request appended before the summary turn, and the ids a summary
    # context starts and ends with (the prompt's framing around it).
    self.by_policy = config.context_mode == "summary" and config.context_summary_by == "policy"
    if self.by_policy:
      if getattr(codec, "chat", False):
        raise ValueError("context summary_by='policy' frames its request in the compact / "
                         "plain-text prompt; chat-template codecs are not supported (use "
                         "summary_by='env').")
      encode = lambda text: codec.tokenizer.encode(text, add_special_tokens=False)
      self.request = encode(summary_request(codec.style))
      head, tail = codec.summary_prompt_text(_MARK).split(_MARK)
      self.head, self.tail = encode(head), encode(tail)

  def cut(self, buffer, r: int, t: int, framed: list[int], fits: bool) -> str:
    """After row `r`'s step `t`, whose observation ids (as they would be appended) are `framed`
    and would leave room for the next turn if `fits`: starts a new segment when one is due and
    possible (a segment left, and the rewritten context plus one turn fits). Returns "cut" if it
    did; "ask" (the policy writes the summary) if the caller is to append `framed` and then
    `self.request` for the row's summary turn (`summarised` rewrites after it); "" if neither:
    the caller appends `framed` or truncates the row."""
    c = self.config
    if self.index[r] + 1 >= c.context_segments:
      return ""
    every = c.context_every and t + 1 - self.first_step[r] >= c.context_every
    if self.by_policy:
      return "ask" if self._ask(buffer, r, framed, every) else ""
    if not (every or not fits):
      return ""
    ids, turns = self._context(buffer, r, t, framed)
    if len(ids) + c.turn_tokens + 1 > c.context_length:
      return ""
    self._rewrite(buffer, r, t, ids, turns, framed)
    return "cut"

  def _ask(self, buffer, r: int, framed: list[int], every: bool) -> bool:
    """Whether row `r` asks the policy for its summary now: due by `every`, or because after one
    more step (an action and an observation as long as `framed`) the request and a whole summary
    would no longer fit; and they fit now."""
    c = self.config
    ask = len(framed) + len(self.request) + c.context_summary_tokens + 1
    now = buffer.end[r] + ask <= c.context_length
    later = buffer.end[r] + len(framed) + c.turn_tokens + 1 + ask <= c.context_length
    return bool(now and (every or not later))

  def summarised(self, buffer, r: int, t: int, summary: list[int]) -> bool:
    """Row `r` wrote `summary` (its sampled ids, end of turn included or not) after step `t`'s
    observation and the request: its context is rewritten as the prompt's framing around the
    summary's ids, copied as sampled. False (nothing changed) if that would not fit."""
    eot = self.codec.stop_token_ids
    ids = list(summary[:-1] if summary and summary[-1] in eot else summary)
    context = self.head + ids + self.tail
    if len(context) + self.config.turn_tokens + 1 > self.config.context_length:
      return False
    self._rewrite(buffer, r, t, context, [-1] * len(context), [])
    return True

  def _rewrite(self, buffer, r, t, ids, turns, framed) -> None:
    self.history[r] += buffer.batch.tokens[r, self.own_start[r]:buffer.end[r]].tolist() + framed
    self.saved.append((r, buffer.cut(r, ids, turns)))
    self.rewrites.append((r, list(self.history[r]), len(ids)))
    self.own_start[r] = len(ids)
    self.index[r] += 1
    self.first_step[r] = t + 1

  def _context(self, buffer, r: int, t: int, framed: list[int]) -> tuple[list[int], list[int]]:
    """Row `r`'s rewritten context after step `t`: `(ids, step label of each id)`."""
    if self.config.context_mode == "summary":
      text = self.codec.summary_prompt_text(self.rows.state_text(r))
      ids = self.codec.tokenizer.encode(text, add_special_tokens=False)
      unk = self.codec.tokenizer.unk_token_id
      if unk is not None and unk in ids:
        self.unknown_words += len(self.codec.unknown_words(text))
      return ids, [-1] * len(ids)
    out = buffer.batch
    end = int(buffer.end[r])
    turn = out.turn[r, :end]
    keep = np.flatnonzero((turn > t - self.config.context_keep) & (turn <= t))
    prompt = self.prompts[r]
    ids = prompt + out.tokens[r, keep].tolist() + list(framed)
    turns = [-1] * len(prompt) + turn[keep].tolist() + [t] * len(framed)
    return ids, turns

  def segments(self, batch: EpisodeBatch) -> EpisodeBatch:
    """The earlier segments as an `EpisodeBatch` of `B * (context_segments - 1)` rows (segment `j`
    of the saved ones at row `j`, then rows without tokens): each repeats the step- and
    episode-level fields of its episode's row of the finished `batch` and holds its own tokens."""
    b = batch.batch_size
    size = b * (self.config.context_segments - 1)
    owner = np.zeros((size,), np.int32)
    owner[:len(self.saved)] = [r for r, _ in self.saved]
    seg = jax.tree.map(lambda x: np.asarray(x)[owner].copy(), batch)
    for name in ("tokens", "attention_mask", "loss_mask", "turn", "behavior_logprobs",
                 "token_version", "action_part"):
      field = getattr(seg, name)
      field[len(self.saved):] = -1 if name in ("turn", "token_version") else 0
      for j, (_, kept) in enumerate(self.saved):
        field[j] = kept[name]
    return seg.replace(segment_of=owner)


  def rewritten(self, batch_size: int) -> list[tuple[int, list[int], int]]:
    """Every segment that starts from a rewritten context, as `(its row in join_segments(batch,
    segments), the ids full would hold before its first turn, the length of its rewritten
    context)`: the pairs `rewrite_pairs` compares."""
    rows: dict[int, list[int]] = {}  # episode row -> the joined rows of its segments, in order
    for j, (r, _) in enumerate(self.saved):
      rows.setdefault(r, []).append(batch_size + j)
    out = []
    seen: dict[int, int] = {}
    for r, history, length in self.rewrites:
      k = seen[r] = seen.get(r, 0) + 1  # the k-th rewrite of row r starts its segment k
      order = rows[r] + [r]
      out.append((order[k], history, length))
    return out


def rewrite_pairs(rows: EpisodeBatch, rewritten, length: int):
  """`(rewritten, unrewritten)` host `EpisodeBatch`es of `len(rewritten)` rows each (`rewritten`
  from `Segmenter.rewritten`; `rows` the joined batch): row `i` of the first is segment
  `rewritten[i]`'s row as the policy saw it; of the second, the same turns after the history `full`
  would hold instead (`length` tokens wide). Both have loss 1 on the segment's own sampled tokens
  only, so their log-probs there compare the policy with and without the rewrite."""
  n = len(rewritten)
  width = rows.context_length
  out = [empty(n, width, rows.max_steps), empty(n, length, rows.max_steps)]
  for i, (j, history, start) in enumerate(rewritten):
    end = int(np.asarray(rows.attention_mask[j]).sum())
    own = np.asarray(rows.tokens[j][start:end])
    own_loss = np.asarray(rows.loss_mask[j][start:end], bool)
    own_turn = np.asarray(rows.turn[j][start:end])
    for batch, prefix in ((out[0], np.asarray(rows.tokens[j][:start])), (out[1], history)):
      ids = np.concatenate([np.asarray(prefix, np.int32), own]).astype(np.int32)
      if len(ids) > batch.context_length:
        raise ValueError(f"rewrite_pairs: segment row {j} needs {len(ids)} tokens without the "
                         f"rewrite; pass a length of at least that.")
      p = len(prefix)
      batch.tokens[i, :len(ids)] = ids
      batch.attention_mask[i, :len(ids)] = True
      batch.loss_mask[i, p:len(ids)] = own_loss
      batch.turn[i, p:len(ids)] = own_turn
      batch.positions[i] = np.arange(batch.context_length)
  return out[0], out[1]


def offload_pairs(rows: EpisodeBatch, env, codec, tasks, length: int):
  """`(as_seen, inline)` host `EpisodeBatch`es for a batch sampled in `offload` mode (`env` the
  run's `envs.notebook.Notebook`, `tasks[j]` row `j`'s task): row `j` of the first is row `j` as
  the policy saw it; of the second, the same sampled turns with every offloaded output inline
  (the environment's text where the stub was; `length` tokens wide). Both have loss 1 on the
  sampled tokens, so their log-probs there compare the policy with and without the offload.

  The inline text comes from replaying the row's actions on a fresh copy of `env` (reset with
  the row's task and `env_seed`); a replay whose observations differ from the row's raises
  `ValueError` (the environment is not a function of its task, seed and actions)."""
  make = factory_of(env)
  n = rows.batch_size
  out = [empty(n, rows.context_length, rows.max_steps), empty(n, length, rows.max_steps)]
  for j in range(n):
    tokens, turn = np.asarray(rows.tokens[j]), np.asarray(rows.turn[j])
    loss, live = np.asarray(rows.loss_mask[j], bool), np.asarray(rows.attention_mask[j], bool)
    seen = [(tokens[live & (turn == -1)], False)]
    inline = list(seen)
    replay = make()
    try:
      replay.reset(tasks[j], int(rows.env_seed[j]))
      for t in range(int(rows.num_steps[j])):
        action, obs = tokens[loss & (turn == t)], tokens[live & ~loss & (turn == t)]
        result = replay.step(codec.action_text(action))
        if not obs.size:  # the last step: no observation appended
          seen.append((action, True))
          inline.append((action, True))
          continue
        rendered = codec.render_observation(result.observation)
        if len(obs) < len(rendered) or obs[len(obs) - len(rendered):].tolist() != rendered:
          raise ValueError(f"offload_pairs: row {j} step {t}: the replayed observation "
                           f"{result.observation!r} is not the one the row holds; the environment "
                           "did not repeat the episode from its task, seed and actions.")
        head = obs[:len(obs) - len(rendered)]  # a forced end of turn, if any
        note = result.info.get("offloaded_note")
        full = obs if note is None else np.concatenate(
            [head, codec.render_observation(replay.notes[note])]).astype(np.int32)
        seen += [(action, True), (obs, False)]
        inline += [(action, True), (full, False)]
    finally:
      replay.close()
    for batch, parts in ((out[0], seen), (out[1], inline)):
      ids = np.concatenate([p for p, _ in parts]).astype(np.int32)
      if len(ids) > batch.context_length:
        raise ValueError(f"offload_pairs: row {j} needs {len(ids)} tokens with its outputs "
                         "inline; pass a length of at least that.")
      batch.tokens[j, :len(ids)] = ids
      batch.attention_mask[j, :len(ids)] = True
      batch.loss_mask[j, :len(ids)] = np.concatenate([np.full(len(p), l) for p, l in parts])
      batch.positions[j] = np.arange(batch.context_length)
  return out[0], out[1]


_MARK = "\u2063SUMMARY\u2063"  # where the summary goes in the prompt's framing


def summary_request(style: str) -> str:
  """What is appended after the observation to ask the policy for its summary (compact: words of
  every codec's vocabulary)."""
  return " text :" if style == "compact" else " Summarise the state in one line:"


def segment_keys(base_keys, index) -> jax.Array:
  """`[B]` sampling keys: row `r`'s `base_keys[r]` in its first segment, folded with its segment
  `index[r]` after."""
  index = jnp.asarray(index, jnp.uint32)
  folded = jax.vmap(jax.random.fold_in)(base_keys, index)
  data = jnp.where((index > 0)[:, None], jax.random.key_data(folded),
                   jax.random.key_data(base_keys))
  return jax.random.wrap_key_data(data)
