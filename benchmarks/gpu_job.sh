#!/bin/bash
# One device-machine job: install Kiln, run the cuda tests, then benchmark.
# Usage (from the repository root on the GPU machine): benchmarks/gpu_job.sh [ops_bench args...]
set -o pipefail
export PYTHONUNBUFFERED=1 KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e core -e ops_builtin -e mappings_builtin -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest -q -m cuda tests/cuda -p no:cacheprovider ${KILN_PYTEST_ARGS} 2>&1 | tee "$OUT/cuda_tests.log" | tail -25
if [ $# -gt 0 ]; then
  python3 benchmarks/ops_bench.py "$@" --json "$OUT/ops_bench.json" 2>"$OUT/bench.err" | tee "$OUT/bench.log"
fi
