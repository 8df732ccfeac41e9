"""Validation of training configs, and their conversion to the library's typed option objects.

`validate(config)` checks every field a training run reads and raises `ValueError` naming the field,
the value and what is allowed, before anything is built. Library code never reads flags: the
launcher parses the config, validates it and passes it down.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import ml_collections

from longhorizon import envs
from longhorizon.core.losses import AGGREGATION_MODES as AGGREGATIONS
from longhorizon.envs.codec import STYLES
from longhorizon.envs.wrappers import FAULT_KINDS
from longhorizon.rollout import RewardConfig, RolloutConfig
from longhorizon.train.algorithms import ALGORITHMS, AlgorithmOptions
from longhorizon.train.update import LossOptions

__all__ = ["ConfigError", "RANGES", "Range", "set_path", "validate", "algorithm_options", "loss_options", "rollout_config", "reward_config"]

_CHOICES = {
    "env.style": STYLES,
    "rollout.mode": ("sync", "async"),
    "rollout.stale_policy": ("drop", "downweight"),
    "algorithm.off_policy": ("decoupled", "tis"),
    "algorithm.kl_kind": ("k1", "k2", "k3"),
    "algorithm.advantage": ("gae", "length_adaptive_gae"),
    "optim.schedule": ("constant", "cosine", "linear"),
    "model.dtype": ("float32", "bfloat16"),
    "eval.split": ("test", "ood", "train"),
}


@dataclasses.dataclass(frozen=True)
class Range:
  """The valid values of one numeric config field: an int or a finite real in an interval."""
  kind: type  # int or float (an int is accepted where a float is expected; bools never)
  low: float = -math.inf
  high: float = math.inf
  low_open: bool = False  # the interval excludes `low`
  high_open: bool = False  # the interval excludes `high`
  note: str = ""  # what special values mean, e.g. "0 = off"

  def holds(self, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return False
    if self.kind is int and not isinstance(value, int):
      return False
    if not math.isfinite(value):
      return False
    above = value > self.low if self.low_open else value >= self.low
    below = value < self.high if self.high_open else value <= self.high
    return above and below

  def describe(self) -> str:
    what = "an integer" if self.kind is int else "a number"
    if self.high == math.inf:
      text = f"{what} {'>' if self.low_open else '>='} {self.low:g}"
    elif self.low == -math.inf:
      text = f"{what} {'<' if self.high_open else '<='} {self.high:g}"
    else:
      text = (f"{what} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
              f"{')' if self.high_open else ']'}")
    return f"{text} ({self.note})" if self.note else text


_COUNT = Range(int, 1)
_NON_NEGATIVE_INT = Range(int, 0)
_NON_NEGATIVE = Range(float, 0)
_POSITIVE = Range(float, 0, low_open=True)
_PROBABILITY = Range(float, 0, 1)
_DISCOUNT = Range(float, 0, 1, note="a discount or GAE lambda")

# Every numeric field a training run reads, with its valid range (a test checks that each numeric
# field of configs/default.py is listed here, so a new field cannot skip validation).
RANGES: dict[str, Range] = {
    "seed": _NON_NEGATIVE_INT,
    "num_updates": Range(int, 0, note="0: warm start and evaluation only"),
    "env.max_steps": _COUNT,
    "env.loop_k": Range(int, 0, note="0 = off, else >= 2"),
    "tasks.seed": _NON_NEGATIVE_INT,
    "tasks.train_size": _COUNT, "tasks.test_size": _COUNT, "tasks.ood_size": _COUNT,
    "model.hidden_size": _COUNT, "model.num_hidden_layers": _COUNT,
    "model.num_attention_heads": _COUNT, "model.num_key_value_heads": _COUNT,
    "model.intermediate_size": _COUNT,
    "rollout.num_tasks": _COUNT, "rollout.group_size": _COUNT,
    "rollout.context_length": _COUNT, "rollout.turn_tokens": _COUNT,
    "rollout.temperature": Range(float, 0, low_open=True,
                                 note="RL samples; use eval greedy for temperature 0"),
    "rollout.top_k": Range(int, 0, note="0 = off"),
    "rollout.top_p": Range(float, 0, 1, low_open=True),
    "rollout.max_staleness": _NON_NEGATIVE_INT,
    "rollout.num_actors": _COUNT, "rollout.queue_size": _COUNT,
    "rollout.stale_weight": Range(float, 0, 1, low_open=True,
                                  note="per version past rollout.max_staleness, for "
                                       "rollout.stale_policy='downweight'"),
    "reward.success": _NON_NEGATIVE, "reward.milestone": _NON_NEGATIVE,
    "reward.cost": Range(float, 0, note="a weight: the step cost times it is subtracted"),
    "reward.invalid": Range(float, 0, note="a penalty: subtracted per malformed action"),
    "reward.violation": Range(float, high=0, note="a violation is a failure"),
    "algorithm.clip_low": Range(float, 0, 1, high_open=True, note="the ratio clip 1 - clip_low"),
    "algorithm.clip_high": _NON_NEGATIVE,
    "algorithm.dual_clip": _NON_NEGATIVE,  # and 0 or > 1, checked below
    "algorithm.kl_coef": _NON_NEGATIVE, "algorithm.entropy_coef": _NON_NEGATIVE,
    "algorithm.tis_threshold": Range(float, 0, note="0 = off"),
    "algorithm.gamma": _DISCOUNT, "algorithm.lam": _DISCOUNT, "algorithm.step_gamma": _DISCOUNT,
    "algorithm.step_weight": _NON_NEGATIVE,
    "algorithm.keep_top_groups": Range(float, 0, 1, low_open=True, note="a fraction of groups"),
    "algorithm.value_coef": _NON_NEGATIVE,
    "optim.learning_rate": _POSITIVE, "optim.critic_learning_rate": _POSITIVE,
    "optim.warmup_steps": _NON_NEGATIVE_INT,
    "optim.max_grad_norm": Range(float, 0, note="0 = no clipping; a negative norm would turn "
                                                "the clip scale negative"),
    "optim.weight_decay": _NON_NEGATIVE,
    "optim.epochs": _COUNT, "optim.minibatches": _COUNT,
    "sft.steps": Range(int, 0, note="0 = no warm start"),
    "sft.episodes": _NON_NEGATIVE_INT,
    "sft.demo_epsilon": Range(float, 0, 1, note="probability of a random demonstrator action"),
    "sft.learning_rate": _POSITIVE, "sft.minibatches": _COUNT,
    "eval.num_tasks": _COUNT, "eval.every": Range(int, 0, note="0 = only before and after"),
    "eval.k": _COUNT,
    "curriculum.num_buckets": Range(int, 0, note="0 = off"),
    "curriculum.alpha": _NON_NEGATIVE,
    "curriculum.floor": Range(float, 0, 1, note="0 = 0.1 / num_buckets; at most 1 / num_buckets"),
    "curriculum.ema": Range(float, 0, 1, low_open=True, note="rate of the running estimates"),
    "alarm.min_entropy": _NON_NEGATIVE,
    "alarm.max_zero_advantage_rate": _PROBABILITY, "alarm.success_ceiling": _PROBABILITY,
    "checkpoint_every": _COUNT, "keep_checkpoints": _COUNT,
    "mesh.data": _COUNT, "mesh.fsdp": _COUNT, "mesh.tensor": _COUNT,
}
_BOOLS = ("algorithm.gspo", "algorithm.normalize_std", "algorithm.filter_zero_std", "tensorboard",
          "progress", "rollout.continue_partial")
_STRINGS = ("env.name", "model.checkpoint", "tasks.data_dir", "algorithm.agg", "algorithm.name")
_MAPPINGS = ("env.params", "env.faults", "env.tool_costs")


def _get(config, path: str) -> Any:
  node = config
  for part in path.split("."):
    if part not in node:
      raise ConfigError(f"config is missing the field {path!r}.")
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


class ConfigError(ValueError):
  """A config field has a value that is not allowed (the message names the field and the range)."""


def _fail(path, value, allowed):
  raise ConfigError(f"config.{path}={value!r} is not allowed; expected {allowed}.")


def _check_fields(config):
  """Every field's type, and every numeric field's range."""
  for path, valid in RANGES.items():
    value = _get(config, path)
    if not valid.holds(value):
      _fail(path, value, valid.describe())
  for path in _BOOLS:
    value = _get(config, path)
    if not isinstance(value, bool):
      _fail(path, value, "True or False")
  for path in _STRINGS:
    if not isinstance(_get(config, path), str):
      _fail(path, _get(config, path), "a string")
  for path in _MAPPINGS:
    if not hasattr(_get(config, path), "items"):
      _fail(path, _get(config, path), "a mapping")
  for name, rate in config.env.faults.items():
    if not _PROBABILITY.holds(rate):
      _fail(f"env.faults.{name}", rate, "a probability in [0, 1]")
  for name, cost in config.env.tool_costs.items():
    if not _NON_NEGATIVE.holds(cost):
      _fail(f"env.tool_costs.{name}", cost, "a cost >= 0")


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks the training config; returns it unchanged or raises `ConfigError` naming the field.

  Every numeric field's range (`RANGES`), every choice, then the rules that tie fields together.
  """
  _check_fields(config)
  checks = dict(_CHOICES)
  checks["algorithm.name"] = tuple(sorted(ALGORITHMS))
  for path, allowed in checks.items():
    value = _get(config, path)
    if value not in allowed:
      _fail(path, value, f"one of {list(allowed)}")
  if config.env.name not in envs.registered():
    try:
      envs.resolve(config.env.name)  # an environment outside the library: 'package.module:Class'
    except ValueError as e:
      raise ConfigError(f"config.env.name={config.env.name!r} is not allowed: {e}") from None
  agg = _get(config, "algorithm.agg")
  if agg and agg not in AGGREGATIONS:
    _fail("algorithm.agg", agg, f"'' (the algorithm's default) or one of {list(AGGREGATIONS)}")
  _check_model(config.model)
  _check_rules(config)
  _check_off_policy(config)
  return config


def _check_model(m):
  if m.hidden_size % m.num_attention_heads:
    _fail("model.num_attention_heads", m.num_attention_heads,
          f"a divisor of model.hidden_size={m.hidden_size}")
  if (m.hidden_size // m.num_attention_heads) % 2:
    _fail("model.num_attention_heads", m.num_attention_heads,
          f"a divisor of model.hidden_size={m.hidden_size} leaving an even head size (RoPE rotates "
          f"pairs of dimensions)")
  if m.num_attention_heads % m.num_key_value_heads:
    _fail("model.num_key_value_heads", m.num_key_value_heads,
          f"a divisor of model.num_attention_heads={m.num_attention_heads}")


def _check_rules(config):
  """Rules between fields: batch divisibility, group sizes, SFT data, special values."""
  a = config.algorithm
  if a.dual_clip and a.dual_clip <= 1:
    _fail("algorithm.dual_clip", a.dual_clip, "0 (off) or a number > 1")
  if config.env.loop_k == 1:
    _fail("env.loop_k", config.env.loop_k, "0 (off) or an integer >= 2 (the k-th repeat stops)")
  if sum(config.env.faults.values()) > 1 + 1e-9:
    _fail("env.faults", dict(config.env.faults), "rates that sum to at most 1 (one fault per call)")
  bad_faults = sorted(set(config.env.faults) - set(FAULT_KINDS))
  if bad_faults:
    _fail("env.faults", dict(config.env.faults), f"fault kinds from {sorted(FAULT_KINDS)}")
  batch = config.rollout.num_tasks * config.rollout.group_size
  if batch % config.optim.minibatches:
    _fail("optim.minibatches", config.optim.minibatches,
          f"a divisor of rollout.num_tasks * rollout.group_size = {batch}")
  need = ALGORITHMS[a.name].min_group_size
  if config.rollout.group_size < need:
    _fail("rollout.group_size", config.rollout.group_size,
          f"an integer >= {need} for algorithm.name={a.name!r}: its advantages are relative to the "
          f"other rollouts of the same task, so a group of one gets advantage 0 and learns nothing "
          f"(use algorithm.name='ppo' for single rollouts)")
  if config.sft.steps:
    if config.sft.episodes < 1:
      _fail("sft.episodes", config.sft.episodes,
            f"an integer >= 1 with sft.steps={config.sft.steps} (or set sft.steps=0 to skip the "
            f"warm start)")
    if config.sft.episodes % config.sft.minibatches:
      _fail("sft.minibatches", config.sft.minibatches,
            f"a divisor of sft.episodes = {config.sft.episodes}")
  mesh = config.mesh
  devices = jax.local_device_count()
  if mesh.data * mesh.fsdp * mesh.tensor > devices:
    _fail("mesh.data", mesh.data,
          f"mesh.data * mesh.fsdp * mesh.tensor = {mesh.data * mesh.fsdp * mesh.tensor} at most "
          f"the {devices} local device(s) (emulate more on CPU with XLA_FLAGS="
          f"--xla_force_host_platform_device_count=8)")
  c = config.curriculum
  if c.num_buckets and c.floor > 1 / c.num_buckets:
    _fail("curriculum.floor", c.floor,
          f"at most 1 / curriculum.num_buckets = {1 / c.num_buckets:.6g} (or 0 for the default)")


def _check_off_policy(config):
  """The asynchronous-rollout fields (`rollout.max_staleness`, ...) and `algorithm.off_policy`."""
  r, a = config.rollout, config.algorithm
  if r.continue_partial:
    _fail("rollout.continue_partial", r.continue_partial,
          "False: continuing partial episodes across a weight update is not implemented (every "
          "episode is sampled by one policy version; see docs/notes/issue-07.md)")
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
