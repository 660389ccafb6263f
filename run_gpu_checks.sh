#!/usr/bin/env bash
# Session tool (not committed): GPU tests of this session's changes, logs under $OUT.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash benchmarks/device_setup.sh 2>&1 | tail -1
T="$1"; shift
timeout "$T" python3 -m pytest -m cuda -q -n 24 -p no:cacheprovider -p no:randomly --junitxml=$OUT/junit.xml "$@" > $OUT/tests.log 2>&1
echo "pytest rc $?"
grep -E "passed|failed" $OUT/tests.log | tail -3
grep -E "^(FAILED|ERROR)" $OUT/tests.log | head -40
