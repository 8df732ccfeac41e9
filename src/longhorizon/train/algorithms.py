"""The algorithm registry: how each learner turns an `EpisodeBatch` into token advantages.

Every algorithm is a small function `(batch, values, options) -> Advantages` plus its defaults;
choose by name (`ALGORITHMS[name]`), add one by registering a function. All of them:

* exclude episodes with an environment error (`batch.trainable`) from statistics and from the loss;
* apply the group filters first: `filter_zero_std` drops task groups whose scores are all equal
  (DAPO dynamic sampling: they carry no signal for group-relative estimators), and
  `keep_top_groups < 1` keeps only that fraction of groups with the largest score std (RAGEN);
  dropped rows get loss weight 0 (shapes never change, so nothing recompiles);
* return per-token advantages `[B, L]` (0 off the loss mask) and the row weights `[B]`.

| name | advantage | critic |
|---|---|---|
| `grpo` | `(s - mean_g) / (std_g + eps)` on every token | no |
| `drgrpo` | `s - mean_g` (Dr.GRPO; pair with `seq-mean-token-sum-norm`) | no |
| `rloo` | leave-one-out baseline | no |
| `reinforce_pp` | REINFORCE++-baseline (group mean, token returns, batch whitening) | no |
| `gigpo` | episode + anchor-state step-group advantages | no |
| `ppo` | GAE on a critic: over tokens or turns (`unit`), VAPO's length-adaptive lambda (length in tokens or turns), or bi-level GAE | yes |
| `vine` | branch trees: `Q(s_t, a_t) - V(s_t)` from Monte-Carlo means over the rows through each state / action (VinePPO) | no |
| `branch` | branch trees: the row's return minus the mean return from the same state | no |
| `tree_grpo` | branch trees: GRPO over the task group plus exact step groups of sibling actions (Tree-GRPO) | no |
| `tree_critic` | branch trees: a critic trained on the tree's Monte-Carlo state values; `A_t = V(s_{t+1}) - V(s_t)` | yes |

The three tree estimators (`core/tree_advantages.py`) read `parent` / `branch_step`
(`rollout.branch_k > 0`); a branch's copied prefix never trains (its loss mask is 0 there).

`time_discount > 0` replaces the constant step discount of `gigpo` and of `ppo` with `unit='turn'`
by `exp(-time_discount * d)` per step, `d` the step's measured latency or its cost
(`turn_advantages.time_discounts`).

`step_verifier` ("milestone": the step reached a new milestone; "oracle": the step's action was
the oracle's, `EpisodeBatch.oracle_match`) adds `verifier_weight` times the verifier's
group-relative step advantage (`turn_advantages.verifier_advantages`) to a critic-free estimator's
advantages: step-local credit that is never folded into the outcome reward.

`part_weights` (text, tool name, arguments, final answer) multiplies each policy token's advantage
by the weight of the action part it belongs to (`EpisodeBatch.action_part`, labelled by the
rollout when a weight is not 1): hierarchical credit over the parts of a tool call.

`critic` chooses how `ppo` and `tree_critic` parameterise their critic: "separate" (a `Critic` with
its own trunk and optimiser step) or "shared" (a value head on the policy's trunk whose value loss
is part of the policy's loss; `train/update.py`). Critic-free estimators refuse "shared".

`empg=True` modulates the step advantages of a critic-free estimator by the policy's step entropy
(EMPG, `turn_advantages.empg`); the learner then computes per-token entropies before the update.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.core import advantages as adv
from longhorizon.core import tree_advantages as tree_adv
from longhorizon.core import turn_advantages as turn_adv
from longhorizon.core.episode import EpisodeBatch
from longhorizon.envs.action_parts import PART_NAMES
from longhorizon.train.options import (DISCOUNT, NON_NEGATIVE, POSITIVE, Options, Range, fail,
                                       option)

__all__ = ["ALGORITHMS", "ADVANTAGE_KINDS", "STEP_VERIFIERS", "Algorithm", "Advantages",
           "AlgorithmOptions",
           "compute_advantages", "group_filter", "register"]


ADVANTAGE_KINDS = ("gae", "length_adaptive_gae", "bilevel_gae")  # ppo's advantage (see `_ppo`)
UNITS = ("token", "turn")  # what one step of ppo's GAE recursion is
CRITICS = ("separate", "shared")  # how an algorithm with a critic parameterises it


@dataclasses.dataclass(frozen=True)
class AlgorithmOptions(Options):
  """The advantage estimator and its options (`config.algorithm`; frozen and hashable)."""
  SECTION = "algorithm"
  name: str = option("grpo", choices=lambda: sorted(ALGORITHMS))
  gamma: float = option(1.0, range=DISCOUNT)  # token/step discount (GAE, REINFORCE++)
  lam: float = option(0.95, range=DISCOUNT)  # GAE lambda (ppo with gae)
  advantage: str = option("gae", choices=ADVANTAGE_KINDS)  # ppo's advantage
  # ppo's gae / length_adaptive_gae recursion over policy tokens or over turns (then `gamma` and
  # `lam` are per turn, the critic's value of a turn is read at its first token)
  unit: str = option("token", choices=UNITS)
  # length-adaptive GAE: lambda = 1 - 1 / (alpha * L) (VAPO: L in tokens, alpha 0.05; with L in
  # turns an alpha near 1 gives lambda = 1 - 1/L)
  vapo_alpha: float = option(0.05, range=POSITIVE)
  vapo_length: str = option("tokens", choices=("tokens", "turns"))
  step_gamma: float = option(0.95, range=DISCOUNT)  # GiGPO step-return / bi-level turn discount
  step_lam: float = option(1.0, range=DISCOUNT)  # bi-level GAE: the turn-level lambda
  step_weight: float = option(1.0, range=NON_NEGATIVE)  # GiGPO weight of the step-level advantage
  normalize_std: bool = option(True)  # grpo/gigpo: divide by the group std
  filter_zero_std: bool = option(False)  # DAPO dynamic sampling: drop groups with equal scores
  # RAGEN: keep this fraction of groups with the largest score std
  keep_top_groups: float = option(1.0, range=Range(float, 0, 1, low_open=True,
                                                   note="a fraction of groups"))
  # EMPG (critic-free estimators): A' = g(H_s) A_s + zeta f(H_s'), g = exp(-k h) / mean, f =
  # exp(-k_future h), h the min-max normalised step entropy (`turn_advantages.empg`)
  empg: bool = option(False)
  empg_k: float = option(1.0, range=POSITIVE)
  empg_k_future: float = option(1.0, range=POSITIVE)
  empg_zeta: float = option(0.05, range=NON_NEGATIVE)
  # Time- and cost-aware discounting: each step discounted by exp(-time_discount * d), d its
  # measured latency in seconds or its cost (`time_source`), instead of the constant step discount
  # (ppo with unit='turn': gamma; gigpo: step_gamma). 0 = off.
  time_discount: float = option(0.0, range=NON_NEGATIVE)
  time_source: str = option("latency", choices=("latency", "cost"))
  # A step verifier's judgement (`STEP_VERIFIERS`: "milestone", "oracle"; "" = off) as a
  # group-relative step advantage added with this weight to a critic-free estimator's, not folded
  # into the outcome reward (`turn_advantages.verifier_advantages`).
  step_verifier: str = option("", choices=lambda: ("",) + tuple(sorted(STEP_VERIFIERS)))
  verifier_weight: float = option(0.5, range=NON_NEGATIVE)
  # Hierarchical credit: loss weights of the action's parts (text, tool name, arguments, final
  # answer; `envs.action_parts`), multiplying each policy token's advantage; all 1 = off (the
  # rollout then does not label parts).
  part_weights: tuple = option((1.0, 1.0, 1.0, 1.0))
  # The critic of an algorithm that has one (ppo, tree_critic): "separate" = its own decoder trunk
  # and value head, trained by its own loss and optimiser (optim.critic_learning_rate); "shared" =
  # a value head on the policy's trunk, its value loss (loss.value_coef) part of the policy's loss,
  # so its gradient reaches the trunk (`train/update.py`).
  critic: str = option("separate", choices=CRITICS)

  def check(self):
    w = self.part_weights
    if (not isinstance(w, (tuple, list)) or len(w) != len(PART_NAMES)
        or not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in w)):
      fail("algorithm.part_weights", w, f"{len(PART_NAMES)} finite weights >= 0 for the parts "
           f"{PART_NAMES}")
    if self.critic == "shared" and not self.spec.needs_critic:
      with_critic = sorted(n for n, a in ALGORITHMS.items() if a.needs_critic)
      fail("algorithm.critic", self.critic,
           f"'separate' (the default) for algorithm.name={self.name!r}, which has no critic; "
           f"'shared' (a value head on the policy trunk) applies to {with_critic}")

  @property
  def labels_parts(self) -> bool:
    """Whether the rollout must label each token's action part (some part weight is not 1)."""
    return any(float(x) != 1.0 for x in self.part_weights)

  @property
  def spec(self) -> "Algorithm":
    return ALGORITHMS[self.name]


class Advantages(NamedTuple):
  advantages: jax.Array  # [B, L] float32 per-token advantages (0 off the loss mask)
  returns: jax.Array | None  # [B, L] value targets (ppo) or None
  row_weight: jax.Array  # [B] float32 1 for rows in the loss, 0 for filtered / env-error rows


@dataclasses.dataclass(frozen=True)
class Algorithm:
  name: str
  fn: Callable[[EpisodeBatch, jax.Array | None, AlgorithmOptions, jax.Array], Advantages]
  needs_critic: bool = False
  default_agg: str = "token-mean"
  # Rollouts per task the estimator needs to give a non-zero advantage: 2 for the group-relative
  # ones (a group of one is its own baseline: every advantage is 0 and nothing is learned).
  min_group_size: int = 1
  # Needs branch rollouts (rollout.branch_k > 0): without branches its steps after the first have
  # no baseline but the row itself, and get advantage 0.
  needs_branches: bool = False
  # Reads the batch's branch tree (`parent`, `branch_step`; core/tree_advantages.py).
  reads_tree: bool = False


ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
  if algorithm.name in ALGORITHMS:
    raise ValueError(f"algorithm {algorithm.name!r} is already registered.")
  ALGORITHMS[algorithm.name] = algorithm
  return algorithm


def group_filter(scores, groups, valid, options: AlgorithmOptions) -> jax.Array:
  """`[B]` float32 row weights after the DAPO / RAGEN group filters (see the module docstring)."""
  scores, groups = jnp.asarray(scores, jnp.float32), jnp.asarray(groups, jnp.int32)
  valid = jnp.asarray(valid, bool)
  b = scores.shape[0]
  ids = adv.step_group_ids(groups, jnp.zeros((b, 1), jnp.uint32))[:, 0]
  w = valid.astype(jnp.float32)
  count = jax.ops.segment_sum(w, ids, num_segments=b)
  mean = jax.ops.segment_sum(w * scores, ids, num_segments=b) / jnp.maximum(count, 1)
  var = jax.ops.segment_sum(w * (scores - mean[ids]) ** 2, ids, num_segments=b) / jnp.maximum(count, 1)
  std = jnp.sqrt(var)
  keep = valid
  if options.filter_zero_std:
    keep = keep & (std[ids] > 1e-6)
  if options.keep_top_groups < 1.0:
    present = count > 0
    n_groups = present.sum()
    n_keep = jnp.maximum(jnp.ceil(options.keep_top_groups * n_groups), 1).astype(jnp.int32)
    # Rank groups by std (ties by id); keep the n_keep largest.
    order = jnp.argsort(jnp.where(present, -std, jnp.inf), stable=True)
    rank = jnp.zeros((b,), jnp.int32).at[order].set(jnp.arange(b, dtype=jnp.int32))
    keep = keep & (rank[ids] < n_keep)
  return keep.astype(jnp.float32)


def _outcome(per_row, batch, weight):
  mask = jnp.asarray(batch.loss_mask, jnp.float32) * weight[:, None]
  return Advantages(per_row[:, None] * mask, None, weight)


def _grpo(batch, values, options, weight, normalize_std=None):
  del values
  ns = options.normalize_std if normalize_std is None else normalize_std
  a = adv.grpo(batch.score, batch.group, normalize_std=ns, valid=weight > 0)
  return _outcome(a, batch, weight)


def _drgrpo(batch, values, options, weight):
  return _grpo(batch, values, options, weight, normalize_std=False)


def _rloo(batch, values, options, weight):
  del values
  return _outcome(adv.rloo(batch.score, batch.group, valid=weight > 0), batch, weight)


def _reinforce_pp(batch, values, options, weight):
  del values
  mask = jnp.asarray(batch.loss_mask, bool) & (weight[:, None] > 0)
  a, _ = adv.reinforce_pp_baseline(batch.token_rewards(), mask, batch.group, gamma=options.gamma,
                                valid=weight > 0)
  return Advantages(a * mask, None, weight)


def _step_discount(batch, options, constant):
  """The step discount: `constant`, or per step from its latency or cost (`time_discount`)."""
  if not options.time_discount:
    return constant
  durations = batch.latency if options.time_source == "latency" else batch.cost
  return turn_adv.time_discounts(durations, batch.step_mask, options.time_discount)


def _gigpo(batch, values, options, weight):
  del values
  step_adv = adv.gigpo(batch.score, batch.rewards, batch.step_mask, batch.group, batch.anchor,
                       gamma=_step_discount(batch, options, options.step_gamma), step_weight=options.step_weight,
                       normalize_std=options.normalize_std, valid=weight > 0)
  tokens = adv.broadcast_steps(step_adv, batch.turn)
  mask = jnp.asarray(batch.loss_mask, jnp.float32) * weight[:, None]
  return Advantages(tokens * mask, None, weight)


def _ppo(batch, values, options, weight):
  if values is None:
    raise ValueError("ppo needs critic values; set config.algorithm.name='ppo' with a critic.")
  mask = jnp.asarray(batch.loss_mask, bool) & (weight[:, None] > 0)
  if options.advantage not in ADVANTAGE_KINDS:
    raise ValueError(f"algorithm.advantage must be one of {ADVANTAGE_KINDS}, got "
                     f"{options.advantage!r}.")
  if options.advantage == "bilevel_gae":
    a, returns = turn_adv.bilevel_gae(batch.rewards, _steps_in_loss(batch, weight), values,
                                      batch.turn, mask, gamma=options.gamma, lam=options.lam,
                                      turn_gamma=options.step_gamma, turn_lam=options.step_lam)
  elif options.unit == "turn":
    a, returns = _turn_gae(batch, values, options, weight, mask)
  elif options.advantage == "length_adaptive_gae" and options.vapo_length == "tokens":
    a, returns = adv.length_adaptive_gae(batch.token_rewards(), values, mask, gamma=options.gamma,
                                         alpha=options.vapo_alpha)
  else:  # token GAE with lam, or with VAPO's lambda from the number of turns (critic lambda 1)
    critic_lam = 1.0 if options.advantage == "length_adaptive_gae" else None
    a, returns = adv.gae(batch.token_rewards(), values, mask, gamma=options.gamma,
                         lam=_lambda(batch, options, mask), critic_lam=critic_lam)
  a = adv.masked_whiten(a, mask)
  return Advantages(a * mask, returns * mask, weight)


def _steps_in_loss(batch, weight):
  return jnp.asarray(batch.step_mask, bool) & (weight[:, None] > 0)


def _lambda(batch, options, mask):
  """ppo's GAE lambda: `lam`, or VAPO's per-row length-adaptive one (length in tokens or turns)."""
  if options.advantage != "length_adaptive_gae":
    return options.lam
  if options.vapo_length == "turns":
    length = jnp.sum(jnp.asarray(batch.step_mask, bool) & jnp.any(mask, axis=1, keepdims=True), -1)
  else:
    length = jnp.sum(mask, axis=-1)
  return turn_adv.adaptive_lambda(length, options.vapo_alpha)


def _turn_gae(batch, values, options, weight, mask):
  """GAE over turns, broadcast to each turn's policy tokens (advantages and value targets)."""
  steps = _steps_in_loss(batch, weight)
  step_values = turn_adv.turn_start_values(values, batch.turn, mask, steps)
  # VAPO's critic uses lambda 1 (Monte-Carlo targets); plain GAE its own lambda.
  critic_lam = 1.0 if options.advantage == "length_adaptive_gae" else None
  a, returns = turn_adv.turn_gae(batch.rewards, step_values, steps,
                                 gamma=_step_discount(batch, options, options.gamma),
                                 lam=_lambda(batch, options, mask), critic_lam=critic_lam)
  return adv.broadcast_steps(a, batch.turn), adv.broadcast_steps(returns, batch.turn)


def _tree(estimator):
  """A tree estimator's `[B, S]` step advantages on the tokens of each row's own steps."""

  def fn(batch, values, options, weight):
    del values
    args = (batch.score, batch.group, batch.parent, batch.branch_step, batch.step_mask)
    if estimator is tree_adv.tree_grpo_advantages:
      step_adv = estimator(*args, valid=weight > 0, step_weight=options.step_weight,
                           normalize_std=options.normalize_std)
    else:
      step_adv = estimator(*args, valid=weight > 0)
    own = tree_adv.own_steps(batch.parent, batch.branch_step, batch.step_mask)
    tokens = adv.broadcast_steps(jnp.where(own, step_adv, 0.0), batch.turn)
    mask = jnp.asarray(batch.loss_mask, jnp.float32) * weight[:, None]
    return Advantages(tokens * mask, None, weight)

  return fn


def _tree_critic(batch, values, options, weight):
  """A learned step value trained from branch outcomes: the critic's target at every turn is the
  tree's Monte-Carlo value of the turn's state, and each step's advantage is the change of the
  learned value it caused, `A_t = V(s_{t+1}) - V(s_t)` (the episode's score after its last step),
  whitened; a branch's copied steps get none."""
  if values is None:
    raise ValueError("tree_critic needs critic values (its learned step values).")
  mask = jnp.asarray(batch.loss_mask, bool) & (weight[:, None] > 0)
  steps = _steps_in_loss(batch, weight)
  step_values = turn_adv.turn_start_values(values, batch.turn, mask, steps)
  last = jnp.arange(steps.shape[1])[None, :] == (jnp.sum(steps, -1, keepdims=True) - 1)
  outcome = jnp.where(last & steps, jnp.asarray(batch.score, jnp.float32)[:, None], 0.0)
  a, _ = turn_adv.turn_gae(outcome, step_values, steps, gamma=1.0, lam=0.0)
  targets, _, _, _ = tree_adv.tree_values(batch.score, batch.group, batch.parent,
                                          batch.branch_step, batch.step_mask, valid=weight > 0)
  own = tree_adv.own_steps(batch.parent, batch.branch_step, batch.step_mask)
  a = adv.broadcast_steps(jnp.where(own, a, 0.0), batch.turn)
  a = adv.masked_whiten(a, mask)
  return Advantages(a * mask, adv.broadcast_steps(targets, batch.turn) * mask, weight)


register(Algorithm("grpo", _grpo, min_group_size=2))
register(Algorithm("drgrpo", _drgrpo, default_agg="seq-mean-token-sum-norm", min_group_size=2))
register(Algorithm("rloo", _rloo, min_group_size=2))
register(Algorithm("reinforce_pp", _reinforce_pp, min_group_size=2))
register(Algorithm("gigpo", _gigpo, min_group_size=2))
register(Algorithm("ppo", _ppo, needs_critic=True))
register(Algorithm("vine", _tree(tree_adv.vine_advantages), min_group_size=2, needs_branches=True,
                   reads_tree=True))
register(Algorithm("branch", _tree(tree_adv.branch_advantages), min_group_size=2,
                   needs_branches=True, reads_tree=True))
register(Algorithm("tree_grpo", _tree(tree_adv.tree_grpo_advantages), min_group_size=2,
                   reads_tree=True))
register(Algorithm("tree_critic", _tree_critic, needs_critic=True, needs_branches=True,
                   reads_tree=True))


def _milestone_scores(batch):
  """1 on steps that reached a new milestone, 0 on the others; judged wherever a step happened."""
  return jnp.asarray(batch.milestones) != 0, jnp.asarray(batch.step_mask, bool)


def _oracle_scores(batch):
  """1 on steps whose action was the oracle's, 0 on the others; judged where recorded."""
  match = jnp.asarray(batch.oracle_match)
  return match == 1, jnp.asarray(batch.step_mask, bool) & (match >= 0)


# Rule-based step verifiers: `batch -> ([B, S] score, [B, S] judged)`.
STEP_VERIFIERS = {"milestone": _milestone_scores, "oracle": _oracle_scores}


def _verified(batch, out: Advantages, options: AlgorithmOptions) -> Advantages:
  """The estimator's advantages plus the weighted verifier step advantages on each step's tokens."""
  if options.spec.needs_critic:
    raise ValueError(f"algorithm.step_verifier adds step advantages to critic-free estimators; "
                     f"{options.name!r} has token-level advantages (use grpo, gigpo, rloo, ...).")
  scores, judged = STEP_VERIFIERS[options.step_verifier](batch)
  judged = (judged & _steps_in_loss(batch, out.row_weight)
            & tree_adv.own_steps(batch.parent, batch.branch_step, batch.step_mask))
  step_adv = turn_adv.verifier_advantages(scores.astype(jnp.float32), judged, batch.group,
                                          normalize_std=options.normalize_std)
  mask = jnp.asarray(batch.loss_mask, jnp.float32) * out.row_weight[:, None]
  extra = options.verifier_weight * adv.broadcast_steps(step_adv, batch.turn) * mask
  return out._replace(advantages=out.advantages + extra)


def compute_advantages(batch: EpisodeBatch, values, options: AlgorithmOptions,
                       entropy=None) -> Advantages:
  """Filters, then the estimator `options.name`, then the step verifier's advantages when
  `options.step_verifier`, then EMPG when `options.empg` (which needs the `[B, L]` per-token
  `entropy` of the policy that sampled the batch)."""
  weight = group_filter(batch.score, batch.group, batch.trainable, options)
  out = options.spec.fn(batch, values, options, weight)
  if options.step_verifier:
    out = _verified(batch, out, options)
  if options.labels_parts:
    weights = jnp.asarray(options.part_weights, jnp.float32)[jnp.asarray(batch.action_part)]
    out = out._replace(advantages=out.advantages * weights)
  if options.empg:
    out = _empg(batch, out, entropy, options)
  return out


def _empg(batch, out: Advantages, entropy, options: AlgorithmOptions) -> Advantages:
  """EMPG on the step means of the estimator's token advantages, placed back on the tokens."""
  if options.spec.needs_critic:
    raise ValueError(f"algorithm.empg modulates step advantages of critic-free estimators; "
                     f"{options.name!r} has token-level advantages (use grpo, gigpo, rloo, ...).")
  if entropy is None:
    raise ValueError("algorithm.empg needs the per-token entropy of the batch's policy.")
  mask = jnp.asarray(batch.loss_mask, bool) & (out.row_weight[:, None] > 0)
  steps = _steps_in_loss(batch, out.row_weight)
  step_adv = turn_adv.step_means(out.advantages, batch.turn, mask, steps)
  step_entropy = turn_adv.step_means(entropy, batch.turn, mask, steps)
  modulated = turn_adv.empg(step_adv, step_entropy, steps, k=options.empg_k,
                            k_future=options.empg_k_future, zeta=options.empg_zeta)
  return out._replace(advantages=adv.broadcast_steps(modulated, batch.turn) * mask)


def step_view(batch: EpisodeBatch) -> EpisodeBatch:
  """`batch`'s episodes as rows of one token per step (`L = S`): step `s` is token `s`, with the
  episode's step- and episode-level fields. A critic-free estimator's advantage of a token is a
  function of its row and step, so its advantages on this view are the episodes' step advantages
  whichever rows hold their tokens (the context segments of `segment_advantages`)."""
  steps = jnp.asarray(batch.step_mask, bool)
  b, s = steps.shape
  index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  zeros = jnp.zeros((b, s), jnp.int32)
  return batch.replace(
      tokens=zeros, positions=index, attention_mask=steps, loss_mask=steps,
      turn=jnp.where(steps, index, -1), behavior_logprobs=jnp.zeros((b, s), jnp.float32),
      token_version=jnp.where(steps, 0, -1), action_part=zeros, routing=None)


def segment_advantages(batch: EpisodeBatch, options: AlgorithmOptions) -> Advantages:
  """The advantages of a batch holding context segments (`EpisodeBatch.segment_of`; the episodes'
  last segments first, `episode.join_segments`): the estimator runs once per episode on the
  episodes' `step_view` (group statistics over episodes, not rows), and each row's tokens get
  their episode's advantage of their step; a row's weight is its episode's."""
  if options.spec.needs_critic or options.spec.reads_tree or options.empg or options.labels_parts:
    raise ValueError(f"context segments take critic-free per-step advantages; algorithm "
                     f"{options.name!r} with empg={options.empg}, part weights "
                     f"{options.part_weights} does not give them.")
  segment_of = jnp.asarray(batch.segment_of)
  n = int(np.sum(np.asarray(segment_of) < 0))
  episodes = jax.tree.map(lambda x: x[:n], batch)
  out = compute_advantages(step_view(episodes), None, options)
  owner = jnp.where(segment_of < 0, jnp.arange(batch.batch_size), segment_of)
  turn = jnp.asarray(batch.turn)
  mask = jnp.asarray(batch.loss_mask, jnp.float32)
  step_adv = out.advantages[owner]  # [B, S]
  tokens = jnp.take_along_axis(step_adv, jnp.clip(turn, 0, step_adv.shape[1] - 1), axis=1)
  return Advantages(tokens * mask, None, out.row_weight[owner])
