"""`loss.reuse_behaviour_logprobs`: the sampler's log-probs as the proximal anchor (no learner
pass), refused where the sampler's policy is not the learner's."""

import numpy as np
import pytest

from longhorizon.core.episode import to_device
from longhorizon.train import config as config_lib
from longhorizon.train.metrics import Timer


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_the_anchor_is_the_behaviour_logprobs_and_close_to_the_recomputed_ones(tmp_path,
                                                                                smoke_learner):
  s = smoke_learner(tmp_path, {"loss.reuse_behaviour_logprobs": True})
  state = s.initial_state()
  batch, _ = s.collect_batch(state.params, 0, 0, Timer())
  db = to_device(s.trimmed(batch))
  inputs = s.learn_inputs(state, db)
  np.testing.assert_array_equal(inputs.old_logp, db.behavior_logprobs)
  recomputed = np.asarray(s.logprobs(state.params, db))
  mask = np.asarray(db.loss_mask, bool)
  # Sync float32 rollouts: the sampler ran these parameters, so only float rounding differs.
  np.testing.assert_allclose(np.asarray(db.behavior_logprobs)[mask], recomputed[mask], atol=2e-4)


@pytest.mark.parametrize("path,value,message", [
    ("rollout.mode", "async", "actors' parameters lag"),
    ("model.decode_quant", "int8", "quantised rollouts"),
])
def test_refused_where_the_sampler_is_not_the_learner(tmp_path, path, value, message):
  from configs import default as default_config  # pylint: disable=g-import-not-at-top
  config = default_config.get_config("smoke")
  config.unlock()
  config_lib.set_path(config, "loss.reuse_behaviour_logprobs", True)
  config_lib.set_path(config, path, value)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config)
