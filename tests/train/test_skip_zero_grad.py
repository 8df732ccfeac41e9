"""`optim.skip_zero_grad`: a minibatch whose policy gradient is exactly zero takes no optimiser
step. Plain Adam moves the parameters on a zero gradient (its momentum), which is what the third
SmolLM2 attempt showed (approx KL 0.002-0.009 on updates whose groups all failed;
experiments/results/smollm2_lora/attempt_2026-12-05/README.md).

The update test uses the scripted batch of `tests/train/conftest.py::update_batch` (2-layer
model, pointer_chain's compact vocabulary, 8 episodes), as `test_nonfinite.py` does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.train.policy_losses import LossOptions
from longhorizon.train.update import LearnInputs, TrainState, jit_rl_update, make_optimizer

LR = 0.1
_LOSS = LossOptions(agg="token-mean", clip_high=0.2)


def _steps(optimizer, params, grads_seq):
  """Applies `grads_seq` in order; returns the list of updates and the final state."""
  state, out = optimizer.init(params), []
  for g in grads_seq:
    updates, state = optimizer.update(g, state, params)
    out.append(updates)
  return out, state


def test_plain_adam_moves_on_a_zero_gradient_by_hand():
  """Adam (b1 0.9, b2 0.999): after one step on g, a zero gradient gives m_hat = 0.09 g / 0.19 and
  v_hat = 0.000999 g^2 / 0.001999, so the update is -lr * 0.4737 / 0.7069 * sign(g) = -0.6701 lr
  sign(g) (eps aside). With skip_zero_grad the same step is exactly zero."""
  params = {"w": jnp.zeros(3)}
  g = {"w": jnp.array([2.0, -0.5, 0.25])}
  zero = {"w": jnp.zeros(3)}
  plain, _ = _steps(make_optimizer(LR, max_grad_norm=None), params, [g, zero])
  np.testing.assert_allclose(plain[0]["w"], -LR * np.sign(g["w"]), rtol=1e-5)
  factor = (0.09 / 0.19) / np.sqrt(0.000999 / 0.001999)
  np.testing.assert_allclose(factor, 0.6701, atol=1e-4)
  np.testing.assert_allclose(plain[1]["w"], -LR * factor * np.sign(g["w"]), rtol=1e-4)
  skip, _ = _steps(make_optimizer(LR, max_grad_norm=None, skip_zero_grad=True), params, [g, zero])
  np.testing.assert_allclose(skip[0]["w"], plain[0]["w"], rtol=1e-6)
  assert np.all(np.asarray(skip[1]["w"]) == 0.0)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_skipped_step_is_as_if_it_never_happened(clip):
  """[g1, 0, g2] with skipping gives the updates of [g1, g2] with plain Adam (moments, bias
  correction, clipping and schedule all unchanged by the skipped step); a gradient that is zero in
  one leaf only is not skipped."""
  params = {"a": jnp.zeros((2, 2)), "b": jnp.zeros(3)}
  g1 = {"a": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([0.1, 0.2, -0.3])}
  g2 = {"a": jnp.array([[-1.0, 0.5], [2.0, 1.0]]), "b": jnp.array([-0.4, 0.0, 0.3])}
  zero = jax.tree.map(jnp.zeros_like, g1)
  kw = dict(max_grad_norm=clip, warmup_steps=2, total_steps=10, schedule="cosine")
  plain, plain_state = _steps(make_optimizer(LR, **kw), params, [g1, g2])
  skip, skip_state = _steps(make_optimizer(LR, skip_zero_grad=True, **kw), params,
                            [g1, zero, g2])
  for got, want in zip([skip[0], skip[2]], plain):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9), got, want)
  jax.tree.map(lambda x: np.testing.assert_array_equal(x, 0.0), skip[1])
  assert int(skip_state.gradient_step) == 2  # the steps taken
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6),
               skip_state.inner_opt_state, plain_state)
  half = {"a": g1["a"], "b": jnp.zeros(3)}  # zero in one leaf: a real step
  (upd,), state = _steps(make_optimizer(LR, skip_zero_grad=True, max_grad_norm=clip), params,
                        [half])
  assert np.all(np.asarray(upd["a"]) != 0) and int(state.gradient_step) == 1


def _state(s, optimizer):
  return TrainState(params=jax.tree.map(jnp.array, s.params),
                    opt_state=optimizer.init(s.params), critic_params=None,
                    critic_opt_state=None, step=jnp.zeros((), jnp.int32),
                    policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(2),
                    skipped=jnp.zeros((), jnp.int32))


@pytest.mark.parametrize("skip", [False, True])
def test_rl_update_on_zero_advantages(update_batch, skip):
  """An RL update on a batch with signal, then one whose advantages are all zero: with
  `skip_zero_grad` the second leaves the parameters and the optimiser state exactly as they were;
  without it Adam's momentum still moves the parameters. The update compiles once."""
  setup = update_batch
  optimizer = make_optimizer(1e-2, skip_zero_grad=skip)
  update = jit_rl_update(config=setup.model_config, optimizer=optimizer, critic_optimizer=None,
                         loss=_LOSS, epochs=1, minibatches=2)
  rows = jnp.ones((setup.batch.tokens.shape[0],), jnp.float32)

  def run(state, advantages):
    inputs = LearnInputs(advantages, None, rows, setup.old_logp, None, None)
    new, metrics = update(jax.tree.map(jnp.array, state), setup.batch, inputs)
    return jax.device_get(new), jax.device_get(metrics)

  first, m1 = run(_state(setup, optimizer), setup.advantages)
  assert float(m1["grad_norm"]) > 0 and float(m1["zero_grad_fraction"]) == 0.0
  second, m2 = run(first, jnp.zeros_like(setup.advantages))
  assert float(m2["grad_norm"]) == 0.0
  assert float(m2["zero_grad_fraction"]) == 1.0  # both minibatches' steps: counted (and skipped)
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first.params),
                                                     jax.tree.leaves(second.params))]
  if skip:
    assert not any(moved)
    jax.tree.map(np.testing.assert_array_equal, first.opt_state, second.opt_state)
  else:
    assert all(moved)
  assert int(second.skipped) == 0  # not the non-finite counter
  # Signal in one row alone: one of the two minibatches has a zero gradient.
  _, m3 = run(second, jnp.zeros_like(setup.advantages).at[0].set(setup.advantages[0]))
  assert float(m3["zero_grad_fraction"]) == 0.5
  assert update._cache_size() == 1


def test_config_option_reaches_the_learners_rl_optimizer(tmp_path, smoke_learner):
  """`optim.skip_zero_grad` builds the skipping optimiser for RL (its state counts the steps
  taken); off by default."""
  on = smoke_learner(tmp_path, {"optim.skip_zero_grad": True})
  off = smoke_learner(tmp_path / "off", {})
  params = {"w": jnp.zeros(2)}
  zero = {"w": jnp.zeros(2)}
  upd, state = on.optimizer.update(zero, on.optimizer.init(params), params)
  assert hasattr(state, "gradient_step") and int(state.gradient_step) == 0
  assert np.all(np.asarray(upd["w"]) == 0)
  assert not hasattr(off.optimizer.init(params), "gradient_step")
