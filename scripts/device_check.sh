#!/usr/bin/env bash
# Accelerator readiness check: the GPU test subset, then one table of memory bandwidth, bf16 matmul
# peak, sampler tokens/s against the bandwidth roofline (SmolLM2-135M- and ~1.2B-shaped decoders,
# random weights, batch 1 / 16 / 64 / 256) and the RL update's MFU in bf16
# (experiments/benchmarks/device_check.py). Aimed at 8 minutes on one GPU (the test subset is cut
# off at 4); not yet timed on one (no GPU has been lent to this project's sessions so far).
#
#   bash scripts/device_check.sh          # on a GPU machine whose python has jax[cuda], flax, optax,
#                                         # orbax, chex and numpy; other small packages are installed
#                                         # from .device_wheels/ (build it here first:
#                                         # bash scripts/device_wheels.sh) when they are missing
#   bash scripts/device_check.sh --dry    # anywhere (CI): tiny shapes on the default backend, no tests
#
# Output: the table on stdout, and device_check.json under $OUT (or ./results/) for BUILD_NOTES.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [ "${1:-}" = "--dry" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"

if [ "${1:-}" = "--dry" ]; then
  exec "$PY" experiments/benchmarks/device_check.py --dry --tests="not run (dry)" \
    --out="$OUT_DIR/device_check_dry.json"
fi

# Install what the image lacks from the carried wheelhouse (no index is reachable from the device).
missing=$("$PY" scripts/device_requirements.py --missing)
if [ -n "$missing" ]; then
  if [ ! -d .device_wheels ]; then
    echo "device_check: missing Python packages ($missing) and no .device_wheels/ to install them" \
         "from; build it with: bash scripts/device_wheels.sh (and carry .device_wheels)" >&2
    exit 2
  fi
  "$PY" -m pip install --quiet --no-index --no-deps --find-links .device_wheels $missing
fi
"$PY" -c "import jax; d = jax.devices(); print('devices:', d); assert d[0].platform == 'gpu', d"

# The GPU test subset: kernels, decoder, LoRA, sampler, update (JAX_PLATFORMS=cuda overrides the
# tests' CPU default). Its summary line goes into the table.
set +e
JAX_PLATFORMS=cuda timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/core/test_logprobs.py tests/core/test_losses.py tests/core/test_advantages.py \
  tests/models/test_llama.py tests/models/test_lora.py tests/sampling/test_sampler.py \
  2>&1 | tee "$OUT_DIR/device_tests.log" | tail -3
set -e
summary=$(grep -E "(passed|failed|error)" "$OUT_DIR/device_tests.log" | tail -1)
JAX_PLATFORMS=cuda "$PY" experiments/benchmarks/device_check.py --tests="${summary:-no summary}" \
  --out="$OUT_DIR/device_check.json"
