"""Issue 16's table from one device call's records: the baseline and this build side by side, each target checked.

    python3 tools/issue16_table.py OUT_DIR
    python3 tools/issue16_table.py docs/results/2026-12-05-h200-s10     # the records as kept (a prefix)

OUT_DIR is what `tools/gpu-issue16.sh` (and the `--symmetric` run beside it) left under $OUT, unpacked:
  coll-new/results.json, coll-base/results.json   `bench collectives --world 8 ... --modes graph` of each build
  coll-sym/results.json                            the same of this build with `--symmetric` (optional)
  bench_engine.json, bench_engine_base.json        tests/gpu/bench_cuda_engine.py of each build
  graph-ab/ab.jsonl, eager-ab/ab.jsonl             tools/gpu-graph-ab.sh and tools/gpu-eager-ab.sh (optional)
A record that is missing leaves its cells "-"; nothing is filled in from elsewhere. Given a prefix instead
of a folder, the records are PREFIX-bench-collectives.json, -bench-collectives-base.json,
-bench-collectives-symmetric.json, -cuda-engine.json, -cuda-engine-base.json, -graph-ab.jsonl, -eager-ab.jsonl.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

MIB = 1 << 20


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def coll_rows(doc) -> dict:
    """(collective, bytes) -> the purlin graph row at 8 ranks (the heap rows of a --symmetric run included)."""
    out = {}
    for r in (doc or {}).get("rows", []):
        if r.get("impl", "").startswith("purlin") and r.get("mode") == "graph" and r.get("world") == 8:
            out[(r["collective"], r["bytes"])] = r
    return out


def engine_rows(doc) -> dict:
    return {(r["case"], r["world"]): r for r in (doc or {}).get("rows", [])}


def ab_medians(rows: list[dict], key: str) -> dict:
    """(case, label) -> median over rounds (graph A/B: the call check on, as shipped; eager: by world)."""
    by = defaultdict(list)
    for r in rows:
        if key == "case" and r.get("check") is False:
            continue
        by[(r[key], r["label"])].append(r["us_per_call"] if "us_per_call" in r else r["median_us"])
    return {k: (statistics.median(v), v) for k, v in by.items()}


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


# where each record lies: in a call's $OUT folder, and as kept under docs/results (PREFIX + suffix)
RECORDS = {"new": ("coll-new/results.json", "-bench-collectives.json"),
           "base": ("coll-base/results.json", "-bench-collectives-base.json"),
           "sym": ("coll-sym/results.json", "-bench-collectives-symmetric.json"),
           "engine": ("bench_engine.json", "-cuda-engine.json"),
           "engine_base": ("bench_engine_base.json", "-cuda-engine-base.json"),
           "graph_ab": ("graph-ab/ab.jsonl", "-graph-ab.jsonl"),
           "eager_ab": ("eager-ab/ab.jsonl", "-eager-ab.jsonl")}


def record(out: Path, key: str) -> Path:
    folder, suffix = RECORDS[key]
    return out / folder if out.is_dir() else Path(str(out) + suffix)


def build(out: Path) -> list[tuple]:
    new, base = coll_rows(_load(record(out, "new"))), coll_rows(_load(record(out, "base")))
    sym = coll_rows(_load(record(out, "sym")))
    eng = engine_rows(_load(record(out, "engine")))
    eng_b = engine_rows(_load(record(out, "engine_base")))
    gab = ab_medians(_jsonl(record(out, "graph_ab")), "case")
    # eager rows by world and output mode (out=, as the issue's figure; "new": a new output per call)
    eab = ab_medians([dict(r, case=(r["world"], r.get("out", "out="))) for r in _jsonl(record(out, "eager_ab"))],
                     "case")

    def t(rows, coll, nbytes):
        r = rows.get((coll, nbytes))
        return None if r is None or not r.get("correct", True) else r["time_us_median"]

    def frac(rows, coll, nbytes=256 * MIB):
        r = rows.get((coll, nbytes))
        return None if r is None or not r.get("correct", True) else r["of_floor"]  # floor time / measured time

    def best(rows, kib):  # the faster of packet and one-shot in the engine bench, with its name
        got = [(r["us_per_call"], alg) for alg in ("packet", "oneshot")
               if (r := rows.get((f"graph {kib} KiB bf16 {alg}", 8)))]
        return min(got) if got else (None, None)

    table = []
    g = {lab: gab.get(("8k-w8", lab), (None,))[0] for lab in ("base", "new")}
    table.append(("all_reduce 8 KiB packet, 8 ranks (graph A/B, median of rounds)", "6.6 us",
                  fmt(g["base"], 2), fmt(g["new"], 2), "<= 4.0", g["new"] is not None and g["new"] <= 4.0))
    w12 = {lab: "/".join(fmt(gab.get((c, lab), (None,))[0], 2) for c in ("8k-w1", "8k-w2")) for lab in ("base", "new")}
    table.append(("the same at 1 / 2 ranks (graph A/B)", "2.9 / 4.3", w12["base"], w12["new"], "-", None))
    for kib, want, issue in ((64, 6.0, "8.5"), (128, 10.0, "28.8")):
        (b, ba), (n, na) = best(eng_b, kib), best(eng, kib)
        table.append((f"all_reduce {kib} KiB (engine bench, the faster algorithm)", f"{issue} us",
                      f"{fmt(b, 2)} {ba or ''}".strip(), f"{fmt(n, 2)} {na or ''}".strip(), f"<= {want:g}",
                      n is not None and n <= want))
    r_b = [t(base, "all_reduce", 512 << 10), t(base, "all_reduce", 64 << 10)]
    r_n = [t(new, "all_reduce", 512 << 10), t(new, "all_reduce", 64 << 10)]

    def ratio(v):
        return "-" if None in v else f"{v[0]:.1f} vs {v[1]:.1f} ({v[0] / v[1]:.1f}x)"
    table.append(("all_reduce 512 KiB vs 64 KiB (CLI)", "95 vs 20 us", ratio(r_b), ratio(r_n), "<= 2x",
                  None not in r_n and r_n[0] <= 2 * r_n[1]))
    colls, targets = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"), (0.6, 0.8, 0.6, 0.7)
    fb = [frac(base, c) for c in colls]
    fn = [frac(new, c) for c in colls]
    fs = [frac(sym, c) for c in colls]
    table.append(("256 MiB, of the copy floor: AR / AG / RS / A2A (CLI, staged)", "0.36 / 0.54 / 0.36 / 0.48",
                  " / ".join(fmt(x, 2) for x in fb), " / ".join(fmt(x, 2) for x in fn), "0.6 / 0.8 / 0.6 / 0.7",
                  all(x is not None and x >= w for x, w in zip(fn, targets))))
    if any(x is not None for x in fs):
        algs = "/".join((sym.get((c, 256 * MIB)) or {}).get("algorithm") or "-" for c in colls)
        table.append((f"the same, inputs in the symmetric heap (CLI --symmetric: {algs})", "-", "-",
                      " / ".join(fmt(x, 2) for x in fs), "0.6 / 0.8 / 0.6 / 0.7",
                      " / ".join("-" if x is None else ("yes" if x >= w else "no") for x, w in zip(fs, targets))))
    vs = ("all_gather_v", "reduce_scatter_v", "all_to_all_v")
    vb, vn = [t(base, c, 1024) for c in vs], [t(new, c, 1024) for c in vs]
    table.append(("all_gather_v / reduce_scatter_v / all_to_all_v 1 KiB (CLI)", "37 / 70 / 71 us",
                  " / ".join(fmt(x, 2) for x in vb), " / ".join(fmt(x, 2) for x in vn), "<= 10",
                  " / ".join("-" if x is None else ("yes" if x <= 10 else "no") for x in vn)))
    def rounds(v):
        return "-" if v is None else f"{v[0]:.2f} (rounds {', '.join(f'{x:.2f}' for x in v[1])})"
    for mode, what in (("out=", "with out="), ("new", "a new output per call, SGLang's way")):
        e = {lab: eab.get(((1, mode), lab)) for lab in ("base", "new")}
        table.append((f"eager host time, 1 rank, 8 KiB, {what} (eager A/B, median of rounds)",
                      "13.0 us" if mode == "out=" else "-", rounds(e["base"]), rounds(e["new"]), "<= 10",
                      e["new"] is not None and e["new"][0] <= 10))
    c_b, c_n = t(base, "all_reduce", 8192), t(new, "all_reduce", 8192)
    x_b = (eng_b.get(("graph 8 KiB bf16", 8)) or {}).get("us_per_call")
    x_n = (eng.get(("graph 8 KiB bf16", 8)) or {}).get("us_per_call")
    table.append(("8 KiB all_reduce: the CLI vs the engine bench", "21.4 vs 6.6 us", f"{fmt(c_b)} vs {fmt(x_b)}",
                  f"{fmt(c_n)} vs {fmt(x_n)}", "one figure",
                  None if None in (c_n, x_n) else abs(c_n - x_n) <= 0.15 * x_n))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    print("| case | issue 16 | base | now | target | met |")
    print("|---|---|---|---|---|---|")
    for case, issue, b, n, target, met in build(a.out):
        m = met if isinstance(met, str) else {True: "yes", False: "no", None: "-"}[met]
        print(f"| {case} | {issue} | {b} | {n} | {target} | {m} |")


if __name__ == "__main__":
    main()
