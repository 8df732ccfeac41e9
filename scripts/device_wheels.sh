#!/usr/bin/env bash
# Downloads the wheels scripts/device_check.sh may need on a GPU machine that reaches no package
# index (scripts/device_requirements.py lists them) into .device_wheels/ (git-ignored; carry it to
# the device). Binary wheels are fetched for CPython 3.11-3.13 (the package needs >= 3.11) on manylinux x86_64.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p .device_wheels
mapfile -t reqs < <("$PY" scripts/device_requirements.py)
for version in 3.11 3.12 3.13; do
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest .device_wheels \
    --python-version "$version" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 "${reqs[@]}"
done
du -sh .device_wheels
