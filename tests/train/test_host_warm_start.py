"""SFT demonstrations of a host environment through the `Learner`: one oracle episode per task
whatever the task dicts hold (a batch of host tasks is a list, not a pytree with a batch axis)."""

import jax
import numpy as np

from longhorizon.envs import pool as pool_lib


def test_oracle_episodes_of_host_tasks_are_one_per_task(tmp_path, smoke_learner, host_fixtures):
  # Counter's tasks are `{"id": i, "length": 3}`: their first leaf is an int. Counting tasks by
  # the first leaf's length raised TypeError here (the custom-environment notebook's host cell),
  # and with a string first leaf it would count the string's characters.
  del host_fixtures  # puts tests/envs on sys.path for the import path below
  learner = smoke_learner(tmp_path, {"env.name": "host_fixtures:Counter", "env.params": {},
                                     "pool.backend": "serial"})
  try:
    tasks = learner.tasks_at(0, 3)
    assert isinstance(tasks, list) and len(tasks) == 3
    batch, _ = learner.oracle_episodes(tasks, jax.random.key(0))
    assert batch.batch_size == 3
    np.testing.assert_array_equal(batch.success, [True] * 3)
    np.testing.assert_array_equal(batch.num_steps, [3] * 3)  # `up` x length 3
  finally:
    pool_lib.close_pools(learner.env)
