"""bench/timing.py's graph replays on a GPU: with and without launch-ahead, every replay runs (warm-up and
timed) and each sample is a positive time per call."""

from __future__ import annotations

import pytest
import torch

from purlin_sglang.bench.timing import time_graph_replays

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ahead", [False, True])
def test_graph_replays_all_run_and_are_timed(ahead, capsys):
    calls, warmup, iters = 7, 2, 5
    side = torch.cuda.Stream()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        for _ in range(calls):
            counter.add_(1)
    counter.zero_()
    torch.cuda.synchronize()
    barriers = []
    samples = time_graph_replays(g, side, calls, warmup, iters, lambda: barriers.append(1), ahead=ahead)
    torch.cuda.synchronize()
    assert len(samples) == iters and all(s > 0 for s in samples)
    assert barriers == [1]
    assert int(counter.item()) == (warmup + iters) * calls  # no replay lost behind the sleep
    if ahead:  # one thread, 5 replays of 7 tiny kernels: enqueued well inside the 50 ms sleep
        assert "launch-ahead" not in capsys.readouterr().err
