#!/usr/bin/env bash
# Installs what the tests need into ./.venv and runs the whole test suite. Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh test,notebooks
exec .venv/bin/python -m pytest -n 2 "$@"
