"""Host time of one small collective call, on a machine without a GPU (not a test).

    python3 benchmarks/bench_host_overhead.py [--world 8] [--iters 20000] [--json out.json]

Two layers are timed per call with ``time.perf_counter_ns`` around each call (median and p90):

* ``Communicator.run`` (through the convenience methods) on CPU tensors of rank 0 of a virtual
  world, with the engine replaced by ``FakeCudaEngine``: a fake standing in for CudaEngine that
  only records its arguments. This is validation, plan/schedule lookup, fingerprint, output
  allocation and the call context: everything of an eager call above the engine.
* ``CudaEngine.execute`` itself (the real Python code of a call's first run) with a fake native library
  whose ``snac_execute`` returns 0 and a fake stream lookup, and the two layers together, where every
  call after the first is the steady state: ``CudaEngine.launch`` of the shape bound at the first call,
  one call of the library's ``snac_launch`` (here a fake Python function of the same five arguments).

Then the pieces: the call-cache lookup, the usability checks, a new output by shape and by
``empty_like``, one call into the native library through the module's ``snac_launch`` and through
ctypes (a launch the library refuses before touching a device), and the loopback launch gate's two
rendezvous alone in ``--world`` threads.

What is NOT in these figures: the real stream lookup, the driver and the kernel launch. The GPU
machine's eager figure (benchmarks/bench_cuda_engine.py) includes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import ctypes

import torch

from purlin_sglang import native
from purlin_sglang.api import Communicator
from purlin_sglang.virtual import VirtualWorld
from purlin_sglang.config import PurlinConfig
from purlin_sglang.engines import cuda as cuda_mod
from purlin_sglang.memory.layout import DeviceLayout

FAKE_STREAM = 0x5EED  # the cudaStream_t the fake stream lookup reports


class FakeCudaEngine:
    """Stands in for CudaEngine under a Communicator: records each call's arguments, runs nothing."""

    name = "cuda"

    def __init__(self):
        self.broken = None
        self.calls = 0
        self.last = None

    def execute(self, sched, ctx) -> None:
        self.calls += 1
        self.last = (sched, ctx)

    def check(self) -> None:
        pass

    def mark_broken(self, reason: str) -> None:
        self.broken = self.broken or reason

    def close(self) -> None:
        pass


class FakeNativeLibrary:
    """The one native entry point execute() calls, returning cudaSuccess."""

    def __init__(self):
        self.launches = 0

    def snac_execute(self, params, stream) -> int:
        self.launches += 1
        return 0

    def snac_launch(self, addr, inp, out, seq, stream) -> int:
        """The module's snac_launch (a C function taking five ints) without its struct writes and launch."""
        self.launches += 1
        self.last_launch = (addr, inp, out, seq, stream)
        return 0

    def copy_atom(self, dst_ptr, src_ptr, nbytes, stream, max_blocks=0, device=-1) -> None:
        ctypes.memmove(dst_ptr, src_ptr, nbytes)  # tables live in CPU memory here

    def error_string(self, code: int) -> str:
        return f"fake error {code}"


class _FakeStream:
    cuda_stream = FAKE_STREAM

    def synchronize(self) -> None:
        pass


def install_fake_cuda_queries() -> None:
    """Replace the torch.cuda queries CudaEngine.execute makes (no GPU here) by constant fakes:
    the stream lookup, and the capture check made once when a schedule's table is built."""
    torch.cuda.current_stream = lambda device=None: _FakeStream()
    torch.cuda.is_current_stream_capturing = lambda: False
    if hasattr(cuda_mod, "_current_raw_stream"):
        cuda_mod._current_raw_stream = lambda index: FAKE_STREAM


def real_cuda_engine_on_cpu(world: int, rank: int, staging_bytes: int, call_check: bool = False) -> cuda_mod.CudaEngine:
    """A real CudaEngine object whose device parts are on the CPU and whose library is fake.

    Built field by field as CudaEngine.__init__ does (its __init__ needs a GPU)."""
    e = cuda_mod.CudaEngine.__new__(cuda_mod.CudaEngine)
    e.lib = FakeNativeLibrary()
    e.ws, e.rank, e.world, e.timeout_s = None, rank, world, 60.0
    e.device = torch.device("cuda", 0)
    e.dlayout = DeviceLayout(world, staging_bytes)
    e.blocks = 16
    e._arena = cuda_mod._Arena(torch.device("cpu"), 1 << 16)
    e._host_error = torch.zeros(cuda_mod.HOST_ERROR_WORDS, dtype=torch.int64)
    e._err = e._host_error.numpy()
    e._params = native.SnacParams()
    e._params.rank, e._params.world = rank, world
    e._pref = ctypes.byref(e._params)
    e.call_check = call_check
    e._params.desc_off = e.dlayout.desc_off if call_check else -1
    e._by_id, e._by_key, e._names = {}, {}, []
    e._index, e._stream, e._stream_handle = 0, None, None
    e.broken = None
    return e


def make_comm(world: int, engine) -> Communicator:
    """Rank 0 of a virtual CPU world of ``world`` ranks, its engine replaced by ``engine``."""
    cfg = PurlinConfig(staging_bytes=1 << 20)
    vw = VirtualWorld(world, cfg, torch.device("cpu"))
    comm = Communicator._virtual(vw, 0, "cpu", "host")
    comm._engine.close()
    comm._engine, comm.engine_name = engine, "cuda"
    return comm


def time_calls(call, iters: int, warmup: int = 200) -> dict:
    for _ in range(warmup):
        call()
    ns = [0] * iters
    clock = time.perf_counter_ns
    for i in range(iters):
        t = clock()
        call()
        ns[i] = clock() - t
    ns.sort()
    return {"median_us": statistics.median(ns) / 1e3, "p90_us": ns[int(0.9 * iters)] / 1e3}


def native_call_rows(emit, iters: int) -> None:
    """The cost of one call into the native library, two ways, on a launch the library refuses before it
    touches a device (a SnacParams naming no ranks: cudaErrorInvalidValue, so this runs without a GPU):
    the module's snac_launch (the steady state) and ctypes' purlin_snac_execute (a call's first run).
    Skipped without a CUDA build of the module."""
    import importlib

    info = native.build_info()
    if not info.get("cuda"):
        print(f"(native call rows skipped: {info.get('reason')})")
        return
    mod = importlib.import_module("purlin_sglang._native")
    p = native.SnacParams()
    addr, ref = ctypes.addressof(p), ctypes.byref(p)
    lib = ctypes.CDLL(mod.__file__)
    execute = lib.purlin_snac_execute
    execute.argtypes = [ctypes.POINTER(native.SnacParams), ctypes.c_void_p]
    execute.restype = ctypes.c_int
    if mod.snac_launch(addr, 1, 2, 3, 0) != 1 or execute(ref, 0) != 1:
        raise SystemExit("the refused launch did not answer cudaErrorInvalidValue")
    emit("native: module snac_launch, 5 ints (refused launch)", time_calls(lambda: mod.snac_launch(addr, 1, 2, 3, 0),
                                                                          iters))
    emit("native: ctypes purlin_snac_execute (refused launch)", time_calls(lambda: execute(ref, 0), iters))


def gate_time(world: int, calls: int) -> dict:
    """Per call, the wall time of ``calls`` calls' two rendezvous of the loopback launch gate (virtual.py)
    in ``world`` threads, nothing launched: the slowest thread's total / calls (median = p90: one figure)."""
    import threading

    from purlin_sglang.virtual import LaunchGate

    gate, start = LaunchGate(world, 60.0), threading.Barrier(world)
    per = [0.0] * world

    def rank(r: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        for seq in range(1, calls + 1):
            gate.enter(r, seq, "all_reduce", 7, (torch.bfloat16, (4096,)))
            gate.launched(r, seq, "all_reduce")
        per[r] = (time.perf_counter() - t0) / calls * 1e6

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"median_us": max(per), "p90_us": max(per)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    w = a.world
    bf16 = torch.bfloat16
    rows = []

    def emit(case: str, res: dict) -> None:
        rows.append({"case": case, **res})
        print(f"{case:<58} median {res['median_us']:6.2f} us   p90 {res['p90_us']:6.2f} us", flush=True)

    # -- Communicator.run above a fake engine ---------------------------------------------------------
    fake = FakeCudaEngine()
    comm = make_comm(w, fake)
    x = torch.randn(4096).to(bf16)
    out = torch.empty_like(x)
    xg = torch.randn(4096).to(bf16)
    xa = torch.randn(8 * w, 64).to(bf16)  # all_to_all_v: 8 rows of 64 to every rank
    splits = [8] * w
    cases = [
        ("run: all_reduce 4096 bf16", lambda: comm.all_reduce(x)),
        ("run: all_reduce 4096 bf16, out=", lambda: comm.all_reduce(x, out=out)),
        ("run: all_reduce 4096 bf16, in place (out=x)", lambda: comm.all_reduce(x, out=x)),
        ("run: all_gather 4096 bf16 per rank", lambda: comm.all_gather(xg)),
        ("run: all_to_all_v 8x64 bf16 per peer, splits as lists", lambda: comm.all_to_all_v(xa, splits, splits)),
    ]
    for case, call in cases:
        before = fake.calls
        emit(case, time_calls(call, a.iters))
        if fake.calls != before + a.iters + 200:
            raise SystemExit(f"{case}: the fake engine saw {fake.calls - before} calls")
    sched, ctx = fake.last
    if sched.plan.spec.name != "all_to_all_v" or ctx.dtype is not bf16:
        raise SystemExit(f"the fake engine recorded {sched.plan.spec.name}, {ctx.dtype}")

    # -- CudaEngine.execute (real Python, fake library and stream lookup) -----------------------------
    install_fake_cuda_queries()
    eng = real_cuda_engine_on_cpu(w, 0, 1 << 20)
    comm.all_reduce(x, out=out)
    sched, ctx = fake.last
    emit("CudaEngine.execute (fake lib and stream), all_reduce", time_calls(lambda: eng.execute(sched, ctx), a.iters))
    if eng.lib.launches != a.iters + 200 or eng._params.output != out.data_ptr():
        raise SystemExit("the fake library did not see the expected launches / pointers")

    eng_checked = real_cuda_engine_on_cpu(w, 0, 1 << 20, call_check=True)
    emit("CudaEngine.execute, all_reduce, device_call_check on",
         time_calls(lambda: eng_checked.execute(sched, ctx), a.iters))
    if eng_checked._params.desc_seq != ctx.seq:
        raise SystemExit("the checked engine did not pass the call number")

    # A communicator over the real engine: the first call of a shape runs execute() and binds the shape,
    # every later one is the steady state (CudaEngine.launch: one native call).
    comm2 = make_comm(w, eng)
    before = eng.lib.launches
    emit("run + CudaEngine, bound: all_reduce 4096 bf16, out=", time_calls(lambda: comm2.all_reduce(x, out=out),
                                                                         a.iters))
    emit("run + CudaEngine, bound: all_reduce 4096 bf16", time_calls(lambda: comm2.all_reduce(x), a.iters))
    if eng.lib.launches != before + 2 * (a.iters + 200) or eng.lib.last_launch[1] != x.data_ptr():
        raise SystemExit("the fake library did not see the expected bound launches")

    # -- the pieces of a call (where the time above goes) ----------------------------------------------
    from purlin_sglang.collectives import ALL_REDUCE

    path = comm2._path
    emit("piece: call-cache lookup and tensor checks, out=",
         time_calls(lambda: path.lookup(ALL_REDUCE, x, out, "sum", None, None, None), a.iters))
    emit("piece: usability checks", time_calls(lambda: comm2._check_usable("all_reduce"), a.iters))
    emit("piece: new output, torch.empty(shape, dtype=, device=)",
         time_calls(lambda: torch.empty((4096,), dtype=bf16, device=x.device), a.iters))
    emit("piece: new output, torch.empty_like(x)", time_calls(lambda: torch.empty_like(x), a.iters))
    native_call_rows(emit, a.iters)
    emit(f"LaunchGate alone, {w} rank threads (loopback eager, world > 1)", gate_time(w, max(200, a.iters // 20)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "world": w, "iters": a.iters, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
