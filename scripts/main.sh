#!/usr/bin/env bash
# The main job. Until the training loop lands (issue 5) it is the kernel benchmark: it prints one table
# and writes it to results/kernels.json. Extra args go to the benchmark (absl flags).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
exec .venv/bin/python experiments/benchmarks/core_kernels.py --out=results/kernels.json "$@"
