#!/usr/bin/env bash
# Installs what the tests need into ./.venv and runs the test suite. Extra args go to pytest.
# By default the heavier checks marked `slow` (multi-process kill/resume, sharded training on 8
# emulated devices, per-algorithm learning runs, ...) are skipped; CI (.ci/run) runs them too with
#   bash scripts/test.sh -m "slow or not slow"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh test,notebooks
exec .venv/bin/python -m pytest -n 2 -m "not slow" "$@"
