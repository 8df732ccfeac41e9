"""experiments/context_modes_report.py, its flag-free part (`studies/context_report.py`): the
context length at each step is the position of the step's first sampled token, averaged over
the rows that reach it (a hand case), and plots are titled by the runs' environment."""

import types

import numpy as np

from longhorizon.studies import context_report


def test_context_length_per_step_by_hand():
  turn = np.array([[-1, -1, 0, 0, 0, 1, 1, 1],
                   [-1, 0, 0, 1, 1, 2, 2, -1]])
  loss = np.array([[0, 0, 1, 0, 0, 1, 1, 0],
                   [0, 1, 0, 1, 0, 1, 0, 0]], bool)
  rows = types.SimpleNamespace(batch_size=2, turn=turn, loss_mask=loss)
  # step 0 begins at 2 and 1, step 1 at 5 and 3, step 2 only in row 1, at 5; step 3 nowhere
  assert context_report.context_lengths(rows, 4) == [1.5, 4.0, 5.0, None]


def test_plot_titles_name_the_environment():
  assert context_report.task_label([{"env": "textworld", "horizon": 16, "context_budget": 640}]) == (
      "textworld quest 16, budget 640")
  assert context_report.task_label([{"env": "pointer_chain", "horizon": 32, "context_budget": 128}]) == (
      "pointer_chain N = 32, budget 128")
