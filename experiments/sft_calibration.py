r"""Warm-start calibration: sampled success on the test split as SFT proceeds.

    python experiments/sft_calibration.py --config=configs/smollm2_calculator.py:cpu_lora \
        --eval_at=2,4,6,8 --eval_tasks=32 --out=experiments/results/smollm2_lora/sft_calibration.json

Runs the config's SFT warm start (`Learner.warm_start`, the same oracle episodes, optimiser and
minibatches as a training run) for `max(eval_at)` steps and, after each step named in `--eval_at`,
evaluates the policy on the first `--eval_tasks` tasks of the test split at the rollout temperature
with the training run's evaluation seed. A policy-gradient run needs a warm start that succeeds
sometimes but not always; this picks `sft.steps` for one without running RL. Prints one row per
evaluation and writes them (with the SFT metrics and times) as JSON.

`--probe_tasks=N` adds a teacher-forced choice probe (`longhorizon.eval.choice_probe`) on oracle
episodes of the first N test tasks, before SFT and at every `--eval_at` step: the policy's
probability of the oracle's choice wherever its tokens hold `--probe_marker` followed by one of
`--probe_choices` (by default the operation of a `calculator` tool call). One log-prob pass, so it
is cheap beside a sampled evaluation; `--eval_tasks=0` runs the probe alone:

    python experiments/sft_calibration.py --config=configs/smollm2_calculator.py:cpu_lora \
        --eval_at=1,2,3 --eval_tasks=0 --probe_tasks=32
"""

import dataclasses
import json
import os
import time

import jax
import numpy as np

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from longhorizon.core import episode as episode_lib
from longhorizon.envs import tasks as task_suites
from longhorizon.eval import choice_probe
from longhorizon.train import loop
from longhorizon.train.learner import Learner

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=False)
_EVAL_AT = flags.DEFINE_list("eval_at", ["2", "4", "6", "8"], "SFT steps after which to evaluate.")
_EVAL_TASKS = flags.DEFINE_integer("eval_tasks", 32, "Test tasks per sampled evaluation (one "
                                   "attempt each; 0: none).", lower_bound=0)
_SAMPLE_AT = flags.DEFINE_list("sample_at", [], "The `--eval_at` steps with a sampled evaluation "
                                "(default: all of them).")
_PROBE_TASKS = flags.DEFINE_integer("probe_tasks", 0, "Test tasks whose oracle episodes the choice "
                                    "probe scores (0: no probe).", lower_bound=0)
_PROBE_MARKER = flags.DEFINE_string("probe_marker", ', "op": "', "Text right before the choice.")
_PROBE_CHOICES = flags.DEFINE_list("probe_choices", ["add", "sub", "mul", "div"],
                                   "The choices' texts, each right after the marker.")
_PROBE_ROWS = flags.DEFINE_integer("probe_rows", 8, "Episodes per log-prob pass.", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "JSON file for the rows.")
flags.mark_flags_as_required(["config"])


def _probe_setup(s, config, n):
  """The oracle episodes of the first `n` test tasks (host batch) and the marker's and choices'
  token ids under the run's tokenizer."""
  tok = s.codec.tokenizer
  marker_text, choices = _PROBE_MARKER.value, list(_PROBE_CHOICES.value)
  marker = tok.encode(marker_text, add_special_tokens=False)
  choice_ids = []
  for c in choices:
    ids = tok.encode(marker_text + c, add_special_tokens=False)
    if ids[:len(marker)] != marker:
      raise app.UsageError(f"--probe_marker {marker_text!r} tokenizes differently before {c!r} "
                           f"({ids} against {marker}); choose a marker that ends a token.")
    choice_ids.append(ids[len(marker):])
  source = s.eval_tasks.get(config.eval.split, s.train_tasks)
  n = min(n, len(source))
  batch, _ = s.oracle_episodes(task_suites.stack(source, range(n)),
                               jax.random.key(config.seed + 1))
  if not np.asarray(batch.success).all():
    logging.warning("probe: only %.2f of the oracle episodes succeed.",
                    float(np.mean(batch.success)))
  return batch, marker, choice_ids, choices


def _probe(s, params, batch, marker, choice_ids, names):
  """`choice_probe.summarize` of the policy `params` on the oracle `batch`."""
  hits, rows = [], _PROBE_ROWS.value
  for lo in range(0, batch.batch_size, rows):
    part = jax.tree.map(lambda a: np.asarray(a)[lo:lo + rows], batch)
    part = s.trimmed(part)
    logp = np.asarray(jax.device_get(s.logprobs(params, episode_lib.to_device(part))))
    hits += [dataclasses.replace(h, row=h.row + lo) for h in choice_probe.choice_logprobs(
        part.tokens, part.loss_mask, logp, marker, choice_ids)]
  if not hits:
    raise app.UsageError(f"--probe_marker {_PROBE_MARKER.value!r} followed by one of "
                         f"--probe_choices {list(names)} occurs in no oracle action.")
  return choice_probe.summarize(hits, names)


def main(argv):
  del argv
  config = _CONFIG.value
  eval_at = sorted({int(x) for x in _EVAL_AT.value})
  if not eval_at or eval_at[0] < 1:
    raise app.UsageError(f"--eval_at must name SFT steps >= 1, got {_EVAL_AT.value}.")
  sample_at = {int(x) for x in _SAMPLE_AT.value} or set(eval_at)
  if not sample_at <= set(eval_at):
    raise app.UsageError(f"--sample_at {sorted(sample_at)} must be among --eval_at {eval_at}.")
  config.sft.steps = eval_at[-1]
  s = Learner.build(config)
  rows, start = [], time.perf_counter()
  probe = _probe_setup(s, config, _PROBE_TASKS.value) if _PROBE_TASKS.value else None

  def run_probe(params, row):
    began = time.perf_counter()
    row["probe"] = _probe(s, params, *probe)
    row["probe_seconds"] = time.perf_counter() - began
    logging.info("SFT step %d: oracle choice probability %.3f (above 1/2: %.3f) over %d "
                 "decisions; %s (%.0f s).", row["sft_step"], row["probe"]["all"]["mean_prob"],
                 row["probe"]["all"]["frac_above_half"], row["probe"]["all"]["count"],
                 {k: round(v["mean_prob"], 3) for k, v in row["probe"].items() if k != "all"},
                 row["probe_seconds"])

  def on_step(step, params, metrics):
    if step not in eval_at:
      return
    row = {"sft_step": step, "sft_nll": float(metrics["sft_nll"]),
           "sft_token_accuracy": float(metrics["sft_token_accuracy"])}
    if _EVAL_TASKS.value and step in sample_at:
      began = time.perf_counter()
      report = s.evaluate(params, config.eval.split, _EVAL_TASKS.value,
                          temperature=s.rollout.temperature, seed=loop.eval_seed(config))
      row.update(success_rate=report["success_rate"], truncation_rate=report["truncation_rate"],
                 mean_steps=report["mean_steps"], eval_seconds=time.perf_counter() - began)
      logging.info("SFT step %d: sampled success %.3f on %d tasks (nll %.3f, %.0f s eval).",
                   step, row["success_rate"], _EVAL_TASKS.value, row["sft_nll"],
                   row["eval_seconds"])
    if probe is not None:
      run_probe(params, row)
    row["elapsed_seconds"] = time.perf_counter() - start
    rows.append(row)

  with s.in_mesh():
    state = s.initial_state()
    if probe is not None:
      rows.append({"sft_step": 0})
      run_probe(state.params, rows[-1])
    s.warm_start(state, on_step=on_step)
  print(f"{'sft step':>8} {'success':>8} {'p(oracle choice)':>17} {'nll':>7} {'accuracy':>9} "
        f"{'elapsed s':>10}")
  for r in rows:
    cell = lambda k, f: format(r[k], f) if k in r else "-"  # noqa: E731
    p = format(r["probe"]["all"]["mean_prob"], ".3f") if "probe" in r else "-"
    print(f"{r['sft_step']:>8} {cell('success_rate', '.3f'):>8} {p:>17} "
          f"{cell('sft_nll', '.3f'):>7} {cell('sft_token_accuracy', '.3f'):>9} "
          f"{cell('elapsed_seconds', '.0f'):>10}")
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump({"config": config.to_dict(), "eval_tasks": _EVAL_TASKS.value,
                 "probe_tasks": _PROBE_TASKS.value, "probe_marker": _PROBE_MARKER.value,
                 "probe_choices": list(_PROBE_CHOICES.value), "rows": rows}, f, indent=2,
                default=str)


if __name__ == "__main__":
  app.run(main)
