#!/usr/bin/env bash
# The main job: SFT warm start then RL of a tiny policy on pointer_chain (configs/default.py), with a
# progress bar; leaves metrics.jsonl, checkpoints, eval.json and learning_curve.png in the workdir.
# Rerunning resumes from the last checkpoint. Extra args go to experiments/train.py (absl flags), e.g.
#   bash scripts/main.sh --workdir=/tmp/run2 --config.num_updates=20
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
WORKDIR="${WORKDIR:-results/default}"
exec .venv/bin/python experiments/train.py --config=configs/default.py --workdir="$WORKDIR" "$@"
