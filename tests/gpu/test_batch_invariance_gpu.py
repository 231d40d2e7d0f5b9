"""Batch invariance on the CUDA engine (loopback, one GPU): a row's all_reduce result is bitwise the
same alone and in a batch of 2048, across the packet / one-shot / two-shot crossovers, every reduce
dtype, eager and CUDA graph; and equal to the CPU engine's. The CPU-engine twin: tests/test_batch_invariance.py."""

from __future__ import annotations

import threading

import pytest
import torch

import purlin_sglang as ps

pytestmark = pytest.mark.gpu
W, H = 4, 128
ROWS = (0, 1, 17, 2047)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)


def _batch(rank, dtype, n=2048):
    g = torch.Generator().manual_seed(7000 + rank)
    if dtype.is_floating_point:
        return (torch.randn(n, H, generator=g, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-1000, 1000, (n, H), generator=g, dtype=dtype)


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("algorithm", ["auto", "oneshot", "twoshot", "packet"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_row_alone_equals_row_in_batch_eager_and_graph(algorithm, dtype):
    cfg = {"staging_bytes": 4 << 20, "timeout_s": 10, "tuning": {"algorithm": algorithm}}
    if algorithm == "packet":
        cfg["tuning"]["packet_max_bytes"] = 65536
    lock = threading.Lock()  # torch refuses concurrent captures: the ranks capture one by one
    captured = threading.Barrier(W)  # no rank replays (or syncs) while another still captures

    def fn(comm):
        x = _batch(comm.rank, dtype).to(comm.device)
        singles = [x[i:i + 1].clone() for i in ROWS]
        if algorithm == "packet":  # a packet call carries at most the window: check rows alone only
            full = None
        else:
            full = comm.all_reduce(x)
        alone = [comm.all_reduce(s) for s in singles]
        # graph: capture the single-row calls once (warmed up above), replay with new data
        outs = [torch.empty_like(s) for s in singles]
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with lock, torch.cuda.stream(side), comm.capture():
            with torch.cuda.graph(g, stream=side):
                for s, o in zip(singles, outs):
                    comm.all_reduce(s, out=o)
        captured.wait(60)
        with torch.cuda.stream(side):
            g.replay()
        side.synchronize()
        return (None if full is None else full.cpu()), [a.cpu() for a in alone], [o.cpu() for o in outs]

    gpu = ps.run_virtual(W, fn, device="cuda", config=cfg)
    cpu_cfg = {k: v for k, v in cfg.items()}
    x_all = [_batch(r, dtype) for r in range(W)]
    want_full = ps.run_virtual(W, lambda c: c.all_reduce(x_all[c.rank]), config=cpu_cfg)[0]
    for r, (full, alone, graphed) in enumerate(gpu):
        if full is not None:
            assert torch.equal(_bits(full), _bits(want_full)), (r, "full batch differs from the CPU engine")
        for i, a, gr in zip(ROWS, alone, graphed):
            assert torch.equal(_bits(a), _bits(want_full[i:i + 1])), (r, i, "eager row alone")
            assert torch.equal(_bits(gr), _bits(want_full[i:i + 1])), (r, i, "graph row alone")
