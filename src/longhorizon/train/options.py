"""Typed options: frozen dataclasses built from one config section each, that validate themselves.

    AlgorithmOptions.from_config(config)   # == AlgorithmOptions(**config.algorithm), checked

A section and its dataclass have the same fields (`from_config` refuses a field the other lacks), so
every option is reachable from a config file and from `--config.<section>.<field>=...`, and each has
one default: the dataclass's (configs/default.py writes the same values out for readers; a test
checks they agree). A field declares its valid values with `option(default, range=..., choices=...)`;
`choices` may be a function returning a registry's names, so the allowed names come from the
registries, never from a copied list. A bad value raises `ConfigError` naming
`config.<section>.<field>`, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Sequence

import ml_collections

from longhorizon.core.preference import PAIR_LEVELS
from longhorizon.rollout import BRANCH_POINTS, RECOVERY_FROM, RolloutConfig
from longhorizon.rollout.context import CONTEXT_MODES, SUMMARY_BY
from longhorizon.rollout.store import KEEP

__all__ = ["ConfigError", "Range", "Options", "ContextOptions", "RolloutOptions", "OptimOptions",
           "PoolOptions", "PreferenceOptions",
           "option", "fail",
           "as_config", "section_ranges", "COUNT",
           "NON_NEGATIVE_INT", "NON_NEGATIVE", "POSITIVE", "PROBABILITY", "DISCOUNT"]


class ConfigError(ValueError):
  """A config field has a value that is not allowed (the message names the field and the range)."""


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


COUNT = Range(int, 1)
NON_NEGATIVE_INT = Range(int, 0)
NON_NEGATIVE = Range(float, 0)
POSITIVE = Range(float, 0, low_open=True)
PROBABILITY = Range(float, 0, 1)
DISCOUNT = Range(float, 0, 1, note="a discount or GAE lambda")


def option(default, *, range: Range | None = None,  # pylint: disable=redefined-builtin
           choices: Sequence[str] | Callable[[], Sequence[str]] | None = None):
  """A dataclass field of an `Options` class with its valid values (a numeric `range`, or
  `choices`: a tuple, or a function returning a registry's names)."""
  return dataclasses.field(default=default, metadata={"range": range, "choices": choices})


def fail(path: str, value, allowed: str):
  raise ConfigError(f"config.{path}={value!r} is not allowed; expected {allowed}.")


def _choices(field: dataclasses.Field) -> tuple | None:
  choices = field.metadata.get("choices")
  return tuple(choices() if callable(choices) else choices) if choices is not None else None


@dataclasses.dataclass(frozen=True)
class Options:
  """Base of the typed option classes (`SECTION` names their config section)."""
  SECTION: ClassVar[str] = ""

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value, path = getattr(self, field.name), f"{self.SECTION}.{field.name}"
      valid, choices = field.metadata.get("range"), _choices(field)
      if valid is not None and not valid.holds(value):
        fail(path, value, valid.describe())
      elif choices is not None and value not in choices:
        fail(path, value, f"one of {list(choices)}")
      elif isinstance(field.default, bool) and not isinstance(value, bool):
        fail(path, value, "True or False")
      elif isinstance(field.default, str) and not isinstance(value, str):
        fail(path, value, "a string")
    self.check()

  def check(self):
    """Rules between this section's fields (subclasses override; raise with `fail`)."""

  @classmethod
  def from_config(cls, config) -> "Options":
    """The options of `config.<SECTION>`; its fields must be exactly this class's."""
    section = config[cls.SECTION]
    names = {f.name for f in dataclasses.fields(cls)}
    extra, missing = sorted(set(section.keys()) - names), sorted(names - set(section.keys()))
    if extra or missing:
      raise ConfigError(
          f"config.{cls.SECTION} does not match {cls.__name__}: "
          + "; ".join(filter(None, [extra and f"unknown field(s) {extra}",
                                    missing and f"missing field(s) {missing}"])) + ".")
    return cls(**{name: _plain(section[name]) for name in names})


def _plain(value) -> Any:
  return tuple(value) if isinstance(value, list) else value


def section_ranges(cls: type[Options]) -> dict[str, Range]:
  """`{"<section>.<field>": Range}` of the numeric fields of an `Options` class."""
  return {f"{cls.SECTION}.{f.name}": f.metadata["range"] for f in dataclasses.fields(cls)
          if f.metadata.get("range") is not None}


def as_config(cls: type, **overrides) -> "ml_collections.ConfigDict":
  """A config section with the fields and defaults of the options dataclass `cls` (the one place
  the defaults are written), `overrides` applied."""
  values = {f.name: f.default for f in dataclasses.fields(cls)}
  unknown = sorted(set(overrides) - set(values))
  if unknown:
    raise ValueError(f"{cls.__name__} has no field(s) {unknown}.")
  values.update(overrides)
  return ml_collections.ConfigDict(values)


@dataclasses.dataclass(frozen=True)
class RolloutOptions(Options):
  """How a run samples its training episodes (`config.rollout`); `collect_config` gives the
  per-call `rollout.RolloutConfig`."""
  SECTION = "rollout"
  mode: str = option("sync", choices=("sync", "async"))  # async: actor threads (train/async_rollout.py)
  num_tasks: int = option(16, range=COUNT)  # tasks per update
  group_size: int = option(8, range=COUNT)  # rollouts per task (GRPO/RLOO/GiGPO groups)
  context_length: int = option(160, range=COUNT)  # token budget per episode
  turn_tokens: int = option(6, range=COUNT)  # per-turn sampling budget
  temperature: float = option(1.0, range=Range(
      float, 0, low_open=True, note="RL samples; use eval greedy for temperature 0"))
  top_k: int = option(0, range=Range(int, 0, note="0 = off"))
  top_p: float = option(1.0, range=Range(float, 0, 1, low_open=True))
  # Asynchronous rollouts (ignored by sync). An actor starts a batch only if it will be at most
  # max_staleness policy versions old when the learner takes it (0: exactly the sync run);
  # episodes that still arrive older are dropped or down-weighted by
  # stale_weight ** (lag - max_staleness).
  max_staleness: int = option(1, range=NON_NEGATIVE_INT)  # in policy versions (updates)
  num_actors: int = option(1, range=COUNT)  # actor threads (overlap tool latency; share the device)
  queue_size: int = option(2, range=COUNT)  # finished batches waiting for the learner
  stale_policy: str = option("drop", choices=("drop", "downweight"))
  stale_weight: float = option(0.5, range=Range(
      float, 0, 1, low_open=True, note="per version past rollout.max_staleness, for "
                                       "rollout.stale_policy='downweight'"))
  # Branch rollouts of the training episodes: group_size / (1 + branch_k) roots per task, each
  # forked once into branch_k continuations at the step branch_at picks (rollout.BRANCH_POINTS;
  # uniform, max_entropy, after_error, first_divergence); 0 = off. Episodes per task stay
  # group_size, so a run with branches costs what one without does.
  branch_k: int = option(0, range=NON_NEGATIVE_INT)
  branch_at: str = option("uniform", choices=lambda: sorted(BRANCH_POINTS))
  # Record each training step's agreement with the oracle's action (`EpisodeBatch.oracle_match`):
  # the metrics then report where episodes first leave the oracle's path (`first_error/...`).
  record_oracle: bool = option(False)
  # Prefill each task's prompt once for its group_size rollouts (rollout.RolloutConfig.share_prompts)
  share_prompts: bool = option(False)
  # Recovery tasks (rollout/recovery.py): of each update's num_tasks groups, up to recovery_groups
  # restart from a saved state just after an earlier failed episode's first error (by
  # recovery_from), G continuations each with the current policy, newest failures first; the
  # rest are fresh tasks, so the episodes per update stay num_tasks x group_size. The learner
  # keeps the newest recovery_capacity starts (in memory: a resumed run starts with none). 0 = off.
  recovery_groups: int = option(0, range=NON_NEGATIVE_INT)
  recovery_from: str = option("first_divergence", choices=lambda: RECOVERY_FROM)
  recovery_capacity: int = option(64, range=COUNT)
  # Partial rollouts across weight updates (async only): an actor's episodes take the newest
  # published policy at every turn, so an episode under way when the learner updates continues
  # with the new parameters; EpisodeBatch.token_version records each token's version and the
  # staleness filter weighs tokens by their own lag. partial_cache: the KV cache of the tokens so
  # far is kept as the older parameters computed it ("keep") or recomputed ("reprefill").
  continue_partial: bool = option(False)
  partial_cache: str = option("keep", choices=("keep", "reprefill"))

  def check(self):
    if self.group_size % (1 + self.branch_k):
      fail("rollout.branch_k", self.branch_k, f"a value with branch_k + 1 dividing "
           f"rollout.group_size={self.group_size} (roots x (1 + branch_k) episodes per task)")
    if self.recovery_groups >= self.num_tasks:
      fail("rollout.recovery_groups", self.recovery_groups, f"below rollout.num_tasks="
           f"{self.num_tasks} (fresh tasks are where new recovery starts come from)")
    if self.continue_partial and self.mode != "async":
      fail("rollout.continue_partial", True, "False with rollout.mode='sync' (a synchronous batch "
           "is sampled by one policy version; partial rollouts continue across the async "
           "learner's updates)")
    if self.recovery_groups and self.mode == "async":
      fail("rollout.recovery_groups", self.recovery_groups, "0 with rollout.mode='async' (the "
           "starts are kept by the learner's collect)")

  def collect_config(self, max_steps: int, *, context: "ContextOptions | None" = None,
                     group_size: int | None = None,
                     temperature: float | None = None, branch: bool = False,
                     record_oracle: bool = False, label_parts: bool = False,
                     step_budget: int | None = None) -> RolloutConfig:
    """The `collect` settings; `branch=True` (the training episodes) with the branch rollouts,
    `record_oracle` with each step's agreement with the oracle (the `oracle` step verifier),
    `context` (`config.context`) with its context mode (else `full`)."""
    return RolloutConfig(group_size=group_size or self.group_size,
                         context_length=self.context_length, max_steps=max_steps,
                         turn_tokens=self.turn_tokens,
                         temperature=self.temperature if temperature is None else temperature,
                         top_k=self.top_k, top_p=self.top_p,
                         branch_k=self.branch_k if branch else 0, branch_at=self.branch_at,
                         record_oracle=record_oracle, label_parts=label_parts,
                         step_budget=step_budget or 0, share_prompts=self.share_prompts,
                         recovery_from=self.recovery_from if branch and self.recovery_groups
                         else "",
                         **(context.collect_fields() if context is not None else {}))


@dataclasses.dataclass(frozen=True)
class PoolOptions(Options):
  """How a host environment's rows are stepped (`config.pool`; `envs/pool.py`). Ignored by JAX
  environments, which step under jit."""
  SECTION = "pool"
  # "": the env's default; "ray": Ray actors (envs/ray_pool.py, the [ray] extra)
  backend: str = option("", choices=("", "thread", "process", "serial", "ray"))
  workers: int = option(0, range=Range(int, 0, note="0 = one thread per row / one process per CPU"))
  timeout_s: float = option(30.0, range=POSITIVE)  # per call
  retries: int = option(2, range=NON_NEGATIVE_INT)  # further attempts before an environment error
  rate_limit: float = option(0.0, range=Range(float, 0, note="calls/s over all rows; 0 = off"))
  burst: int = option(1, range=COUNT)  # token-bucket size of the rate limits
  # Per-tool limits as (("tool", calls/s), ...), e.g. "(('refund', 2.0),)".
  tool_rate_limits: tuple = option(())
  breaker_failures: int = option(0, range=Range(int, 0, note="consecutive failures; 0 = off"))
  breaker_cooldown_s: float = option(5.0, range=POSITIVE)
  # JSON lines of every call and result, one line per finished episode ("": off), e.g.
  # WORKDIR/env_calls.jsonl; `envs.pool.ReplayEnvironment` serves them again without the environment.
  record_path: str = option("")

  def check(self):
    for item in self.tool_rate_limits:
      if (not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[0], str)
          or not POSITIVE.holds(item[1])):
        fail("pool.tool_rate_limits", self.tool_rate_limits,
             "pairs (tool name, calls/s > 0), e.g. (('refund', 2.0),)")

  def pool_kwargs(self) -> dict:
    """The `EnvPool` keyword arguments."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["tool_rate_limits"] = {name: float(rate) for name, rate in self.tool_rate_limits}
    return out


@dataclasses.dataclass(frozen=True)
class ContextOptions(Options):
  """How long episodes keep their context (`config.context`; `rollout/context.py`)."""
  SECTION = "context"
  # full: the whole episode in one context (truncated when it overflows); window: rewrite it as
  # the prompt + the last `keep` turns; summary: as the environment's state summary. Each segment
  # is a training row of exactly the tokens the policy saw; its episode's return and credit.
  # offload: a host environment's long outputs become notes the policy reads back with a tool
  # (envs/notebook.py); the context is never rewritten (one row per episode, as in full)
  mode: str = option("full", choices=lambda: (*CONTEXT_MODES, "offload"))
  every: int = option(0, range=Range(int, 0, note="steps per segment; 0 = only when the context "
                                                  "is full"))
  keep: int = option(2, range=COUNT)  # window: the turns carried into a new segment
  segments: int = option(4, range=COUNT)  # most segments (training rows) per episode
  # summary: "env" writes it (Environment.state_text); "policy" samples it as a turn of at most
  # summary_tokens after a request, trained with the episode's advantage like any action
  summary_by: str = option("env", choices=lambda: SUMMARY_BY)
  summary_tokens: int = option(24, range=COUNT)
  offload_words: int = option(32, range=COUNT)  # offload: outputs of more words become notes
  offload_preview: int = option(8, range=NON_NEGATIVE_INT)  # words shown before a note's stub

  def collect_fields(self) -> dict:
    """The `RolloutConfig` fields of these options (offload is the environment's doing: the
    rollout keeps one context per episode, as in full)."""
    return {"context_mode": "full" if self.mode == "offload" else self.mode,
            "context_every": self.every, "context_keep": self.keep,
            "context_segments": self.segments, "context_summary_by": self.summary_by,
            "context_summary_tokens": self.summary_tokens}


@dataclasses.dataclass(frozen=True)
class OptimOptions(Options):
  """The RL phase's optimiser and update schedule (`config.optim`)."""
  SECTION = "optim"
  learning_rate: float = option(3e-4, range=POSITIVE)
  critic_learning_rate: float = option(1e-3, range=POSITIVE)
  schedule: str = option("constant", choices=("constant", "cosine", "linear"))
  warmup_steps: int = option(0, range=NON_NEGATIVE_INT)
  max_grad_norm: float = option(1.0, range=Range(
      float, 0, note="0 = no clipping; a negative norm would turn the clip scale negative"))
  weight_decay: float = option(0.0, range=NON_NEGATIVE)
  b1: float = option(0.9, range=Range(float, 0, 1, high_open=True))  # Adam moments' decay
  b2: float = option(0.999, range=Range(float, 0, 1, high_open=True))
  epochs: int = option(2, range=COUNT)  # passes over each batch
  minibatches: int = option(2, range=COUNT)  # optimiser steps per pass
  # SFT and RL batches are cut to the smallest of this many evenly spaced lengths up to
  # rollout.context_length that holds their longest episode (at most this many compiled shapes of
  # each step; padding is most of a batch when episodes are short). 0 = always the full length.
  length_buckets: int = option(4, range=NON_NEGATIVE_INT)
  # N > 0: the tokens every row of an SFT or RL batch shares (a system prompt and tool schemas, up
  # to the first trained token), rounded down to a multiple of N, go through the model once for the
  # whole batch instead of once per row (`Transformer(prefix_length=...)`: the same loss and
  # gradient up to float rounding; one compilation per distinct length). Dense models only; no
  # shared critic. 0 = off.
  share_prefix: int = option(0, range=NON_NEGATIVE_INT)
  # True: an RL minibatch whose policy gradient is exactly zero (every row's advantage 0, no KL or
  # entropy term) takes no optimiser step, so Adam's momentum does not keep moving the policy on a
  # batch without signal (`make_optimizer(skip_zero_grad=True)`: optax.MultiSteps with a skip
  # test; it keeps a gradient buffer the size of the trainable parameters). False: every
  # minibatch steps, as in optax/PyTorch Adam.
  skip_zero_grad: bool = option(False)


@dataclasses.dataclass(frozen=True)
class PreferenceOptions(Options):
  """The DPO stage between the SFT warm start and RL (`config.dpo`; `train/preference.py`)."""
  SECTION = "dpo"
  steps: int = option(0, range=Range(int, 0, note="passes over the pairs; 0 = no DPO stage"))
  tasks: int = option(64, range=COUNT)  # train tasks sampled for preference data
  group_size: int = option(8, range=Range(int, 2))  # rollouts per task
  branch_k: int = option(0, range=NON_NEGATIVE_INT)  # sibling branches per root (0 = plain groups)
  branch_at: str = option("uniform", choices=lambda: sorted(BRANCH_POINTS))
  level: str = option("trajectory", choices=PAIR_LEVELS)
  beta: float = option(0.1, range=POSITIVE)
  label_smoothing: float = option(0.0, range=Range(float, 0, 0.5, high_open=True))
  # weight of the chosen episodes' per-token NLL added to the DPO loss (RPO; 0 = plain DPO)
  sft_weight: float = option(0.0, range=NON_NEGATIVE)
  min_gap: float = option(0.0, range=NON_NEGATIVE)  # a pair's scores differ by more than this
  learning_rate: float = option(1e-4, range=POSITIVE)
  minibatches: int = option(1, range=COUNT)
  store: str = ""  # read pairs from this store directory instead of sampling ("" = sample)
  # store filters applied on reading ("all": a timeout is a failure worth preferring against;
  # env-error episodes never enter a pair either way)
  keep: str = option("all", choices=lambda: sorted(KEEP))

  def check(self):
    if self.group_size % (1 + self.branch_k):
      fail("dpo.branch_k", self.branch_k, f"a value with branch_k + 1 dividing "
           f"dpo.group_size={self.group_size}")
