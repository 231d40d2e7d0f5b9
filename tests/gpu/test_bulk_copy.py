"""The Hopper bulk-copy (TMA) atom on a GPU: exact bytes for sizes around tile and stage edges and
every shared misalignment, nothing written outside, a clear refusal where it cannot run."""

from __future__ import annotations

import pytest
import torch

from purlin_sglang import native

pytestmark = pytest.mark.gpu

TILE = 16384  # BulkConfig::kTile
STAGES = 4
SIZES = [0, 1, 15, 16, 17, 4095, TILE - 16, TILE, TILE + 16, TILE * STAGES + 48, (3 << 20) + 7, (64 << 20) + 3]
POISON = 0xA5
PAD = 64


@pytest.fixture(scope="module")
def lib():
    lib = native.load()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk-copy atom needs sm_90 or newer")
    return lib


@pytest.mark.parametrize("nbytes", SIZES)
def test_bulk_copy_exact_and_bounded(lib, nbytes):
    gen = torch.Generator(device="cuda").manual_seed(99 + nbytes)
    stream = torch.cuda.current_stream().cuda_stream
    cap = nbytes + 16 + PAD
    src_buf = torch.empty(cap, dtype=torch.uint8, device="cuda")
    dst_buf = torch.empty(cap, dtype=torch.uint8, device="cuda")
    offsets = range(16) if nbytes < (1 << 20) else (0, 5)
    for off in offsets:  # the same misalignment on both sides: what the bulk path accepts
        src_buf.random_(0, 256, generator=gen)
        dst_buf.fill_(POISON)
        lib.copy_atom_bulk(dst_buf.data_ptr() + off, src_buf.data_ptr() + off, nbytes, stream)
        got = dst_buf.cpu()
        ctx = f"nbytes={nbytes} offset={off}"
        assert torch.equal(got[off: off + nbytes], src_buf[off: off + nbytes].cpu()), ctx
        assert bool((got[:off] == POISON).all()), ctx + " (wrote before dst)"
        assert bool((got[off + nbytes:] == POISON).all()), ctx + " (wrote past dst + nbytes)"


def test_bulk_copy_graph_replay(lib):  # a side stream and bounded blocks: test_copy_atom.py
    n = (8 << 20) + 5
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.full((n,), POISON, dtype=torch.uint8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lib.copy_atom_bulk(dst.data_ptr(), src.data_ptr(), n, torch.cuda.current_stream().cuda_stream)
    for _ in range(3):
        src.random_(0, 256)
        dst.fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst, src)


def test_bulk_copy_refuses_pointers_that_differ_modulo_16(lib):
    buf = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    with pytest.raises(native.PurlinCudaError, match="^copy_atom_bulk: CUDA error"):
        lib.copy_atom_bulk(buf.data_ptr() + 1, buf.data_ptr() + 512, 100, torch.cuda.current_stream().cuda_stream)
