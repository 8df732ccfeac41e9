"""The flag-free part of `experiments/context_modes_report.py` (absl flags are process-global, so
tests import this, not the script): the context length at each step of sampled rows, and the
label of a set of runs' task."""

import numpy as np

__all__ = ["context_lengths", "task_label"]


def context_lengths(rows, max_steps: int) -> list[float | None]:
  """Mean tokens in context when each step's action began (None past the last step reached):
  the position of the step's first sampled token in the row holding it."""
  per_step = [[] for _ in range(max_steps)]
  for j in range(rows.batch_size):
    turn, loss = np.asarray(rows.turn[j]), np.asarray(rows.loss_mask[j], bool)
    for t in np.unique(turn[loss]):
      per_step[int(t)].append(int(np.flatnonzero(loss & (turn == t))[0]))
  return [float(np.mean(v)) if v else None for v in per_step]


def task_label(runs: list[dict]) -> str:
  """"pointer_chain N = 32, budget 128" or "textworld quest 16, budget 640" (the first run's)."""
  r = runs[0]
  env, budget = r.get("env", "pointer_chain"), r.get("context_budget", 128)
  horizon = r.get("horizon", 32)
  name = f"textworld quest {horizon}" if env == "textworld" else f"{env} N = {horizon}"
  return f"{name}, budget {budget}"
