"""The phase table of ``python -m purlin_sglang.bench.moe_parts --phases`` (pure Python: stamps in, us out)."""

from purlin_sglang import native
from purlin_sglang.bench.moe_parts import phase_table


def _pair(d0: int, c0: int) -> dict:
    d = dict(zip(native.MOE_TRACE_PHASES["dispatch"], (d0, d0 + 1000, d0 + 2000, d0 + 5000, d0 + 6000, d0 + 7000)))
    c = dict(zip(native.MOE_TRACE_PHASES["combine"], (c0, c0 + 500, c0 + 700, c0 + 3000, c0 + 4000)))
    return {"dispatch": d, "combine": c}


def test_phase_table_measures_each_phase_from_the_one_before_and_the_skew_from_the_earliest_rank():
    # rank 1 starts 2 us after rank 0 and waits 4 us where rank 0 waits 3 (ns in, us out)
    late = _pair(2000, 9000)
    late["dispatch"]["wait"] += 1000
    late["dispatch"]["expand"] += 1000
    late["dispatch"]["pad"] += 1000
    t = phase_table([[_pair(0, 8000)] * 3, [late] * 3])
    assert t["dispatch"]["start"] == {"median": 1.0, "max": 2.0}
    assert t["dispatch"]["wait"] == {"median": 3.5, "max": 4.0}
    assert t["dispatch"]["put"] == {"median": 1.0, "max": 1.0}
    # the combine counts from the latest dispatch end (rank 1's, 10 us): rank 0 started 2 us before it
    assert t["combine"]["start"] == {"median": -1.5, "max": -1.0}
    assert t["combine"]["reduce"] == {"median": 1.0, "max": 1.0}
