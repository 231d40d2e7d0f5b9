"""bench/traffic.py: the bytes a plan reads and writes, counted by hand for the plans whose ratio to the
bench's copy floor docs/RESULTS.md quotes (the plan max of the staged and direct plans)."""

from __future__ import annotations

import pytest

from purlin_sglang.bench.traffic import plan_bytes
from purlin_sglang.collectives import CATALOG
from purlin_sglang.snac import Sizes, TuningPolicy, lower, make_plan

W, N = 8, 1 << 16  # ranks; bytes of each rank's input (a multiple of 16 * W: parts cut evenly)


def per_rank(name: str, algorithm: str, sizes: Sizes) -> list[int]:
    return [plan_bytes(lower(make_plan(CATALOG[name], W, r, staging_bytes=1 << 24,
                                       policy=TuningPolicy(algorithm=algorithm)), sizes)) for r in range(W)]


@pytest.mark.parametrize("name, algorithm, sizes, want", [
    # one-shot all_gather: stage my input (2N), copy 7 peers' staging and my input into my output (8 x 2N)
    ("all_gather", "oneshot", Sizes((N,), (N,) * W), 18 * N),
    # two-shot all_reduce: stage 7 parts (7 x 2N/8), reduce 8 sources into my shard (9N/8), copy 8 shards out (8 x 2N/8)
    ("all_reduce", "twoshot", Sizes((N,), (N,)), 39 * N // 8),
    # one-shot all_reduce: stage (2N), reduce 8 sources into the output (9N)
    ("all_reduce", "oneshot", Sizes((N,), (N,)), 11 * N),
    # packet all_reduce: read my input once and push 7 x 2N; reduce 7 windows (7 x 2N), my input (N), write N
    ("all_reduce", "packet", Sizes((N,), (N,)), 31 * N),
    # one-shot all_to_all: stage 7 slices (7 x 2N/8), copy 7 peers' slices and mine out (8 x 2N/8)
    ("all_to_all", "oneshot", Sizes((N // W,) * W, (N // W,) * W), 30 * N // 8),
])
def test_plan_bytes_match_a_hand_count(name, algorithm, sizes, want):
    assert per_rank(name, algorithm, sizes) == [want] * W


def test_the_best_fraction_of_the_floor_a_plan_can_reach():
    """The floor counts each input read once and each output written once (bench/floor.py): 2N per rank
    for all_reduce, 9N for all_gather. The staged plans move more than that, so at the copy bandwidth
    they reach at most floor / plan of it."""
    ar = per_rank("all_reduce", "twoshot", Sizes((N,), (N,)))[0]
    ag = per_rank("all_gather", "oneshot", Sizes((N,), (N,) * W))[0]
    assert 2 * N / ar == pytest.approx(16 / 39)  # 0.41
    assert 9 * N / ag == pytest.approx(0.5)
