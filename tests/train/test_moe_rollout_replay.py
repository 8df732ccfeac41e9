"""Routing replay (R3) through the rollout path: the KV cache records every token's experts while
the sampler runs, `collect` copies them into `EpisodeBatch.routing` aligned with the episode's
tokens, and the learner replays them, so its log-probs of the sampled tokens are the sampler's even
when the rollout engine's numerics (bf16) route some tokens elsewhere; the load-balancing loss
enters the RL loss; `model.moe.replay = False` recomputes the routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import rollout
from longhorizon.core.episode import to_device
from longhorizon.models import Transformer
from longhorizon.train.metrics import Timer


_BASE = {"env.params": {"horizon": 2}, "env.max_steps": 4, "rollout.context_length": 96,
         "model.moe.num_experts": 4, "model.moe.experts_per_token": 2,
         "model.moe.intermediate_size": 32, "optim.learning_rate": 1e-2}


@pytest.fixture(scope="module")
def moe(tmp_path_factory, smoke_learner):
  s = smoke_learner(tmp_path_factory.mktemp("moe"), _BASE)
  # Experts whose outputs matter (gate and up projections 6x their 0.02-scale init, as in
  # tests/models/test_moe_replay.py), so the expert a token is routed to moves its log-probs.
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x * 6.0 if any(n in jax.tree_util.keystr(p) for n in ("gate_proj", "up_proj"))
      else x, s.init_params)
  return s, params


def _collect(s, params, model_config, seed=0):
  tasks = s.tasks_at(0, s.rollout.num_tasks)
  keys = jax.random.split(jax.random.key(seed), s.rollout.num_tasks)
  return rollout.collect(params, model_config, s.env, s.codec, tasks, keys,
                         s.rollout.collect_config(s.config.env.max_steps), sampling_seed=seed)[0]


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_fresh_moe_policy_from_the_config(moe):
  s, params = moe
  c = s.model_config
  assert (c.model_type, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (
      "qwen3_moe", 4, 2, 32)
  assert c.router_aux_loss_coef == 0.01 and c.norm_topk_prob and c.qk_norm
  assert params["layers"]["mlp"]["gate_proj"].shape[:2] == (c.num_hidden_layers, 4)


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_collect_records_the_experts_of_every_episode_token(moe):
  """Same numerics on both sides: the recorded experts are the full pass's routing of the
  episode's tokens (prompt, actions and observations), 0 on padding."""
  s, params = moe
  batch = _collect(s, params, s.model_config)
  c = s.model_config
  assert batch.routing.shape == (*batch.tokens.shape, c.num_hidden_layers, 2)
  batch.validate()
  mask = np.asarray(batch.attention_mask)
  lengths = mask.sum(-1)
  out = Transformer(c).apply({"params": params}, jnp.asarray(batch.tokens),
                             lengths=jnp.asarray(lengths), compute_logits=False)
  full = np.sort(np.asarray(out.routing), -1)[mask]
  recorded = np.sort(batch.routing, -1)[mask]
  assert (recorded == full).all(-1).all(-1).mean() > 0.99  # a rare float tie may flip
  assert (batch.routing[~mask] == 0).all()
  assert len(np.unique(batch.routing[mask])) == c.num_experts  # the routing is not degenerate


def test_replay_makes_the_learner_score_rollout_tokens_like_the_sampler(moe):
  """A bf16 rollout engine against the float32 learner: recomputed routing sends some tokens to
  other experts and moves their log-probs; replaying the recorded experts brings the learner's
  log-probs of the sampled tokens back to the sampler's."""
  s, params = moe
  engine = s.model_config.replace(dtype="bfloat16")
  batch = _collect(s, params, engine)
  loss = np.asarray(batch.loss_mask)
  assert loss.sum() > 50
  behavior = np.asarray(batch.behavior_logprobs)
  replayed = np.asarray(s.logprobs(params, to_device(batch)))
  recomputed = np.asarray(s.logprobs(params, to_device(batch.replace(routing=None))))
  full = Transformer(s.model_config).apply(
      {"params": params}, jnp.asarray(batch.tokens),
      lengths=jnp.asarray(np.asarray(batch.attention_mask).sum(-1)), compute_logits=False)
  mask = np.asarray(batch.attention_mask)
  differ = (np.sort(np.asarray(full.routing), -1) != np.sort(batch.routing, -1)).any(-1).any(-1)
  assert differ[mask].mean() > 0.001  # bf16 numerics do route some tokens elsewhere
  gap_replayed = np.abs(replayed - behavior)[loss]
  gap_recomputed = np.abs(recomputed - behavior)[loss]
  assert gap_recomputed.max() > 5 * gap_replayed.max()
  assert gap_replayed.max() < 0.05  # what is left is bf16 rounding, not routing


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_the_update_adds_the_aux_loss_and_is_traced_once(moe, assert_no_retrace):
  s, _ = moe
  state, timer = s.initial_state(), Timer()
  state, first = s.step(state, 0, 0, timer)
  assert 0.5 < first["moe_aux_loss"] < 2.0  # E * sum_e f_e P_e: 1 when balanced, E / k at worst
  assert np.isfinite(first["loss"]) and first["skipped_updates"] == 0
  state = jax.device_get(state)
  calls = []
  for update in range(1, 3):
    batch, _ = s.collect_batch(state.params, update, 4 * update, timer)
    db = to_device(batch)  # full length: both calls share one shape
    assert db.routing is not None
    calls.append(((jax.tree.map(jnp.array, state), db, s.learn_inputs(state, db)), {}))
  assert_no_retrace(s.update_fn(*calls[0][0]), *calls)


def test_replay_off_recomputes_the_routing(tmp_path, smoke_learner):
  s = smoke_learner(tmp_path, {**_BASE, "model.moe.replay": False})
  batch = s.collect_batch(s.init_params, 0, 0, Timer())[0]
  assert batch.routing is not None and s.trimmed(batch).routing is None
