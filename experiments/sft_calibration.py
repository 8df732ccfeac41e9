r"""Warm-start calibration: sampled success on the test split as SFT proceeds.

    python experiments/sft_calibration.py --config=configs/smollm2_calculator.py:cpu_lora \
        --eval_at=2,4,6,8 --eval_tasks=32 --out=experiments/results/smollm2_lora/sft_calibration.json

Runs the config's SFT warm start (`Learner.warm_start`, the same oracle episodes, optimiser and
minibatches as a training run) for `max(eval_at)` steps and, after each step named in `--eval_at`,
evaluates the policy on the first `--eval_tasks` tasks of the test split at the rollout temperature
with the training run's evaluation seed. A policy-gradient run needs a warm start that succeeds
sometimes but not always; this picks `sft.steps` for one without running RL. Prints one row per
evaluation and writes them (with the SFT metrics and times) as JSON.
"""

import json
import os
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from longhorizon.train import loop
from longhorizon.train.learner import Learner

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=False)
_EVAL_AT = flags.DEFINE_list("eval_at", ["2", "4", "6", "8"], "SFT steps after which to evaluate.")
_EVAL_TASKS = flags.DEFINE_integer("eval_tasks", 32, "Test tasks per evaluation (one attempt each).",
                                   lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "JSON file for the rows.")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  config = _CONFIG.value
  eval_at = sorted({int(x) for x in _EVAL_AT.value})
  if not eval_at or eval_at[0] < 1:
    raise app.UsageError(f"--eval_at must name SFT steps >= 1, got {_EVAL_AT.value}.")
  config.sft.steps = eval_at[-1]
  s = Learner.build(config)
  rows, start = [], time.perf_counter()

  def on_step(step, params, metrics):
    if step not in eval_at:
      return
    began = time.perf_counter()
    report = s.evaluate(params, config.eval.split, _EVAL_TASKS.value,
                        temperature=s.rollout.temperature, seed=loop.eval_seed(config))
    row = {"sft_step": step, "success_rate": report["success_rate"],
           "truncation_rate": report["truncation_rate"], "mean_steps": report["mean_steps"],
           "sft_nll": float(metrics["sft_nll"]),
           "sft_token_accuracy": float(metrics["sft_token_accuracy"]),
           "eval_seconds": time.perf_counter() - began, "elapsed_seconds": time.perf_counter() - start}
    rows.append(row)
    logging.info("SFT step %d: sampled success %.3f on %d tasks (nll %.3f, %.0f s eval).", step,
                 row["success_rate"], _EVAL_TASKS.value, row["sft_nll"], row["eval_seconds"])

  with s.in_mesh():
    s.warm_start(s.initial_state(), on_step=on_step)
  print(f"{'sft step':>8} {'success':>8} {'nll':>7} {'accuracy':>9} {'elapsed s':>10}")
  for r in rows:
    print(f"{r['sft_step']:>8} {r['success_rate']:>8.3f} {r['sft_nll']:>7.3f} "
          f"{r['sft_token_accuracy']:>9.3f} {r['elapsed_seconds']:>10.0f}")
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump({"config": config.to_dict(), "eval_tasks": _EVAL_TASKS.value, "rows": rows}, f,
                indent=2, default=str)


if __name__ == "__main__":
  app.run(main)
