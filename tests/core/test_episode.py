"""EpisodeBatch: field invariants, validate() messages, step <-> token helpers, pytree behaviour."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.core import advantages
from longhorizon.core import episode
from longhorizon.core.episode import EpisodeBatch, Termination


def _two_episodes() -> EpisodeBatch:
  """Row 0: prompt(2) a0(2) obs(1) a1(1) pad(2); two steps, success.
  Row 1: prompt(2) a0(3) obs(2) pad(1); one step, env error on step 0."""
  b = episode.empty(2, 8, 3)
  turn = np.array([[-1, -1, 0, 0, 0, 1, -1, -1],
                   [-1, -1, 0, 0, 0, 0, 0, -1]], np.int32)
  attention = np.array([[1, 1, 1, 1, 1, 1, 0, 0],
                        [1, 1, 1, 1, 1, 1, 1, 0]], bool)
  loss = np.array([[0, 0, 1, 1, 0, 1, 0, 0],
                   [0, 0, 1, 1, 1, 0, 0, 0]], bool)
  return b.replace(
      tokens=np.arange(16, dtype=np.int32).reshape(2, 8) * attention,
      positions=np.cumsum(attention, 1).astype(np.int32) - 1,
      attention_mask=attention, loss_mask=loss, turn=turn,
      behavior_logprobs=np.where(loss, -0.5, 0.0).astype(np.float32),
      rewards=np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], np.float32),
      step_mask=np.array([[1, 1, 0], [1, 0, 0]], bool),
      anchor=np.array([[7, 9, 0], [7, 0, 0]], np.uint32),
      milestones=np.array([[0b01, 0b10, 0], [0, 0, 0]], np.int32),
      env_error=np.array([[0, 0, 0], [1, 0, 0]], bool),
      group=np.array([4, 4], np.int32), success=np.array([True, False]),
      terminated=np.array([True, False]), truncated=np.array([False, False]),
      termination=np.array([Termination.SUCCESS, Termination.ENV_ERROR], np.int32),
      num_steps=np.array([2, 1], np.int32), score=np.array([1.0, 0.0], np.float32),
      reward_components={"success": np.array([1.0, 0.0], np.float32)})


def test_valid_batch_passes_and_reports_sizes():
  batch = _two_episodes().validate()
  assert (batch.batch_size, batch.context_length, batch.max_steps) == (2, 8, 3)


def test_empty_batch_is_valid():
  episode.empty(3, 5, 2).validate()


def test_token_rewards_sit_on_the_last_policy_token_of_each_step():
  rewards = np.asarray(_two_episodes().token_rewards())
  expected = np.zeros((2, 8), np.float32)
  expected[0, 5] = 1.0  # step 1 of row 0 ends at position 5; step 0's reward is 0
  np.testing.assert_array_equal(rewards, expected)
  assert rewards.dtype == np.float32


def test_step_rewards_round_trip_through_tokens():
  batch = _two_episodes().replace(rewards=np.array([[0.5, 2.0, 0.0], [3.0, 0.0, 0.0]], np.float32))
  on_tokens = np.asarray(batch.token_rewards())
  assert on_tokens[0, 3] == 0.5 and on_tokens[0, 5] == 2.0 and on_tokens[1, 4] == 3.0
  assert on_tokens.sum() == pytest.approx(5.5)
  # Broadcasting step values back gives each step's value on every token of the step.
  back = np.asarray(advantages.broadcast_steps(batch.rewards, batch.turn))
  np.testing.assert_array_equal(back[0], [0, 0, 0.5, 0.5, 0.5, 2.0, 0, 0])


def test_trainable_excludes_env_error_rows():
  np.testing.assert_array_equal(np.asarray(_two_episodes().trainable), [True, False])


def test_is_a_pytree_usable_under_jit():
  batch = episode.to_device(_two_episodes())
  leaves = jax.tree_util.tree_leaves(batch)
  # The components dict has one leaf here; `routing` (None for a dense policy) has none.
  assert len(leaves) == len(dataclasses.fields(EpisodeBatch)) - 2 + 1
  total = jax.jit(lambda b: jnp.sum(b.loss_mask) + b.reward_components["success"].sum())(batch)
  assert float(total) == 6.0 + 1.0


def test_routing_is_checked_trimmed_and_sliced_with_the_tokens():
  batch = _two_episodes()
  routing = np.arange(2 * 8 * 3 * 2, dtype=np.int32).reshape(2, 8, 3, 2)
  with_routing = batch.replace(routing=routing).validate()
  cut = episode.trim(with_routing, episode.used_length(batch))
  np.testing.assert_array_equal(cut.routing, routing[:, :cut.tokens.shape[1]])
  with pytest.raises(ValueError, match=r"routing: expected shape \[B, L, layers, k\]"):
    batch.replace(routing=routing[:, :5]).validate()


@pytest.mark.parametrize("field, value, message", [
    ("tokens", np.zeros((2, 7), np.int32), r"tokens: expected shape \[B, L\]=\(2, 8\)"),
    ("rewards", np.zeros((2, 3), np.int32), "rewards: expected dtype kind float"),
    ("group", np.zeros((3,), np.int32), r"group: expected shape \[B\]=\(2,\)"),
    ("loss_mask", np.full((2, 8), 2, np.int32), "loss_mask: expected 0/1 values"),
    ("num_steps", np.array([2, 2], np.int32), "num_steps differs from step_mask"),
    ("step_mask", np.array([[1, 0, 1], [1, 0, 0]], bool), "step_mask"),
    ("turn", np.full((2, 8), 5, np.int32), r"turn has values outside \[-1, S=3\)"),
    ("truncated", np.array([True, False]), "terminated and truncated are both 1"),
    ("success", np.array([False, False]), "success disagrees with termination"),
    ("termination", np.array([1, 9], np.int32), "termination has values outside Termination"),
    ("behavior_logprobs", np.full((2, 8), -0.5, np.float32), "behavior_logprobs is non-zero off"),
    ("reward_components", {"success": np.zeros(3, np.float32)},
     r"reward_components\['success'\]: expected shape \[B\]"),
])
def test_validate_names_the_inconsistent_field(field, value, message):
  with pytest.raises(ValueError, match=message):
    _two_episodes().replace(**{field: value}).validate()


def test_validate_rejects_loss_mask_on_padding_and_prompt():
  batch = _two_episodes()
  on_padding = np.asarray(batch.loss_mask).copy()
  on_padding[0, 7] = True
  with pytest.raises(ValueError, match="loss_mask is 1 on padding"):
    batch.replace(loss_mask=on_padding).validate()
  on_prompt = np.asarray(batch.loss_mask).copy()
  on_prompt[0, 0] = True
  with pytest.raises(ValueError, match="loss_mask is 1 on tokens with turn -1"):
    batch.replace(loss_mask=on_prompt).validate()


def test_validate_rejects_a_step_without_policy_tokens():
  batch = _two_episodes()
  # Row 1 claims two steps but only step 0 has tokens.
  with pytest.raises(ValueError, match="step_mask marks a step without any policy token"):
    batch.replace(step_mask=np.array([[1, 1, 0], [1, 1, 0]], bool),
                  num_steps=np.array([2, 2], np.int32)).validate()


def test_validate_rejects_env_error_kind_without_error_step():
  with pytest.raises(ValueError, match="ENV_ERROR in a row without any env_error"):
    _two_episodes().replace(env_error=np.zeros((2, 3), bool)).validate()


def test_used_length_is_one_past_the_last_attended_token():
  assert episode.used_length(_two_episodes()) == 7  # row 1 attends positions 0..6
  assert episode.used_length(episode.empty(2, 8, 3)) == 0


@pytest.mark.parametrize("used,full,buckets,want", [
    (7, 8, 0, 8),  # off
    (7, 8, 4, 8),  # step 2 -> rounded up to 8: one bucket
    (100, 512, 4, 128), (128, 512, 4, 128), (129, 512, 4, 256), (400, 512, 4, 512),
    (0, 512, 4, 128), (512, 512, 4, 512), (600, 512, 4, 512),
    (100, 640, 4, 160), (161, 640, 4, 320), (100, 100, 3, 100), (30, 100, 3, 40)])
def test_bucket_length_picks_the_smallest_even_bucket_that_holds_the_episodes(used, full, buckets,
                                                                            want):
  assert episode.bucket_length(used, full, buckets) == want


def test_trim_cuts_only_padding_and_keeps_the_batch_valid():
  batch = _two_episodes()
  cut = episode.trim(batch, 7).validate()
  assert cut.context_length == 7
  for name in ("tokens", "positions", "attention_mask", "loss_mask", "turn", "behavior_logprobs"):
    np.testing.assert_array_equal(getattr(cut, name), np.asarray(getattr(batch, name))[:, :7])
  for name in ("rewards", "step_mask", "success", "num_steps"):  # step and row fields untouched
    np.testing.assert_array_equal(getattr(cut, name), getattr(batch, name))
  assert episode.trim(batch, 8) is batch
  with pytest.raises(ValueError, match="length 6 would cut attended tokens"):
    episode.trim(batch, 6)
