#!/bin/bash
# Eager host-path A/B on the GPU machine: this tree's installed build against a baseline commit, alternating.
#   bash tools/gpu-eager-ab.sh build   # build BASE (a `git archive --format=tar.gz` of the baseline) into /tmp/base_site
#                                      # (may run in the background, e.g. while servers run: `... build &`)
#   bash tools/gpu-eager-ab.sh run     # waits for that build (its $OUT/eager-ab/build_base.rc, at most 300 s; without
#                                      # a build of its own it uses /tmp/base_site as gpu-session.sh BASE= left it), then
#                                      # ROUNDS x (this build, baseline) of tests/gpu/bench_eager_host.py, then a profile of each
# Do not wait for the build with `pgrep -f` on a word of the command line: it matches the calling shell itself.
# The current build must be installed already (tools/gpu-serve.sh setup, or pip install .). Output under $OUT/eager-ab/.
# Knobs: BASE (.whl/base-main.tar.gz), ROUNDS (3), ITERS (2000), WORLDS (1,8), PROF (3000 calls; 0: none).
OUT=${OUT:-/tmp/out}/eager-ab; mkdir -p "$OUT"; BASE=${BASE:-.whl/base-main.tar.gz}
export CUDA_MODULE_LOADING=EAGER PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
case "$1" in
  build)
    T0=$(date +%s); rm -f "$OUT/build_base.rc"; rm -rf /tmp/base /tmp/base_site && mkdir -p /tmp/base && tar -xzf "$BASE" -C /tmp/base || exit 1
    ( cd /tmp/base && CMAKE_BUILD_PARALLEL_LEVEL=8 python3 -m pip install --no-build-isolation --no-deps --target /tmp/base_site . ) \
      > "$OUT/build_base.log" 2>&1
    echo "baseline build rc=$? secs=$(( $(date +%s) - T0 ))" | tee "$OUT/build_base.rc" ;;
  run)
    if [ ! -f "$OUT/build_base.log" ] && [ -d /tmp/base_site/purlin_sglang ]; then  # no build of ours started:
      echo "baseline build rc=0 (the one in /tmp/base_site, e.g. from gpu-session.sh BASE=)" > "$OUT/build_base.rc"
    fi
    for _ in $(seq 300); do [ -f "$OUT/build_base.rc" ] && break; sleep 1; done
    grep -q "rc=0" "$OUT/build_base.rc" 2>/dev/null || { echo "no baseline build ($OUT/build_base.rc)"; exit 1; }
    B=tests/gpu/bench_eager_host.py; cp $B /tmp/bench_eager_host.py  # the same script for both builds
    { echo "busiest processes before the A/B:"; ps -eo pcpu,etimes,comm --sort=-pcpu | head -6; } >> "$OUT/ab.err"
    for i in $(seq ${ROUNDS:-3}); do
      timeout 120 python3 -P /tmp/bench_eager_host.py --worlds ${WORLDS:-1,8} --iters ${ITERS:-2000} --label new \
        >> "$OUT/ab.jsonl" 2>> "$OUT/ab.err"
      PYTHONPATH=/tmp/base_site:$PYTHONPATH timeout 120 python3 -P /tmp/bench_eager_host.py --worlds ${WORLDS:-1,8} \
        --iters ${ITERS:-2000} --label base >> "$OUT/ab.jsonl" 2>> "$OUT/ab.err"
    done
    if [ "${PROF:-3000}" != 0 ]; then
      timeout 120 python3 -P /tmp/bench_eager_host.py --worlds 1 --iters 200 --profile ${PROF:-3000} --label new \
        > /dev/null 2> "$OUT/profile-new.txt"
      PYTHONPATH=/tmp/base_site:$PYTHONPATH timeout 120 python3 -P /tmp/bench_eager_host.py --worlds 1 --iters 200 \
        --profile ${PROF:-3000} --label base > /dev/null 2> "$OUT/profile-base.txt"
    fi
    cat "$OUT/ab.jsonl"; tail -3 "$OUT/ab.err" ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
