"""Validation of training configs, and their conversion to the library's typed option objects.

`validate(config)` checks every field a training run reads and raises `ValueError` naming the field,
the value and what is allowed, before anything is built. Library code never reads flags: the
launcher parses the config, validates it and passes it down.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from longhorizon import envs
from longhorizon.core.losses import AGGREGATION_MODES as AGGREGATIONS
from longhorizon.envs.codec import STYLES
from longhorizon.envs.wrappers import FAULT_KINDS
from longhorizon.rollout import RewardConfig, RolloutConfig
from longhorizon.train.algorithms import ALGORITHMS, AlgorithmOptions
from longhorizon.train.update import LossOptions

__all__ = ["set_path", "validate", "algorithm_options", "loss_options", "rollout_config", "reward_config"]

_CHOICES = {
    "env.style": STYLES,
    "rollout.mode": ("sync", "async"),
    "rollout.stale_policy": ("drop", "downweight"),
    "algorithm.off_policy": ("decoupled", "tis"),
    "algorithm.kl_kind": ("k1", "k2", "k3"),
    "algorithm.advantage": ("gae", "length_adaptive_gae"),
    "optim.schedule": ("constant", "cosine", "linear"),
    "model.dtype": ("float32", "bfloat16"),
}
_POSITIVE_INTS = ("env.max_steps", "rollout.num_tasks", "rollout.group_size", "rollout.context_length",
                  "rollout.turn_tokens", "eval.k", "optim.epochs", "optim.minibatches", "sft.minibatches",
                  "eval.num_tasks", "tasks.train_size", "tasks.test_size", "tasks.ood_size",
                  "checkpoint_every", "keep_checkpoints", "mesh.data", "mesh.fsdp", "mesh.tensor",
                  "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads",
                  "model.num_key_value_heads", "model.intermediate_size", "rollout.num_actors",
                  "rollout.queue_size")
_NON_NEGATIVE = ("num_updates", "curriculum.num_buckets", "curriculum.floor", "curriculum.alpha", "sft.steps", "sft.episodes", "eval.every", "algorithm.kl_coef",
                 "algorithm.entropy_coef", "algorithm.tis_threshold", "optim.warmup_steps",
                 "optim.weight_decay", "env.loop_k", "rollout.top_k", "algorithm.clip_low",
                 "algorithm.clip_high", "algorithm.value_coef", "rollout.max_staleness")


def _get(config, path: str) -> Any:
  node = config
  for part in path.split("."):
    if part not in node:
      raise ValueError(f"config is missing the field {path!r}.")
    node = node[part]
  return node


def set_path(config, path: str, value) -> None:
  """Sets the dotted field `path` (e.g. "algorithm.name") of an unlocked ConfigDict; a dict value
  becomes a ConfigDict."""
  node = config
  *parents, leaf = path.split(".")
  for part in parents:
    node = node[part]
  node[leaf] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value


def _fail(path, value, allowed):
  raise ValueError(f"config.{path}={value!r} is not allowed; expected {allowed}.")


_REALS = ("rollout.temperature", "rollout.top_p", "reward.success", "reward.milestone", "reward.cost",
          "reward.invalid", "reward.violation", "algorithm.clip_low", "algorithm.clip_high",
          "algorithm.dual_clip", "algorithm.kl_coef", "algorithm.entropy_coef",
          "algorithm.tis_threshold", "algorithm.gamma", "algorithm.lam", "algorithm.step_gamma",
          "algorithm.step_weight", "algorithm.keep_top_groups", "algorithm.value_coef",
          "optim.learning_rate", "optim.critic_learning_rate", "optim.weight_decay",
          "optim.max_grad_norm", "sft.learning_rate", "sft.demo_epsilon", "curriculum.alpha",
          "curriculum.floor", "curriculum.ema", "alarm.min_entropy",
          "alarm.max_zero_advantage_rate", "alarm.success_ceiling", "rollout.stale_weight")
_BOOLS = ("algorithm.gspo", "algorithm.normalize_std", "algorithm.filter_zero_std", "tensorboard",
          "progress", "rollout.continue_partial")


def _check_types(config):
  import math
  for path in _REALS:
    value = _get(config, path)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      _fail(path, value, "a finite number")
  for path in _BOOLS:
    value = _get(config, path)
    if not isinstance(value, bool):
      _fail(path, value, "True or False")
  for path in _POSITIVE_INTS + ("num_updates", "sft.steps", "sft.episodes", "eval.every",
                                "optim.warmup_steps", "env.loop_k", "rollout.top_k", "seed",
                                "tasks.seed", "curriculum.num_buckets", "env.max_steps",
                                "rollout.max_staleness"):
    value = _get(config, path)
    if isinstance(value, bool) or not isinstance(value, int):
      _fail(path, value, "an integer")
  for path in ("model.checkpoint", "tasks.data_dir", "algorithm.agg"):
    if not isinstance(_get(config, path), str):
      _fail(path, _get(config, path), "a string")
  for path in ("env.params", "env.faults", "env.tool_costs"):
    if not hasattr(_get(config, path), "items"):
      _fail(path, _get(config, path), "a mapping")
  for name, rate in config.env.faults.items():
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
      _fail(f"env.faults.{name}", rate, "a probability in [0, 1]")


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks the training config; returns it unchanged or raises `ValueError` naming the field."""
  _check_types(config)
  checks = dict(_CHOICES)
  checks["env.name"] = tuple(envs.registered())
  checks["algorithm.name"] = tuple(sorted(ALGORITHMS))
  for path, allowed in checks.items():
    value = _get(config, path)
    if value not in allowed:
      _fail(path, value, f"one of {list(allowed)}")
  agg = _get(config, "algorithm.agg")
  if agg and agg not in AGGREGATIONS:
    _fail("algorithm.agg", agg, f"'' (the algorithm's default) or one of {list(AGGREGATIONS)}")
  for path in _POSITIVE_INTS:
    value = _get(config, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      _fail(path, value, "an integer >= 1")
  for path in _NON_NEGATIVE:
    value = _get(config, path)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
      _fail(path, value, "a number >= 0")
  for path in ("optim.learning_rate", "sft.learning_rate", "optim.critic_learning_rate"):
    value = _get(config, path)
    if not isinstance(value, (int, float)) or not value > 0:
      _fail(path, value, "a number > 0")
  if not 0 < config.rollout.temperature:
    _fail("rollout.temperature", config.rollout.temperature,
          "a number > 0 (RL samples; use eval greedy for temperature 0)")
  if not 0 < config.rollout.top_p <= 1:
    _fail("rollout.top_p", config.rollout.top_p, "a number in (0, 1]")
  if config.algorithm.dual_clip and config.algorithm.dual_clip <= 1:
    _fail("algorithm.dual_clip", config.algorithm.dual_clip, "0 (off) or a number > 1")
  if not 0 < config.algorithm.keep_top_groups <= 1:
    _fail("algorithm.keep_top_groups", config.algorithm.keep_top_groups, "a fraction in (0, 1]")
  m = config.model
  if m.hidden_size % m.num_attention_heads:
    _fail("model.num_attention_heads", m.num_attention_heads,
          f"a divisor of model.hidden_size={m.hidden_size}")
  if m.num_attention_heads % m.num_key_value_heads:
    _fail("model.num_key_value_heads", m.num_key_value_heads,
          f"a divisor of model.num_attention_heads={m.num_attention_heads}")
  if config.reward.violation > 0:
    _fail("reward.violation", config.reward.violation, "a number <= 0 (a violation is a failure)")
  batch = config.rollout.num_tasks * config.rollout.group_size
  if batch % config.optim.minibatches:
    _fail("optim.minibatches", config.optim.minibatches,
          f"a divisor of rollout.num_tasks * rollout.group_size = {batch}")
  if config.sft.steps and config.sft.episodes % config.sft.minibatches:
    _fail("sft.minibatches", config.sft.minibatches, f"a divisor of sft.episodes = {config.sft.episodes}")
  bad_faults = sorted(set(config.env.faults) - set(FAULT_KINDS))
  if bad_faults:
    _fail("env.faults", dict(config.env.faults), f"fault kinds from {sorted(FAULT_KINDS)}")
  if not 0 <= config.sft.demo_epsilon <= 1:
    _fail("sft.demo_epsilon", config.sft.demo_epsilon, "a probability in [0, 1]")
  if config.eval.split not in ("test", "ood", "train"):
    _fail("eval.split", config.eval.split, "one of ['test', 'ood', 'train']")
  _check_off_policy(config)
  return config


def _check_off_policy(config):
  """The asynchronous-rollout fields (`rollout.max_staleness`, ...) and `algorithm.off_policy`."""
  r, a = config.rollout, config.algorithm
  if not 0 < r.stale_weight <= 1:
    _fail("rollout.stale_weight", r.stale_weight, "a factor in (0, 1] (per version past "
          "rollout.max_staleness, for rollout.stale_policy='downweight')")
  if r.continue_partial:
    _fail("rollout.continue_partial", r.continue_partial,
          "False: continuing partial episodes across a weight update is not implemented (every "
          "episode is sampled by one policy version; see BUILD_NOTES.md, issue 7)")
  if a.off_policy == "tis":
    if not a.tis_threshold > 0:
      _fail("algorithm.tis_threshold", a.tis_threshold,
            "a truncation constant > 0 (e.g. 2.0) with algorithm.off_policy='tis'")
    if a.gspo:
      _fail("algorithm.off_policy", a.off_policy,
            "'decoupled' with algorithm.gspo=True (the truncated-IS loss is token-level)")
  if r.mode == "async" and config.curriculum.num_buckets:
    _fail("curriculum.num_buckets", config.curriculum.num_buckets,
          "0 with rollout.mode='async' (the curriculum draws tasks from the learner's latest "
          "success estimates, which the actors run ahead of)")


def algorithm_options(config) -> AlgorithmOptions:
  a = config.algorithm
  return AlgorithmOptions(gamma=a.gamma, lam=a.lam, advantage=a.advantage, step_gamma=a.step_gamma,
                          step_weight=a.step_weight, normalize_std=a.normalize_std,
                          filter_zero_std=a.filter_zero_std, keep_top_groups=a.keep_top_groups)


def loss_options(config) -> LossOptions:
  a, o = config.algorithm, config.optim
  return LossOptions(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip or None,
                     agg=a.agg or ALGORITHMS[a.name].default_agg, gspo=a.gspo, kl_coef=a.kl_coef,
                     kl_kind=a.kl_kind, entropy_coef=a.entropy_coef,
                     tis_threshold=a.tis_threshold or None, off_policy=a.off_policy,
                     value_coef=a.value_coef,
                     temperature=config.rollout.temperature, epochs=o.epochs,
                     minibatches=o.minibatches)


def rollout_config(config, group_size: int | None = None, temperature: float | None = None
                   ) -> RolloutConfig:
  r = config.rollout
  return RolloutConfig(group_size=group_size or r.group_size, context_length=r.context_length,
                       max_steps=config.env.max_steps, turn_tokens=r.turn_tokens,
                       temperature=r.temperature if temperature is None else temperature,
                       top_k=r.top_k, top_p=r.top_p)


def reward_config(config) -> RewardConfig:
  w = config.reward
  return RewardConfig(success=w.success, milestone=w.milestone, cost=w.cost, invalid=w.invalid,
                      violation=w.violation)
