"""The kernel timeline of ``python -m purlin_sglang.bench.moe_parts --timeline`` (pure Python: a made-up
profiler trace in, us out)."""

import random

from purlin_sglang.bench.moe_timeline import kernel_events, pair_timeline, pairs_of, plot_timeline


def _kernel(name: str, stream: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def _trace(streams: int, pairs: int, d: float, c: float, g_dc: float, g_cd: float, skew: float, seed: int) -> dict:
    rng = random.Random(seed)
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 0.0, "dur": 1.0}]
    for s in range(streams):
        t = rng.uniform(0, skew) if s else 0.0  # stream 0 starts first, the others within `skew`
        if s == streams - 1:
            t = skew
        for _ in range(3):  # a dispatch-only graph before the pairs: not a pair
            ev.append(_kernel("void purlin::moe::moe_dispatch_one_pass_kernel(PurlinMoeParams)", 7 + s, t, d))
            t += d + g_cd
        t += 500.0
        for _ in range(pairs):
            ev.append(_kernel("void purlin::moe::moe_dispatch_one_pass_kernel(PurlinMoeParams)", 7 + s, t, d))
            t += d + g_dc
            ev.append(_kernel("void purlin::moe::moe_combine_one_pass_kernel(PurlinMoeParams)", 7 + s, t, c))
            t += c + g_cd
        ev.append(_kernel("void at::native::elementwise_kernel<...>", 7 + s, t, 3.0))
    rng.shuffle(ev)
    return {"traceEvents": ev}


def test_the_pair_timeline_measures_durations_gaps_and_the_ranks_start_spread():
    by_stream = kernel_events(_trace(4, 6, d=12.0, c=9.0, g_dc=2.5, g_cd=4.0, skew=3.0, seed=1))
    assert sorted(by_stream) == ["10", "7", "8", "9"]
    assert all(len(pairs_of(v)) == 6 for v in by_stream.values())  # the dispatch-only graph left out
    t = pair_timeline(by_stream)
    assert t["streams"] == 4 and t["pairs"] == 6
    assert t["dispatch"] == 12.0 and t["combine"] == 9.0
    assert t["gap_dispatch_combine"] == 2.5 and t["gap_combine_dispatch"] == 4.0
    assert t["period"] == 12.0 + 2.5 + 9.0 + 4.0
    assert t["start_spread"] == 3.0


def test_a_trace_without_pairs_gives_an_empty_timeline_and_no_chart(tmp_path):
    by_stream = kernel_events({"traceEvents": [_kernel("moe_dispatch_kernel", 1, 0.0, 5.0)]})
    assert pair_timeline(by_stream) == {"streams": 0, "pairs": 0}
    assert plot_timeline(by_stream, tmp_path / "t.png") is not None
    assert not (tmp_path / "t.png").exists()


def test_the_chart_has_a_row_per_rank(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    by_stream = kernel_events(_trace(3, 8, d=12.0, c=9.0, g_dc=2.5, g_cd=4.0, skew=3.0, seed=2))
    assert plot_timeline(by_stream, tmp_path / "t.png") is None
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_the_kernels_written_alone_read_back_to_the_same_timeline(tmp_path):
    from purlin_sglang.bench.moe_timeline import read_events, write_events

    by_stream = kernel_events(_trace(4, 5, d=12.0, c=9.0, g_dc=2.5, g_cd=4.0, skew=3.0, seed=3))
    write_events(by_stream, tmp_path / "k.json")
    back = read_events(tmp_path / "k.json")
    assert sorted(back) == sorted(by_stream) and all(len(back[s]) == len(by_stream[s]) for s in back)
    assert pair_timeline(back) == pair_timeline(by_stream)
