"""The policy-loss registry: how the learner scores the new policy's log-probs against an anchor.

Beside the advantage-estimator registry (`train/algorithms.py`); choose one by name in the config
(`config.loss.name`), add one with `register(PolicyLoss(...))` (its kernel lives in `core/losses.py`).

| name | loss | anchor (`old_logp`) |
|---|---|---|
| `ppo_clip` | PPO clipped ratio with clip-higher, dual clip and truncated-IS weights | proximal |
| `gspo` | PPO clipping on the length-normalised sequence ratio (GSPO-token) | proximal |
| `tis` | truncated importance-sampled policy gradient (V-trace's policy term, `C = tis_threshold`) | behaviour |

The anchor says what the learner passes as `old_logp`: `proximal` losses get the learner's policy
before this update (one extra forward pass; decoupled PPO when the batch is stale, with the
behaviour-to-proximal correction `min(pi_prox / pi_behav, tis_threshold)` as `is_weights` when
`tis_threshold > 0`), `behaviour` losses get the sampler's log-probs (no extra pass, no weights).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from longhorizon.core import losses
from longhorizon.core.losses import AGGREGATION_MODES, KL_ESTIMATORS
from longhorizon.train.options import (COUNT, NON_NEGATIVE, NON_NEGATIVE_INT, Options, Range, fail,
                                       option)

__all__ = ["LossOptions", "PolicyLoss", "POLICY_LOSSES", "ANCHORS", "register"]

ANCHORS = ("proximal", "behaviour")


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  name: str
  # (logp, old_logp, advantages, mask, is_weights, options, turn) -> (loss, metrics); all [B, L]
  # but the scalar loss and `options`, `is_weights` None when off; `turn` (the batch's turn ids) is
  # for the turn-level aggregation modes (`options.agg` in `losses.TURN_MODES`).
  fn: Callable
  anchor: str = "proximal"  # one of ANCHORS (see the module docstring)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register(loss: PolicyLoss) -> PolicyLoss:
  if loss.name in POLICY_LOSSES:
    raise ValueError(f"policy loss {loss.name!r} is already registered.")
  if loss.anchor not in ANCHORS:
    raise ValueError(f"PolicyLoss.anchor must be one of {ANCHORS}, got {loss.anchor!r}.")
  POLICY_LOSSES[loss.name] = loss
  return loss


@dataclasses.dataclass(frozen=True)
class LossOptions(Options):
  """The RL loss (`config.loss`; frozen and hashable: a static argument of the update).

      loss = policy_loss(name)  + kl_coef * KL(pi || ref)  - entropy_coef * entropy
             + value_coef * value_loss (algorithms with a critic)
  """
  SECTION = "loss"
  name: str = option("ppo_clip", choices=lambda: sorted(POLICY_LOSSES))
  agg: str = option("", choices=("",) + AGGREGATION_MODES)  # "": the algorithm's default
  clip_low: float = option(0.2, range=Range(float, 0, 1, high_open=True,
                                            note="the ratio clip 1 - clip_low"))
  clip_high: float = option(0.28, range=NON_NEGATIVE)  # > clip_low: DAPO clip-higher
  dual_clip: float = option(0.0, range=Range(float, 0, note="0 = off, else > 1"))
  gspo_clip_low: float = option(3e-4, range=NON_NEGATIVE)  # gspo: the sequence-ratio clip
  gspo_clip_high: float = option(4e-4, range=NON_NEGATIVE)
  kl_coef: float = option(0.0, range=NON_NEGATIVE)  # > 0: a frozen warm-start reference policy
  kl_kind: str = option("k3", choices=KL_ESTIMATORS)
  # The policy the KL is taken to. "auto": a frozen copy of the warm-start policy, or with LoRA
  # the base model with the adapters off (no copy at all). "warm_start": the warm-start policy in
  # both cases; with LoRA a frozen copy of the adapters alone, on the shared base weights (the
  # reference for a run whose warm start lives in the adapters: the base cannot do the task).
  kl_reference: str = option("auto", choices=("auto", "warm_start"))
  entropy_coef: float = option(0.0, range=NON_NEGATIVE)
  # ppo_clip / gspo: truncation C of the behaviour-to-proximal weight (0 = off); tis: its C (> 0).
  tis_threshold: float = option(0.0, range=Range(float, 0, note="0 = off"))
  value_coef: float = option(0.5, range=NON_NEGATIVE)  # algorithms with a critic
  value_clip: float = option(0.2, range=Range(float, 0, note="0 = no value clipping"))
  # proximal losses: take the sampler's log-probs as the proximal anchor instead of a forward pass
  # of the learner. Exact up to float rounding when rollouts are synchronous and unquantised (the
  # sampler ran the learner's current parameters); refused with async or quantised rollouts.
  reuse_behaviour_logprobs: bool = option(False)
  chunk_size: int = option(4096, range=COUNT)  # vocabulary chunk of the fused log-prob kernel
  # The constant C of `seq-mean-token-sum-norm` (Dr.GRPO); 0 = the batch's padded length. The
  # learner sets rollout.context_length, so a batch cut to a shorter bucket keeps its loss scale.
  norm_length: int = option(0, range=NON_NEGATIVE_INT)

  def check(self):
    if self.dual_clip and self.dual_clip <= 1:
      fail("loss.dual_clip", self.dual_clip, "0 (off) or a number > 1")
    if self.name == "tis" and not self.tis_threshold > 0:
      fail("loss.tis_threshold", self.tis_threshold,
           "a truncation constant > 0 (e.g. 2.0) with loss.name='tis'")

  @property
  def spec(self) -> PolicyLoss:
    return POLICY_LOSSES[self.name]


def _ppo_clip(logp, old_logp, adv, mask, is_weights, o: LossOptions, turn):
  return losses.policy_loss(logp, old_logp, adv, mask, clip_low=o.clip_low, clip_high=o.clip_high,
                            dual_clip=o.dual_clip or None, agg=o.agg, is_weights=is_weights,
                            norm_constant=o.norm_length or None, turn=turn)


def _gspo(logp, old_logp, adv, mask, is_weights, o: LossOptions, turn):
  return losses.gspo_loss(logp, old_logp, adv, mask, clip_low=o.gspo_clip_low,
                          clip_high=o.gspo_clip_high, agg=o.agg, is_weights=is_weights,
                          norm_constant=o.norm_length or None, turn=turn)


def _tis(logp, behavior_logp, adv, mask, is_weights, o: LossOptions, turn):
  del is_weights  # the loss is itself the truncated-IS correction
  return losses.truncated_is_policy_loss(logp, behavior_logp, adv, mask,
                                         threshold=o.tis_threshold, agg=o.agg,
                                         norm_constant=o.norm_length or None, turn=turn)


register(PolicyLoss("ppo_clip", _ppo_clip))
register(PolicyLoss("gspo", _gspo))
register(PolicyLoss("tis", _tis, anchor="behaviour"))
