"""The copy atom on a GPU: exact bytes for every size and misalignment, nothing written outside."""

from __future__ import annotations

import pytest
import torch

from purlin_sglang import native

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 15, 16, 17, 4095, (1 << 20) + 3]
OFFSETS = list(range(16))
POISON = 0xA5
PAD = 64  # bytes of guard after each range


@pytest.fixture(scope="module")
def lib():
    return native.load()


@pytest.mark.parametrize("nbytes", SIZES)
def test_copy_atom_exact_and_bounded(lib, nbytes):
    gen = torch.Generator(device="cuda").manual_seed(1234 + nbytes)
    stream = torch.cuda.current_stream()
    cap = nbytes + 16 + PAD
    # 256-byte aligned allocations (caching allocator), so pointer + offset sets the misalignment.
    src_buf = torch.empty(cap, dtype=torch.uint8, device="cuda")
    dst_buf = torch.empty(cap, dtype=torch.uint8, device="cuda")
    for src_off in OFFSETS:
        for dst_off in OFFSETS:
            src_buf.random_(0, 256, generator=gen)
            dst_buf.fill_(POISON)
            native.copy_atom(
                dst_buf.data_ptr() + dst_off, src_buf.data_ptr() + src_off, nbytes, stream.cuda_stream
            )
            got = dst_buf.cpu()
            want = src_buf[src_off : src_off + nbytes].cpu()
            ctx = f"nbytes={nbytes} src_off={src_off} dst_off={dst_off}"
            assert torch.equal(got[dst_off : dst_off + nbytes], want), ctx
            assert bool((got[:dst_off] == POISON).all()), ctx + " (wrote before dst)"
            assert bool((got[dst_off + nbytes :] == POISON).all()), ctx + " (wrote past dst + nbytes)"


@pytest.mark.parametrize("atom", ["copy_atom", "copy_atom_bulk"])
def test_copy_atom_on_a_side_stream_and_bounded_blocks(lib, atom):
    if atom == "copy_atom_bulk" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk-copy atom needs sm_90 or newer")
    n = (8 << 20) + 5
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.full((n,), POISON, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        getattr(lib, atom)(dst.data_ptr(), src.data_ptr(), n, side.cuda_stream, max_blocks=3)
    side.synchronize()
    assert torch.equal(dst, src)


def test_copy_atom_reports_a_cuda_error(lib):
    src = torch.zeros(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(native.PurlinCudaError) as info:
        lib.copy_atom(src.data_ptr(), src.data_ptr(), 16, 0, max_blocks=-1)  # invalid argument
    assert info.value.code != 0 and "copy_atom" in str(info.value)
