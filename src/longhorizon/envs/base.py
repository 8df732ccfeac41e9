"""The `Environment` base class: functional, stateless, jittable and vmappable.

An environment subclass describes one task family with a handful of pure functions on fixed-shape
arrays (`generate_task`, `init`, `transition`, `error_observation`, `canonical_state`, `verify`,
`oracle`, and the text of its prompts and observations). The base class turns them into the common
API, so every environment treats these the same way:

* `reset(key, task=None)`: a task from the task stream of `key` unless one is given; the environment's
  own randomness uses a separate stream.
* `step(state, action)`: a malformed action (`action.error != NONE`) never reaches `transition`; the
  environment answers with an error observation and the `invalid` penalty of its `RewardSpec`
  (`envs/rewards.py`, the one reward definition). A finished row stays
  finished: stepping it returns its final time step with zero reward and milestones, and leaves the
  state unchanged.
* milestones are rewarded the first time only; a milestone that already holds in the initial state
  (`milestones_at_reset`) is marked reached at reset, so it never fires as progress; success is
  the verifier's verdict at termination, never on a violation; `anchor` hashes the canonical state
  the next action is taken in.

Nothing computed is stored on `self`; parameters are set at construction (`make(name, **params)`).
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.envs.codec import Codec
from longhorizon.envs.rewards import RewardSpec, reward_spec_of
from longhorizon.envs.types import Action, EnvState, ErrorCode, TimeStep, Tool, hash_tree, select

__all__ = ["Environment", "Transition", "RewardSpec", "SPLITS"]

SPLITS = ("train", "test", "ood")


class Transition(NamedTuple):
  """What an environment's `transition` returns for a well-formed action (one row)."""
  inner: Any  # the new dynamic state
  observation: dict  # structured observation (with "error")
  terminated: jax.Array  # [] bool
  milestones: jax.Array  # [M] bool: milestones that hold after this step (first-time logic is in base)
  violation: jax.Array = False  # [] bool: safety gate hit
  rejected: jax.Array = False  # [] bool: the env refused the action (counts as invalid)


class Environment(abc.ABC):
  """Base class of all environments. Subclasses set the class attributes and implement the
  abstract methods; see the module docstring for what the base class does with them."""

  name: str = ""
  version: str = "1"
  milestone_names: tuple[str, ...] = ()

  def __init__(self, reward: RewardSpec | None = None, **reward_kwargs):
    self.reward_spec = reward_spec_of(type(self).__name__, reward, reward_kwargs)

  # ------------------------------------------------------------------ what a subclass provides
  @property
  @abc.abstractmethod
  def tools(self) -> tuple[Tool, ...]:
    """The actions the policy may take."""

  @property
  def num_args(self) -> int:
    return max([1] + [len(t.args) for t in self.tools])

  @property
  def num_milestones(self) -> int:
    return len(self.milestone_names)

  @abc.abstractmethod
  def generate_task(self, key: jax.Array, split: str = "train") -> Any:
    """A task (pytree of fixed-shape arrays) drawn from `split`'s distribution. Jittable."""

  @abc.abstractmethod
  def init(self, task: Any, key: jax.Array) -> tuple[Any, dict]:
    """`(inner, observation)` at the start of `task`."""

  @abc.abstractmethod
  def transition(self, task: Any, inner: Any, action: Action, key: jax.Array) -> Transition:
    """One well-formed action (`action.error == NONE`, `0 <= action.tool < len(tools)`).

    An argument outside its `Arg` range (only a hand-built `Action` carries one: the codec refuses
    such text as BAD_ARGUMENT) must be refused like every built-in environment does: `rejected`,
    observation error INVALID_ARGUMENT, state unchanged."""

  @abc.abstractmethod
  def error_observation(self, task: Any, inner: Any, error: jax.Array) -> dict:
    """The observation answering an action that failed with `error` (state unchanged)."""

  @abc.abstractmethod
  def canonical_state(self, task: Any, inner: Any) -> Any:
    """Integer pytree identifying the state the next action is taken in (hashed into `anchor`).
    Include everything that matters for the future, nothing else (no step counters)."""

  @abc.abstractmethod
  def verify(self, task: Any, inner: Any) -> jax.Array:
    """[] bool: the final verifier, separate from any reward shaping."""

  @abc.abstractmethod
  def oracle(self, state: EnvState) -> Action:
    """A jittable policy that solves every task from any state it reaches."""

  # Text (host side, NumPy inputs). Compact-style text is space-separated words from
  # `vocabulary()` (punctuation as separate words), so word-level tokenizers cover it.
  @abc.abstractmethod
  def system_text(self, style: str) -> str:
    """What the policy is told before the task (the codec appends the action list in compact)."""

  @abc.abstractmethod
  def task_text(self, task: Any, style: str) -> str:
    """The task statement for one (unbatched, NumPy) task."""

  @abc.abstractmethod
  def observation_text(self, observation: dict, style: str) -> str:
    """The text of one observation whose error is NONE or environment-level (INVALID_ARGUMENT,
    NOT_ALLOWED); the codec writes parse errors and faults itself."""

  @abc.abstractmethod
  def vocabulary(self) -> list[str]:
    """Every word `system_text`, `task_text` and `observation_text` write in compact style
    (tool names, argument values and the codec's own words are added by the codec)."""

  def state_text(self, task: Any, inner: Any, style: str) -> str:
    """A summary of one (unbatched, NumPy) state, written in the task's place when
    `context.mode='summary'` rewrites the context (`rollout/context.py`): what the policy needs to
    go on from that state as from a fresh task, in the words of `vocabulary()`. Environments
    without one raise."""
    del task, inner, style
    raise NotImplementedError(
        f"environment {self.name!r} has no state summary (Environment.state_text), which "
        f"context.mode='summary' needs; use context.mode='window' or implement it.")

  def codec(self, tokenizer=None, style: str = "compact"):
    """The text codec for `tokenizer` (None: this environment's default) and `style`."""
    return Codec(self, tokenizer, style)

  def milestones_at_reset(self, task: Any, inner: Any) -> jax.Array:
    """[M] bool: the milestones that already hold in the initial state `inner` of `task`. `reset`
    marks them reached, so they never fire (no milestone reward, never in `TimeStep.milestones`):
    a milestone counts progress made by the policy. Default: none. Override it when a milestone can
    hold before any action, with the same function of the state that `transition` reports. Jittable.
    """
    del task, inner
    return jnp.zeros((self.num_milestones,), bool)

  def episode_info(self, task: Any, inner: Any) -> dict:
    """Scalar facts about a finished episode that evaluation reports (e.g. retail's
    `collateral_damage`, `attacked`, `attack_success`); default none. Jittable."""
    return {}

  def task_difficulty(self, task: Any) -> jax.Array:
    """[] int32 difficulty bucket of a task (for curricula and per-bucket evaluation)."""
    return jnp.zeros((), jnp.int32)

  def split_params(self, split: str) -> dict:
    """Constructor parameters for `split` (default: the same environment for every split)."""
    return {}

  @classmethod
  def horizon_settings(cls, horizon: int) -> dict:
    """How this environment takes part in a horizon sweep (`studies/horizon.py`): for horizon `N`,
    `{"params": constructor parameters, "actions": actions H of a flawless episode, "turn_tokens":
    tokens one turn (action and observation) can take}`. Environments without a horizon raise."""
    raise NotImplementedError(f"{cls.__name__} does not define horizon_settings(horizon): it "
                              "cannot be swept over horizons.")

  # ------------------------------------------------------------------------------ the API
  def reset(self, key: jax.Array, task: Any = None) -> tuple[EnvState, TimeStep]:
    """Starts an episode. `key` splits into a task stream (used only when `task` is None) and the
    environment's own stream."""
    task_key, env_key = jax.random.split(key)
    if task is None:
      task = self.generate_task(task_key)
    init_key, env_key = jax.random.split(env_key)
    inner, observation = self.init(task, init_key)
    m = self.num_milestones
    reached = jnp.asarray(self.milestones_at_reset(task, inner), bool)
    if reached.shape != (m,):
      raise ValueError(f"{self.name}: milestones_at_reset returned shape {reached.shape}; expected "
                       f"({m},), one bool per milestone name {self.milestone_names}.")
    timestep = TimeStep(
        observation=observation, reward=jnp.zeros((), jnp.float32),
        terminated=jnp.zeros((), bool), truncated=jnp.zeros((), bool), success=jnp.zeros((), bool),
        milestones=jnp.zeros((m,), bool), cost=jnp.zeros((), jnp.float32),
        violation=jnp.zeros((), bool), env_error=jnp.zeros((), bool),
        anchor=hash_tree(self.canonical_state(task, inner)), step=jnp.zeros((), jnp.int32),
        invalid_action=jnp.zeros((), bool), loop=jnp.zeros((), bool),
        fault=jnp.zeros((), jnp.int32))
    state = EnvState(task=task, inner=inner, key=env_key, step=jnp.zeros((), jnp.int32),
                     done=jnp.zeros((), bool), milestones=reached, last=timestep,
                     extras={})
    return state, timestep

  def step(self, state: EnvState, action: Action) -> tuple[EnvState, TimeStep]:
    """Applies one action (see the module docstring). Jittable; vmap for a batch."""
    tool = jnp.asarray(action.tool, jnp.int32)
    error = jnp.asarray(action.error, jnp.int32)
    # An out-of-range tool index from a hand-built action is a parse error, not an index error.
    error = jnp.where((error == 0) & ((tool < 0) | (tool >= len(self.tools))),
                      jnp.int32(ErrorCode.UNKNOWN_TOOL), error)
    safe = Action(tool=jnp.clip(tool, 0, len(self.tools) - 1), args=jnp.asarray(action.args, jnp.int32),
                  error=error)
    step_key = jax.random.fold_in(state.key, state.step)
    out = self.transition(state.task, state.inner, safe, step_key)
    parse_failed = error != 0
    rejected = jnp.asarray(out.rejected, bool) & ~parse_failed
    inner = select(parse_failed, state.inner, out.inner)
    observation = select(parse_failed, self.error_observation(state.task, state.inner, error),
                         out.observation)
    terminated = jnp.asarray(out.terminated, bool) & ~parse_failed
    violation = jnp.asarray(out.violation, bool) & ~parse_failed
    terminated = terminated | violation
    reached = jnp.asarray(out.milestones, bool) & ~parse_failed
    new_milestones = reached & ~state.milestones
    success = terminated & ~violation & self.verify(state.task, inner)
    invalid = parse_failed | rejected
    spec = self.reward_spec  # (envs/rewards.py; the step cost is 0 here, wrappers add it)
    reward = (spec.success * success.astype(jnp.float32)
              + spec.milestone * new_milestones.sum().astype(jnp.float32)
              - spec.invalid * invalid.astype(jnp.float32)
              - spec.violation * violation.astype(jnp.float32))
    step = state.step + 1
    timestep = TimeStep(
        observation=observation, reward=reward, terminated=terminated,
        truncated=jnp.zeros((), bool), success=success, milestones=new_milestones,
        cost=jnp.zeros((), jnp.float32), violation=violation, env_error=jnp.zeros((), bool),
        anchor=hash_tree(self.canonical_state(state.task, inner)), step=step,
        invalid_action=invalid, loop=jnp.zeros((), bool), fault=jnp.zeros((), jnp.int32))
    new_state = state.replace(inner=inner, step=step, done=terminated,
                              milestones=state.milestones | reached, last=timestep)
    return finish_guard(state, new_state, timestep)

  # ------------------------------------------------------------------------------ helpers
  @property
  def unwrapped(self) -> "Environment":
    return self

  def __repr__(self):
    return f"{type(self).__name__}({self.name!r})"


def finished_timestep(state: EnvState) -> TimeStep:
  """What stepping a finished row returns: its last time step with nothing new in it."""
  last = state.last
  return last.replace(reward=jnp.zeros_like(last.reward), milestones=jnp.zeros_like(last.milestones),
                      cost=jnp.zeros_like(last.cost))


def finish_guard(old: EnvState, new: EnvState, timestep: TimeStep) -> tuple[EnvState, TimeStep]:
  """Keeps a row that was already done unchanged (the no-op step of a finished episode)."""
  return select(old.done, old, new), select(old.done, finished_timestep(old), timestep)


def batch_reset(env: Environment, keys: jax.Array, tasks: Any = None):
  """vmapped `reset` over `[B]` keys (and optionally `[B]` tasks)."""
  if tasks is None:
    return jax.vmap(lambda k: env.reset(k))(keys)
  return jax.vmap(env.reset)(keys, tasks)


def batch_step(env: Environment, states: EnvState, actions: Action):
  """vmapped `step`."""
  return jax.vmap(env.step)(states, actions)


def stack_actions(actions) -> Action:
  """Stacks host-side `Action`s into a batched one."""
  return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *actions)
