#!/bin/bash
# A kernel change against a baseline build in one device call: the small-message rows of `bench collectives`
# (graph, 8 ranks) and the staged one-shot's parts (tests/gpu/bench_staged_parts.py), each build in its own
# process, alternating, ROUNDS rounds. The installed build is "new"; AB_SITE (default /tmp/fd_site) holds the
# baseline, built with `pip install --no-build-isolation --no-deps --target AB_SITE .` from its tree in AB_TREE
# (default /tmp/fd), whose own copies of the scripts run for it. Output under $OUT/kernel-ab/.
# Knobs: ROUNDS (2), SIZES (1K,8K,64K,512K), COLLS (every collective), PARTS=0 to skip the parts bench.
OUT=${OUT:-/tmp/out}/kernel-ab; mkdir -p "$OUT"
export CUDA_MODULE_LOADING=EAGER PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
SITE=${AB_SITE:-/tmp/fd_site}; TREE=${AB_TREE:-/tmp/fd}
[ -d "$SITE/purlin_sglang" ] || { echo "no baseline build in $SITE"; exit 1; }
COLLS=${COLLS:-all_reduce,all_gather,reduce_scatter,all_to_all,all_gather_v,reduce_scatter_v,all_to_all_v,broadcast}
C="--world 8 --sizes ${SIZES:-1K,8K,64K,512K} --modes graph --baselines none --collectives $COLLS"
for i in $(seq ${ROUNDS:-2}); do
  for lab in new base; do
    if [ $lab = new ]; then pp=$PYTHONPATH; dir=$PWD; else pp=$SITE:$PYTHONPATH; dir=$TREE; fi
    T0=$(date +%s)
    ( cd $dir && PYTHONPATH=$pp timeout ${CT:-120} python3 -P -m purlin_sglang bench collectives $C \
        --out "$OUT/coll-$lab-$i" > "$OUT/coll-$lab-$i.log" 2>&1 ); echo "coll $lab round $i rc=$? secs=$(( $(date +%s) - T0 ))"
    if [ "${PARTS:-1}" != 0 ]; then
      T0=$(date +%s)
      ( cd $dir && PYTHONPATH=$pp timeout ${PTT:-120} python3 -P tests/gpu/bench_staged_parts.py --worlds 2,8 \
          --json "$OUT/parts-$lab-$i.json" > "$OUT/parts-$lab-$i.log" 2>&1 ); echo "parts $lab round $i rc=$? secs=$(( $(date +%s) - T0 ))"
    fi
  done
done
python3 - "$OUT" <<'PY'
import collections, glob, json, os, statistics, sys
out = sys.argv[1]
t = collections.defaultdict(list)
for f in glob.glob(os.path.join(out, "coll-*-*/results.json")):
    lab = os.path.basename(os.path.dirname(f)).split("-")[1]
    for r in json.load(open(f))["rows"]:
        if r.get("impl") == "purlin" and "time_us_median" in r:
            t[(r["collective"], r["bytes"], lab)].append((r["time_us_median"], r.get("algorithm"), r.get("correct")))
print(f"{'collective':18s} {'bytes':>8s} {'base us':>9s} {'new us':>9s}  algorithm  correct")
for (c, b) in sorted({(c, b) for c, b, _ in t}):
    bs, ns = t.get((c, b, "base"), []), t.get((c, b, "new"), [])
    med = lambda v: f"{statistics.median(x[0] for x in v):9.2f}" if v else f"{'-':>9s}"
    ok = all(x[2] for x in bs + ns)
    print(f"{c:18s} {b:8d} {med(bs)} {med(ns)}  {(ns or bs or [(0, '-', 0)])[0][1]:9s}  {ok}")
p = collections.defaultdict(list)
for f in glob.glob(os.path.join(out, "parts-*-*.json")):
    lab = os.path.basename(f).split("-")[1]
    for r in json.load(open(f)).get("rows", []):
        p[(r.get("variant"), r.get("world"), lab)].append(r.get("us_per_call"))
print(f"\n{'one-shot part':55s} {'world':>5s} {'base us':>9s} {'new us':>9s}")
for (v, w) in sorted({(v, w) for v, w, _ in p}, key=lambda k: (str(k[0]), k[1] or 0)):
    med = lambda v: f"{statistics.median(v):9.2f}" if v else f"{'-':>9s}"
    print(f"{str(v)[:55]:55s} {w!s:>5s} {med(p.get((v, w, 'base'), []))} {med(p.get((v, w, 'new'), []))}")
PY
