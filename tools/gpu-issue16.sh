#!/bin/bash
# Issue 16's table in one device call, this build against a baseline (both already built: tools/gpu-session.sh
# with BASE=, then SKIP_SETUP=1 here). Steps, each with its own time limit, logs under $OUT:
#   1. `purlin-sglang tune` (this build) -> $OUT/h200-tune.json; installed as the build's shipped table, so
#      the steps below run with the crossovers measured in this call (TUNE=0: skip, keep the shipped table)
#   2. `bench collectives` (world 8, 1K..1G x8, graph and eager) of both builds -> $OUT/coll-new, $OUT/coll-base
#   3. the engine bench of both builds (tests/gpu/bench_cuda_engine.py) -> $OUT/bench_engine*.json
#   4. the graph A/B (tools/gpu-graph-ab.sh; ROUNDS, TIMINGS), floor cases included
#   5. the eager A/B (tools/gpu-eager-ab.sh run; ROUNDS)
#   6. "parts" (only when named in STEPS): where the staged one-shot's latency goes, tests/gpu/bench_staged_parts.py
#      (the 8 KiB one-shot all_reduce with parts of its schedule taken out, worlds 1, 2 and 8) -> $OUT/parts.json
# STEPS: which of "tune coll engine graph eager parts" to run (default all but parts); COLL_BASE=0 / ENGINE_BASE=0: this build only.
# At most 8 files come back from a device call: the A/B folders are packed into $OUT/ab.tar.gz.
export PYTHONPATH=/tmp/site CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; STEPS=${STEPS:-"tune coll engine graph eager"}
has() { [[ " $STEPS " == *" $1 "* ]]; }
t() { echo "== $1 rc=$2 secs=$(( $(date +%s) - T0 ))"; }
[ -d /tmp/base_site/purlin_sglang ] || echo "warning: no baseline build in /tmp/base_site"
if has tune && [ "${TUNE:-1}" != 0 ]; then
  T0=$(date +%s)
  timeout ${TT:-120} python3 -P -m purlin_sglang tune --device cuda --worlds 2,4,8 --out "$OUT/h200-tune.json" \
    > "$OUT/tune.log" 2>&1; rc=$?; t tune $rc; tail -25 "$OUT/tune.log" | cut -c1-200
  if [ $rc = 0 ]; then
    dst=$(python3 -P -c 'import os, purlin_sglang as p; print(os.path.join(os.path.dirname(p.__file__), "tables", "h200-one-gpu.json"))')
    cp "$OUT/h200-tune.json" "$dst" && echo "installed the new table as $dst"
  fi
fi
COLL=${COLL:-"--world 8 --min-bytes 1K --max-bytes 1G --factor 8"}
if has coll; then
  T0=$(date +%s)
  timeout ${CT:-150} python3 -P -m purlin_sglang bench collectives $COLL --out "$OUT/coll-new" > "$OUT/coll-new.log" 2>&1
  t "bench collectives (new)" $?; grep -v "^  purlin" "$OUT/coll-new.log" | tail -60 | cut -c1-200
  if [ -d /tmp/base_site/purlin_sglang ] && [ "${COLL_BASE:-1}" != 0 ]; then
    T0=$(date +%s)
    ( cd /tmp/base && PYTHONPATH=/tmp/base_site:/tmp/site timeout ${CT:-150} python3 -P -m purlin_sglang bench collectives \
        $COLL --out "$OUT/coll-base" > "$OUT/coll-base.log" 2>&1 )
    t "bench collectives (base)" $?; grep -v "^  purlin" "$OUT/coll-base.log" | tail -60 | cut -c1-200
  fi
fi
if has engine; then
  T0=$(date +%s)
  timeout ${BT:-150} python3 -P tests/gpu/bench_cuda_engine.py --json "$OUT/bench_engine.json" > "$OUT/bench_engine.log" 2>&1
  t "engine bench (new)" $?; cut -c1-260 "$OUT/bench_engine.log"
  if [ -d /tmp/base_site/purlin_sglang ] && [ "${ENGINE_BASE:-1}" != 0 ]; then
    T0=$(date +%s)  # this tree's bench script for both builds (it skips what a build lacks)
    cp tests/gpu/bench_cuda_engine.py tests/gpu/bench_eager_host.py /tmp/base/tests/gpu/ 2>/dev/null
    ( cd /tmp/base && PYTHONPATH=/tmp/base_site:/tmp/site timeout ${BT:-150} python3 -P tests/gpu/bench_cuda_engine.py \
        --json "$OUT/bench_engine_base.json" > "$OUT/bench_engine_base.log" 2>&1 )
    t "engine bench (base)" $?; cut -c1-260 "$OUT/bench_engine_base.log"
  fi
fi
if has graph; then T0=$(date +%s); timeout ${GT:-200} bash tools/gpu-graph-ab.sh; t "graph A/B" $?; fi
if has eager; then T0=$(date +%s); PROF=${PROF:-3000} timeout ${ET:-150} bash tools/gpu-eager-ab.sh run > "$OUT/eager-ab.log" 2>&1
  t "eager A/B" $?; tail -30 "$OUT/eager-ab.log" | cut -c1-250; fi
if has parts; then T0=$(date +%s)
  timeout ${PT16:-150} python3 -P tests/gpu/bench_staged_parts.py --worlds 2,8 --json "$OUT/parts.json" > "$OUT/parts.log" 2>&1
  t "staged parts" $?; cut -c1-260 "$OUT/parts.log" | tail -30; fi
( cd "$OUT" && ls -d graph-ab eager-ab 2>/dev/null | xargs -r tar -czf ab.tar.gz && rm -rf graph-ab eager-ab )
