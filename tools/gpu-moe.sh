#!/bin/bash
# One device call for the MoE work (issue 13): wheels, build, the MoE GPU tests, the MoE bench.
# Logs and JSON under $OUT. Needs the pydantic wheels in .whl/ carried (../shared/tools/device-wheels.sh).
# TESTS (default tests/gpu/test_moe.py), BENCH=0 skips the bench, PT/BT: timeouts.
export PURLIN_REQUIRE_GPU=1  # a GPU test that skips for want of a GPU fails here (tests/conftest.py)
export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader; date -u
T0=$(date +%s)
if [ -z "$SKIP_SETUP" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  CMAKE_BUILD_PARALLEL_LEVEL=16 PURLIN_WITH_NVSHMEM=OFF python3 -m pip install --no-build-isolation --no-deps . \
    > "$OUT/build.log" 2>&1; echo "build rc=$? secs=$(( $(date +%s) - T0 ))"
  tail -3 "$OUT/build.log"
fi
export PYTHONPATH=/tmp/site
T0=$(date +%s)
PYTHONUNBUFFERED=1 timeout ${PT:-200} python3 -P -m pytest -q ${TESTS:-tests/gpu/test_moe.py} -p no:cacheprovider \
  -rfs --tb=short -x > "$OUT/pytest_moe.log" 2>&1; echo "gpu tests rc=$? secs=$(( $(date +%s) - T0 ))"
grep -E "passed|failed|^FAILED|^ERROR|Error" "$OUT/pytest_moe.log" | head -30
if [ "${BENCH:-1}" != 0 ]; then
  T0=$(date +%s)
  timeout ${BT:-100} python3 -P tests/gpu/bench_moe.py --tokens 128 --capacity 32 > "$OUT/bench_moe_decode.jsonl" \
    2> "$OUT/bench_moe_decode.err"; echo "bench decode rc=$? secs=$(( $(date +%s) - T0 ))"
  cat "$OUT/bench_moe_decode.jsonl"; tail -3 "$OUT/bench_moe_decode.err"
  T0=$(date +%s)
  timeout ${BT:-100} python3 -P tests/gpu/bench_moe.py --tokens 4096 --capacity 256 --iters 3 --reps 5 --reserve-mib 4096 \
    > "$OUT/bench_moe_prefill.jsonl" 2> "$OUT/bench_moe_prefill.err"; echo "bench prefill rc=$? secs=$(( $(date +%s) - T0 ))"
  cat "$OUT/bench_moe_prefill.jsonl"; tail -3 "$OUT/bench_moe_prefill.err"
fi
