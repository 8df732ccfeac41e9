"""The flag-free part of experiments/sweep_report.py: a seed sweep of `experiments/train.py` runs
read from its `sweep.json` and run folders, summarised per arm (runs that differ only in the seed)
with 95% t-intervals over seeds, and how many runs meet a claim (final success and gain)."""

import json
import os

from absl import logging
import numpy as np

from longhorizon.studies import credit_report
from longhorizon.studies.credit_report import interval

__all__ = ["arm_name", "read_runs", "summarise", "markdown", "FIELDS", "STAGES"]

SEED_KEY = "config.seed"
STAGES = (("warm_start_success_rate", "warm start, sampled"), ("success_rate", "final, sampled"),
          ("gain", "final - warm start"), ("warm_start_greedy_success_rate", "warm start, greedy"),
          ("greedy_success_rate", "final, greedy"))
FIELDS = ("run", "arm", "seed", "warm_start_success_rate", "success_rate", "gain",
          "warm_start_greedy_success_rate", "greedy_success_rate", "num_updates", "meets_claim",
          "commit", "cpu")


def arm_name(overrides: dict) -> str:
  """The overrides other than the seed, as `key=value,...` (`default` when there are none)."""
  rest = {k.removeprefix("config."): v for k, v in sorted(overrides.items()) if k != SEED_KEY}
  return ",".join(f"{k}={v}" for k, v in rest.items()) or "default"


def read_runs(root: str, min_success: float, min_gain: float) -> list[dict]:
  """One row per finished run of `root/sweep.json`, in the sweep's order."""
  path = os.path.join(root, "sweep.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: --root must be the workdir_root of a "
                            "experiments/sweep.py run.")
  with open(path, encoding="utf-8") as f:
    records = json.load(f)
  rows = []
  for record in records:
    eval_path = os.path.join(root, record["name"], "eval.json")
    if not os.path.exists(eval_path):
      logging.warning("%s has no eval.json (status %s): left out.", record["name"],
                      record.get("status"))
      continue
    with open(eval_path, encoding="utf-8") as f:
      result = json.load(f)
    if SEED_KEY not in record["overrides"]:
      raise ValueError(f"run {record['name']} of {path} sets no {SEED_KEY}: a seed report needs "
                       "every run's seed in its overrides.")
    warm, final = result["warm_start_success_rate"], result["success_rate"]
    made = result.get("provenance", {})
    rows.append({"run": record["name"], "arm": arm_name(record["overrides"]),
                 "seed": int(record["overrides"][SEED_KEY]), "warm_start_success_rate": warm,
                 "success_rate": final, "gain": final - warm,
                 "warm_start_greedy_success_rate": result["warm_start_greedy_success_rate"],
                 "greedy_success_rate": result["greedy_success_rate"],
                 "num_updates": result["num_updates"],
                 "meets_claim": bool(final >= min_success and final - warm >= min_gain),
                 "commit": made.get("commit"), "cpu": made.get("cpu")})
  return rows


def summarise(rows: list[dict]) -> dict:
  """`{arm: {"seeds", "meets_claim", stage key: [mean, half-width or None]}}`."""
  out = {}
  for arm in dict.fromkeys(r["arm"] for r in rows):
    mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"])
    out[arm] = {"seeds": [r["seed"] for r in mine],
                "meets_claim": sum(r["meets_claim"] for r in mine)}
    for key, _ in STAGES:
      mean, half = interval([r[key] for r in mine])
      out[arm][key] = [mean, None if np.isnan(half) else half]  # one seed: no interval
  return out


def _cell(value) -> str:
  mean, half = value  # half None (one seed) prints the mean alone, as the credit report does
  return credit_report._fmt(mean, float("nan") if half is None else half)


def markdown(rows: list[dict], summary: dict, min_success: float, min_gain: float) -> str:
  lines = []
  for arm, s in summary.items():
    lines += [f"## {arm}", "", f"Seeds {s['seeds']}; mean ± 95% t-interval half-width.", "",
              "| | success |", "|---|---|"]
    lines += [f"| {label} | {_cell(s[key])} |" for key, label in STAGES]
    lines += ["", f"{s['meets_claim']} of {len(s['seeds'])} runs meet the claim (final sampled "
              f"success >= {min_success:g} and >= warm start + {min_gain:g}).", "",
              "| seed | warm | final | greedy warm | greedy final | meets | commit | CPU |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"]):
      lines.append(f"| {r['seed']} | {r['warm_start_success_rate']:.4f} | "
                   f"{r['success_rate']:.4f} | {r['warm_start_greedy_success_rate']:.4f} | "
                   f"{r['greedy_success_rate']:.4f} | {'yes' if r['meets_claim'] else 'no'} | "
                   f"{(r['commit'] or '-')[:10]} | {r['cpu'] or '-'} |")
    lines.append("")
  return "\n".join(lines)
