"""Validation of training configs: every field a run reads, before anything is built.

`validate(config)` checks every field and raises `ConfigError` naming the field, the value and what
is allowed. The sections with a typed options class (`algorithm`, `loss`, `rollout`, `optim`,
`pool`, `dpo`) are checked by building it (`SPECS`: each validates itself, its choices coming from the
registries); the other fields by `RANGES` and the cross-field rules below. Library code never reads
flags: the launcher parses the config, validates it and passes it down.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import ml_collections

from longhorizon import envs
from longhorizon.envs.base import SPLITS
from longhorizon.envs.codec import STYLES
from longhorizon.envs.host import HostEnvironment
from longhorizon.envs.wrappers import FAULT_KINDS
from longhorizon.models import DECODE_KERNELS, DECODE_QUANTS, LORA_TARGETS, registered_families
from longhorizon.rollout.store import KEEP as STORE_KEEP
from longhorizon.train.algorithms import ALGORITHMS, AlgorithmOptions
from longhorizon.train.options import (COUNT as _COUNT, NON_NEGATIVE as _NON_NEGATIVE,
                                       NON_NEGATIVE_INT as _NON_NEGATIVE_INT,
                                       POSITIVE as _POSITIVE, PROBABILITY as _PROBABILITY,
                                       ConfigError, ContextOptions, OptimOptions, Options,
                                       PoolOptions,
                                       PreferenceOptions, Range, RolloutOptions,
                                       fail as _fail, section_ranges)
from longhorizon.train.policy_losses import LossOptions

__all__ = ["ConfigError", "RANGES", "Range", "SPECS", "set_path", "validate"]

# The typed options of a run, each built from its config section (`Options.from_config`).
SPECS: tuple[type[Options], ...] = (AlgorithmOptions, LossOptions, RolloutOptions, OptimOptions,
                                    PoolOptions, PreferenceOptions, ContextOptions)

_CHOICES = {
    "env.style": STYLES,
    "model.dtype": ("float32", "bfloat16"),
    "model.decode_kernel": DECODE_KERNELS,
    "model.decode_quant": DECODE_QUANTS,
    "eval.split": SPLITS,
    "store.keep": tuple(STORE_KEEP),
}


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
    "model.lora.rank": Range(int, 0, note="0 = no adapters (full fine-tuning)"),
    "model.lora.alpha": _POSITIVE,
    "model.moe.num_experts": Range(int, 0, note="0 = a dense MLP"),
    "model.moe.experts_per_token": _COUNT, "model.moe.intermediate_size": _COUNT,
    "model.moe.aux_loss_coef": _NON_NEGATIVE,
    "model.lora.dropout": Range(float, 0, 1, high_open=True,
                                note="adapter dropout in the training losses only"),
    "reward.success": _NON_NEGATIVE, "reward.milestone": _NON_NEGATIVE,
    "reward.cost": Range(float, 0, note="a weight: the step cost times it is subtracted"),
    "reward.invalid": Range(float, 0, note="a penalty: subtracted per malformed action"),
    "reward.violation": Range(float, 0, note="a penalty: a violating episode is worth -violation"),
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
    "curriculum.grow_at": Range(float, 0, 1, low_open=True, note="running training success"),
    "alarm.min_entropy": _NON_NEGATIVE,
    "alarm.max_zero_advantage_rate": _PROBABILITY, "alarm.success_ceiling": _PROBABILITY,
    "checkpoint_every": _COUNT, "keep_checkpoints": _COUNT,
    "mesh.data": _COUNT, "mesh.fsdp": _COUNT, "mesh.tensor": _COUNT,
    "store.replay_groups": Range(int, 0, note="0 = off"),
    "store.replay_failure": _POSITIVE,
    "store.replay_half_life": Range(float, 0, note="updates; 0 = no recency weight"),
}
# (the typed sections' ranges, from their options classes, for the range tests and docs)
RANGES.update({path: r for spec in SPECS for path, r in section_ranges(spec).items()})
_BOOLS = ("tensorboard", "progress", "model.moe.replay", "eval.greedy", "store.enabled")
_STRINGS = ("env.name", "model.checkpoint", "model.family", "tasks.data_dir", "sft.store")
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
    for kind, r in (rate.items() if hasattr(rate, "items") else [(None, rate)]):
      if not _PROBABILITY.holds(r):
        _fail(f"env.faults.{name}" + (f".{kind}" if kind else ""), r, "a probability in [0, 1]")
  for name, cost in config.env.tool_costs.items():
    if not _NON_NEGATIVE.holds(cost):
      _fail(f"env.tool_costs.{name}", cost, "a cost >= 0")


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks the training config; returns it unchanged or raises `ConfigError` naming the field.

  Every numeric field's range (`RANGES`), every typed section (`SPECS`), every choice, then the
  rules that tie fields together.
  """
  _check_fields(config)
  for spec in SPECS:
    spec.from_config(config)
  for path, allowed in _CHOICES.items():
    value = _get(config, path)
    if value not in allowed:
      _fail(path, value, f"one of {list(allowed)}")
  if config.env.name not in envs.registered():
    try:
      envs.resolve(config.env.name)  # an environment outside the library: 'package.module:Class'
    except ValueError as e:
      raise ConfigError(f"config.env.name={config.env.name!r} is not allowed: {e}") from None
  _check_model(config.model)
  _check_rules(config)
  _check_off_policy(config)
  _check_context(config)
  _check_replay(config)
  _check_share_prefix(config)
  return config


def _check_model(m):
  if m.family not in registered_families():
    _fail("model.family", m.family, f"one of {registered_families()} (models.register_family adds one)")
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
  targets = m.lora.targets
  if (not isinstance(targets, (list, tuple)) or not set(targets) <= set(LORA_TARGETS)
      or (m.lora.rank and not targets)):
    _fail("model.lora.targets", targets, f"a non-empty list of projections from {list(LORA_TARGETS)}")
  init = m.lora.get("init", "")
  if init and not m.lora.rank:
    _fail("model.lora.init", init, "empty with model.lora.rank=0 (there are no adapters to start "
          "from a folder)")
  if init and not os.path.isfile(os.path.join(init, "adapter_model.safetensors")):
    _fail("model.lora.init", init, "a peft adapter folder holding adapter_model.safetensors and "
          "adapter_config.json (experiments/export.py writes one as DIR/adapters)")
  moe = m.moe
  if moe.num_experts and moe.experts_per_token > moe.num_experts:
    _fail("model.moe.experts_per_token", moe.experts_per_token,
          f"at most model.moe.num_experts={moe.num_experts}")
  if moe.num_experts and m.lora.rank and set(targets) & {"gate_proj", "up_proj", "down_proj"}:
    _fail("model.lora.targets", targets, "attention projections only (q_proj, k_proj, v_proj, "
          "o_proj): adapters on experts are not supported")


def _is_host_env(name: str) -> bool:
  """Whether the environment `name` is a host (plain-Python) one."""
  try:
    cls = envs.resolve(name)
  except Exception:  # an unknown name is reported by its own check
    return False
  return isinstance(cls, type) and issubclass(cls, HostEnvironment)


def _check_rules(config):
  """Rules between fields: batch divisibility, group sizes, SFT data, special values."""
  a = config.algorithm
  if config.env.loop_k == 1:
    _fail("env.loop_k", config.env.loop_k, "0 (off) or an integer >= 2 (the k-th repeat stops)")
  # Fault rates: kind -> rate for every tool, and/or tool -> {kind: rate} (its own; the tool names
  # are checked when the environment is built, `envs.tool_fault_rates`).
  faults = config.env.faults
  shared = {k: v for k, v in faults.items() if not hasattr(v, "items")}
  for path, table in [("env.faults", shared)] + [
      (f"env.faults.{k}", dict(v)) for k, v in faults.items() if hasattr(v, "items")]:
    if sum(table.values()) > 1 + 1e-9:
      _fail(path, table, "rates that sum to at most 1 (one fault per call)")
    if sorted(set(table) - set(FAULT_KINDS)):
      _fail(path, table, f"fault kinds from {sorted(FAULT_KINDS)} (or a tool name -> its own "
            "{kind: rate})")
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
  if a.time_discount and not (a.name == "gigpo" or (
      a.name == "ppo" and a.unit == "turn" and a.advantage != "bilevel_gae")):
    _fail("algorithm.time_discount", a.time_discount,
          f"0 for algorithm.name={a.name!r}: per-step discounts apply to gigpo's step returns and "
          f"to ppo with algorithm.unit='turn' (gae or length_adaptive_gae), whose recursions run "
          f"over steps")
  if a.time_discount and a.time_source == "latency" and not _is_host_env(config.env.name):
    _fail("algorithm.time_source", a.time_source,
          f"'cost' for the JAX environment {config.env.name!r}: it steps every row in one call, "
          f"so no per-step latency is measured (EpisodeBatch.latency is 0)")
  if a.step_verifier and ALGORITHMS[a.name].needs_critic:
    _fail("algorithm.step_verifier", a.step_verifier,
          f"'' for algorithm.name={a.name!r}: verifier step advantages are added to critic-free "
          f"estimators (grpo, gigpo, rloo, ...)")
  if ALGORITHMS[a.name].reads_tree and config.rollout.recovery_groups:
    _fail("rollout.recovery_groups", config.rollout.recovery_groups,
          f"0 for algorithm.name={a.name!r}: the tree estimators read a batch's branch tree, which "
          f"recovery episodes (started from an earlier batch's state) are not part of")
  if ALGORITHMS[a.name].needs_branches and not config.rollout.branch_k:
    _fail("rollout.branch_k", config.rollout.branch_k,
          f"an integer >= 1 for algorithm.name={a.name!r}: it estimates each step's value from the "
          f"branches forked there, and without branches only the first step gets an advantage")
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
  budgets = c.step_budgets
  if not isinstance(budgets, (tuple, list)) or (budgets and (
      not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= config.env.max_steps
              for b in budgets) or list(budgets) != sorted(set(budgets)))):
    _fail("curriculum.step_budgets", budgets,
          f"increasing integers in [1, env.max_steps={config.env.max_steps}] (or () for off)")


def _check_off_policy(config):
  """The asynchronous rollouts against the curriculum, and the behaviour log-probs as the proximal
  anchor against anything that makes the sampler's policy differ from the learner's."""
  if config.rollout.mode == "async" and config.curriculum.step_budgets:
    _fail("curriculum.step_budgets", tuple(config.curriculum.step_budgets),
          "() with rollout.mode='async' (the budget grows with the learner's success, which the "
          "actors run ahead of)")
  for path, value in (("curriculum.num_buckets", config.curriculum.num_buckets),
                      ("curriculum.step_budgets", tuple(config.curriculum.step_budgets))):
    if config.rollout.recovery_groups and value:
      _fail("rollout.recovery_groups", config.rollout.recovery_groups,
            f"0 with {path}={value!r} (recovery groups replace some of the update's tasks, which "
            f"that curriculum chooses or truncates)")
  if config.loss.reuse_behaviour_logprobs:
    if config.rollout.mode == "async":
      _fail("loss.reuse_behaviour_logprobs", True,
            "False with rollout.mode='async' (the actors' parameters lag the learner's: the "
            "proximal log-probs must be recomputed)")
    if config.model.get("decode_quant", "none") != "none":
      _fail("loss.reuse_behaviour_logprobs", True,
            f"False with model.decode_quant={config.model.decode_quant!r} (quantised rollouts "
            "are not the learner's policy)")


def _refuse(refusals, setting: str):
  """Fails on the first `(path, value, refused, allowed)` that is refused with `setting`."""
  for path, value, refused, allowed in refusals:
    if refused:
      _fail(path, value, f"{allowed}, with {setting}")


def _check_replay(config):
  """Replay from the trajectory store (`train/replay.py`): only with what it was built and tested
  for, and with an off-policy correction for the older policies' tokens."""
  store = config.get("store")
  n = store.get("replay_groups", 0) if store else 0
  if not n:
    return
  a, r, loss = config.algorithm, config.rollout, config.loss
  spec = ALGORITHMS[a.name]
  corrected = loss.name == "tis" or (loss.tis_threshold > 0 and not loss.reuse_behaviour_logprobs)
  refusals = (
      ("store.enabled", store.enabled, not store.enabled,
       "True (replay draws from the run's own store)"),
      ("loss.tis_threshold", loss.tis_threshold, not corrected,
       "> 0 with loss.reuse_behaviour_logprobs=False, or loss.name='tis': replayed tokens were "
       "sampled by older policies, and the truncated importance weight against their stored "
       "behaviour log-probs is the off-policy correction"),
      ("algorithm.name", a.name, spec.needs_critic or spec.reads_tree,
       "a critic-free group estimator (grpo, drgrpo, rloo, gigpo, ...): stored episodes carry no "
       "critic values, and replayed groups are not branch trees"),
      ("rollout.mode", r.mode, r.mode == "async", "'sync' (the async learner's batches are not "
       "extended yet)"),
      ("rollout.branch_k", r.branch_k, r.branch_k, "0 (branch links do not carry into replay)"),
      ("rollout.recovery_groups", r.recovery_groups, r.recovery_groups, "0"),
      ("context.mode", config.context.mode, config.context.mode in ("window", "summary"),
       "'full' or 'offload' (one row per episode)"),
      ("model.moe.num_experts", config.model.moe.num_experts, config.model.moe.num_experts,
       "0 (stored routing is not replayed yet)"),
      ("mesh.data", config.mesh.data, config.mesh.data * config.mesh.fsdp * config.mesh.tensor > 1,
       "1 (with mesh.fsdp = mesh.tensor = 1: the store is process 0's)"),
  )
  _refuse(refusals, f"store.replay_groups={n}")
  rows = (r.num_tasks + n) * r.group_size
  if rows % config.optim.minibatches:
    _fail("optim.minibatches", config.optim.minibatches,
          f"a divisor of (rollout.num_tasks + store.replay_groups) * rollout.group_size = {rows} "
          f"(the update's rows with the replayed groups)")


def _check_share_prefix(config):
  """`optim.share_prefix`: the flat shared-prefix layout is built for one device's dense policy."""
  n = config.optim.get("share_prefix", 0)
  if not n:
    return
  a, mesh = config.algorithm, config.mesh
  refusals = (
      ("model.moe.num_experts", config.model.moe.num_experts, config.model.moe.num_experts,
       "0 (routing is per row)"),
      ("algorithm.critic", a.critic, ALGORITHMS[a.name].needs_critic and a.critic == "shared",
       "'separate' (the shared critic's values are read at every position)"),
      ("mesh.data", mesh.data, mesh.data * mesh.fsdp * mesh.tensor > 1,
       "1 (with mesh.fsdp = mesh.tensor = 1: the flat layout is one row, not split over devices)"),
  )
  _refuse(refusals, f"optim.share_prefix={n}")


def _check_context(config):
  """Context segments (`config.context.mode` window / summary) against what reads a batch as one
  row per episode or a token-level critic: refused with the reason."""
  mode = config.context.mode
  if mode == "full":
    return
  if mode == "offload":
    if not _is_host_env(config.env.name):
      _fail("context.mode", mode, f"'full', 'window' or 'summary' for the JAX environment "
            f"{config.env.name!r}: offload keeps long text outputs as notes (envs/notebook.py), and "
            "a JAX environment's observations are rendered from arrays by its codec")
    if config.context.offload_preview > config.context.offload_words:
      _fail("context.offload_preview", config.context.offload_preview,
            f"at most context.offload_words={config.context.offload_words}")
    return
  a, r = config.algorithm, config.rollout
  spec = ALGORITHMS[a.name]
  refusals = (
      ("algorithm.name", a.name, spec.needs_critic or spec.reads_tree,
       "a critic-free estimator of outcome or step credit (grpo, drgrpo, rloo, gigpo, ...): a "
       "token-level critic or a branch tree does not carry across rewritten contexts"),
      ("algorithm.empg", a.empg, a.empg, "False (EMPG reads the step entropies of one row)"),
      ("algorithm.part_weights", tuple(a.part_weights), any(w != 1.0 for w in a.part_weights),
       "all 1.0 (action parts are labelled per row)"),
      ("rollout.mode", r.mode, r.mode == "async", "'sync' (the async pipeline and partial "
       "rollouts keep one row per episode)"),
      ("rollout.branch_k", r.branch_k, r.branch_k, "0 (a fork needs the segment its step is in)"),
      ("rollout.recovery_groups", r.recovery_groups, r.recovery_groups, "0"),
      ("dpo.steps", config.dpo.steps, config.dpo.steps, "0 (preference pairs are whole rows)"),
      ("model.moe.num_experts", config.model.moe.num_experts, config.model.moe.num_experts,
       "0 (the re-prefilled segments' routing is not recorded for replay)"),
      ("mesh.data", config.mesh.data, config.mesh.data * config.mesh.fsdp * config.mesh.tensor > 1,
       "1 (with mesh.fsdp = mesh.tensor = 1: segment rows are not placed on a mesh yet)"),
  )
  _refuse(refusals, f"context.mode={mode!r}")
  if mode == "summary" and not _has_state_text(config.env.name):
    _fail("context.mode", mode, f"'full' or 'window' for the environment {config.env.name!r}: "
          f"it has no state summary (Environment.state_text), which summary writes")


def _has_state_text(name: str) -> bool:
  """Whether the environment `name` writes a state summary (overrides `state_text`)."""
  try:
    cls = envs.resolve(name)
  except Exception:  # an unknown name is reported by its own check
    return True
  if not isinstance(cls, type):
    return True
  base = HostEnvironment if issubclass(cls, HostEnvironment) else envs.Environment
  return cls.state_text is not base.state_text
