"""The MoE kernels' timeline: every rank's dispatch and combine kernels as the device ran them.

``python -m purlin_sglang.bench.moe_parts --timeline`` records its run with the torch profiler (CUPTI
kernel records: start and end of each kernel on each stream, graph replays included) and reads the
profiler's trace here, keeping the MoE kernels alone (``write_events``). Each virtual rank replays its
graphs on a stream of its own, so a stream is a rank. The pair graph's kernels alternate dispatch,
combine on each stream; ``pair_timeline`` takes those runs and tells, in us (medians over pairs, and
the ranks' spread):

* ``dispatch`` / ``combine``: a kernel's duration on its stream (start to end);
* ``gap_dispatch_combine`` / ``gap_combine_dispatch``: from a kernel's end to the next kernel's start
  on the same stream (launch and scheduling: no kernel of that rank runs then);
* ``start_spread``: for the same pair, the latest rank's dispatch start minus the earliest's;
* ``period``: from one dispatch start to the next on the same stream (a pair's time in step).

Pure Python over the trace's JSON (tests feed it made-up traces); the plot needs matplotlib.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

DISPATCH, COMBINE = "moe_dispatch", "moe_combine"
PAUSE_US = 1000.0  # a combine's end to the next dispatch's start this long or longer: a pause between the
                   # tool's steps (a host barrier, another graph), not a pair following a pair


def _kind(name: str) -> str | None:
    for k in (DISPATCH, COMBINE):
        if k in name:
            return k
    return None


def kernel_events(trace: dict) -> dict[str, list[tuple[str, float, float]]]:
    """The MoE kernels of a Chrome trace (torch.profiler export) by stream: ``{stream: [(kind, start_us,
    end_us), ...]}`` in start order."""
    out: dict[str, list[tuple[str, float, float]]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") != "kernel":
            continue
        kind = _kind(str(ev.get("name", "")))
        if kind is None:
            continue
        args = ev.get("args", {})
        stream = str(args.get("stream", ev.get("tid")))
        ts = float(ev["ts"])
        out.setdefault(stream, []).append((kind, ts, ts + float(ev.get("dur", 0.0))))
    for v in out.values():
        v.sort(key=lambda e: e[1])
    return out


def pairs_of(events: list[tuple[str, float, float]]) -> list[tuple[tuple, tuple]]:
    """The (dispatch, combine) pairs of one stream's kernels: a dispatch directly followed by a combine,
    where the kernel before the dispatch is a combine or the one after the combine is a dispatch (the
    pair graph's alternation; the dispatch-only and combine-only graphs' kernels are left out)."""
    pairs = []
    for i in range(len(events) - 1):
        d, c = events[i], events[i + 1]
        if d[0] != DISPATCH or c[0] != COMBINE:
            continue
        before = events[i - 1][0] if i > 0 else None
        after = events[i + 2][0] if i + 2 < len(events) else None
        if before == COMBINE or after == DISPATCH:
            pairs.append((d, c))
    return pairs


def stream_pairs(by_stream: dict[str, list[tuple[str, float, float]]]) -> dict[str, list[tuple[tuple, tuple]]]:
    """``pairs_of`` each stream, the streams without a pair left out."""
    per = {s: pairs_of(ev) for s, ev in by_stream.items()}
    return {s: p for s, p in per.items() if p}


def _med(v: list[float]) -> float | None:
    return round(statistics.median(v), 2) if v else None


def pair_timeline(by_stream: dict[str, list[tuple[str, float, float]]]) -> dict:
    """Medians (us) of the pair graph's kernels over every stream and pair; see the module doc."""
    per = stream_pairs(by_stream)
    if not per:
        return {"streams": 0, "pairs": 0}
    dur_d, dur_c, gap_dc, gap_cd, period = [], [], [], [], []
    for p in per.values():
        for i, (d, c) in enumerate(p):
            dur_d.append(d[2] - d[1])
            dur_c.append(c[2] - c[1])
            gap_dc.append(c[1] - d[2])
            if i + 1 < len(p):
                nd = p[i + 1][0]
                if 0 <= nd[1] - c[2] < PAUSE_US:
                    gap_cd.append(nd[1] - c[2])
                    period.append(nd[1] - d[1])
    n = min(len(p) for p in per.values())
    spread = [max(p[i][0][1] for p in per.values()) - min(p[i][0][1] for p in per.values()) for i in range(n)]
    return {"streams": len(per), "pairs": n, "dispatch": _med(dur_d), "combine": _med(dur_c),
            "gap_dispatch_combine": _med(gap_dc), "gap_combine_dispatch": _med(gap_cd),
            "start_spread": _med(spread), "period": _med(period)}


def replay_timeline(by_stream: dict[str, list[tuple[str, float, float]]], calls: int) -> dict:
    """How the pair graph's replays meet (us): each stream's pairs cut into runs of ``calls`` (its replays,
    warm-up ones included; a stream's pairs come from the pair graph alone, pairs_of). Medians over every
    stream and replay: ``span_per_pair`` (a replay's first dispatch start to its last combine end, over
    ``calls``), ``period_inside`` (one dispatch start to the next, a replay's first and last pair left out),
    ``first_pair`` (the same for a replay's first pair: it waits for the ranks that launched it late; also
    its p90) and ``gap_between`` (a replay's last combine end to the next replay's first dispatch start on
    the same stream: the stream idle; also p10 and p90)."""
    per = stream_pairs(by_stream)
    span, inner, first, gap = [], [], [], []
    for p in per.values():
        runs = [p[i:i + calls] for i in range(0, len(p) - calls + 1, calls)]
        for i, r in enumerate(runs):
            span.append((r[-1][1][2] - r[0][0][1]) / calls)
            if calls > 1:
                first.append(r[1][0][1] - r[0][0][1])
            inner += [r[j + 1][0][1] - r[j][0][1] for j in range(1, calls - 1)]
            if i + 1 < len(runs):
                gap.append(runs[i + 1][0][0][1] - r[-1][1][2])

    def q(v: list[float], f: float) -> float | None:
        return round(sorted(v)[int(f * (len(v) - 1))], 2) if v else None

    return {"calls": calls, "replays": min((len(p) // calls for p in per.values()), default=0),
            "span_per_pair": _med(span), "period_inside": _med(inner), "first_pair": _med(first),
            "first_pair_p90": q(first, 0.9), "gap_between": _med(gap), "gap_between_p10": q(gap, 0.1),
            "gap_between_p90": q(gap, 0.9)}


def read_trace(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def write_events(by_stream: dict[str, list[tuple[str, float, float]]], path: Path) -> None:
    """The MoE kernels alone (``{"streams": {stream: [[kind, start_us, end_us], ...]}}``, times from the
    earliest start), a small file where the profiler's trace holds every kernel of the run."""
    t0 = min((ev[0][1] for ev in by_stream.values() if ev), default=0.0)
    streams = {s: [[k, round(a - t0, 3), round(b - t0, 3)] for k, a, b in ev] for s, ev in by_stream.items()}
    Path(path).write_text(json.dumps({"streams": streams}))


def read_events(path: Path) -> dict[str, list[tuple[str, float, float]]]:
    """What write_events wrote (or its gzip, ``.json.gz``), as kernel_events gives it."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return {s: [(k, a, b) for k, a, b in ev] for s, ev in json.loads(text)["streams"].items()}


def plot_timeline(by_stream: dict[str, list[tuple[str, float, float]]], path: Path, pairs: int = 4,
                  title: str = "") -> str | None:
    """A Gantt chart of ``pairs`` pairs from the middle of the pair graph's replays, a row per stream
    (rank). Returns None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "install matplotlib for plots (pip install 'purlin-sglang[bench]')"
    per = stream_pairs(by_stream)
    if not per:
        return "no pair kernels in the trace"
    n = min(len(p) for p in per.values())
    mid = max(0, n // 2 - pairs // 2)
    lo = min(p[mid][0][1] for p in per.values())
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(per) + 1.5))
    colours = {DISPATCH: "tab:blue", COMBINE: "tab:orange"}
    for row, (s, p) in enumerate(sorted(per.items())):
        for d, c in p[mid:mid + pairs]:
            for k, t0, t1 in (d, c):
                ax.broken_barh([(t0 - lo, t1 - t0)], (row - 0.4, 0.8), color=colours[k])
    ax.set_yticks(range(len(per)), [f"stream {s}" for s in sorted(per)])
    ax.set_xlabel("us")
    ax.set_title(title or "MoE kernels per rank's stream (blue: dispatch, orange: combine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m purlin_sglang.bench.moe_timeline EVENTS --calls N``: the pair and replay timelines of a
    ``timeline-T-DTYPE.json`` (or its ``.json.gz``) that moe_parts --timeline wrote, as JSON."""
    p = argparse.ArgumentParser(prog="python -m purlin_sglang.bench.moe_timeline", description=main.__doc__)
    p.add_argument("events", type=Path)
    p.add_argument("--calls", type=int, required=True, help="calls per captured graph of the run (moe_parts --calls)")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error("--calls must be >= 1")
    events = read_events(args.events)
    print(json.dumps({"pairs": pair_timeline(events), "replays": replay_timeline(events, args.calls)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
