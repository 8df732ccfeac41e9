"""Non-finite inputs to `rl_update`: a step whose loss or gradient is not finite is skipped (the
parameters and the optimiser state stay as they were) and counted in `skipped_updates`, and the
next update with finite inputs trains normally.

The setup is tiny and built by hand (`tests/train/conftest.py::update_batch`): a 2-layer model over
pointer_chain's compact vocabulary and 8 scripted (noisy oracle) episodes, so the update compiles
in seconds.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.train.policy_losses import LossOptions
from longhorizon.train.update import LearnInputs, TrainState, jit_rl_update, make_optimizer


@dataclasses.dataclass
class Setup:
  model_config: object
  optimizer: object
  params: object
  batch: object  # EpisodeBatch on device, [8] rows
  old_logp: jax.Array  # [B, L] finite log-probs of the initial parameters
  advantages: jax.Array  # [B, L] +1 / -1 per group member on the loss mask, 0 elsewhere
  mask: np.ndarray  # [B, L] bool loss mask


@pytest.fixture(scope="module")
def setup(update_batch):
  b = update_batch
  return Setup(b.model_config, make_optimizer(1e-2), b.params, b.batch, b.old_logp,
               b.advantages, b.mask)


def _fresh_state(s: Setup) -> TrainState:
  return TrainState(params=jax.tree.map(jnp.array, s.params), opt_state=s.optimizer.init(s.params),
                    critic_params=None, critic_opt_state=None, step=jnp.zeros((), jnp.int32),
                    policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(2),
                    skipped=jnp.zeros((), jnp.int32))


_LOSS = LossOptions(agg="token-mean", clip_high=0.2)
_UPDATES = {}  # (setup, epochs) -> its jitted update, compiled once


def _update(s: Setup, advantages, old_logp, state=None, epochs=1):
  """One update of `epochs` x 2 minibatches on a copy of `state` (the update donates it); returns
  host `(state, metrics)`."""
  state = _fresh_state(s) if state is None else jax.tree.map(jnp.array, state)
  row_weight = jnp.ones((s.batch.tokens.shape[0],), jnp.float32)
  key = (id(s), epochs)
  if key not in _UPDATES:
    _UPDATES[key] = jit_rl_update(config=s.model_config, optimizer=s.optimizer,
                                  critic_optimizer=None, loss=_LOSS, epochs=epochs, minibatches=2)
  inputs = LearnInputs(advantages, None, row_weight, old_logp, None, None)
  new, metrics = _UPDATES[key](state, s.batch, inputs)
  return jax.device_get(new), jax.device_get(metrics)


def _equal(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def _finite(tree) -> bool:
  return all(bool(np.isfinite(x).all()) for x in jax.tree.leaves(tree))


def _assert_trains(s: Setup, state, skipped_before: int):
  """A finite update from `state` changes the parameters, keeps them finite and skips nothing."""
  new, metrics = _update(s, s.advantages, s.old_logp, state)
  assert np.isfinite(metrics["loss"]) and not _equal(new.params, state.params)
  assert _finite(new.params)
  assert int(metrics["skipped_updates"]) == skipped_before  # a running count: nothing new skipped
  assert int(new.policy_version) == int(state.policy_version) + 1


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_finite_update_is_not_skipped(setup):
  new, metrics = _update(setup, setup.advantages, setup.old_logp)
  assert int(metrics["skipped_updates"]) == 0 and np.isfinite(metrics["loss"])
  assert not _equal(new.params, setup.params)


def test_nan_advantages_skip_every_step(setup):
  """NaN advantages on every trained token: both minibatch steps are skipped."""
  s = setup
  state = _fresh_state(s)
  new, metrics = _update(s, jnp.where(s.mask, jnp.nan, s.advantages), s.old_logp, state)
  assert not np.isfinite(metrics["loss"])
  assert int(metrics["skipped_updates"]) == 2  # epochs (1) x minibatches (2)
  assert _equal(new.params, s.params) and _equal(new.opt_state, jax.device_get(state.opt_state))
  _assert_trains(s, new, skipped_before=2)


@pytest.mark.parametrize("epochs", [1, 2])
def test_one_bad_row_skips_its_minibatches_only(setup, epochs):
  """A NaN in one row poisons the one minibatch per epoch that holds it; the others train."""
  s = setup
  row, col = 3, int(np.argmax(s.mask[3]))
  advantages = s.advantages.at[row, col].set(jnp.nan)
  new, metrics = _update(s, advantages, s.old_logp, epochs=epochs)
  assert int(metrics["skipped_updates"]) == epochs
  assert not _equal(new.params, s.params) and _finite(new.params)
  _assert_trains(s, new, skipped_before=epochs)


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_infinite_old_logp_leaves_params_unchanged(setup, value):
  """Infinite old log-probs on every trained token: the log-ratio clip makes the loss finite and
  its gradient zero, so the parameters stay as they were (and finite); training goes on."""
  s = setup
  new, metrics = _update(s, s.advantages, jnp.where(s.mask, value, s.old_logp))
  assert _equal(new.params, s.params) and _finite(new.params)
  _assert_trains(s, new, skipped_before=int(metrics["skipped_updates"]))


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_infinite_old_logp_is_counted_as_skipped(setup, value):
  s = setup
  state = _fresh_state(s)
  new, metrics = _update(s, s.advantages, jnp.where(s.mask, value, s.old_logp), state)
  assert int(metrics["skipped_updates"]) == 2
  assert _equal(new.opt_state, jax.device_get(state.opt_state))
