"""The learner: a frozen description of a run, and the two halves of an RL update.

    learner = Learner.build(config)         # the validated config -> everything a run is made of
    state = learner.initial_state()
    state, sft_metrics = learner.warm_start(state)
    batch, stats = learner.collect_batch(state.params, update, data_position, timer)
    state, metrics = learner.learn(state, batch, stats, timer)   # (or learner.step: both)

`Learner` holds the environment (with its wrappers), codec, task suites, model config and initial
parameters, the optimisers, the mesh and the typed options of the run (`rollout`, `reward`,
`algorithm`, `loss`, `optim`: one object each, built once from their config sections). `learn` owns
every forward pass an update needs besides the update itself (the proximal policy's log-probs, the
KL reference's, the critic's values), the advantages and the jitted update, which is closed over the
optimisers and options (with explicit shardings on a mesh) and compiled once per learner.

The critic of `ppo` / `tree_critic` is a separate `Critic` (`algorithm.critic='separate'`), or
with `'shared'` a value head on the policy's trunk (`TrainState.critic_params` then holds the head
alone; its rollout-time values come with the proximal log-probs, from the same pass; the update
trains trunk and head in one loss: `train/update.py`).

Its drivers: the synchronous loop (`train/loop.py`: `step` per update), the asynchronous pipeline
(`train/async_rollout.py`: actors call `collect_batch` with published parameters, the learner thread
`learn`) and the horizon study (`studies/horizon.py`: one learner per algorithm via `with_config`).
None of them repeats an update.

Determinism: every random stream of update `u` derives from `(config.seed, u)` and the state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any

from absl import logging
import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from longhorizon import envs
from longhorizon import rollout
from longhorizon.core import episode as episode_lib
from longhorizon.core import preference
from longhorizon.core.episode import Termination, to_device
from longhorizon.envs import host_wrappers
from longhorizon.envs import tasks as task_suites
from longhorizon.envs.notebook import Notebook
from longhorizon.models import (Critic, ModelConfig, PolicyWithValue, Transformer, init_params,
                                lora, sharding, tiny_config)
from longhorizon.models import checkpoint as checkpoint_lib
from longhorizon.rollout.store import KEEP, StoreError, TrajectoryStore
from longhorizon.train import config as config_lib
from longhorizon.train.algorithms import AlgorithmOptions, compute_advantages, segment_advantages
from longhorizon.train.metrics import Timer
from longhorizon.envs import pool as pool_lib
from longhorizon.train.options import ContextOptions, OptimOptions, PoolOptions, RolloutOptions
from longhorizon.train.policy_losses import LossOptions
from longhorizon.train.update import (LearnInputs, TrainState, critic_values, episode_logprobs,
                                      dpo_update, jit_rl_update, make_optimizer, sft_update)

__all__ = ["Learner", "key", "make_env", "check_process_split", "episode_metrics",
           "stored_demonstrations"]


def key(seed: int, *path: int) -> jax.Array:
  """The PRNG key of stream `path` of a run with `seed` (e.g. `key(seed, 5, update)`)."""
  k = jax.random.key(seed)
  for p in path:
    k = jax.random.fold_in(k, p)
  return k


def make_env(config) -> envs.Environment | envs.HostEnvironment:
  """The configured environment with its wrappers (TimeLimit innermost); its reward is
  `config.reward` (when the config has that section; `envs.RewardSpec` fields). A host environment
  gets no JAX wrappers (the loop's `env.max_steps` limits it): its faults, tool costs and loop
  detection run around its calls (`envs.host_wrappers.guard`), its pool options from
  `config.pool`."""
  params = dict(config.env.params)
  if "reward" in config:
    clash = sorted(set(params) & {"reward", *config.reward.keys()})
    if clash:
      raise config_lib.ConfigError(
          f"config.env.params sets {clash}: the reward weights are config.reward's "
          f"(--config.reward.<field>=...), not environment parameters.")
    params["reward"] = envs.RewardSpec(**config.reward)
  if "context" in config and config.context.mode == "offload":  # wraps a host environment
    reward = params.pop("reward", None)
    return _host_env(config, Notebook(config.env.name, params, reward=reward,
                                      max_words=config.context.offload_words,
                                      preview_words=config.context.offload_preview))
  env = envs.make(config.env.name, **params)
  if envs.is_host(env):
    return _host_env(config, env)
  env = envs.TimeLimit(env, config.env.max_steps)
  faults = {k: dict(v) if hasattr(v, "items") else v for k, v in config.env.faults.items()}
  if any(r > 0 for v in faults.values() for r in (v.values() if isinstance(v, dict) else [v])):
    try:
      env = envs.FaultInjection(env, faults, tuple(config.env.env_error_kinds))
    except ValueError as e:  # a tool name the environment lacks
      raise config_lib.ConfigError(f"env.faults: {e}") from None
  if config.env.tool_costs:
    env = envs.ToolCost(env, dict(config.env.tool_costs))
  if config.env.loop_k:
    env = envs.LoopDetector(env, config.env.loop_k)
  return env


def _host_env(config, env: envs.HostEnvironment) -> envs.HostEnvironment:
  """Faults, tool costs and loop detection as the rollout loop applies them around a host
  environment's calls (`envs/host_wrappers.py`: the JAX wrappers' semantics), and the pool."""
  if config.env.faults or config.env.tool_costs or config.env.loop_k:
    forks = [name for name in ("branch_k", "recovery_groups") if config.rollout.get(name)]
    if config.env.faults and forks:
      raise config_lib.ConfigError(
          f"config.env.faults with rollout.{forks[0]}: branch and recovery rollouts of a host "
          "environment replay the pool's history to reach a saved state, which a faulted call "
          "(never made) would put out of step; set one of them to 0.")
    try:
      faults = {k: dict(v) if hasattr(v, "items") else v for k, v in config.env.faults.items()}
      host_wrappers.guard(env, faults=faults,
                          env_error_kinds=tuple(config.env.env_error_kinds),
                          tool_costs=dict(config.env.tool_costs or {}), loop_k=config.env.loop_k)
    except ValueError as e:  # an unknown kind or tool, rates past 1
      raise config_lib.ConfigError(f"env.faults / env.tool_costs / env.loop_k: {e}") from None
  if "pool" in config:
    pool_lib.configure_pool(env, **PoolOptions.from_config(config).pool_kwargs())
  return env


def check_process_split(config, eval_size: int, process_count: int | None = None):
  """Multi-host runs split each update's tasks, and the `eval_size` evaluation tasks, evenly
  over the processes: raises a ValueError naming the field when they cannot be."""
  count = jax.process_count() if process_count is None else process_count
  for field, n in (("rollout.num_tasks", config.rollout.num_tasks), ("eval.num_tasks", eval_size)):
    if n % count:
      raise ValueError(
          f"config.{field}={n} cannot be split evenly over {count} JAX processes (each collects "
          f"an equal share of the tasks); use a multiple of {count}, e.g. "
          f"--config.{field}={-(-n // count) * count}.")


@functools.partial(jax.jit, static_argnames=("config", "temperature", "chunk_size", "with_entropy"))
def _logprobs(params, batch, *, config, temperature, chunk_size=4096, with_entropy=False,
              value_head=None):
  return episode_logprobs(params, config, batch, temperature=temperature, chunk_size=chunk_size,
                          return_entropy=with_entropy, value_head=value_head)


_critic_values = jax.jit(critic_values, static_argnames=("config",))


def _init_critic(model_config: ModelConfig, rng, shared: bool):
  """Fresh critic parameters: a separate `Critic` (its own trunk and value head), or for the
  shared critic only the `value_head` of the family's `PolicyWithValue` (its trunk is the policy;
  jitted, so the unused trunk initialisation is compiled away)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  if not shared:
    return nn.meta.unbox(Critic(model_config).init(rng, tokens)["params"])
  head = lambda k: nn.meta.unbox(PolicyWithValue(model_config).init(
      k, tokens, compute_logits=False)["params"]["value_head"])
  return jax.jit(head)(rng)


def _policy(config, env) -> tuple[ModelConfig, Any, Any]:
  """`(model config, parameters, codec)`: a checkpoint's, or a fresh tiny decoder over the codec's
  own tokenizer."""
  m = config.model
  lora_fields = {}
  if "lora" in m and m.lora.rank:
    lora_fields = dict(lora_rank=m.lora.rank, lora_alpha=m.lora.alpha,
                       lora_targets=tuple(m.lora.targets), lora_dropout=m.lora.dropout)
  if m.checkpoint:  # its own family and shapes; the decode kernel (and adapters) are the config's
    model_config, params, tokenizer = checkpoint_lib.load(m.checkpoint)
    model_config = dataclasses.replace(model_config, decode_kernel=m.decode_kernel,
                                       dtype=m.get("dtype", "float32"),
                                       remat=m.get("remat", "none"),
                                       decode_quant=m.get("decode_quant", "none"), **lora_fields)
    params = _initial_adapters(lora.add_adapters(params, model_config, key(config.seed, 1)),
                               model_config, m)
    return model_config, params, env.codec(tokenizer, config.env.style)
  codec = env.codec(None, config.env.style)
  moe_fields = {}
  if "moe" in m and m.moe.num_experts:  # a fresh Qwen3-MoE
    moe_fields = dict(model_type="qwen3_moe", qk_norm=True, num_experts=m.moe.num_experts,
                      num_experts_per_tok=m.moe.experts_per_token,
                      moe_intermediate_size=m.moe.intermediate_size, norm_topk_prob=True,
                      router_aux_loss_coef=m.moe.aux_loss_coef)
  model_config = dataclasses.replace(
      tiny_config(), vocab_size=len(codec.tokenizer), hidden_size=m.hidden_size,
      num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
      num_key_value_heads=m.num_key_value_heads, intermediate_size=m.intermediate_size,
      head_dim=m.hidden_size // m.num_attention_heads, dtype=m.dtype, family=m.family,
      decode_kernel=m.decode_kernel, decode_quant=m.get("decode_quant", "none"),
      remat=m.get("remat", "none"), **lora_fields,
      **moe_fields)
  return model_config, _initial_adapters(init_params(model_config, key(config.seed, 1)),
                                         model_config, m), codec


def _initial_adapters(params, model_config: ModelConfig, m):
  """`params` with the adapters of the peft folder `model.lora.init` (a `save_adapters` or
  `experiments/export.py` output: e.g. a committed SFT warm start) in place of the fresh ones
  (A random, B zero); unchanged when the field is empty."""
  folder = m.lora.get("init", "") if "lora" in m else ""
  if not folder:
    return params
  params = lora.load_adapters(folder, params, model_config)
  logging.info("LoRA adapters from %s (adapter_model.safetensors sha256 %s).", folder,
               lora.adapter_digest(folder))
  return params


def _task_suites(config, env) -> tuple[Any, dict]:
  """`(train tasks, {"test": ..., "ood": ...})`, generated on first use (by process 0 alone in a
  multi-host run, while the others wait)."""
  sizes = {"train": config.tasks.train_size, "test": config.tasks.test_size,
           "ood": config.tasks.ood_size}
  if envs.is_host(env):  # JSON task specs from the environment itself (cheap, deterministic)
    tasks = {split: env.tasks(split, n, config.tasks.seed) for split, n in sizes.items()}
    return tasks["train"], {split: tasks[split] for split in ("test", "ood")}
  data_dir = config.tasks.data_dir or None
  if jax.process_count() > 1:
    if jax.process_index() == 0:
      task_suites.build(config.env.name, dict(config.env.params), config.tasks.seed, sizes,
                        data_dir)
    multihost_utils.sync_global_devices("longhorizon.setup.task_suites")
  load = functools.partial(task_suites.load, config.env.name, env_params=dict(config.env.params),
                           seed=config.tasks.seed, sizes=sizes, data_dir=data_dir)
  return load("train"), {split: load(split) for split in ("test", "ood")}


def _mesh_rules(config) -> tuple:
  return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
               for name, axes in config.mesh.rules.items())


@dataclasses.dataclass(frozen=True, eq=False)
class Learner:
  """Everything a run builds from its config; its one piece of training state is the recovery
  starts it keeps between updates (`rollout.recovery_groups`). See the module doc."""
  config: Any  # the validated ConfigDict (read by the drivers: eval, sft, curriculum, alarms)
  env: envs.Environment
  codec: Any
  model_config: ModelConfig
  init_params: Any
  train_tasks: Any
  eval_tasks: dict
  mesh: Any  # jax.sharding.Mesh when config.mesh has more than one device, else None
  rollout: RolloutOptions
  algorithm: AlgorithmOptions
  loss: LossOptions  # its `agg` resolved ("" -> the algorithm's default)
  optim: OptimOptions
  optimizer: Any
  # None unless the algorithm needs a critic; with algorithm.critic='shared' it steps the value
  # head alone (the trunk is the policy's, stepped by `optimizer`)
  critic_optimizer: Any
  context: ContextOptions  # config.context: the context mode of every collect (rollout/context.py)
  # The jitted update(s), built on first use; never shared with a copy (`dataclasses.replace` or
  # `with_config` may change what they close over).
  _jitted: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
  # Recovery starts kept from earlier training collects (`rollout.recovery_groups`); each copy of
  # a learner starts with none.
  _kept: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

  # ------------------------------------------------------------------------------ construction
  @classmethod
  def build(cls, config) -> "Learner":
    """The learner of a validated config: environment, codec, tasks, policy, mesh, options."""
    config_lib.validate(config)
    env = make_env(config)
    model_config, params, codec = _policy(config, env)
    train_tasks, eval_tasks = _task_suites(config, env)
    source = eval_tasks.get(config.eval.split, train_tasks)
    check_process_split(config, min(config.eval.num_tasks, len(source)))
    mesh = None
    if config.mesh.data * config.mesh.fsdp * config.mesh.tensor > 1:
      # Parameters (and so optimiser state) are placed by the config's logical-axis rules: fsdp
      # shards the model width, tensor the heads / MLP / vocabulary. Each process's own devices: in
      # a multi-host run the parameters are replicated across hosts.
      mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                                devices=jax.local_devices())
      params = sharding.shard_params(params, Transformer(model_config),
                                     jnp.zeros((1, 1), jnp.int32), mesh, _mesh_rules(config))
    return cls.from_parts(config, env=env, codec=codec, model_config=model_config,
                          init_params=params, train_tasks=train_tasks, eval_tasks=eval_tasks,
                          mesh=mesh)

  @classmethod
  def from_parts(cls, config, **parts) -> "Learner":
    """A learner of `config` over already-built parts (environment, codec, model, tasks, mesh):
    the typed options and optimisers are built here, from the config."""
    algorithm = AlgorithmOptions.from_config(config)
    loss = LossOptions.from_config(config)
    loss = dataclasses.replace(loss, agg=loss.agg or algorithm.spec.default_agg,
                               norm_length=loss.norm_length or config.rollout.context_length)
    optim = OptimOptions.from_config(config)
    total = max(config.num_updates * optim.epochs * optim.minibatches, 1)
    optimizer = make_optimizer(optim.learning_rate, warmup_steps=optim.warmup_steps,
                               total_steps=total, schedule=optim.schedule,
                               max_grad_norm=optim.max_grad_norm,
                               weight_decay=optim.weight_decay, b1=optim.b1, b2=optim.b2,
                               skip_zero_grad=optim.skip_zero_grad)
    critic_optimizer = None
    if algorithm.spec.needs_critic:
      critic_optimizer = make_optimizer(optim.critic_learning_rate,
                                        max_grad_norm=optim.max_grad_norm)
    return cls(config=config, rollout=RolloutOptions.from_config(config), algorithm=algorithm,
               loss=loss, optim=optim, optimizer=optimizer, critic_optimizer=critic_optimizer,
               context=ContextOptions.from_config(config), **parts)

  def with_config(self, config, **parts) -> "Learner":
    """This learner's environment, codec, tasks, model and mesh under another config (e.g. another
    algorithm): new options, optimisers and jitted update. `parts` replace parts (`init_params`)."""
    for section in ("env", "reward", "tasks", "model", "mesh"):
      if config[section].to_dict() != self.config[section].to_dict():
        raise ValueError(f"Learner.with_config keeps the environment, tasks, model and mesh; "
                         f"config.{section} differs: build a new Learner for it.")
    keep = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name in ("env", "codec", "model_config", "init_params", "train_tasks",
                          "eval_tasks", "mesh")}
    return Learner.from_parts(config_lib.validate(config), **{**keep, **parts})

  @property
  def reward(self) -> envs.RewardSpec:
    """The run's reward: its environment's `reward_spec` (built from `config.reward`)."""
    return self.env.reward_spec

  def in_mesh(self):
    """A context with the run's mesh and logical-axis rules active (a no-op on one device)."""
    if self.mesh is None:
      return contextlib.nullcontext()
    return sharding.mesh_context(self.mesh, _mesh_rules(self.config))

  @property
  def shared_critic(self) -> bool:
    """Whether the critic is a value head on the policy's trunk (`algorithm.critic='shared'`)."""
    return self.critic_optimizer is not None and self.algorithm.critic == "shared"

  def initial_state(self) -> TrainState:
    """The state before any update: the initial policy, fresh optimiser states and, for an
    algorithm with a critic, a fresh critic (with the shared critic: only its value head)."""
    critic_params = critic_opt = None
    if self.critic_optimizer is not None:
      critic_params = _init_critic(self.model_config, key(self.config.seed, 2),
                                   self.shared_critic)
      critic_opt = self.critic_optimizer.init(critic_params)
    return TrainState(params=self.init_params, opt_state=self.init_opt_state(self.init_params),
                      critic_params=critic_params, critic_opt_state=critic_opt,
                      step=jnp.zeros((), jnp.int32), policy_version=jnp.zeros((), jnp.int32),
                      rng=key(self.config.seed, 3), skipped=jnp.zeros((), jnp.int32))

  def init_opt_state(self, params, optimizer=None):
    """`optimizer`'s (default: the RL optimiser's) state for `params`' trainable part: every
    parameter, or with LoRA the adapters alone (`lora.partition`)."""
    return (optimizer or self.optimizer).init(lora.partition(params, self.model_config)[0])

  def with_reference(self, state: TrainState) -> TrainState:
    """Freezes a copy of the current (warm-start) policy as the KL reference when the KL is on.
    With LoRA nothing is copied by default (`loss.kl_reference="auto"`): the reference is the
    base model, the adapters switched off (`reference_logprobs`); with
    `loss.kl_reference="warm_start"` a copy of the adapters alone is frozen."""
    if not self.loss.kl_coef > 0:
      return state
    if not self.model_config.lora_rank:
      return state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
    if self.loss.kl_reference == "warm_start":
      return state.replace(ref_params=jax.tree.map(jnp.copy, lora.adapters(state.params)))
    return state

  def reference_logprobs(self, state: TrainState, db):
    """The KL reference's `[B, L]` log-probs of `db`: the frozen copy in `state.ref_params` (with
    LoRA: frozen adapters, put on the policy's own base weights), or with LoRA the base model
    (`lora.base_params` under `lora.base_config`: the same frozen arrays, no adapters); None when
    the KL is off (and no reference was frozen)."""
    if state.ref_params is not None and self.model_config.lora_rank:
      return self.logprobs(lora.combine(state.ref_params, lora.base_params(state.params)), db)
    if state.ref_params is not None:
      return self.logprobs(state.ref_params, db)
    if self.model_config.lora_rank and self.loss.kl_coef > 0:
      return self.logprobs(lora.base_params(state.params), db,
                           config=lora.base_config(self.model_config))
    return None

  # ---------------------------------------------------------------------------------- episodes
  def collect_config(self, max_steps: int | None = None, **overrides):
    """`rollout.collect_config` with this run's context mode (`config.context`); `max_steps`
    defaults to `env.max_steps`."""
    steps = self.config.env.max_steps if max_steps is None else max_steps
    return self.rollout.collect_config(steps, context=self.context, **overrides)

  def tasks_at(self, start: int, count: int):
    n = len(self.train_tasks)
    return task_suites.stack(self.train_tasks, [(start + i) % n for i in range(count)])

  def collect_batch(self, params, update: int, data_position: int, timer: Timer,
                    task_indices=None, *, policy_version: int | None = None, on_env_step=None,
                    step_budget: int | None = None, params_source=None):
    """The rollout half of RL update `update`: `(EpisodeBatch, RolloutStats)` sampled with
    `params`. Tasks are the next `num_tasks` train tasks from `data_position`, or `task_indices`
    (curriculum). In a multi-host run each process collects its share and all get the whole batch.
    Environment keys, sampling seed and group labels derive from `update`; `policy_version`
    (default `update`) is recorded on every episode; `on_env_step` goes to `rollout.collect`;
    `step_budget` (a horizon curriculum's) truncates episodes sooner than `env.max_steps`;
    `params_source` (the async pipeline's newest published policy, with
    `rollout.continue_partial`) goes to `rollout.collect` with `rollout.partial_cache`."""
    c, n = self.config, self.rollout.num_tasks
    starts = self._recovery_starts()
    fresh = n - (len(starts) if starts is not None else 0)
    if task_indices is None:
      tasks = self.tasks_at(data_position, fresh)
    else:
      tasks = task_suites.stack(self.train_tasks, list(task_indices)[:fresh])
    extra = {} if on_env_step is None else {"on_env_step": on_env_step}
    if params_source is not None:
      extra.update(params_source=params_source,
                   reprefill=self.rollout.partial_cache == "reprefill")
    rc = self.collect_config(
        c.env.max_steps, branch=True,
        record_oracle=self.rollout.record_oracle or self.algorithm.step_verifier == "oracle",
        label_parts=self.algorithm.labels_parts, step_budget=step_budget)
    common = dict(sampling_seed=c.seed * 1_000_003 + update, task_seed=c.tasks.seed,
                  policy_version=update if policy_version is None else policy_version, **extra)
    with timer("rollout"):
      batch, stats = rollout.collect_across_processes(
          params, self.model_config, self.env, self.codec, tasks,
          jax.random.split(key(c.seed, 5, update), n)[:fresh], rc, group_offset=update * n,
          **common)
      if self.rollout.recovery_groups:
        batch, stats = self._with_recovery(params, batch, stats, starts, rc, update, common)
    return batch, stats

  def _recovery_starts(self):
    """This update's recovery starts (newest first), None when off or none are kept yet."""
    if not self.rollout.recovery_groups:
      return None
    if jax.process_count() > 1:
      raise ValueError("rollout.recovery_groups needs a single-process run: the starts are kept "
                       "by each process's own collect.")
    pool = self._kept.setdefault("recovery", rollout.RecoveryPool(self.rollout.recovery_capacity))
    return pool.pop(self.rollout.recovery_groups)

  def _with_recovery(self, params, batch, stats, starts, rc, update: int, common: dict):
    """`batch` (the fresh tasks) followed by the recovery groups of `starts` (one group of G per
    start, after the fresh groups and rows); keeps the fresh batch's new starts."""
    new_starts, fresh = stats.recovery, batch.batch_size // rc.group_size
    info = {"recovery/groups": 0.0, "recovery/success_rate": float("nan"),
            "recovery/start_step": float("nan")}
    if starts is not None:
      back, back_stats = rollout.collect_recovery(
          params, self.model_config, self.env, self.codec, starts,
          dataclasses.replace(rc, branch_k=0, recovery_from=""),
          group_offset=update * self.rollout.num_tasks + fresh,
          row_offset=batch.batch_size, **common)
      batch = jax.tree.map(lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)]),
                           batch, back)
      stats = rollout.merge_stats(stats, back_stats)
      info = {"recovery/groups": float(len(starts)),
              "recovery/success_rate": float(np.mean(back.success)),
              "recovery/start_step": float(np.mean(starts.steps))}
    self._kept["recovery"].add(new_starts)
    stats.extra.update(info, **{"recovery/kept": float(len(self._kept["recovery"]))})
    return batch, stats

  def logprobs(self, params, batch, *, temperature: float | None = None, config=None):
    """`[B, L]` token log-probs of `batch` under `params` (at the rollout temperature), with the
    run's model config or `config` (e.g. `lora.base_config` for the adapters-off reference)."""
    t = self.rollout.temperature if temperature is None else temperature
    return _logprobs(params, batch, config=config or self.model_config, temperature=t,
                     chunk_size=self.loss.chunk_size)

  # ---------------------------------------------------------------------------------- learning
  def learn(self, state: TrainState, batch, stats, timer: Timer, row_scale=None, extra=None):
    """The learning half of an RL update on `batch` (from `collect_batch`): the proximal,
    reference and critic passes, the advantages and the jitted update. Returns `(state,
    metrics)`; `state` is donated. `row_scale` (`[B]`, optional) multiplies the row weights: the
    async learner's staleness filter (0 drops an episode, < 1 down-weights it); a `[B, L]` one
    weighs each token instead (the filter with partial rollouts, by each token's own lag).
    `extra` (optional): `(rows, scale)`, rows trained on after the batch's with row weights
    multiplied by `scale` (`[R]`): the groups replayed from the trajectory store
    (`train/replay.py`); the episode metrics stay the batch's."""
    with timer("update"):
      rows = episode_lib.join_segments(batch, stats.segments)  # context segments: their rows too
      if extra is not None:
        extra_rows, extra_scale = extra
        fresh_scale = (np.ones((rows.batch_size,), np.float32) if row_scale is None
                       else np.asarray(row_scale, np.float32))
        row_scale = np.concatenate([fresh_scale, np.asarray(extra_scale, np.float32)])
        rows = jax.tree.map(lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)]), rows,
                            extra_rows)
      rows = self.trimmed(rows)
      prefix = episode_lib.shared_prefix_length(rows, self.optim.share_prefix)
      db = to_device(rows)
      if self.mesh is not None:  # data-parallel inputs: rows split over (data, fsdp)
        db = sharding.shard_batch(db, self.mesh, _mesh_rules(self.config))
      inputs = self.learn_inputs(state, db, row_scale)
      state, m = self.update(state, db, inputs, prefix)
      m = jax.device_get(m)
    metrics = {k: float(np.asarray(v)) for k, v in m.items()}
    metrics.update(episode_metrics(batch, np.asarray(inputs.row_weight)[:batch.batch_size]))
    if stats.segments is not None:
      metrics["context/rows_per_episode"] = float(
          np.asarray(rows.loss_mask).any(-1).sum() / batch.batch_size)
    metrics["update_length"] = float(np.shape(db.tokens)[1])
    metrics["_task_success"] = np.asarray(batch.success).reshape(self.rollout.num_tasks, -1).mean(-1)
    metrics.update({k: float(v) for k, v in stats.as_dict().items()})
    return state, metrics

  def trimmed(self, batch):
    """`batch` cut to the shortest of `optim.length_buckets` lengths that holds its episodes (the
    update's and SFT's shapes: at most that many compilations each), without its recorded routing
    when `model.moe.replay` is off."""
    full = np.shape(batch.tokens)[1]
    if batch.routing is not None and not self.config.model.get("moe", {}).get("replay", True):
      batch = batch.replace(routing=None)  # replay off: the learner recomputes the routing
    return episode_lib.trim(batch, episode_lib.bucket_length(
        episode_lib.used_length(batch), full, self.optim.length_buckets))

  def step(self, state: TrainState, update: int, data_position: int, timer: Timer, hook=None,
           task_indices=None, step_budget: int | None = None, on_batch=None, replay=None):
    """One synchronous RL update: `collect_batch` with the current parameters, then `learn`.
    `on_batch(batch, stats)`, if given, is called after `learn` with the batch it trained on (the
    training loop's trajectory store). `replay` (a `train.replay.StoreReplay`, optional) adds the
    groups it draws from the store to the update's rows."""
    batch, stats = self.collect_batch(state.params, update, data_position, timer, task_indices,
                                      step_budget=step_budget)
    if hook is not None:
      hook("update", update)
    extra, replay_metrics = {}, {}
    if replay is not None:
      with timer("replay"):
        replayed, scale, replay_metrics = replay.extend(batch, update)
      extra = {"extra": (replayed, scale)}
    state, metrics = self.learn(state, batch, stats, timer, **extra)
    metrics.update(replay_metrics)
    if on_batch is not None:
      on_batch(batch, stats)
    return state, metrics

  def learn_inputs(self, state: TrainState, db, row_scale=None) -> LearnInputs:
    """The update's inputs for the device batch `db`: the loss's anchor log-probs (the proximal
    policy's, `state.params` before the update, or the behaviour ones), critic values, advantages
    with their row weights, and the KL reference's log-probs. The shared critic's values are
    `state.params`' trunk under `state.critic_params`' head, from the proximal pass when there is
    one (else a pass of their own)."""
    old_logp, entropy, values = db.behavior_logprobs, None, None
    if self.algorithm.empg:  # EMPG's step entropies: the current policy's, one extra pass
      logp, entropy = _logprobs(state.params, db, config=self.model_config,
                                temperature=self.rollout.temperature,
                                chunk_size=self.loss.chunk_size, with_entropy=True)
      if self.loss.spec.anchor == "proximal":
        old_logp = logp
    elif self.loss.spec.anchor == "proximal" and not self.loss.reuse_behaviour_logprobs:
      if self.shared_critic:  # one trunk pass: proximal log-probs and rollout-time values
        old_logp, values = _logprobs(state.params, db, config=self.model_config,
                                     temperature=self.rollout.temperature,
                                     chunk_size=self.loss.chunk_size,
                                     value_head=state.critic_params)
      else:
        old_logp = self.logprobs(state.params, db)
    if self.critic_optimizer is not None and values is None:
      trunk = (state.params,) if self.shared_critic else ()
      values = _critic_values(state.critic_params, self.model_config, db, *trunk)
    if episode_lib.num_episodes(db) < db.batch_size:  # context segments: credit per episode
      adv = segment_advantages(db, self.algorithm)
    else:
      adv = compute_advantages(db, values, self.algorithm, entropy)
    row_weight, token_weight = adv.row_weight, None
    if row_scale is not None and np.ndim(row_scale) == 2:  # per-token (partial rollouts)
      token_weight = jnp.asarray(row_scale, jnp.float32)[:, :db.tokens.shape[1]]
    elif row_scale is not None:
      row_weight = row_weight * jnp.asarray(row_scale, row_weight.dtype)
    ref_logp = self.reference_logprobs(state, db)
    return LearnInputs(adv.advantages, adv.returns, row_weight, old_logp, ref_logp, values,
                       token_weight)

  def update(self, state: TrainState, db, inputs: LearnInputs, prefix_length: int = 0):
    """The jitted update on the device batch `db` with its `inputs` (`learn_inputs`): `(state,
    metrics)`, `state` donated. `prefix_length`: the batch's shared prefix
    (`episode.shared_prefix_length`, with `optim.share_prefix`), computed once per minibatch."""
    return self.update_fn(state, db, inputs, prefix_length)(state, db, inputs)

  def update_fn(self, state, db, inputs, prefix_length: int = 0):
    """The jitted update function for these arguments' layout and shared-prefix length (one per
    learner and length; on a mesh, one per input layout, which it takes as its explicit in/out
    shardings)."""
    layout = None
    if self.mesh is not None:
      replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      layout = (*(jax.tree.map(lambda x: x.sharding, t) for t in (state, db, inputs)), replicated)
    cache_key = (prefix_length, None if layout is None else (jax.tree.structure(layout),
                                                             *jax.tree.leaves(layout)))
    if cache_key not in self._jitted:
      self._jitted[cache_key] = jit_rl_update(
          config=self.model_config, optimizer=self.optimizer,
          critic_optimizer=self.critic_optimizer, loss=self.loss,
          temperature=self.rollout.temperature, epochs=self.optim.epochs,
          minibatches=self.optim.minibatches, shardings=layout,
          shared_critic=self.shared_critic, prefix_length=prefix_length)
    return self._jitted[cache_key]

  # ---------------------------------------------------------------------- warm start, evaluation
  def warm_start(self, state: TrainState, on_step=None) -> tuple[TrainState, dict]:
    """SFT on oracle episodes of train tasks (the same masks as RL), from `state`'s parameters;
    with `sft.store` a trajectory store, on its newest successful episodes instead
    (`stored_demonstrations`).

    `on_step(step, params, metrics)`, if given, is called after every step (step 1..sft.steps)
    with the current parameters (not donated until the next step returns): how a calibration
    evaluates the warm start as SFT proceeds."""
    c = self.config
    if not c.sft.steps:
      return state, {}
    n = c.sft.episodes
    start = time.perf_counter()
    segments = None  # the demonstrations' earlier context segments (context.mode window/summary)
    if c.sft.get("store"):
      batch = stored_demonstrations(c.sft.store, n, c.rollout.context_length, c.env.max_steps,
                                    env_version=rollout.env_version(self.env))
    else:
      batch, demo_stats = self.oracle_episodes(self.tasks_at(0, n), key(c.seed, 4),
                                               c.sft.demo_epsilon)
      segments = demo_stats.segments
    logging.info("SFT: %d demonstration episodes in %.1f s (success %.2f, %.1f steps and %.0f "
                 "tokens each).", n, time.perf_counter() - start, float(batch.success.mean()),
                 float(np.mean(batch.num_steps)),
                 float(np.asarray(batch.attention_mask).sum(-1).mean()))
    if not c.sft.get("store") and not c.sft.demo_epsilon and not batch.success.all():
      logging.warning("oracle SFT episodes: only %.2f succeed (context budget, turn budget "
                      "rollout.turn_tokens or step limit too small?)", float(batch.success.mean()))
    rows = episode_lib.join_segments(batch, segments)
    if segments is not None:  # segment rows past an episode's last hold nothing to train on
      rows = episode_lib.without_empty_segments(rows, batch.batch_size, c.sft.minibatches)
    rows = self.trimmed(rows)
    prefix = episode_lib.shared_prefix_length(rows, self.optim.share_prefix)
    batch = to_device(rows)
    sft_opt = make_optimizer(c.sft.learning_rate, max_grad_norm=self.optim.max_grad_norm)
    sft_state = state.replace(opt_state=self.init_opt_state(state.params, sft_opt))
    metrics, start, every = {}, time.perf_counter(), max(1, c.sft.steps // 5)
    for step in range(1, c.sft.steps + 1):
      sft_state, metrics = sft_update(sft_state, batch, config=self.model_config,
                                      optimizer=sft_opt, minibatches=c.sft.minibatches,
                                      prefix_length=prefix)
      # One step in flight: on a multi-device mesh the CPU client deadlocks once a device has 32
      # queued computations with collectives (BUILD_NOTES.md, issue 15, "sharded SFT deadlock").
      jax.block_until_ready(sft_state)
      if on_step is not None:
        on_step(step, sft_state.params, metrics)
      if step % every == 0 or step == c.sft.steps:
        logging.info("SFT step %d/%d: nll %.3f, token accuracy %.3f (%.1f s).", step, c.sft.steps,
                     float(metrics["sft_nll"]), float(metrics["sft_token_accuracy"]),
                     time.perf_counter() - start)
    metrics = {k: float(v) for k, v in metrics.items()}
    # `sft_update` donated `sft_state` (and the buffers it shared with `state`): continue from it.
    return sft_state.replace(opt_state=self.init_opt_state(sft_state.params)), metrics

  def oracle_episodes(self, tasks, rng, epsilon: float = 0.0):
    """`rollout.collect`'s `(batch, stats)` of the environment's oracle on `tasks` (one episode
    each, env keys split from `rng`; with `epsilon` a noisy demonstrator, `rollout.oracle_turns`):
    SFT demonstrations, or teacher-forced probes."""
    n = task_suites.count(tasks)
    return rollout.collect(
        None, None, self.env, self.codec, tasks, jax.random.split(rng, n),
        self.collect_config(group_size=1), sampling_seed=0,
        scripted=rollout.oracle_turns(self.env, self.codec, epsilon, seed=self.config.seed))

  def dpo(self, state: TrainState, batch, pairs, opts) -> tuple[TrainState, dict]:
    """`opts.steps` passes of `dpo_update` (`PreferenceOptions` `opts`) over the preference `pairs`
    (`core.preference.Pairs`) of the host `batch`, from `state`'s policy, which is also the
    reference: its summed log-probs of each pair's scored tokens are computed once here, so no
    second copy of the weights is kept. Returns `(state, last pass's metrics)`; the RL optimiser
    state starts afresh after it."""
    chosen_mask, rejected_mask = preference.pair_masks(batch, pairs, opts.level)
    rows = np.concatenate([pairs.chosen, pairs.rejected])
    db = to_device(self.trimmed(jax.tree.map(lambda a: np.asarray(a)[rows], batch)))
    masks = np.concatenate([chosen_mask, rejected_mask])[:, :db.tokens.shape[1]]
    ref = np.sum(np.asarray(self.logprobs(state.params, db)) * masks, axis=-1)
    optimizer = make_optimizer(opts.learning_rate, max_grad_norm=self.optim.max_grad_norm)
    state = state.replace(opt_state=self.init_opt_state(state.params, optimizer))
    metrics, every = {}, max(1, opts.steps // 5)
    for step in range(1, opts.steps + 1):
      state, metrics = dpo_update(state, db, masks, ref, config=self.model_config,
                                  optimizer=optimizer, beta=opts.beta,
                                  label_smoothing=opts.label_smoothing,
                                  sft_weight=opts.sft_weight, minibatches=opts.minibatches, temperature=self.rollout.temperature)
      jax.block_until_ready(state)  # one step in flight (see `warm_start`)
      if step % every == 0 or step == opts.steps:
        logging.info("DPO pass %d/%d: loss %.4f, margin %.3f, pair accuracy %.2f.", step,
                     opts.steps, float(metrics["dpo_loss"]), float(metrics["dpo_margin"]),
                     float(metrics["dpo_accuracy"]))
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    return state.replace(opt_state=self.init_opt_state(state.params)), metrics

  def evaluate(self, params, split: str, num_tasks: int, *, temperature: float, seed: int,
               group_size: int = 1) -> dict:
    """Success rate (and episode stats) of `params` on the first `num_tasks` tasks of `split`."""
    source = self.eval_tasks.get(split, self.train_tasks)
    n = min(num_tasks, len(source))
    batch, _ = rollout.collect_across_processes(
        params, self.model_config, self.env, self.codec, task_suites.stack(source, range(n)),
        jax.random.split(key(seed, 7), n),
        self.collect_config(group_size=group_size,
                                    temperature=temperature),
        sampling_seed=seed)
    return {"success_rate": float(np.mean(batch.success)),
            "mean_steps": float(np.mean(batch.num_steps)),
            "truncation_rate": float(np.mean(batch.truncated)),
            "env_error_rate": float(np.mean(np.asarray(batch.env_error).any(-1)))}


def stored_demonstrations(path: str, n: int, context_length: int, max_steps: int,
                          env_version: int | None = None):
  """The newest `n` distinct successful episodes of the trajectory store at `path` (no
  environment error, truncation or parse failure; one per canonical action sequence), as one host
  EpisodeBatch padded to `context_length` x `max_steps`: SFT data from earlier runs (rejection
  sampling). Each row trains on its own `loss_mask` (a branch row's copied prefix is its parent's).
  With `env_version` (the learner passes its environment's) only episodes of that environment
  count (`store.matching_versions`). Raises `StoreError` naming the count when the store holds
  fewer."""
  store = TrajectoryStore(path)
  versions = None if env_version is None else {"env_version": env_version}
  rows = store.rows(filters=KEEP["valid"], dedup=True, versions=versions)
  rows = rows.take(rows.success)
  if len(rows) < n:
    raise StoreError(f"sft.store={path!r}: {len(rows)} distinct valid successful episode(s) "
                     f"stored ({len(store)} in all), sft.episodes={n} asked for.")
  return store.load(rows.take(np.arange(len(rows) - n, len(rows))),
                    context_length=context_length, max_steps=max_steps)


def episode_metrics(batch, row_weight) -> dict:
  """Success, reward components, lengths, termination kinds and the zero-advantage group rate."""
  steps = np.asarray(batch.num_steps)
  out = {"success_rate": float(np.mean(batch.success)), "score": float(np.mean(batch.score)),
         "episode_steps": float(steps.mean()), "tool_calls": float(steps.mean()),
         "episode_tokens": float(np.asarray(batch.attention_mask).sum(-1).mean()),
         "sampled_tokens_per_episode": float(np.asarray(batch.loss_mask).sum(-1).mean()),
         "env_error_rate": float(np.mean(np.asarray(batch.env_error).any(-1))),
         "truncation_rate": float(np.mean(batch.truncated)),
         "violation_rate": float(np.mean(np.asarray(batch.violation).any(-1))),
         "trained_fraction": float(np.mean(np.asarray(row_weight) > 0))}
  kinds = np.asarray(batch.termination)
  for kind in Termination:
    if kind != Termination.RUNNING:
      out[f"termination/{kind.name.lower()}"] = float(np.mean(kinds == kind))
  for name, value in batch.reward_components.items():
    out[name] = float(np.mean(value))
  groups, scores = np.asarray(batch.group), np.asarray(batch.score)
  flat = [np.ptp(scores[groups == g]) == 0 for g in np.unique(groups)]
  out["zero_advantage_group_rate"] = float(np.mean(flat))
  out.update(first_error_metrics(batch))
  return out


def first_error_metrics(batch) -> dict:
  """Where episodes first leave the oracle's path, when the rollout recorded it
  (`EpisodeBatch.oracle_match`; roots only: a branch's or a recovery episode's copied steps are
  another episode's):
  `first_error/rate` (episodes with a non-oracle action), `/mean_step`, `/at_first_step` and
  `/step_k` (fractions of those episodes whose first error is at step k). Empty if not recorded."""
  match, roots = np.asarray(batch.oracle_match), np.asarray(batch.parent) == -1
  if not (match >= 0).any():
    return {}
  wrong = (match == 0)[roots]
  erring = wrong.any(-1)
  first = np.argmax(wrong, -1)[erring]
  out = {"first_error/rate": float(erring.mean())}
  if erring.any():
    counts = np.bincount(first, minlength=match.shape[1]) / len(first)
    out.update({"first_error/mean_step": float(first.mean()),
                "first_error/at_first_step": float(counts[0]),
                **{f"first_error/step_{k}": float(c) for k, c in enumerate(counts)}})
  return out
