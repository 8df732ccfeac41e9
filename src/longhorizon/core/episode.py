"""`EpisodeBatch`: the fixed-shape, token-exact record of a batch of multi-turn episodes.

One row per episode. `L` is the context budget (tokens), `S` the maximum number of environment steps.
The rollout loop writes it, filters and reward code read it, the learner trains on it. Tokens are the
exact ids the policy saw and produced; nothing is re-tokenised from text.

The schema is written once: each array field declares its dims and dtype (`_array("B L", np.int32)`);
`validate` checks against those declarations and `empty` builds from them.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any, Mapping, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.core import advantages as _advantages

__all__ = ["EpisodeBatch", "Termination", "RECOVERY", "bucket_length", "empty", "episodes_only",
           "join_segments", "num_episodes", "shared_prefix_length", "to_device", "trim",
           "used_length",
           "without_empty_segments", "place_step_rewards", "broadcast_steps"]

# Re-exported: the two step <-> token helpers belong with the data model as much as with the math.
place_step_rewards = _advantages.place_step_rewards
broadcast_steps = _advantages.broadcast_steps


class Termination(enum.IntEnum):
  """How an episode ended (`EpisodeBatch.termination`). Kinds are kept distinct: a timeout is not a
  failure, and an environment error is not the policy's fault (excluded from the loss)."""
  RUNNING = 0  # not finished (only in partial batches)
  SUCCESS = 1
  FAILURE = 2  # the environment ended the episode unsuccessfully
  TIMEOUT = 3  # step limit reached (truncated)
  CONTEXT_OVERFLOW = 4  # context budget exhausted (truncated)
  SAFETY_STOP = 5  # a safety gate was hit (terminated, hard failure)
  ENV_ERROR = 6  # infrastructure failure (tool crash, injected fault)


class _Spec(NamedTuple):
  """One array field of `EpisodeBatch`: its dims (letters of `B`, `L`, `S`), its dtype, and its value
  in `empty()`. `validate` accepts the dtype's kind, and 0/1 integers for a bool field."""
  dims: tuple[str, ...]
  dtype: np.dtype
  fill: int = 0


def _array(dims: str, dtype, fill: int = 0):
  """An array field of shape `dims` (`"B L"`) and dtype `dtype`: what `validate` and `empty` read."""
  return flax.struct.field(metadata={"spec": _Spec(tuple(dims.split()), np.dtype(dtype), fill)})


@flax.struct.dataclass
class EpisodeBatch:
  """A padded batch of `B` episodes. Shapes: `L` tokens (context budget), `S` environment steps."""
  # Token level.
  tokens: Any = _array("B L", np.int32)  # exact token ids (prompt, actions, observations, padding)
  positions: Any = _array("B L", np.int32)  # position ids fed to the model
  attention_mask: Any = _array("B L", bool)  # 1 on real tokens, 0 on padding
  loss_mask: Any = _array("B L", bool)  # 1 on exactly the policy-sampled tokens (turn ends included)
  turn: Any = _array("B L", np.int32, fill=-1)  # step index of each token; -1 on prompt and padding
  behavior_logprobs: Any = _array("B L", np.float32)  # sampler log-probs on sampled tokens, else 0
  # The policy version that sampled each token (`policy_version` of a whole episode, unless the
  # episode continued across weight updates: `rollout.continue_partial`); -1 off the loss mask, and
  # on it in batches stored before the field existed (unknown).
  token_version: Any = _array("B L", np.int32, fill=-1)
  # The part of the action each policy token belongs to (`envs.action_parts`: 0 text, 1 tool name,
  # 2 arguments, 3 final answer); labelled when `RolloutConfig.label_parts`, else 0.
  action_part: Any = _array("B L", np.int32)
  # Step level.
  rewards: Any = _array("B S", np.float32)  # per-step reward (composed; see reward components)
  step_mask: Any = _array("B S", bool)  # 1 on steps that happened
  anchor: Any = _array("B S", np.uint32)  # hash of the env state the step's action was taken in
  milestones: Any = _array("B S", np.int32)  # bit m: milestone m first reached at this step
  cost: Any = _array("B S", np.float32)  # cost of the step (tool/time/token cost)
  # Wall seconds of the step's environment call as the pool measured it (retries and rate-limit
  # waits included); 0 for JAX environments, which step every row in one call.
  latency: Any = _array("B S", np.float32)
  violation: Any = _array("B S", bool)  # a safety gate was hit at this step
  # The step's action against the oracle's in the same state (a rule-based step verifier; recorded
  # when `RolloutConfig.record_oracle` or a branch rule needs it): 1 the same, 0 different, -1 not
  # recorded.
  oracle_match: Any = _array("B S", np.int32, fill=-1)
  env_error: Any = _array("B S", bool)  # the env failed at this step (not the policy's fault)
  # Episode level.
  group: Any = _array("B", np.int32)  # task-group label (rollouts of one task share it)
  success: Any = _array("B", bool)  # the verifier accepted the final state
  terminated: Any = _array("B", bool)  # ended in a terminal state (success, failure, safety stop)
  truncated: Any = _array("B", bool)  # cut off (step limit, context budget); not a failure
  termination: Any = _array("B", np.int32)  # `Termination` kind
  num_steps: Any = _array("B", np.int32)  # number of steps taken (== step_mask.sum(-1))
  score: Any = _array("B", np.float32)  # episode reward used by outcome estimators (GRPO, RLOO, ...)
  policy_version: Any = _array("B", np.int32)  # version of the parameters that sampled the episode
  env_version: Any = _array("B", np.int32)  # env names/versions/params hash (rollout.env_version)
  reward_version: Any = _array("B", np.int32)  # RewardConfig values hash (rollout.reward_version)
  env_seed: Any = _array("B", np.uint32)  # environment-dynamics seed
  task_seed: Any = _array("B", np.uint32)  # task-generation seed
  sampling_seed: Any = _array("B", np.uint32)  # policy-sampling seed
  # Branch rollouts (`rollout.collect` with `branch_k > 0`): row `i` was forked from row
  # `parent[i]` (an index into this batch, smaller than `i`) just before that row's step
  # `branch_step[i]`: it shares the parent's states and actions of the steps before, which it holds
  # as copies with loss_mask 0 (they are the parent's to train on). -1 / -1 for a root episode.
  # A recovery episode (`rollout.recovery_groups`) has parent RECOVERY (-2): it started before
  # step `branch_step[i]` from the saved state of an earlier batch's failed episode, whose steps
  # before it holds as copies with loss_mask 0 (that batch trained on them).
  parent: Any = _array("B", np.int32, fill=-1)
  branch_step: Any = _array("B", np.int32, fill=-1)
  # Context segments (`config.context.mode` window / summary, `rollout/context.py`): an episode
  # whose context was rewritten is held as several rows, each the exact tokens the policy saw in
  # one segment of it. -1 on the row of the episode's last (or only) segment, which all the step-
  # and episode-level fields describe; on an earlier segment's row, the index of that last
  # segment's row, whose step- and episode-level fields it repeats (it trains on its own tokens
  # with the episode's return, group and step credit). Rows with no attended token pad the batch.
  segment_of: Any = _array("B", np.int32, fill=-1)
  reward_components: Mapping[str, Any] = flax.struct.field(default_factory=dict)  # name -> [B] float32
  # Mixture-of-experts policies: `[B, L, layers, k]` int32, the experts the sampler routed each token
  # to (0 on padding); the learner replays them (routing replay, R3). None otherwise.
  routing: Any = None

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @property
  def context_length(self) -> int:
    return self.tokens.shape[1]

  @property
  def max_steps(self) -> int:
    return self.rewards.shape[1]

  @property
  def trainable(self):
    """`[B]` bool: episodes that may enter the loss (those without an environment error)."""
    return ~jnp.any(jnp.asarray(self.env_error), axis=-1)

  def token_rewards(self):
    """`[B, L]` float32: each step's reward on the last policy token of that step."""
    return place_step_rewards(self.rewards, self.turn, self.loss_mask)

  def validate(self) -> "EpisodeBatch":
    """Checks shapes, dtypes and the invariants between fields on the host; returns `self`.

    Raises:
      ValueError naming the first inconsistent field, what was expected and what was found.
    """
    fields = {name: np.asarray(getattr(self, name)) for name in _SCHEMA}
    dims = _infer_dims(fields)
    b, s = dims["B"], dims["S"]
    for name, spec in _SCHEMA.items():
      want = tuple(dims[d] for d in spec.dims)
      got = fields[name].shape
      if got != want:
        raise ValueError(f"EpisodeBatch.{name}: expected shape {_fmt(spec.dims, want)}, got {got}.")
      kind = _KINDS[spec.dtype.kind]
      if fields[name].dtype.kind not in kind:
        raise ValueError(f"EpisodeBatch.{name}: expected dtype kind {_KIND_NAMES[kind]}, got "
                         f"{fields[name].dtype}.")
    for name, value in self.reward_components.items():
      if np.shape(value) != (b,):
        raise ValueError(f"EpisodeBatch.reward_components[{name!r}]: expected shape [B]=({b},), got "
                         f"{np.shape(value)}.")
    for name in (name for name, spec in _SCHEMA.items() if spec.dtype == bool):
      values = fields[name]
      if values.dtype.kind != "b" and not np.isin(values, (0, 1)).all():
        raise ValueError(f"EpisodeBatch.{name}: expected 0/1 values, got {np.unique(values)[:8]}.")
    if self.routing is not None and (np.ndim(self.routing) != 4
                                     or np.shape(self.routing)[:2] != (b, dims["L"])):
      raise ValueError(f"EpisodeBatch.routing: expected shape [B, L, layers, k] with [B, L]="
                       f"({b}, {dims['L']}), got {np.shape(self.routing)}.")
    loss_mask, attention = fields["loss_mask"] != 0, fields["attention_mask"] != 0
    turn, step_mask = fields["turn"], fields["step_mask"] != 0
    _check(not (loss_mask & ~attention).any(), "loss_mask", "is 1 on padding (attention_mask 0)")
    _check(((turn >= -1) & (turn < s)).all(), "turn", f"has values outside [-1, S={s})")
    _check(not (loss_mask & (turn < 0)).any(), "loss_mask", "is 1 on tokens with turn -1")
    _check(not (~attention & (turn >= 0)).any(), "turn", "is >= 0 on padding")
    num_steps = fields["num_steps"]
    _check((step_mask.sum(-1) == num_steps).all(), "num_steps", "differs from step_mask.sum(-1)")
    _check((step_mask == (np.arange(s)[None] < num_steps[:, None])).all(), "step_mask",
           "is not a prefix of steps (1 for the first num_steps steps, 0 after)")
    _check_tree(fields["parent"], fields["branch_step"], fields["num_steps"])
    segment_of = fields["segment_of"]
    _check_segments(fields)
    policy_turn = np.where(loss_mask, turn, -1)
    has_tokens = (policy_turn[:, :, None] == np.arange(s)[None, None]).any(1)  # [B, S]
    earlier = np.flatnonzero(segment_of >= 0)  # an episode's steps' tokens are in all its rows
    np.logical_or.at(has_tokens, segment_of[earlier], has_tokens[earlier])
    has_tokens[earlier] = has_tokens[segment_of[earlier]]
    own = np.arange(s)[None, :] >= fields["branch_step"][:, None]  # a branch's copies have none
    _check(not (step_mask & own & ~has_tokens).any(), "step_mask",
           "marks a step without any policy token")
    _check(not (~step_mask & has_tokens).any(), "turn", "puts policy tokens in a step step_mask says "
           "did not happen")
    _check(not (fields["terminated"] & fields["truncated"]).any(), "terminated",
           "and truncated are both 1 in one row (they are exclusive)")
    kinds = fields["termination"]
    _check(np.isin(kinds, [int(k) for k in Termination]).all(), "termination",
           f"has values outside Termination ({[int(k) for k in Termination]})")
    _check((fields["success"] == (kinds == Termination.SUCCESS)).all(), "success",
           "disagrees with termination == SUCCESS")
    _check(((kinds == Termination.ENV_ERROR) <= fields["env_error"].any(-1)).all(), "termination",
           "is ENV_ERROR in a row without any env_error step")
    lp = fields["behavior_logprobs"]
    _check(np.isfinite(lp).all() and (lp <= 1e-6).all(), "behavior_logprobs",
           "has non-finite or positive values")
    _check(not (~loss_mask & (lp != 0)).any(), "behavior_logprobs", "is non-zero off the loss_mask")
    tv = fields["token_version"]
    _check(not (~loss_mask & (tv != -1)).any(), "token_version", "is not -1 off the loss_mask")
    _check((tv >= -1).all(), "token_version", "has values below -1")
    return self


# The array fields' declarations, in field order (`reward_components` is checked on its own).
_SCHEMA = {f.name: f.metadata["spec"] for f in dataclasses.fields(EpisodeBatch) if "spec" in f.metadata}
# Declared dtype kind -> the dtype kinds `validate` accepts (0/1 integers for a bool field).
_KINDS = {"b": "biu", "i": "iu", "u": "iu", "f": "f"}
_KIND_NAMES = {"iu": "integer", "f": "float", "b": "bool", "biu": "bool or integer"}


def _infer_dims(fields):
  """B, L and S as the sizes most fields agree on, so the one odd field is the one reported."""
  seen = {"B": [], "L": [], "S": []}
  for name, spec in _SCHEMA.items():
    dims, shape = spec.dims, fields[name].shape
    if len(shape) != len(dims):
      raise ValueError(f"EpisodeBatch.{name}: expected rank {len(dims)} ({_fmt(dims, '?')}), got shape "
                       f"{shape}.")
    for dim, size in zip(dims, shape):
      seen[dim].append(size)
  return {dim: collections.Counter(sizes).most_common(1)[0][0] for dim, sizes in seen.items()}


def _fmt(dims, values):
  return "[" + ", ".join(dims) + "]=" + str(values)


def _check_tree(parent, branch_step, num_steps):
  """The branch-rollout fields: roots have parent -1 and branch step -1; a branch's parent is an
  earlier row that took the branch step, which the branch took too; a recovery row (parent
  RECOVERY) started at a step in [0, its num_steps]."""
  b, root, recovery = len(parent), parent == -1, parent == RECOVERY
  _check(((parent >= RECOVERY) & (parent < np.arange(b))).all(), "parent",
         f"has values outside [{RECOVERY}, own row index)")
  _check((root == (branch_step < 0)).all() and (branch_step >= -1).all(), "branch_step",
         "is not -1 exactly on root rows (parent -1)")
  _check(not (recovery & (branch_step > num_steps)).any(), "branch_step",
         "is past the steps a recovery row (parent -2) holds")
  p = np.where(parent < 0, 0, parent)
  _check((root | recovery | ((branch_step < num_steps[p]) & (branch_step < num_steps))).all(),
         "branch_step", "is not a step both the branch and its parent took")


# `EpisodeBatch.parent` of a recovery episode: started from an earlier batch's saved state.
RECOVERY = -2

# The step- and episode-level fields an earlier segment's row repeats from its episode's last.
_EPISODE_FIELDS = tuple(name for name, spec in _SCHEMA.items()
                        if "L" not in spec.dims and name != "segment_of")


def _check_segments(fields):
  """Context segments: an earlier segment points to a last-segment row (segment_of -1) and repeats
  its step- and episode-level fields."""
  segment_of = fields["segment_of"]
  b, earlier = len(segment_of), np.flatnonzero(segment_of >= 0)
  _check(((segment_of >= -1) & (segment_of < b)).all(), "segment_of", "has values outside [-1, B)")
  if not len(earlier):
    return
  last = segment_of[earlier]
  _check((segment_of[last] == -1).all(), "segment_of",
         "points to a row that is itself an earlier segment (not its episode's last)")
  for name in _EPISODE_FIELDS:
    _check(np.array_equal(fields[name][earlier], fields[name][last]), name,
           "differs between an earlier context segment's row and its episode's last segment")


def _check(ok, field, problem):
  if not ok:
    raise ValueError(f"EpisodeBatch.{field} {problem}.")


def num_episodes(batch: EpisodeBatch) -> int:
  """Episodes in `batch`: its rows less the earlier context segments (`segment_of >= 0`), which
  come after every episode's last-segment row (`join_segments`)."""
  return int(np.sum(np.asarray(batch.segment_of) < 0))


def episodes_only(batch: EpisodeBatch) -> EpisodeBatch:
  """`batch` without the rows of earlier context segments: one row per episode (host)."""
  n = num_episodes(batch)
  if n == batch.batch_size:
    return batch
  return jax.tree.map(lambda x: np.asarray(x)[:n], batch)


def join_segments(batch: EpisodeBatch, segments: EpisodeBatch | None) -> EpisodeBatch:
  """The training rows of a segmented rollout: `batch` (one row per episode, its last context
  segment) followed by `segments` (`RolloutStats.segments`: the earlier segments, `segment_of`
  indexing `batch`'s rows). `batch` itself when `segments` is None (`context.mode` full)."""
  if segments is None:
    return batch
  if batch.routing is not None or segments.routing is not None:
    raise ValueError("join_segments: context segments of a mixture-of-experts policy with "
                     "routing replay are not supported (the re-prefilled segments' routing is not "
                     "recorded).")
  return jax.tree.map(lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)]), batch, segments)


def without_empty_segments(batch: EpisodeBatch, num_episodes: int, multiple: int = 1) -> EpisodeBatch:
  """A joined batch (`join_segments`, its first `num_episodes` rows the episodes) without the
  segment rows that hold no trained token (episodes with fewer segments than the fixed shape
  allows), keeping the first of them only as far as needed for a row count that is a multiple of
  `multiple` (minibatches). Episode rows and the kept segments' `segment_of` are unchanged. For
  one-off shapes (the warm start): the rollout's own batches keep one shape per update."""
  loss = np.asarray(batch.loss_mask).any(-1)
  empty_rows = np.flatnonzero(~loss[num_episodes:]) + num_episodes
  keep = np.flatnonzero(loss | (np.arange(batch.batch_size) < num_episodes))
  short = (-len(keep)) % max(1, int(multiple))
  if short > len(empty_rows):
    return batch
  keep = np.sort(np.concatenate([keep, empty_rows[:short]]))
  if len(keep) == batch.batch_size:
    return batch
  return jax.tree.map(lambda a: np.asarray(a)[keep], batch)


def used_length(batch: EpisodeBatch) -> int:
  """The token positions any row of `batch` uses: one past the last attended token (host)."""
  attended = np.asarray(batch.attention_mask).any(0)
  return int(np.flatnonzero(attended)[-1]) + 1 if attended.any() else 0


def bucket_length(used: int, full: int, buckets: int) -> int:
  """The smallest of `buckets` evenly spaced lengths `full/buckets, 2 full/buckets, ..., full`
  (rounded up to multiples of 8) that holds `used` tokens; `full` when `buckets` is 0 (off)."""
  if buckets <= 0 or used >= full:
    return full
  step = -(-full // buckets)
  step = -(-step // 8) * 8
  return min(full, max(1, -(-used // step)) * step)


def shared_prefix_length(batch: EpisodeBatch, multiple: int) -> int:
  """How many leading tokens a model pass may compute once for the whole batch (host): the
  positions where every row has the same token id and position id and attends, up to the first
  trained (`loss_mask`) token of any row, rounded down to a multiple of `multiple`; 0 when that is
  under `multiple`, when `multiple` is 0, or for a single row. Always less than the batch's
  length, and every trained token is scored from a hidden state at or after it
  (`Transformer(prefix_length=...)`)."""
  tokens = np.asarray(batch.tokens)
  if multiple <= 0 or tokens.shape[0] < 2:
    return 0
  positions = np.asarray(batch.positions)
  same = ((tokens == tokens[:1]).all(0) & (positions == positions[:1]).all(0)
          & np.asarray(batch.attention_mask).astype(bool).all(0))
  common = len(same) if same.all() else int(np.argmin(same))
  trained = (np.asarray(batch.loss_mask) > 0).any(0)
  first = int(np.argmax(trained)) if trained.any() else len(same)
  return min(common, first, tokens.shape[1] - 1) // multiple * multiple


def trim(batch: EpisodeBatch, length: int) -> EpisodeBatch:
  """`batch` with its token axis (the `L` fields) cut to the first `length` positions.

  Padding is on the right, so cutting after `used_length` drops only padding, and every per-token
  quantity of the kept positions is unchanged (causal attention: a token never sees the ones after
  it). Raises ValueError if the cut would drop an attended token.
  """
  used = used_length(batch)
  if length < used:
    raise ValueError(f"trim: length {length} would cut attended tokens (the batch uses {used} "
                     f"positions).")
  if length >= np.shape(batch.tokens)[1]:
    return batch
  cut = {name: getattr(batch, name)[:, :length] for name, spec in _SCHEMA.items() if "L" in spec.dims}
  if batch.routing is not None:
    cut["routing"] = batch.routing[:, :length]
  return batch.replace(**cut)


def empty(batch_size: int, context_length: int, max_steps: int) -> EpisodeBatch:
  """An all-padding batch with the declared dtypes (rollout code fills it in)."""
  sizes = {"B": batch_size, "L": context_length, "S": max_steps}
  return EpisodeBatch(**{name: np.full(tuple(sizes[d] for d in spec.dims), spec.fill, spec.dtype)
                         for name, spec in _SCHEMA.items()})


def to_device(batch: EpisodeBatch) -> EpisodeBatch:
  """Moves every field to the default device as JAX arrays."""
  return jax.tree_util.tree_map(jnp.asarray, batch)
