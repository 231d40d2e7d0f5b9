"""Batch invariance, a promise: a row's all_reduce result is bitwise the same whether the row
travels alone or with thousands of others, whatever algorithm the size selects (packet, one-shot,
two-shot) and whatever the reduce dtype: every algorithm accumulates in float32 (16-bit types) or
the dtype itself, in rank order. CPU engine here; the same check on the CUDA engine (eager and
CUDA graph) is in tests/gpu/test_batch_invariance_gpu.py."""

import pytest
import torch

import purlin_sglang as ps

W = 4
H = 128  # one row of bf16: 256 bytes (packet / one-shot); 2048 rows: 512 KiB (two-shot under auto)
ROWS = (0, 1, 17, 2047)  # rows checked alone against the batch of 2048
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)


def _batch(rank: int, dtype: torch.dtype, n: int = 2048) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return (torch.randn(n, H, generator=g, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-1000, 1000, (n, H), generator=g, dtype=dtype)


@pytest.mark.parametrize("algorithm", ["auto", "oneshot", "twoshot", "packet"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_all_reduce_row_alone_equals_row_in_batch(algorithm, dtype):
    cfg = {"staging_bytes": 1 << 20, "timeout_s": 20, "tuning": {"algorithm": algorithm}}

    def fn(comm):
        x = _batch(comm.rank, dtype)
        full = comm.all_reduce(x)
        alone = [comm.all_reduce(x[i:i + 1].clone()) for i in ROWS]
        mid = comm.all_reduce(x[:300].clone())  # a batch between the two sizes
        return full, alone, mid

    res = ps.run_virtual(W, fn, config=cfg)
    full = res[0][0]
    for rank, (f, alone, mid) in enumerate(res):
        assert torch.equal(f.view(-1).view(torch.uint8) if f.dtype.is_floating_point else f, full.view(-1).view(
            torch.uint8) if full.dtype.is_floating_point else full), f"rank {rank} differs from rank 0"
        for i, a in zip(ROWS, alone):
            assert torch.equal(a.view(torch.uint8), full[i:i + 1].view(torch.uint8)), (rank, i)
        assert torch.equal(mid.view(torch.uint8), full[:300].view(torch.uint8)), rank
