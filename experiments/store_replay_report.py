r"""RL alone against RL with groups replayed from the trajectory store: a table from the runs.

    python experiments/store_replay_report.py --root=ROOT --out=experiments/results/store_replay

Reads `ROOT/{base,replay}_s{SEED}/` (made by the commands in `--out`'s summary.md: the main job's
config for 20 updates, store on, `loss.tis_threshold=2`; the replay arm adds
`store.replay_groups=8`, `store.replay_failure=2`, `store.replay_half_life=4`), writes
`summary.md` (final sampled / greedy test success per seed, means with 95% t-intervals, the paired
differences, the mean replay metrics) and copies each run's eval.json, config.json and
metrics.jsonl under `run_files/`.
"""

from __future__ import annotations

import json
import os
import shutil

from absl import app
from absl import flags
import numpy as np
from scipy import stats

_ROOT = flags.DEFINE_string("root", None, "Folder holding the runs.", required=True)
_OUT = flags.DEFINE_string("out", "experiments/results/store_replay", "Output folder.")
ARMS = ("base", "replay")


def _interval(x):
  x = np.asarray(x, float)
  if len(x) < 2:
    return float(x.mean()), float("nan")
  return float(x.mean()), float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))


def main(argv):
  del argv
  runs = {}
  for name in sorted(os.listdir(_ROOT.value)):
    path = os.path.join(_ROOT.value, name)
    arm, _, seed = name.rpartition("_s")
    if arm in ARMS and os.path.exists(os.path.join(path, "eval.json")):
      with open(os.path.join(path, "eval.json")) as f:
        ev = json.load(f)
      with open(os.path.join(path, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
      runs[(arm, int(seed))] = (ev, metrics, path)
  seeds = sorted({s for a, s in runs if all((b, s) in runs for b in ARMS)})
  if not seeds:
    raise SystemExit(f"no seed has both arms finished under {_ROOT.value}")
  lines = ["# RL alone vs RL + store replay (main job's task, 20 updates)", "",
           "| seed | warm start | RL alone: sampled / greedy | RL + replay: sampled / greedy |",
           "|---|---|---|---|"]
  final = {a: [] for a in ARMS}
  for s in seeds:
    cells = []
    for a in ARMS:
      ev = runs[(a, s)][0]
      final[a].append(ev["success_rate"])
      cells.append(f"{ev['success_rate']:.3f} / {ev['greedy_success_rate']:.3f}")
    lines.append(f"| {s} | {runs[('base', s)][0]['warm_start_success_rate']:.3f} | "
                 + " | ".join(cells) + " |")
  lines.append("")
  for a in ARMS:
    m, h = _interval(final[a])
    lines.append(f"- {a}: final sampled success {m:.3f} ± {h:.3f} (95% t, {len(seeds)} seeds)")
  m, h = _interval(np.subtract(final["replay"], final["base"]))
  lines.append(f"- replay minus alone, paired by seed: {m:+.3f} ± {h:.3f}")
  replay_rows = [x for s in seeds for x in runs[("replay", s)][1] if x.get("replay/groups")]
  if replay_rows:
    mean = lambda k: float(np.mean([x[k] for x in replay_rows]))
    lines.append(f"- replay updates: {mean('replay/groups'):.1f} groups each, age "
                 f"{mean('replay/age_mean'):.2f} updates, replayed success "
                 f"{mean('replay/success_rate'):.3f}, IS weight mean "
                 f"{mean('is_weight_mean'):.3f}, truncated share {mean('is_truncated_frac'):.4f}")
  ev = runs[("base", seeds[0])][0]
  prov = ev.get("provenance", {})
  lines += ["", f"Commit {prov.get('commit', '?')[:7]}, {prov.get('cpu', '?')}, "
            f"{prov.get('cpus', '?')} cores, jax {prov.get('packages', {}).get('jax', '?')}."]
  lines += ["", "Commands (SEED in 0 1 2; ROOT any folder):", "", "```bash",
            "python experiments/train.py --config=configs/default.py --workdir=ROOT/base_sSEED \\",
            "    --config.seed=SEED --config.num_updates=20 --config.store.enabled=True \\",
            "    --config.loss.tis_threshold=2.0 \\",
            "    --config.sft.episodes=64 --config.sft.steps=80",
            "python experiments/train.py --config=configs/default.py --workdir=ROOT/replay_sSEED \\",
            "    --config.seed=SEED --config.num_updates=20 --config.store.enabled=True \\",
            "    --config.loss.tis_threshold=2.0 --config.store.replay_groups=8 \\",
            "    --config.sft.episodes=64 --config.sft.steps=80 \\",
            "    --config.store.replay_failure=2.0 --config.store.replay_half_life=4.0",
            "python experiments/store_replay_report.py --root=ROOT --out=experiments/results/store_replay",
            "```"]
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "summary.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  for (a, s), (_, _, path) in runs.items():
    dest = os.path.join(_OUT.value, "run_files", f"{a}_s{s}")
    os.makedirs(dest, exist_ok=True)
    for name in ("eval.json", "config.json", "metrics.jsonl"):
      shutil.copy(os.path.join(path, name), dest)
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
