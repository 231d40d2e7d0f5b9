#!/bin/bash
# One device call: build, the GPU tests named in $TESTS (default: every tests/gpu/test_*.py that
# needs nothing but this package), the CUDA-engine benchmark and a short `bench collectives` run.
# Logs and JSON under $OUT. Needs pydantic wheels in .whlp/ (see tools/gpu-check.sh) carried.
# SKIP_SETUP=1: the wheels (in /tmp/site) and the build are already there (e.g. after gpu-sglang-check.sh).
# BASE=file.tar.gz: a `git archive` of the baseline commit, built alongside into /tmp/base_site; the
#   engine benchmark then runs for the baseline too, in the same call (predict, change, measure).
# DIAG=1: tests/gpu/diag_staging_timeout.py (DIAG_ARGS) before the tests.
export PURLIN_REQUIRE_GPU=1  # a GPU test that skips for want of a GPU fails here (tests/conftest.py)
W=${WHEELS:-$([ -d .whlp ] && echo .whlp || echo .whl)}  # the pydantic wheels (tools/gpu-check.sh; ../shared/tools/device-wheels.sh writes .whl)
if [ -z "$SKIP_SETUP" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site
export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
T0=$(date +%s)
if [ -n "$BASE" ] && [ -z "$SKIP_SETUP" ]; then
  rm -rf /tmp/base && mkdir -p /tmp/base && tar -xzf "$BASE" -C /tmp/base || exit 1
  ( cd /tmp/base && python3 -m pip install --no-build-isolation --no-deps --target /tmp/base_site . \
      > "$OUT/build_base.log" 2>&1; echo "baseline build rc=$? secs=$(( $(date +%s) - T0 ))" ) &
fi
[ -n "$SKIP_SETUP" ] || { python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1;
  echo "build rc=$? secs=$(( $(date +%s) - T0 ))"; }
wait
if [ -n "$DIAG" ]; then
  T0=$(date +%s)
  timeout ${DT:-200} python3 -P tests/gpu/diag_staging_timeout.py $DIAG_ARGS > "$OUT/diag.log" 2>&1
  echo "diag rc=$? secs=$(( $(date +%s) - T0 ))"; grep -A20 "^summary" "$OUT/diag.log" || tail -5 "$OUT/diag.log"
fi
TESTS=${TESTS:-"tests/gpu/test_copy_atom.py tests/gpu/test_reduce_atom.py tests/gpu/test_cuda_engine.py tests/gpu/test_ipc_provider.py tests/gpu/test_torch_symm_provider.py tests/gpu/test_cuda_group.py"}
if [ "$TESTS" != none ]; then
  T0=$(date +%s)
  PYTHONUNBUFFERED=1 timeout ${PT:-300} python3 -P -m pytest -q $TESTS -p no:cacheprovider -rfs --tb=short \
    > "$OUT/pytest_gpu.log" 2>&1; echo "gpu tests rc=$? secs=$(( $(date +%s) - T0 ))"
  grep -E "passed|failed|^FAILED|^SKIPPED|^ERROR" "$OUT/pytest_gpu.log" | head -40
fi
if [ -n "$BENCH_ENGINE" ]; then
  T0=$(date +%s)
  timeout ${BT:-150} python3 -P tests/gpu/bench_cuda_engine.py --json "$OUT/bench_engine.json" > "$OUT/bench_engine.log" 2>&1
  echo "bench engine rc=$? secs=$(( $(date +%s) - T0 ))"; cat "$OUT/bench_engine.log" | cut -c1-300
  if [ -d /tmp/base_site ] && [ -d /tmp/base ]; then
    T0=$(date +%s)
    ( cd /tmp/base && PYTHONPATH=/tmp/base_site:/tmp/site timeout ${BT:-150} python3 -P tests/gpu/bench_cuda_engine.py \
        --json "$OUT/bench_engine_base.json" > "$OUT/bench_engine_base.log" 2>&1 )
    echo "baseline bench engine rc=$? secs=$(( $(date +%s) - T0 ))"; cut -c1-300 "$OUT/bench_engine_base.log"
  fi
fi
if [ -n "$BENCH_COLL" ]; then
  T0=$(date +%s)
  timeout ${CT:-150} python3 -P -m purlin_sglang bench collectives $BENCH_COLL --out "$OUT/coll" > "$OUT/bench_coll.log" 2>&1
  echo "bench collectives rc=$? secs=$(( $(date +%s) - T0 ))"; tail -40 "$OUT/bench_coll.log" | cut -c1-250
  ls "$OUT/coll" 2>/dev/null
fi
