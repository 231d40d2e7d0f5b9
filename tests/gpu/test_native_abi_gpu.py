"""The checked native ABI on a GPU: the device index on every launch, and records the kernels cannot
run recorded as errors (never skipped)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import purlin_sglang as ps
from purlin_sglang import native
from purlin_sglang.engines import cuda as cuda_mod
from purlin_sglang.engines import cuda_ops as co
from purlin_sglang.errors import PurlinBrokenError, PurlinCudaError
from purlin_sglang.memory.loopback import LoopbackWorld
from purlin_sglang.snac import Buf, Span

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib():
    return native.load()


def test_load_checked_the_layout(lib):
    assert native.layout_problems(native.native_layout()) == []
    assert lib.abi_version() == native.ABI_VERSION


def _copy(lib, device: int, stream_handle: int, dst: torch.Tensor, src: torch.Tensor) -> None:
    lib.copy_atom(dst.data_ptr(), src.data_ptr(), src.numel(), stream_handle, device=device)


def test_a_launch_makes_its_device_current(lib):
    dev = torch.cuda.current_device()
    src = torch.randint(0, 256, (4099,), dtype=torch.uint8, device=f"cuda:{dev}")
    dst = torch.zeros_like(src)
    stream = torch.cuda.current_stream(dev)
    _copy(lib, dev, stream.cuda_stream, dst, src)
    assert lib.last_device() == dev
    stream.synchronize()
    assert torch.equal(dst, src)


def test_a_launch_from_a_thread_with_no_current_context(lib):
    """A new host thread has no CUDA context current and has never set a device in either runtime
    (torch's or the library's); the library makes the device of the call current itself."""
    dev = torch.cuda.current_device()
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=f"cuda:{dev}")
    dst = torch.zeros_like(src)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    handle = side.cuda_stream  # taken here: the thread below makes no torch CUDA call
    seen, errors = [], []

    def body():
        try:
            _copy(lib, dev, handle, dst, src)
            seen.append(lib.last_device())
        except Exception as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join(60)
    assert not t.is_alive() and not errors, errors
    assert seen == [dev]
    side.synchronize()
    assert torch.equal(dst, src)


def test_a_device_that_does_not_exist_is_refused(lib):
    dev = torch.cuda.current_device()
    src = torch.randint(0, 256, (64,), dtype=torch.uint8, device=f"cuda:{dev}")
    dst = torch.zeros_like(src)
    with pytest.raises(PurlinCudaError, match="copy_atom"):
        _copy(lib, torch.cuda.device_count(), 0, dst, src)
    stream = torch.cuda.current_stream(dev)  # the failure is not reported again by the next launch
    _copy(lib, dev, stream.cuda_stream, dst, src)
    stream.synchronize()
    assert torch.equal(dst, src) and lib.last_device() == dev


def test_collectives_pass_the_communicator_device(lib):
    dev = torch.cuda.current_device()

    def fn(comm):
        x = torch.full((64,), float(comm.rank + 1), device=comm.device)
        return comm.all_reduce(x).cpu()  # not in place: the result is returned

    out = ps.run_virtual(2, fn, device=f"cuda:{dev}")
    assert all(torch.equal(o, torch.full((64,), 3.0)) for o in out)
    assert lib.last_device() == dev


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_second_gpu_while_torch_is_on_the_first(lib):
    def fn(comm):
        x = torch.full((64,), float(comm.rank + 1), device=comm.device)
        return comm.all_reduce(x).cpu()  # not in place: the result is returned

    with torch.cuda.device(0):  # torch's current device is 0 here, and again after the test
        src = torch.randint(0, 256, (4099,), dtype=torch.uint8, device="cuda:1")
        dst = torch.zeros_like(src)
        stream = torch.cuda.current_stream(1)
        _copy(lib, 1, stream.cuda_stream, dst, src)
        assert lib.last_device() == 1
        stream.synchronize()
        assert torch.equal(dst, src)
        torch.cuda.set_device(0)
        out = ps.run_virtual(2, fn, device="cuda:1")
        assert lib.last_device() == 1
    assert all(torch.equal(o, torch.full((64,), 3.0)) for o in out)


# -- records a kernel cannot run ---------------------------------------------------------------------
def _ref(buf: Buf, nbytes: int) -> int:
    return co._ref(Span(buf, 0, 0, nbytes))


def _reduce_w0(code: int, op: int = 1, nsrc: int = 1) -> int:
    return code | (op << co.SUB_SHIFT) | (nsrc << co.NSRC_SHIFT)


def _run(records: list, dtype_code: int, packets: int):
    """Run one table on a fresh one-rank workspace; return (input, output) after synchronize()."""
    dev = torch.cuda.current_device()
    world = LoopbackWorld(1, 1 << 16, dev)
    eng = cuda_mod.CudaEngine(world.view(0), 0, 1, 5.0)
    try:
        x = torch.randn(8, dtype=torch.bfloat16, device=f"cuda:{dev}")
        y = torch.zeros_like(x)
        words = np.zeros(len(records) * co.OP_WORDS, dtype=np.int64)
        for i, r in enumerate(records):
            words[i * co.OP_WORDS: i * co.OP_WORDS + len(r)] = r
        stream = torch.cuda.current_stream(dev)
        table = eng._arena.put(words, eng.lib, stream.cuda_stream)
        p = eng._params
        p.ops, p.n_ops, p.n_updates, p.tag, p.packets = table.data_ptr(), len(records), 0, 0, packets
        p.input, p.output, p.dtype = x.data_ptr(), y.data_ptr(), dtype_code
        assert p.device == dev
        assert eng.lib.snac_execute(eng._pref, stream.cuda_stream) == 0
        eng._stream = stream
        eng.synchronize()
        return x, y
    finally:
        torch.cuda.synchronize(dev)
        eng.close()
        world.close()


BF16 = native.DTYPE_CODES["bfloat16"]


def test_a_valid_reduce_record_runs():  # the control of the cases below
    x, y = _run([[_reduce_w0(co.REDUCE), _ref(Buf.OUTPUT, 16), 16, _ref(Buf.INPUT, 16)]], BF16, 0)
    assert torch.equal(x, y)


@pytest.mark.parametrize("records, dtype_code, packets, opcode", [
    ([[_reduce_w0(co.REDUCE), _ref(Buf.OUTPUT, 16), 16, _ref(Buf.INPUT, 16)]], 0, 0, co.REDUCE),
    ([[42, _ref(Buf.OUTPUT, 16), _ref(Buf.INPUT, 16), 16]], BF16, 0, 42),
    ([[_reduce_w0(co.REDUCE, op=7), _ref(Buf.OUTPUT, 16), 16, _ref(Buf.INPUT, 16)]], BF16, 0, co.REDUCE),
    ([[co.PACKET_COPY, _ref(Buf.OUTPUT, 16), 16, _ref(Buf.INPUT, 16)]], 0, 0, co.PACKET_COPY),
    ([[_reduce_w0(co.PACKET_REDUCE), _ref(Buf.OUTPUT, 16), 16, _ref(Buf.INPUT, 16)]], 0, 1, co.PACKET_REDUCE),
    ([[co.COPY, _ref(Buf.OUTPUT, 16), _ref(Buf.INPUT, 16), 16]], 0, 1, co.COPY),
], ids=["reduce-in-copy-only", "unknown-opcode", "unknown-reduce-op", "packet-op-in-staged-kernel",
        "packet-reduce-in-copy-only", "staged-op-in-packet-kernel"])
def test_a_record_the_kernel_cannot_run_is_an_error(records, dtype_code, packets, opcode):
    with pytest.raises(PurlinBrokenError, match=rf"op #0 \(opcode {opcode}, .*cannot run"):
        _run(records, dtype_code, packets)
