r"""Context modes at an overflowing horizon: the report of configs/context_modes.py's runs.

    python experiments/train.py --config=configs/context_modes.py:MODE,SEED \
        --workdir=ROOT/MODE_sSEED
    python experiments/context_modes_report.py --root=ROOT --out=experiments/results/context_modes

Reads every run folder under --root that has an `eval.json` (unfinished ones are named in the log
and left out). For each run: its warm-start, final and greedy test success (`eval.json`) and
training curve (`metrics.jsonl`); then, with its final checkpoint, `--episodes` test episodes
sampled in its own context mode, from which it measures

* the context length at each turn (tokens the policy had in context when it began step t's
  action, averaged over the episodes that reached step t), and
* the distribution shift of the rewrite (window / summary): on every segment that starts from a
  rewritten context, the policy's log-probs of its own sampled actions with the rewritten context
  (`q`, the behaviour) and after the history `full` would hold instead (`p`,
  `context.rewrite_pairs`): `kl = E_q[log q - log p]` per action token, and the importance ratio
  `p / q` (its mean and the share of tokens outside [0.8, 1.25]); for offload the same with every
  offloaded output inline instead of its stub (`context.offload_pairs`, all rows).

Writes `runs.json` (everything per run), `summary.md` (per mode: seeds, success mean and 95%
t-interval, the shift) and `context_length.png` / `curves.png`.
"""

import glob
import json
import os

from absl import app
from absl import flags
from absl import logging
import jax
from matplotlib.figure import Figure
import ml_collections
import numpy as np

from longhorizon import rollout
from longhorizon.core.episode import join_segments, to_device
from longhorizon.envs import tasks as task_suites
from longhorizon.rollout import context
from longhorizon.studies import context_report
from longhorizon.studies.credit_report import interval
from longhorizon.train.checkpoints import Checkpointer
from longhorizon.train.learner import Learner
from longhorizon.train.metrics import read_metrics
from longhorizon.train.update import episode_logprobs
from longhorizon.train.workdir import ADDED_FIELDS

_ROOT = flags.DEFINE_string("root", None, "Folder of the runs (ROOT/MODE_sSEED).")
_OUT = flags.DEFINE_string("out", None, "Where the report goes (default: --root).")
_EPISODES = flags.DEFINE_integer("episodes", 32, "Test episodes sampled per run for the "
                                 "context lengths and the rewrite's shift.")
flags.mark_flags_as_required(["root"])

MODES = ("full", "window", "summary", "policy", "offload")


def _shift(learner: Learner, params, q_rows, p_rows, count: int) -> dict:
  """The policy's log-probs of the same sampled tokens in `q_rows` (the contexts it saw) and
  `p_rows` (the alternative): KL per action token and the importance ratio `p / q`."""
  t = learner.rollout.temperature
  q = np.asarray(episode_logprobs(params, learner.model_config, to_device(q_rows), temperature=t))
  p = np.asarray(episode_logprobs(params, learner.model_config, to_device(p_rows), temperature=t))
  q, p = q[np.asarray(q_rows.loss_mask)], p[np.asarray(p_rows.loss_mask)]
  ratio = np.exp(p - q)
  return {"segments": count, "tokens": int(q.size), "kl": float(np.mean(q - p)),
          "ratio_mean": float(ratio.mean()),
          "ratio_outside_0.8_1.25": float(np.mean((ratio < 0.8) | (ratio > 1.25)))}


def rewrite_shift(learner: Learner, params, rows, rewritten) -> dict:
  """The policy's log-probs of each rewritten segment's own actions with and without the
  rewrite (see the module doc)."""
  if not rewritten:
    return {}
  longest = max(len(h) for _, h, _ in rewritten) + rows.context_length
  q_rows, p_rows = context.rewrite_pairs(rows, rewritten, -(-longest // 64) * 64)
  return _shift(learner, params, q_rows, p_rows, len(rewritten))


def offload_shift(learner: Learner, params, rows, tasks) -> dict:
  """The policy's log-probs of its own actions with the stubs it saw (`q`) and with every
  offloaded output inline (`p`), as `rewrite_shift` (see the module doc)."""
  # outputs inline: a few times the budget (offload_pairs names a row that needs more)
  q_rows, p_rows = context.offload_pairs(rows, learner.env, learner.codec, tasks,
                                         4 * rows.context_length)
  return _shift(learner, params, q_rows, p_rows, int(rows.batch_size))


def measure(run: str, episodes: int) -> dict:
  """Context lengths and the rewrite's shift of `run`'s final policy on test episodes."""
  with open(os.path.join(run, "config.json"), encoding="utf-8") as f:
    saved = json.load(f)
  for path, value in ADDED_FIELDS.items():  # fields added after the run started: their defaults
    node = saved
    *parents, leaf = path.split(".")
    for part in parents:
      node = node.setdefault(part, {})
    node.setdefault(leaf, value)
  config = ml_collections.ConfigDict(saved)
  s = Learner.build(config)
  checkpointer = Checkpointer(os.path.join(run, "checkpoints"))
  try:
    state, _ = checkpointer.restore(template=s.with_reference(s.initial_state()))
  finally:
    checkpointer.close()
  source = s.eval_tasks["test"]
  n = min(episodes, len(source))
  batch, stats = rollout.collect(
      state.params, s.model_config, s.env, s.codec, task_suites.stack(source, range(n)),
      jax.random.split(jax.random.key(config.seed + 17), n), s.collect_config(group_size=1),
      sampling_seed=config.seed + 17)
  rows = join_segments(batch, stats.segments)
  if config.context.mode == "offload":
    shift = offload_shift(s, state.params, rows, [source[i] for i in range(n)])
  else:
    shift = rewrite_shift(s, state.params, rows, stats.rewritten or [])
  return {"context_length": context_report.context_lengths(rows, config.env.max_steps),
          "sampled_success": float(np.mean(batch.success)),
          "mean_steps": float(np.mean(batch.num_steps)), "shift": shift,
          "env": config.env.name, "context_budget": config.rollout.context_length,
          "horizon": int(config.env.params.get("horizon", config.env.params.get("quest_length", 0)))}


def read_runs(root: str, episodes: int) -> list[dict]:
  runs = []
  for path in sorted(glob.glob(os.path.join(root, "*", "config.json"))):
    run = os.path.dirname(path)
    if not os.path.exists(os.path.join(run, "eval.json")):
      logging.info("unfinished (no eval.json), left out: %s", run)
      continue
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
    with open(os.path.join(run, "eval.json"), encoding="utf-8") as f:
      result = json.load(f)
    logging.info("measuring %s", run)
    mode = config["context"]["mode"]
    if mode == "summary" and config["context"].get("summary_by") == "policy":
      mode = "policy"
    every = config["context"].get("every", 0) if mode not in ("full", "offload") else 0
    row = {"run": os.path.basename(run), "mode": mode, "every": every,
           "label": mode if not every else f"{mode}, every {every}",
           "seed": config["seed"], "num_updates": result["num_updates"],
           "warm_start": result["warm_start_success_rate"], "final": result["success_rate"],
           "greedy": result.get("greedy_success_rate"),
           "curve": [(int(r["update"]), float(r["success_rate"])) for r in read_metrics(run)]}
    row.update(measure(run, episodes))
    runs.append(row)
  return runs


def _summary(runs: list[dict]) -> str:
  lines = ["| mode | seeds | warm start | final (sampled) | final (greedy) | rewrite KL | "
           "ratio outside [0.8, 1.25] |", "|---|---|---|---|---|---|---|"]
  labels = sorted({r["label"] for r in runs},
                  key=lambda x: (MODES.index(x.split(",")[0]), x))
  for mode in labels:
    own = [r for r in runs if r["label"] == mode]
    cell = lambda key: _mean(own, key)
    shift = [r["shift"] for r in own if r["shift"]]
    kl = f"{np.mean([x['kl'] for x in shift]):.3f}" if shift else "-"
    out = (f"{np.mean([x['ratio_outside_0.8_1.25'] for x in shift]):.3f}" if shift else "-")
    lines.append(f"| {mode} | {', '.join(str(r['seed']) for r in own)} | {cell('warm_start')} | "
                 f"{cell('final')} | {cell('greedy')} | {kl} | {out} |")
  return "\n".join(lines) + "\n"


def _mean(runs, key) -> str:
  values = [r[key] for r in runs if r[key] is not None]
  if len(values) < 2:
    return f"{values[0]:.3f}" if values else "-"
  mean, half = interval(values)
  return f"{mean:.3f} ± {half:.3f}"


def _plots(runs: list[dict], out: str) -> None:
  colors = {"full": "tab:gray", "window": "tab:blue", "summary": "tab:green",
            "policy": "tab:orange", "offload": "tab:purple"}
  task = context_report.task_label(runs)
  fig = Figure(figsize=(6, 3.6))
  ax = fig.subplots()
  for r in runs:
    steps = [(t, v) for t, v in enumerate(r["context_length"]) if v is not None]
    ax.plot(*zip(*steps), color=colors[r["mode"]], label=f"{r['label']} (seed {r['seed']})",
            linestyle="--" if r["mode"] == "full" else "-", linewidth=3 if r["mode"] == "full" else 1.5)
  ax.set(xlabel="step", ylabel="tokens in context at the step's action",
         title=f"Context length per turn ({task})")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "context_length.png"), dpi=120)
  fig = Figure(figsize=(6, 3.6))
  ax = fig.subplots()
  for r in runs:
    ax.plot(*zip(*r["curve"]), color=colors[r["mode"]],
            label=f"{r['label']} (seed {r['seed']})")
  ax.set(xlabel="update", ylabel="training success", title=f"GRPO on {task}")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "curves.png"), dpi=120)


def main(argv):
  del argv
  out = _OUT.value or _ROOT.value
  os.makedirs(out, exist_ok=True)
  runs = read_runs(_ROOT.value, _EPISODES.value)
  with open(os.path.join(out, "runs.json"), "w", encoding="utf-8") as f:
    json.dump(runs, f, indent=1)
  with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
    f.write(_summary(runs))
  if runs:
    _plots(runs, out)
  print(_summary(runs))


if __name__ == "__main__":
  app.run(main)
