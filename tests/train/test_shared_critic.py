"""The shared-trunk critic (`algorithm.critic='shared'`): a value head on the policy's trunk, its
value loss part of the policy's loss.

Checked here: its values are `PolicyWithValue`'s (the head on the trunk's final hidden states),
aligned like `critic_values`; the update reads them from the policy's own forward pass (no second
trunk); the value gradient reaches the trunk (and with LoRA the adapters alone), which a separate
critic's never does; the option is validated; and `ppo` with it trains, compiles its update once
and resumes from a checkpoint exactly.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default as default_config
from longhorizon.core import losses
from longhorizon.core.episode import to_device
from longhorizon.models import PolicyWithValue, Transformer, lora
from longhorizon.train import config as config_lib
from longhorizon.train import loop
from longhorizon.train.algorithms import AlgorithmOptions
from longhorizon.train.metrics import Timer, read_metrics
from longhorizon.train.options import ConfigError
from longhorizon.train.update import critic_values, episode_logprobs, jit_rl_update

_SHARED = {"algorithm.name": "ppo", "algorithm.critic": "shared", "optim.length_buckets": 0}


def _copy(tree):
  return jax.tree.map(jnp.array, tree)  # a fresh copy: the update donates its state


def _random_head(head, seed=0):
  """`head`'s structure with non-zero values: the initial head is zero, so the value loss would
  send no gradient into the trunk before the head has moved."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), head)


@pytest.fixture(scope="module")
def shared(tmp_path_factory, smoke_learner):
  """`(learner, state with a random head, device batch)`: ppo with the shared critic on the smoke
  config (full-length batches: one compiled update shape)."""
  s = smoke_learner(tmp_path_factory.mktemp("shared"), _SHARED)
  state = s.initial_state()
  state = state.replace(critic_params=_random_head(state.critic_params))
  batch, _ = s.collect_batch(state.params, 0, 0, Timer())
  return s, jax.device_get(state), to_device(s.trimmed(batch))


def _with(s, *, value_coef=None, **optim):
  """The learner `s` with another `loss.value_coef` and/or optimiser schedule (a fresh jit)."""
  loss = s.loss if value_coef is None else dataclasses.replace(s.loss, value_coef=value_coef)
  return dataclasses.replace(s, loss=loss, optim=dataclasses.replace(s.optim, **optim))


# ------------------------------------------------------------------------------------- values

@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_shared_values_are_the_value_head_on_the_policy_trunk(shared):
  """`critic_values(head, trunk_params=policy)` is `PolicyWithValue` over the policy's parameters,
  and the head's affine map of the policy `Transformer`'s final hidden states (computed here in
  NumPy), shifted one token right like log-probs; the learner's rollout-time values and the loss
  pass (`episode_logprobs(value_head=...)`) give the same, and the proximal log-probs that come with
  them are the policy's."""
  s, state, db = shared
  cfg, head = s.model_config, state.critic_params
  tokens, positions = jnp.asarray(db.tokens), jnp.asarray(db.positions)
  lengths = jnp.asarray(db.attention_mask).sum(-1)
  got = np.asarray(critic_values(head, cfg, db, trunk_params=state.params))
  _, v = PolicyWithValue(cfg).apply({"params": {"trunk": state.params, "value_head": head}},
                                    tokens, positions, lengths, compute_logits=False)
  np.testing.assert_allclose(got[:, 1:], np.asarray(v)[:, :-1], rtol=1e-5, atol=1e-6)
  assert np.all(got[:, 0] == 0)
  hidden = np.asarray(Transformer(cfg).apply({"params": state.params}, tokens, positions, lengths,
                                             compute_logits=False).hidden, np.float64)
  dense = head["Dense_0"]
  by_hand = hidden @ np.asarray(dense["kernel"], np.float64)[:, 0] + float(dense["bias"][0])
  np.testing.assert_allclose(got[:, 1:], by_hand[:, :-1], rtol=1e-4, atol=1e-5)
  assert np.abs(got).max() > 1e-3  # a random head: the comparison is not of zeros

  logp, values = episode_logprobs(state.params, cfg, db, temperature=s.rollout.temperature,
                                  value_head=head)
  np.testing.assert_allclose(values, got, rtol=1e-5, atol=1e-6)
  inputs = s.learn_inputs(state, db)
  np.testing.assert_allclose(inputs.old_values, got, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(inputs.old_logp, s.logprobs(state.params, db), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logp, s.logprobs(state.params, db), rtol=1e-5, atol=1e-5)


def test_update_value_loss_is_that_of_the_shared_values(shared):
  """One optimiser step: the update's `value_loss` is the clipped value loss of the values computed
  independently above (so the loss reads the head on the policy trunk, not something else), and its
  `loss` adds `value_coef` times it to the policy loss."""
  s, state, db = shared
  s = _with(s, epochs=1, minibatches=1)
  inputs = s.learn_inputs(state, db)
  values = critic_values(state.critic_params, s.model_config, db, trunk_params=state.params)
  mask = jnp.asarray(db.loss_mask, jnp.float32) * inputs.row_weight[:, None]
  expected, _ = losses.value_loss(values, inputs.old_values, inputs.returns, mask,
                                  clip=s.loss.value_clip or None)
  _, m = s.update(_copy(state), db, inputs)
  np.testing.assert_allclose(m["value_loss"], expected, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(m["loss"], m["policy_loss"] + s.loss.value_coef * m["value_loss"],
                             rtol=1e-4, atol=1e-6)


def _layer_scans(jaxpr, length: int) -> int:
  """Number of `scan`s over `length` steps in `jaxpr` and its sub-jaxprs (a decoder's layers run
  under one `nn.scan`: one per forward and one per backward pass)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "scan" and eqn.params.get("length") == length
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          count += _layer_scans(sub, length)
  return count


def test_update_runs_the_trunk_once_per_step(shared):
  """The shared critic's update has as many layer scans as a critic-free one on the same batch (its
  values come from the policy's forward pass); a separate critic adds its own trunk's."""
  s, state, db = shared
  inputs = s.learn_inputs(state, db)
  kw = dict(config=s.model_config, optimizer=s.optimizer, loss=s.loss, epochs=1, minibatches=1)
  n = s.model_config.num_hidden_layers

  def scans(fn, st):
    return _layer_scans(jax.make_jaxpr(fn)(st, db, inputs).jaxpr, n)

  policy_only = scans(jit_rl_update(critic_optimizer=None, **kw), state.replace(
      critic_params=None, critic_opt_state=None))
  shared_scans = scans(jit_rl_update(critic_optimizer=s.critic_optimizer, shared_critic=True, **kw),
                       state)
  sep = s.with_config(_config(s, **{"algorithm.critic": "separate"}))
  sep_state = sep.initial_state().replace(params=state.params)
  separate = scans(jit_rl_update(critic_optimizer=sep.critic_optimizer, **kw), sep_state)
  assert policy_only >= 2  # forward and backward
  assert shared_scans == policy_only < separate


# ------------------------------------------------------------------------------------ gradient

def _config(s, **changes):
  config = s.config.copy_and_resolve_references()
  config.unlock()
  for path, value in changes.items():
    config_lib.set_path(config, path, value)
  config.lock()
  return config


def _trunk_after(s, state, db, inputs, value_coef):
  new, _ = _with(s, value_coef=value_coef).update(_copy(state), db, inputs)
  return jax.device_get(new.params)


def _max_change(a, b) -> float:
  return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_value_gradient_reaches_the_shared_trunk_only(shared):
  """With the shared critic the policy update depends on `value_coef` (the value loss's gradient
  flows into every layer of the trunk); with a separate critic it is bit for bit the same."""
  s, state, db = shared
  inputs = s.learn_inputs(state, db)
  with_value = _trunk_after(s, state, db, inputs, 0.5)
  without = _trunk_after(s, state, db, inputs, 0.0)
  moved = _max_change(with_value, state.params)
  assert _max_change(with_value["layers"], without["layers"]) > 0.01 * moved, (
      "the value loss did not change the trunk's update")

  sep = s.with_config(_config(s, **{"algorithm.critic": "separate"}))
  assert not sep.shared_critic
  sep_state = jax.device_get(sep.initial_state().replace(params=state.params))
  sep_inputs = sep.learn_inputs(sep_state, db)
  a = _trunk_after(sep, sep_state, db, sep_inputs, 0.5)
  b = _trunk_after(sep, sep_state, db, sep_inputs, 0.0)
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_shared_critic_with_lora_trains_adapters_and_head_only(tmp_path, smoke_learner):
  """With LoRA the value gradient reaches the adapters (their update depends on `value_coef`),
  never the frozen weights; the optimiser state covers adapters alone, and the head trains."""
  s = smoke_learner(tmp_path, {**_SHARED, "model.lora.rank": 4})
  state = s.initial_state()
  state = jax.device_get(state.replace(critic_params=_random_head(state.critic_params)))
  batch, _ = s.collect_batch(state.params, 0, 0, Timer())
  db = to_device(s.trimmed(batch))
  inputs = s.learn_inputs(state, db)
  new, m = _with(s, value_coef=0.5).update(_copy(state), db, inputs)
  new = jax.device_get(new)
  without = _trunk_after(s, state, db, inputs, 0.0)
  adapters, frozen = lora.partition(new.params, s.model_config)
  jax.tree.map(np.testing.assert_array_equal, frozen,
               lora.partition(state.params, s.model_config)[1])
  assert _max_change(adapters, lora.partition(without, s.model_config)[0]) > 0
  assert _max_change(new.critic_params, state.critic_params) > 0
  assert jax.tree.structure(new.opt_state) == jax.tree.structure(
      s.init_opt_state(state.params))
  assert np.isfinite(m["loss"]) and np.isfinite(m["value_loss"])


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_shared_critic_in_bfloat16_compute(shared):
  """With a bfloat16 trunk (`model.dtype`) the head still reads float32 values (the hidden states
  cast up), close to the float32 model's, and the update's losses stay finite."""
  s, state, db = shared
  bf16 = dataclasses.replace(s, model_config=dataclasses.replace(s.model_config, dtype="bfloat16"))
  inputs = bf16.learn_inputs(state, db)
  assert inputs.old_values.dtype == jnp.float32
  f32 = critic_values(state.critic_params, s.model_config, db, trunk_params=state.params)
  scale = float(jnp.abs(f32).max())
  np.testing.assert_allclose(inputs.old_values, f32, atol=0.05 * scale)
  _, m = bf16.update(_copy(state), db, inputs)
  assert np.isfinite(m["loss"]) and np.isfinite(m["value_loss"]) and m["skipped_updates"] == 0


# ---------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("name", ["grpo", "gigpo"])
def test_shared_critic_without_a_critic_is_refused_naming_the_field(name):
  config = default_config.get_config("smoke")
  config.unlock()
  config.algorithm.name, config.algorithm.critic = name, "shared"
  with pytest.raises(ConfigError) as info:
    config_lib.validate(config)
  message = str(info.value)
  assert "config.algorithm.critic='shared'" in message and repr(name) in message
  assert "['ppo', 'tree_critic']" in message
  with pytest.raises(ConfigError, match=r"config.algorithm.critic='both' is not allowed"):
    AlgorithmOptions(name="ppo", critic="both")
  assert AlgorithmOptions(name="ppo", critic="shared").critic == "shared"


# ---------------------------------------------------------------------------------- end to end

def test_ppo_with_shared_critic_trains_and_compiles_once(shared):
  """Three learner steps: finite losses, the head and trunk move, and the jitted update is
  compiled once (full-length batches: one shape). (From the random head: the untrained smoke
  policy never succeeds, so with the zero initial head every value target and advantage is 0.)"""
  s, start, _ = shared
  s = dataclasses.replace(s)  # a fresh jit cache
  state, timer = _copy(start), Timer()
  for update in range(3):
    state, m = s.step(state, update, 4 * update, timer)
    assert np.isfinite(m["loss"]) and np.isfinite(m["value_loss"]), m
    assert m["skipped_updates"] == 0
  assert len(s._jitted) == 1
  assert next(iter(s._jitted.values()))._cache_size() == 1
  state = jax.device_get(state)
  assert jax.tree.structure(state.critic_params) == jax.tree.structure(start.critic_params)
  assert _max_change(state.critic_params, start.critic_params) > 0
  assert _max_change(state.params, start.params) > 0


def test_update_is_traced_once(shared, assert_no_retrace):
  s, state, db = shared
  s = dataclasses.replace(s)
  db2 = to_device(s.trimmed(s.collect_batch(state.params, 1, 4, Timer())[0]))
  calls = [((_copy(state), b, s.learn_inputs(state, b)), {}) for b in (db, db2)]
  assert_no_retrace(s.update_fn(*calls[0][0]), *calls)


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path):
  """`train_and_evaluate` with ppo and the shared critic: a run stopped after 2 updates and
  resumed from its checkpoint logs the same metrics as one run of 3 updates."""
  def config(n):
    c = default_config.get_config("smoke")
    c.unlock()
    c.tasks.data_dir = str(tmp_path / "tasks")
    for path, value in {**_SHARED, "num_updates": n, "checkpoint_every": 1, "eval.k": 1,
                        "eval.greedy": False, "eval.num_tasks": 8, "tensorboard": False}.items():
      config_lib.set_path(c, path, value)
    c.lock()
    return c

  loop.train_and_evaluate(config(3), str(tmp_path / "straight"))
  loop.train_and_evaluate(config(2), str(tmp_path / "resumed"))
  loop.train_and_evaluate(config(3), str(tmp_path / "resumed"))
  straight, resumed = (read_metrics(str(tmp_path / d)) for d in ("straight", "resumed"))
  assert [r["update"] for r in resumed] == [1, 2, 3]
  skip = lambda k: (k.startswith(("time", "memory")) or k.endswith("_s") or "per_s" in k
                    or k.endswith("frac"))
  for a, b in zip(straight, resumed):
    assert np.isfinite(a["loss"]) and "value_loss" in a
    for k in a:
      if not skip(k):
        assert a[k] == b[k] or (a[k] is None and b[k] is None), (k, a[k], b[k])
  saved = json.loads((tmp_path / "resumed" / "config.json").read_text())
  assert saved["algorithm"]["critic"] == "shared"
