"""The reduce atom on a GPU: bitwise the CPU engine's reduction, every size and offset, nothing
written outside the range."""

from __future__ import annotations

import ctypes
import zlib

import pytest
import torch

from purlin_sglang import native

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64]
OPS = ["sum", "max", "min"]
NSRC = [1, 2, 3, 5, 8]
SIZES = [0, 1, 7, 4096 + 3, (1 << 20) + 5]  # elements
OFFSETS = [0, 1, 3, 7]  # elements: misaligns every pointer by the same amount
PAD = 40  # guard elements after the range
_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # as engines/cpu.py
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CUDA_ERROR_INVALID_VALUE = 1


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(scope="module")
def lib():
    return native.load()


def reference(srcs: list[torch.Tensor], op: str, dtype: torch.dtype) -> torch.Tensor:
    """The CPU engine's semantics (engines/cpu.py `_reduce`), on CPU tensors."""
    acc_dtype = _ACC.get(dtype, dtype)
    acc = srcs[0].to(acc_dtype, copy=True)
    for v in srcs[1:]:
        v = v.to(acc_dtype)
        if op == "sum":
            acc.add_(v)
        elif op == "max":
            torch.maximum(acc, v, out=acc)
        else:
            torch.minimum(acc, v, out=acc)
    return acc.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def random_values(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Fresh non-zero values on the GPU; floats span a few binades so that rounding matters."""
    if dtype.is_floating_point:
        base = torch.float64 if dtype == torch.float64 else torch.float32
        x = torch.randn(n, dtype=base, device="cuda", generator=gen)
        x *= torch.exp2(torch.randint(-6, 7, (n,), device="cuda", generator=gen).to(base))
        x = x.to(dtype)
        x[x == 0] = 1
    elif dtype == torch.int32:  # full range: sums wrap
        x = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=dtype, device="cuda", generator=gen)
        x[x == 0] = 1
    else:
        x = torch.randint(-(2**62), 2**62, (n,), dtype=dtype, device="cuda", generator=gen)
        x[x == 0] = 1
    return x


def poison(dtype: torch.dtype, n: int) -> torch.Tensor:
    return torch.full((n * torch.tensor([], dtype=dtype).element_size(),), 0xA5, dtype=torch.uint8,
                      device="cuda").view(dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor, ctx: str, signed_zero: bool = True) -> None:
    """Bitwise equal, except that NaN only needs to be NaN (payloads are unspecified) and, with
    signed_zero=False, a zero only needs to be a zero."""
    assert got.shape == want.shape, ctx
    same = bits(got) == bits(want)
    if got.dtype.is_floating_point:
        gn, wn = torch.isnan(got), torch.isnan(want)
        assert torch.equal(gn, wn), ctx + f" (NaN at {int((gn != wn).sum())} wrong positions)"
        same |= gn & wn
        if not signed_zero:
            same |= (got == 0) & (want == 0)
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(
            f"{ctx}: {int((~same).sum())} elements differ, first at {i}: got {got[i].item()!r} "
            f"(bits {bits(got)[i].item():#x}), want {want[i].item()!r} (bits {bits(want)[i].item():#x})"
        )


def run_case(lib, dtype, op, srcs_buf, dst_buf, src_offs, dst_off, n, ctx, max_blocks=0):
    """Poison dst, reduce n elements, check the range bitwise and the guards untouched."""
    esize = dst_buf.element_size()
    fresh = poison(dtype, dst_buf.numel())
    dst_buf.copy_(fresh)
    ptrs = [s.data_ptr() + o * esize for s, o in zip(srcs_buf, src_offs)]
    stream = torch.cuda.current_stream()
    lib.reduce_atom(dst_buf.data_ptr() + dst_off * esize, ptrs, n * esize, dtype, op, stream.cuda_stream,
                    max_blocks=max_blocks)
    got = dst_buf.cpu()
    want = reference([s[o : o + n].cpu() for s, o in zip(srcs_buf, src_offs)], op, dtype)
    assert_same(got[dst_off : dst_off + n], want, ctx)
    p = fresh.cpu()
    assert torch.equal(bits(got[:dst_off]), bits(p[:dst_off])), ctx + " (wrote before dst)"
    assert torch.equal(bits(got[dst_off + n :]), bits(p[dst_off + n :])), ctx + " (wrote past dst + n)"


@pytest.mark.parametrize("nsrc", NSRC)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_reduce_atom_bitwise_and_bounded(lib, dtype, op, nsrc):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{dtype} {op} {nsrc}".encode()))
    for n in SIZES:
        cap = n + max(OFFSETS) + PAD
        dst_buf = torch.empty(cap, dtype=dtype, device="cuda")
        for off in OFFSETS:
            srcs = [random_values(cap, dtype, gen) for _ in range(nsrc)]  # fresh inputs every call
            run_case(lib, dtype, op, srcs, dst_buf, [off] * nsrc, off, n,
                     f"{dtype} {op} nsrc={nsrc} n={n} offset={off}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64], ids=_name)
@pytest.mark.parametrize("op", OPS)
def test_reduce_atom_mixed_alignment(lib, dtype, op):
    """Sources whose alignment differs from dst's modulo 16 bytes (element-wise path), and ones that
    differ by whole 16-byte vectors (vector path with different bases)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    esize = torch.tensor([], dtype=dtype).element_size()
    per16 = 16 // esize
    for n in [5, 4096 + 3, (1 << 20) + 1]:
        cap = n + 4 * per16 + PAD
        dst_buf = torch.empty(cap, dtype=dtype, device="cuda")
        for offs, dst_off in [([0, 1, 2, 3, 0], 1), ([1, 1 + per16, 1 + 2 * per16], 1 + per16), ([3, 0], 0)]:
            offs = [o % (4 * per16) for o in offs]
            srcs = [random_values(cap, dtype, gen) for _ in offs]
            run_case(lib, dtype, op, srcs, dst_buf, offs, dst_off, n, f"{dtype} {op} n={n} offs={offs} dst={dst_off}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=_name)
def test_reduce_atom_nan_inf_and_zeros(lib, dtype, op):
    """NaN in any source makes max/min NaN (torch.maximum/minimum; CUDA's fmaxf would drop it);
    infinities and signed zeros as torch. The sign of a zero from max/min(+0, -0) is unspecified."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    n, nsrc = 4096 + 5, 5
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0], dtype=dtype, device="cuda")
    for off in [0, 3]:
        srcs = []
        for _ in range(nsrc):
            x = random_values(n + off, dtype, gen)
            pick = torch.randint(0, 40, (n + off,), device="cuda", generator=gen)  # ~1/8 of elements special
            mask = pick < specials.numel()
            x[mask] = specials[pick[mask]]
            srcs.append(x)
        dst = torch.empty(n + off + PAD, dtype=dtype, device="cuda")
        dst.copy_(poison(dtype, dst.numel()))
        esize = dst.element_size()
        lib.reduce_atom(dst.data_ptr() + off * esize, [s.data_ptr() + off * esize for s in srcs], n * esize, dtype,
                        op, torch.cuda.current_stream().cuda_stream)
        got = dst[off : off + n].cpu()
        want = reference([s[off:].cpu() for s in srcs], op, dtype)
        assert_same(got, want, f"{dtype} {op} offset={off}", signed_zero=(op == "sum"))
        if op != "sum":
            any_nan = torch.stack([torch.isnan(s[off:].cpu()) for s in srcs]).any(0)
            assert bool(any_nan.any()) and torch.equal(torch.isnan(got), any_nan), "NaN must propagate"


def test_reduce_atom_in_place_side_stream_bounded_blocks_and_graph(lib):
    dtype, n = torch.bfloat16, (4 << 20) + 3
    a = random_values(n, dtype, torch.Generator(device="cuda").manual_seed(3))
    b = random_values(n, dtype, torch.Generator(device="cuda").manual_seed(4))
    want = reference([a.cpu(), b.cpu()], "sum", dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # in place: dst is the first source
        lib.reduce_atom(a.data_ptr(), [a.data_ptr(), b.data_ptr()], n * 2, dtype, "sum", side.cuda_stream,
                        max_blocks=3)
    side.synchronize()
    assert_same(a.cpu(), want, "in place, side stream, 3 blocks")

    x = [random_values(n, dtype, torch.Generator(device="cuda").manual_seed(5 + i)) for i in range(3)]
    out = torch.empty(n, dtype=dtype, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        lib.reduce_atom(out.data_ptr(), [t.data_ptr() for t in x], n * 2, dtype, "max",
                        torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(50)
    for i in range(2):  # replays read the current contents of the captured buffers
        for t in x:
            t.copy_(random_values(n, dtype, gen))
        out.copy_(poison(dtype, n))
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out.cpu(), reference([t.cpu() for t in x], "max", dtype), f"graph replay {i}")


def test_reduce_atom_native_rejects_bad_arguments(lib):
    """The C ABI returns cudaErrorInvalidValue (and launches nothing) for bad codes and counts."""
    buf = torch.zeros(64, dtype=torch.float32, device="cuda")
    p = buf.data_ptr()
    fn = lib._lib.purlin_reduce_atom

    def call(dst, srcs, nbytes, dtype=3, op=1, max_blocks=0):
        arr = (ctypes.c_void_p * max(1, len(srcs)))(*srcs)
        return int(fn(dst, arr, len(srcs), nbytes, dtype, op, None, max_blocks, buf.device.index))

    assert call(p, [p], 16) == 0
    assert call(p, [p], 16, dtype=0) == CUDA_ERROR_INVALID_VALUE
    assert call(p, [p], 16, dtype=7) == CUDA_ERROR_INVALID_VALUE
    assert call(p, [p], 16, op=0) == CUDA_ERROR_INVALID_VALUE
    assert call(p, [p], 16, op=4) == CUDA_ERROR_INVALID_VALUE
    assert call(p, [], 16) == CUDA_ERROR_INVALID_VALUE
    assert call(p, [p] * 9, 16) == CUDA_ERROR_INVALID_VALUE
    assert call(p, [p], 6) == CUDA_ERROR_INVALID_VALUE  # not a multiple of 4 bytes
    assert call(p + 2, [p], 16) == CUDA_ERROR_INVALID_VALUE  # dst not element-aligned
    assert call(p, [p, p + 1], 16) == CUDA_ERROR_INVALID_VALUE  # a source not element-aligned
    assert call(p, [p], 16, max_blocks=-1) == CUDA_ERROR_INVALID_VALUE
    assert call(p, [p], 0) == 0  # nothing to do
    torch.cuda.synchronize()
    assert bool((buf == 0).all())
