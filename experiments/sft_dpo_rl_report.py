r"""RL alone vs SFT -> DPO -> RL at equal sampled episodes: the report of configs/sft_dpo_rl.py's sweep.

    python experiments/sweep.py --config=configs/sft_dpo_rl.py --workdir_root=ROOT
    python experiments/sft_dpo_rl_report.py --root=ROOT [--out=DIR]

Reads every run folder's `eval.json` and `metrics.jsonl` under --root (a run without `eval.json`
is unfinished and left out, named in the log) and writes to --out (default --root): `runs.csv`
(one row per run), `summary.md` (each stage's test success, mean and 95% t-interval over seeds, the
per-seed difference of the final success, and a line per run), `summary.json`, and `curves.png` (training success
against episodes sampled: the pipeline's curve starts after its DPO episodes).
"""

import csv
import glob
import json
import os

from absl import app
from absl import flags
from absl import logging
from matplotlib.figure import Figure
import numpy as np

from longhorizon.studies.credit_report import interval
from longhorizon.train.metrics import read_metrics

_ROOT = flags.DEFINE_string("root", None, "The sweep's --workdir_root.")
_OUT = flags.DEFINE_string("out", None, "Where the report goes (default: --root).")
flags.mark_flags_as_required(["root"])

ARMS = ("rl_alone", "sft_dpo_rl")
_STAGES = (("warm_start_success_rate", "warm start (SFT)"), ("dpo_success_rate", "after DPO"),
           ("success_rate", "final"), ("warm_start_greedy_success_rate", "warm start, greedy"),
           ("dpo_greedy_success_rate", "after DPO, greedy"), ("greedy_success_rate", "final, greedy"))


def read_runs(root: str) -> list[dict]:
  """One row per finished run: arm, seed, each stage's success, episodes, the training curve."""
  rows = []
  for path in sorted(glob.glob(os.path.join(root, "*", "eval.json"))):
    run = os.path.dirname(path)
    with open(path, encoding="utf-8") as f:
      result = json.load(f)
    with open(os.path.join(run, "config.json"), encoding="utf-8") as f:
      config = json.load(f)
    per_update = config["rollout"]["num_tasks"] * config["rollout"]["group_size"]
    episodes = result["training_episodes"]
    curve = [(episodes["dpo"] + int(r["update"]) * per_update, float(r["success_rate"]))
             for r in read_metrics(run)]
    row = {"run": os.path.basename(run), "arm": ARMS[bool(result.get("dpo"))],
           "seed": config["seed"], "sampled_episodes": episodes["sampled"],
           "dpo_episodes": episodes["dpo"], "rl_updates": result["num_updates"],
           "dpo_pairs": (result.get("dpo") or {}).get("pairs_used", 0),
           "dpo_chosen_logratio": (result.get("dpo") or {}).get("dpo_chosen_logratio"),
           "dpo_rejected_logratio": (result.get("dpo") or {}).get("dpo_rejected_logratio"),
           "curve": curve}
    row.update({key: result.get(key) for key, _ in _STAGES})
    rows.append(row)
  for run in sorted(glob.glob(os.path.join(root, "*", "config.json"))):
    if not os.path.exists(os.path.join(os.path.dirname(run), "eval.json")):
      logging.warning("%s has no eval.json yet (unfinished): left out.", os.path.dirname(run))
  return rows


def summarise(rows: list[dict]) -> dict:
  """`{arm: {stage key: [mean, half-width], "seeds": [...]}, "final_difference": ...}`."""
  out = {}
  for arm in ARMS:
    mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"])
    if not mine:
      continue
    out[arm] = {"seeds": [r["seed"] for r in mine],
                "sampled_episodes": sorted({r["sampled_episodes"] for r in mine})}
    for key, _ in _STAGES:
      values = [r[key] for r in mine if r[key] is not None]
      if values:
        out[arm][key] = list(interval(values))
  both = {a: {r["seed"]: r["success_rate"] for r in rows if r["arm"] == a} for a in ARMS}
  seeds = sorted(set(both[ARMS[0]]) & set(both[ARMS[1]]))
  if seeds:
    diffs = [both["sft_dpo_rl"][s] - both["rl_alone"][s] for s in seeds]
    out["final_difference"] = {"seeds": seeds, "per_seed": diffs, "interval": list(interval(diffs))}
  return out


def _cell(value) -> str:
  if value is None:
    return "-"
  mean, half = value
  return f"{mean:.3f}" + ("" if np.isnan(half) else f" ± {half:.3f}")


def markdown(summary: dict) -> str:
  lines = ["| stage | " + " | ".join(a for a in ARMS if a in summary) + " |",
           "|---|" + "---|" * sum(a in summary for a in ARMS)]
  for key, label in _STAGES:
    lines.append(f"| {label} | " + " | ".join(_cell(summary[a].get(key)) for a in ARMS
                                              if a in summary) + " |")
  lines.append("| seeds | " + " | ".join(str(summary[a]["seeds"]) for a in ARMS
                                         if a in summary) + " |")
  lines.append("| episodes sampled | " + " | ".join(str(summary[a]["sampled_episodes"])
                                                    for a in ARMS if a in summary) + " |")
  d = summary.get("final_difference")
  if d:
    lines += ["", f"Final sampled success, sft_dpo_rl minus rl_alone on the same seed {d['seeds']}: "
              + ", ".join(f"{x:+.3f}" for x in d["per_seed"])
              + f"; mean {_cell(d['interval'])} (95% t-interval)."]
  return "\n".join(lines) + "\n"


def runs_table(rows: list[dict]) -> str:
  """One line per run: its stages' test success (sampled / greedy), pairs and the DPO stage's
  log-ratios of the chosen and rejected episodes to the reference after its last pass."""
  fmt = lambda x, spec=".3f": "-" if x is None else format(x, spec)
  lines = ["| run | warm start | after DPO | final | pairs | chosen / rejected log-ratio |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['run']} | {fmt(r['warm_start_success_rate'])} / "
        f"{fmt(r['warm_start_greedy_success_rate'])} | {fmt(r['dpo_success_rate'])} / "
        f"{fmt(r['dpo_greedy_success_rate'])} | {fmt(r['success_rate'])} / "
        f"{fmt(r['greedy_success_rate'])} | {r['dpo_pairs']} | "
        f"{fmt(r['dpo_chosen_logratio'], '+.2f')} / {fmt(r['dpo_rejected_logratio'], '+.2f')} |")
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> str:
  fig = Figure(figsize=(7, 4))
  ax = fig.subplots()
  for arm, color in zip(ARMS, ("tab:blue", "tab:orange")):
    for i, r in enumerate(r for r in rows if r["arm"] == arm):
      x, y = zip(*r["curve"]) if r["curve"] else ((), ())
      ax.plot(x, y, color=color, alpha=0.7, label=arm if i == 0 else None)
      if r["dpo_success_rate"] is not None:
        ax.plot([r["dpo_episodes"]], [r["dpo_success_rate"]], "o", color=color)
  ax.set_xlabel("episodes sampled (DPO stage + RL)")
  ax.set_ylabel("training success (dots: test success after DPO)")
  ax.set_ylim(-0.02, 1.02)
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  out = _OUT.value or _ROOT.value
  rows = read_runs(_ROOT.value)
  if not rows:
    raise app.UsageError(f"--root={_ROOT.value}: no finished run (no */eval.json).")
  os.makedirs(out, exist_ok=True)
  fields = [k for k in rows[0] if k != "curve"]
  with open(os.path.join(out, "runs.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  summary = summarise(rows)
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
  text = markdown(summary) + "\nEach run (test success sampled / greedy):\n\n" + runs_table(rows)
  with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
    f.write(text)
  plot(rows, os.path.join(out, "curves.png"))
  print(text)


if __name__ == "__main__":
  app.run(main)
