#!/bin/bash
# The recorded benchmark run (benchmarks/RESULTS.md): cuda tests, every suite (torch.compile on
# the headline and row cases), a second process reusing the caches, compute-sanitizer memcheck
# on the templates. Run from the repository root on the GPU machine; logs and JSON under $OUT.
export KILN_CACHE_DIR=/tmp/kc PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
benchmarks/gpu_job.sh --suite all --overhead > $OUT/job.log 2>&1
grep -v "^kiln: tuning" $OUT/job.log | tail -50; grep winner $OUT/bench.err | cut -c1-160
python3 benchmarks/ops_bench.py --suite norm --compile --json $OUT/norm.json 2>/dev/null | tail -8
echo "SECOND PROCESS (same caches)"
python3 benchmarks/ops_bench.py --suite matmul --quick --compile --json $OUT/second.json 2>/dev/null | tail -3
timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -m cuda \
  tests/cuda/test_templates_cuda.py -k "edges or linear or conv or batched" -p no:cacheprovider > $OUT/memcheck.log 2>&1
echo "memcheck rc=$?"; tail -2 $OUT/memcheck.log
