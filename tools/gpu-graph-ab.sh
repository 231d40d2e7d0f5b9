#!/bin/bash
# Graph-time A/B of the packet path on the GPU machine: this tree's installed build against a baseline,
# alternating processes, ROUNDS rounds (tests/gpu/bench_graph_ab.py; the same script copy for both builds).
#   bash tools/gpu-graph-ab.sh     # after tools/gpu-session.sh BASE=... built /tmp/base_site (or gpu-eager-ab.sh build)
# The current build must be installed already. Output: $OUT/graph-ab/ab.jsonl and a summary (median per case and
# build over the rounds) on stdout. Knobs: ROUNDS (3), TIMINGS (5), CASES (all of bench_graph_ab.py's).
OUT=${OUT:-/tmp/out}/graph-ab; mkdir -p "$OUT"
export CUDA_MODULE_LOADING=EAGER PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# a baseline build started by `tools/gpu-eager-ab.sh build &` in the same call: wait for it (at most 300 s)
if [ -d "${OUT%/graph-ab}/eager-ab" ] && [ ! -f "${OUT%/graph-ab}/eager-ab/build_base.rc" ]; then
  for _ in $(seq 300); do [ -f "${OUT%/graph-ab}/eager-ab/build_base.rc" ] && break; sleep 1; done
fi
[ -d /tmp/base_site/purlin_sglang ] || { echo "no baseline build in /tmp/base_site"; exit 1; }
mkdir -p /tmp/graph-ab && cp tests/gpu/bench_graph_ab.py tests/gpu/bench_cuda_engine.py /tmp/graph-ab/
ARGS="--timings ${TIMINGS:-5}${CASES:+ --cases $CASES}"
for i in $(seq ${ROUNDS:-3}); do
  timeout 150 python3 -P /tmp/graph-ab/bench_graph_ab.py --label new $ARGS >> "$OUT/ab.jsonl" 2>> "$OUT/ab.err"
  PYTHONPATH=/tmp/base_site:$PYTHONPATH timeout 150 python3 -P /tmp/graph-ab/bench_graph_ab.py --label base $ARGS \
    >> "$OUT/ab.jsonl" 2>> "$OUT/ab.err"
done
tail -3 "$OUT/ab.err"
python3 - "$OUT/ab.jsonl" <<'PY'
import collections, json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = collections.defaultdict(list)
for r in rows:
    by[(r["case"], r["label"], r["check"])].append(r["us_per_call"])
print(f"{'case':12s} {'build':5s} {'check':5s} {'median us':>9s}  rounds")
for (case, label, check), v in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
    print(f"{case:12s} {label:5s} {str(check):5s} {statistics.median(v):9.2f}  {v}")
PY
