"""Drivers for checking environments: the full text path on the host, and structured batched
rollouts under jit + vmap (oracle, uniformly random, or any jittable policy).

These are what the tests, the task-suite checks and the environment benchmark use; they are also
the quickest way to sanity-check a new environment in a notebook.

The text path is checked, not only driven: `text_episode` raises when a prompt or an observation
does not survive encode -> decode (`check_text_round_trip`), e.g. a word missing from the
environment's `vocabulary()`, which the word-level tokenizer would turn into `<unk>`. The oracle's
success alone cannot show such a gap: the scripted oracle acts on the state, not on the text.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.envs.base import Environment
from longhorizon.envs.types import Action, EnvState, TimeStep

__all__ = ["random_action", "text_episode", "check_text_round_trip", "structured_rollout",
           "tasks_from_keys"]


def random_action(env: Environment, state: EnvState, key: jax.Array) -> Action:
  """A uniformly random well-formed action: a random tool, each argument uniform over its range."""
  del state
  k_tool, k_args = jax.random.split(key)
  tool = jax.random.randint(k_tool, (), 0, len(env.tools))
  highs = np.ones((len(env.tools), env.num_args), np.int32)  # exclusive upper bounds
  lows = np.zeros((len(env.tools), env.num_args), np.int32)
  for t, spec in enumerate(env.tools):
    for a, arg in enumerate(spec.args):
      if arg.kind == "enum":
        highs[t, a] = len(arg.choices)
      else:
        lows[t, a], highs[t, a] = arg.low, arg.high + 1
  u = jax.random.uniform(k_args, (env.num_args,))
  lo, hi = jnp.asarray(lows)[tool], jnp.asarray(highs)[tool]
  args = jnp.minimum(lo + jnp.floor(u * (hi - lo)).astype(jnp.int32), hi - 1)
  return Action(tool=tool.astype(jnp.int32), args=args, error=jnp.zeros((), jnp.int32))


def check_text_round_trip(codec, text: str, where: str = "text") -> list[int]:
  """The ids of `text` (as the codec encodes environment text), after checking that they decode
  back to `text`: the same words in the same order (a word-level tokenizer keeps words, not their
  spacing; a byte-level one gives the text back exactly).

  Raises:
    ValueError naming `where`, the words the tokenizer does not know (each would be its unknown
    token; add them to the environment's `vocabulary()`), or else the first word that differs.
  """
  unknown = codec.unknown_words(text)
  if unknown:
    raise ValueError(
        f"{where}: the tokenizer does not know {sorted(set(unknown))} ({len(unknown)} occurrence(s); "
        f"each is encoded as {codec.tokenizer.unk_token!r}); add them to "
        f"{codec.env.name}.vocabulary(). Text: {text!r}")
  ids = codec.tokenizer.encode(text, add_special_tokens=False)
  want, got = text.split(), codec.decode(ids).split()
  if got != want:
    i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    raise ValueError(f"{where}: encode -> decode changes the text at word {i}: expected "
                     f"{want[i:i + 3]!r}, got {got[i:i + 3]!r}. Text: {text!r}")
  return ids


def text_episode(env: Environment, codec, key: jax.Array, task: Any = None,
                 policy: Callable[[EnvState, jax.Array], Action] | None = None,
                 max_steps: int = 200, check_text: bool = True) -> dict:
  """One episode through the full text path: policy action -> `format_action` -> text ->
  `parse_action` -> `step` -> `render_observation` (default policy: the oracle).

  With `check_text` (default), the prompt and every observation go through
  `check_text_round_trip`, which raises `ValueError` on a word the tokenizer does not know.

  Returns a dict with `ids` (prompt, then each action text's ids and each observation's ids, as a
  rollout would append them), `actions` (texts), `observations` (texts), `parsed_ok` (bools),
  `timesteps` (host copies) and `final` (the last `TimeStep`)."""
  step = _jitted(env, "step")
  state, timestep = _jitted(env, "reset")(key, task)
  policy = policy or (lambda s, k: _jitted(env, "oracle")(s))
  if check_text:
    check_text_round_trip(codec, codec.prompt_text(state), "prompt")
  ids = list(codec.render_prompt(state))
  out = {"actions": [], "observations": [], "parsed_ok": [], "timesteps": []}
  for t in range(max_steps):
    if bool(timestep.done):
      break
    action = policy(state, jax.random.fold_in(key, t))
    text = codec.format_action(action)
    ids += codec.tokenizer.encode(text, add_special_tokens=False) + list(codec.stop_token_ids)
    parsed, ok, message = codec.parse_action(codec.decode(
        codec.tokenizer.encode(text, add_special_tokens=False) + list(codec.stop_token_ids)))
    state, timestep = step(state, parsed)
    if check_text:
      check_text_round_trip(codec, codec.observation_turn_text(timestep, message),
                            f"observation after action {t} ({text!r})")
    observation = codec.render_observation(timestep, message)
    ids += observation
    out["actions"].append(text)
    out["observations"].append(codec.decode(observation))
    out["parsed_ok"].append(ok)
    out["timesteps"].append(jax.tree.map(np.asarray, timestep))
  out.update(ids=ids, final=jax.tree.map(np.asarray, timestep), state=state)
  return out


@functools.lru_cache(maxsize=None)
def _jitted(env, method):
  return jax.jit(getattr(env, method))


def tasks_from_keys(env: Environment, keys: jax.Array, split: str = "train"):
  """`[B]` tasks of `split` from `[B]` keys (jitted, cached per env and split)."""
  return _generator(env, split)(keys)


@functools.lru_cache(maxsize=None)
def _generator(env, split):
  return jax.jit(jax.vmap(lambda k: env.generate_task(k, split)))


def structured_rollout(env: Environment, keys: jax.Array, tasks: Any = None,
                       policy: str | Callable = "oracle", max_steps: int = 64) -> TimeStep:
  """A batched episode under jit + vmap without text. Returns the stacked `[T, B]` time steps.

  `policy`: "oracle", "random" or a jittable `(state, key) -> Action` (one row)."""
  if isinstance(policy, str):
    policy = _named_policy(env, policy)
  return _rollout(env, policy, max_steps)(keys, tasks)


@functools.lru_cache(maxsize=None)
def _named_policy(env, name):
  """One function object per (env, name), so the jitted rollout is cached across calls."""
  if name == "oracle":
    return lambda s, k: env.oracle(s)
  if name == "random":
    return functools.partial(random_action, env)
  raise ValueError(f"policy must be 'oracle', 'random' or a function, got {name!r}.")


@functools.lru_cache(maxsize=None)
def _rollout(env, policy, max_steps):
  def one(key, task):
    state, _ = env.reset(key, task)

    def body(state, t):
      action = policy(state, jax.random.fold_in(key, 1_000_003 + t))
      state, timestep = env.step(state, action)
      return state, timestep

    _, timesteps = jax.lax.scan(body, state, jnp.arange(max_steps))
    return timesteps

  @jax.jit
  def run(keys, tasks):
    out = jax.vmap(one)(keys, tasks) if tasks is not None else jax.vmap(lambda k: one(k, None))(keys)
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), out)

  return run


def episode_summary(timesteps: TimeStep) -> dict:
  """Per-row outcome of `[T, B]` time steps: `success`, `done`, `steps` (actions until done)."""
  done = np.asarray(timesteps.terminated | timesteps.truncated)
  finished = done.any(axis=0)
  first = np.where(finished, done.argmax(axis=0), done.shape[0] - 1)
  rows = np.arange(done.shape[1])
  return {"success": np.asarray(timesteps.success)[first, rows] & finished,
          "done": finished, "steps": first + 1,
          "violation": np.asarray(timesteps.violation)[first, rows] & finished,
          "env_error": np.asarray(timesteps.env_error).any(axis=0)}
