"""`EpisodeBuffer`: a two-row episode written by hand, checked position by position; buffers
concatenated row-wise, and refused when they do not fit together."""

import numpy as np
import pytest

from longhorizon.core.episode import Termination
from longhorizon.envs.types import ErrorCode, TimeStep
from longhorizon.envs import RewardSpec
from longhorizon.rollout.buffer import EpisodeBuffer


def _timestep(b, **fields):
  """A host `[B]` time step: nothing happened, except `fields`."""
  zeros = lambda dtype, *shape: np.zeros((b,) + shape, dtype)
  ts = dict(observation={"error": zeros(np.int32)}, reward=zeros(np.float32),
            terminated=zeros(bool), truncated=zeros(bool), success=zeros(bool),
            milestones=zeros(bool, 2), cost=zeros(np.float32), violation=zeros(bool),
            env_error=zeros(bool), anchor=zeros(np.uint32), step=zeros(np.int32),
            invalid_action=zeros(bool), loop=zeros(bool), fault=zeros(np.int32))
  ts.update({k: v if k == "observation" else np.asarray(v, ts[k].dtype) for k, v in fields.items()})
  return TimeStep(**ts)


def test_a_two_row_episode_by_hand():
  buffer = EpisodeBuffer.start([[7, 8, 9], [5, 6]], context_length=10, max_steps=2,
                               anchor=np.array([11, 12], np.uint32), num_milestones=2)
  np.testing.assert_array_equal(buffer.budgets(4), [4, 4])
  np.testing.assert_array_equal(buffer.budgets(8), [6, 7])  # one slot stays free for an end of turn
  active = np.array([True, True])
  written = buffer.write_turn(0, active, tokens=np.array([[1, 2, 0], [3, 0, 0]]),
                              logprobs=np.array([[-0.5, -0.25, 0], [-1.0, 0, 0]], np.float32),
                              lengths=np.array([2, 1]))
  assert written == 3
  # Row 0 answers and succeeds; row 1 reaches milestone 0 with a rejected action and goes on.
  ts = _timestep(2, terminated=[True, False], success=[True, False], milestones=[[0, 0], [1, 0]],
                 cost=[0.0, 0.5], invalid_action=[False, True], anchor=[21, 22],
                 observation={"error": np.array([0, ErrorCode.NOT_ALLOWED], np.int32)})
  finished = buffer.record_step(0, active, ts)
  np.testing.assert_array_equal(finished, [True, False])
  buffer.append_observation(1, 0, [4, 4])
  buffer.stop(1, Termination.CONTEXT_OVERFLOW)
  np.testing.assert_array_equal(buffer.done, [True, True])
  batch = buffer.finish(RewardSpec(milestone=0.5, invalid=0.25)).validate()

  np.testing.assert_array_equal(batch.tokens, [[7, 8, 9, 1, 2, 0, 0, 0, 0, 0],
                                               [5, 6, 3, 4, 4, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.turn, [[-1, -1, -1, 0, 0, -1, -1, -1, -1, -1],
                                             [-1, -1, 0, 0, 0, -1, -1, -1, -1, -1]])
  np.testing.assert_array_equal(batch.loss_mask[:, :5], [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]])
  np.testing.assert_array_equal(batch.attention_mask.sum(-1), [5, 5])
  np.testing.assert_array_equal(batch.behavior_logprobs[:, :5],
                                [[0, 0, 0, -0.5, -0.25], [0, 0, -1.0, 0, 0]])
  np.testing.assert_array_equal(batch.positions[1], np.arange(10))
  np.testing.assert_array_equal(batch.step_mask, [[1, 0], [1, 0]])
  np.testing.assert_array_equal(batch.anchor[:, 0], [11, 12])  # the state the action was taken in
  np.testing.assert_array_equal(buffer.next_anchor, [21, 22])
  np.testing.assert_array_equal(batch.milestones[:, 0], [0, 1])  # bit 0: milestone 0
  np.testing.assert_array_equal(batch.termination, [Termination.SUCCESS,
                                                    Termination.CONTEXT_OVERFLOW])
  np.testing.assert_array_equal(batch.terminated, [True, False])
  np.testing.assert_array_equal(batch.truncated, [False, True])
  np.testing.assert_array_equal(batch.num_steps, [1, 1])
  # Row 0: success 1; row 1: milestone 0.5 - invalid 0.25.
  np.testing.assert_allclose(batch.rewards[:, 0], [1.0, 0.25])
  np.testing.assert_allclose(batch.score, [1.0, 0.25])
  info = buffer.episode_info()
  np.testing.assert_array_equal(info["tool_calls"], [1, 1])
  np.testing.assert_array_equal(info["invalid_actions"], [0, 1])
  np.testing.assert_array_equal(info["unauthorized"], [0, 1])


def test_how_a_step_ends_an_episode_by_priority():
  """An environment error first (never terminated), then a safety stop, a success, a failure; an
  episode the environment truncated (step limit, loop detector) is a TIMEOUT."""
  buffer = EpisodeBuffer.start([[1]] * 5, context_length=4, max_steps=1,
                               anchor=np.zeros(5, np.uint32), num_milestones=2)
  ts = _timestep(5, terminated=[1, 1, 1, 1, 0], truncated=[0, 0, 0, 0, 1], success=[1, 0, 1, 0, 0],
                 violation=[1, 1, 0, 0, 0], env_error=[1, 0, 0, 0, 0])
  np.testing.assert_array_equal(buffer.record_step(0, np.ones(5, bool), ts), [True] * 5)
  out = buffer.batch
  np.testing.assert_array_equal(out.termination, [Termination.ENV_ERROR, Termination.SAFETY_STOP,
                                                  Termination.SUCCESS, Termination.FAILURE,
                                                  Termination.TIMEOUT])
  np.testing.assert_array_equal(out.terminated, [False, True, True, True, False])
  np.testing.assert_array_equal(out.truncated, [True, False, False, False, True])
  np.testing.assert_array_equal(out.success, [True, False, True, False, False])


def test_concat_holds_each_buffers_rows_in_order():
  first = EpisodeBuffer.start([[7, 8], [5]], context_length=4, max_steps=2,
                              anchor=np.array([11, 12], np.uint32), num_milestones=2)
  second = EpisodeBuffer.start([[3, 4, 6]], context_length=4, max_steps=2,
                               anchor=np.array([13], np.uint32), num_milestones=2)
  # Row 0 of the second buffer takes a rejected step and ends.
  second.record_step(0, np.array([True]), _timestep(1, terminated=[True], invalid_action=[True],
                                                    cost=[0.5], anchor=[23]))
  both = EpisodeBuffer.concat([first, second])
  np.testing.assert_array_equal(both.batch.tokens, [[7, 8, 0, 0], [5, 0, 0, 0], [3, 4, 6, 0]])
  np.testing.assert_array_equal(both.batch.attention_mask.sum(-1), [2, 1, 3])
  np.testing.assert_array_equal(both.batch.step_mask, [[0, 0], [0, 0], [1, 0]])
  np.testing.assert_array_equal(both.batch.cost, [[0, 0], [0, 0], [0.5, 0]])
  np.testing.assert_array_equal(both.batch.anchor[:, 0], [0, 0, 13])
  np.testing.assert_array_equal(both.batch.oracle_match, -np.ones((3, 2)))
  np.testing.assert_array_equal(both.batch.termination, [0, 0, Termination.FAILURE])
  np.testing.assert_array_equal(both.end, [2, 1, 3])
  np.testing.assert_array_equal(both.done, [False, False, True])
  np.testing.assert_array_equal(both.next_anchor, [11, 12, 23])
  np.testing.assert_array_equal(both.invalid, [[0, 0], [0, 0], [1, 0]])
  assert both.env_reward is None and both.num_milestones == 2
  # Every array, of the batch and of the buffer, is the parts' rows in order, in a new array.
  for rows, part in (([0, 1], first), ([2], second)):
    got, want = both.take(rows), part
    for name in ("end", "done", "next_anchor", "invalid", "unauthorized", "faulted", "looped"):
      np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for name, value in vars(want.batch).items():
      np.testing.assert_array_equal(getattr(got.batch, name), value, err_msg=name)
  both.batch.tokens[0, 0] = 9
  assert first.batch.tokens[0, 0] == 7


def test_concat_of_incompatible_buffers_names_the_mismatch():
  make = lambda length=4, steps=2, milestones=2: EpisodeBuffer.start(
      [[1]], context_length=length, max_steps=steps, anchor=np.zeros(1, np.uint32),
      num_milestones=milestones)
  with pytest.raises(ValueError, match=r"buffer 1 has context_length .* = 5 but buffer 0 has 4"):
    EpisodeBuffer.concat([make(), make(length=5)])
  with pytest.raises(ValueError, match="max_steps"):
    EpisodeBuffer.concat([make(), make(), make(steps=3)])
  with pytest.raises(ValueError, match="num_milestones"):
    EpisodeBuffer.concat([make(), make(milestones=1)])
  host = make()
  host.record_step(0, np.array([True]), _timestep(1), env_reward=np.array([1.0]))
  with pytest.raises(ValueError, match="env_reward"):
    EpisodeBuffer.concat([make(), host])
  with pytest.raises(ValueError, match="at least one"):
    EpisodeBuffer.concat([])
