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


def _replayed(streams: int, replays: int, calls: int, d: float, c: float, gap: float, late: float) -> dict:
    """Every stream replays a pair graph of `calls` pairs `replays` times, idle `gap` us between replays;
    each replay's first dispatch runs `late` us longer on every stream but the last (waiting for it)."""
    ev = []
    for s in range(streams):
        t = 0.0
        for _ in range(replays):
            for i in range(calls):
                dd = d + (late if i == 0 and s < streams - 1 else 0.0)
                ev.append(_kernel("moe_dispatch_one_pass_kernel", s, t, dd))
                ev.append(_kernel("moe_combine_one_pass_kernel", s, t + dd + 1.0, c))
                t += dd + 1.0 + c + 1.0
            t += gap - 1.0
    return {"traceEvents": ev}


def test_the_replay_timeline_separates_the_pairs_in_step_from_the_replays_meeting():
    from purlin_sglang.bench.moe_timeline import replay_timeline

    by_stream = kernel_events(_replayed(3, 4, 10, d=12.0, c=8.0, gap=100.0, late=50.0))
    r = replay_timeline(by_stream, 10)
    assert r["calls"] == 10 and r["replays"] == 4
    assert r["period_inside"] == 22.0  # 12 + 1 + 8 + 1: the pairs in step
    assert r["first_pair"] == 72.0 and r["first_pair_p90"] == 72.0  # two of three streams waited 50 us
    assert r["gap_between"] == 100.0 and r["gap_between_p10"] == 100.0
    assert r["span_per_pair"] == round((10 * 22.0 + 50.0 - 1.0) / 10, 2)  # the late first pair counts in the span
    assert replay_timeline({}, 10)["replays"] == 0


def test_the_timeline_module_reads_gzipped_events_from_its_command_line(tmp_path, capsys):
    import gzip
    import json

    from purlin_sglang.bench.moe_timeline import main, write_events

    by_stream = kernel_events(_replayed(2, 3, 5, d=10.0, c=6.0, gap=40.0, late=0.0))
    plain = tmp_path / "timeline-1-bf16.json"
    write_events(by_stream, plain)
    packed = tmp_path / "timeline-1-bf16.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        assert main([str(path), "--calls", "5"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["pairs"]["streams"] == 2 and out["replays"]["replays"] == 3
        assert out["replays"]["gap_between"] == 40.0 and out["replays"]["period_inside"] == 18.0
