"""The call cache of Communicator (api.py ``_run``) and the CUDA engine's launch path.

A call whose spec, op, root, dtype, shape and splits were seen before skips planning and the checks
that depend only on those. Shown here: a change of any of them misses the cache and the results
still equal the torch references; every check that depends on the tensors or on the communicator's
state still runs on a cache hit and raises the message a first call gets; the cache is bounded.
The CUDA engine's execute() is run on a fake native library (no GPU needed).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import purlin_sglang as ps  # noqa: E402
from purlin_sglang.testing.collectives import (  # noqa: E402
    all_gather, all_gather_v, all_reduce, all_to_all_v, assert_bits_equal, broadcast, make_input, poison_like,
    reduce_ref,
)
from purlin_sglang import native  # noqa: E402
from purlin_sglang.api import Communicator  # noqa: E402
from purlin_sglang.collectives import ALL_GATHER, ReduceOp  # noqa: E402
from purlin_sglang.config import PurlinConfig  # noqa: E402
from purlin_sglang.engines import cuda as cuda_mod  # noqa: E402
from purlin_sglang.engines.base import Engine  # noqa: E402
from purlin_sglang.errors import (  # noqa: E402
    PurlinBrokenError, PurlinClosedError, PurlinCudaError, PurlinError, PurlinTimeoutError,
)
from purlin_sglang.memory.layout import DeviceLayout  # noqa: E402
from purlin_sglang.virtual import VirtualWorld  # noqa: E402

CFG = {"staging_bytes": 1 << 16, "timeout_s": 10}
W = 3
f32, bf16 = torch.float32, torch.bfloat16


def misses(comm) -> int:
    """Calls of ``comm`` that took the full (uncached) path so far."""
    return comm.cache_info().misses


def hits(comm) -> int:
    """Calls of ``comm`` whose shape was found in the call cache so far."""
    return comm.cache_info().hits


def inputs(seed, shape_of_rank, dtype, world=W):
    return [make_input(seed, p, shape_of_rank(p), dtype) for p in range(world)]


def good_call(comm):
    x = torch.full((5, 3), float(comm.rank + 1))
    assert torch.equal(comm.all_reduce(x), torch.full((5, 3), float(sum(range(1, comm.world_size + 1)))))
    return True


# -- hits and misses -----------------------------------------------------------------------------------
def test_a_repeated_call_takes_the_cached_path_and_stays_right():
    def fn(comm):
        r = comm.rank
        for i in range(3):
            xs = inputs(i, lambda p: (4, 5), bf16)  # fresh values each time, the same shape
            want = all_reduce(xs, r)
            assert_bits_equal(comm.all_reduce(xs[r]), want, "default out")
            out = poison_like(want)
            assert comm.all_reduce(xs[r], out=out) is out
            assert_bits_equal(out, want, "out=")
            y = xs[r].clone()
            assert comm.all_reduce(y, out=y) is y
            assert_bits_equal(y, want, "in place")
        return misses(comm), comm.cache_info().calls

    assert ps.run_virtual(W, fn, config=CFG) == [(1, 1)] * W  # one full-path call, one entry


def test_a_change_of_shape_dtype_op_root_or_splits_misses_and_stays_right():
    send1 = [[1, 2, 0], [0, 1, 2], [2, 0, 1]]  # rows rank p sends to rank q: the same row and column
    send2 = [[2, 0, 1], [1, 2, 0], [0, 1, 2]]  # sums as send1 (so the same x and out shapes)
    sizes1, sizes2 = [1, 2, 1], [2, 1, 1]  # rank 2 has 1 row in both

    def fn(comm):
        r = comm.rank
        steps = []

        def step(miss, got, want, what):
            steps.append((what, miss, misses(comm)))
            assert_bits_equal(got, want, what)

        xs = inputs(1, lambda p: (4, 2), f32)
        step(1, comm.all_reduce(xs[r]), all_reduce(xs, r), "f32 (4,2) sum")
        step(0, comm.all_reduce(xs[r]), all_reduce(xs, r), "again")
        # ReduceOp.SUM == "sum"; whether it also hashes alike (the same entry) varies by Python version
        step(None, comm.all_reduce(xs[r], ReduceOp.SUM), all_reduce(xs, r), "ReduceOp.SUM")
        step(0, comm.all_reduce(xs[r], ReduceOp.SUM), all_reduce(xs, r), "ReduceOp.SUM again")
        xt = inputs(2, lambda p: (2, 4), f32)
        step(1, comm.all_reduce(xt[r]), all_reduce(xt, r), "shape (2,4): same bytes, other rows")
        xb = inputs(3, lambda p: (4, 2), bf16)
        step(1, comm.all_reduce(xb[r]), all_reduce(xb, r), "bf16: other bytes")
        xi = inputs(4, lambda p: (4, 2), torch.int32)
        step(1, comm.all_reduce(xi[r]), all_reduce(xi, r), "int32: same bytes as f32")
        step(1, comm.all_reduce(xs[r], "max"), reduce_ref(xs, "max"), "op max")
        step(1, comm.all_reduce(xs[r], "min"), reduce_ref(xs, "min"), "op min")
        step(0, comm.all_reduce(xs[r], "max"), reduce_ref(xs, "max"), "op max again")
        xr = inputs(5, lambda p: (3,), f32)
        for root, miss in ((0, 1), (1, 1), (0, 0)):
            y = xr[r].clone()
            step(miss, comm.broadcast(y, root), broadcast(xr, r, root), f"broadcast root {root}")
        for send, miss, kind in ((send1, 1, list), (send2, 1, list), (send1, 0, tuple), (send1, 0, list)):
            xa = inputs(6, lambda p: (sum(send[p]), 2), f32)
            got = comm.all_to_all_v(xa[r], kind(send[r]), kind(send[p][r] for p in range(W)))
            step(miss, got, all_to_all_v(xa, r, send), f"all_to_all_v {send} as {kind.__name__}")
        xa = inputs(7, lambda p: (sum(send2[p]), 2), f32)
        got = comm.all_to_all_v(xa[r], torch.tensor(send2[r]), torch.tensor([send2[p][r] for p in range(W)]))
        step(1, got, all_to_all_v(xa, r, send2), "splits as tensors: not cached, still right")
        for sizes, miss in ((sizes1, 1), (sizes2, 1), (sizes1, 0)):
            xg = inputs(8, lambda p: (sizes[p], 3), f32)
            step(miss, comm.all_gather_v(xg[r], sizes), all_gather_v(xg, r), f"all_gather_v {sizes}")
        xg = inputs(9, lambda p: (2,), f32)
        step(1, comm.all_gather(xg[r]), all_gather(xg, r), "all_gather")
        out = poison_like(all_gather(xg, r))
        step(0, comm.all_gather(xg[r], out=out), all_gather(xg, r), "all_gather out=: same entry")
        return steps

    for rank, steps in enumerate(ps.run_virtual(W, fn, config=CFG)):
        before = 0
        for what, miss, after in steps:  # all_gather_v: on rank 2 only the splits change, not x's shape
            assert miss is None or after - before == miss, (rank, what, miss, after - before)
            before = after


# -- checks still made on a hit ------------------------------------------------------------------------
def x4(*shape, dtype=f32):
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)


# (id, a valid call, a bad call of the same spec, op, dtype, shape and splits, whether the bad call's
# key is cached: False where the key must NOT match the valid call's although its values compare equal)
BAD_AFTER_GOOD = [
    ("noncontig-out", lambda c: c.all_reduce(x4(3, 2), out=torch.empty(3, 2)),
     lambda c: c.all_reduce(x4(3, 2), out=torch.empty(2, 3).t()), True),
    ("noncontig-x", lambda c: c.all_reduce(x4(6, 4)), lambda c: c.all_reduce(x4(4, 6).t()), True),
    ("strided-x", lambda c: c.all_gather(x4(4)), lambda c: c.all_gather(x4(8)[::2]), True),
    ("device-x", lambda c: c.all_reduce(x4(3)), lambda c: c.all_reduce(torch.empty(3, device="meta")), True),
    ("device-out", lambda c: c.all_gather(x4(2), out=torch.empty(2 * W)),
     lambda c: c.all_gather(x4(2), out=torch.empty(2 * W, device="meta")), True),
    ("sparse-x", lambda c: c.all_reduce(x4(3)), lambda c: c.all_reduce(x4(3).to_sparse()), True),
    ("dtype-out", lambda c: c.all_reduce(x4(3), out=torch.empty(3)),
     lambda c: c.all_reduce(x4(3), out=torch.empty(3, dtype=torch.float64)), True),
    ("shape-out", lambda c: c.all_gather(x4(2, 3)), lambda c: c.all_gather(x4(2, 3), out=torch.empty(2 * W, 4)), True),
    ("shape-out-same-numel", lambda c: c.all_gather(x4(2, 3)),
     lambda c: c.all_gather(x4(2, 3), out=torch.empty(2 * W * 3)), True),
    ("not-tensor-out", lambda c: c.all_gather(x4(2)), lambda c: c.all_gather(x4(2), out="out"), True),
    ("overlap-gather", lambda c: c.all_gather(x4(2)),
     lambda c: (lambda buf: c.all_gather(buf[:2], out=buf))(x4(2 * W)), True),
    ("overlap-gather-tail", lambda c: c.all_gather(x4(2)),
     lambda c: (lambda buf: c.all_gather(buf[-2:], out=buf))(x4(2 * W)), True),
    ("overlap-a2a-inplace", lambda c: c.all_to_all(x4(W)), lambda c: (lambda b: c.all_to_all(b, out=b))(x4(W)), True),
    ("overlap-rs-partial", lambda c: c.reduce_scatter(x4(W)),
     lambda c: (lambda buf: c.reduce_scatter(buf, out=buf[W - 1:W]))(x4(W)), True),
    ("overlap-ar-shifted", lambda c: c.all_reduce(x4(4)),
     lambda c: (lambda buf: c.all_reduce(buf[:4], out=buf[1:5]))(x4(5)), True),
    ("splits-bools", lambda c: c.reduce_scatter_v(x4(3), [1, 1, 1]),
     lambda c: c.reduce_scatter_v(x4(3), [True, True, True]), False),
    ("splits-floats", lambda c: c.all_to_all_v(x4(3), [1, 1, 1], [1, 1, 1]),
     lambda c: c.all_to_all_v(x4(3), [1.0, 1.0, 1.0], [1, 1, 1]), False),
    ("root-bool", lambda c: c.broadcast(x4(3), 1), lambda c: c.broadcast(x4(3), True), False),
    ("op-avg", lambda c: c.all_reduce(x4(3)), lambda c: c.all_reduce(x4(3), "avg"), False),
    ("op-for-copy", lambda c: c.all_gather(x4(2)), lambda c: c.run(ALL_GATHER, x4(2), op="sum"), False),
]


def error_of(call) -> PurlinError:
    with pytest.raises(PurlinError) as info:
        call()
    return info.value


@pytest.mark.parametrize("good,bad,cached", [b[1:] for b in BAD_AFTER_GOOD], ids=[b[0] for b in BAD_AFTER_GOOD])
def test_a_bad_call_after_a_good_one_raises_what_a_first_call_raises(good, bad, cached):
    def fn(comm):
        cold = error_of(lambda: bad(comm))
        good(comm)
        before = hits(comm)
        warm = error_of(lambda: bad(comm))
        assert (type(warm), str(warm)) == (type(cold), str(cold))
        assert hits(comm) - before == (1 if cached else 0)
        good(comm)  # and the entry still serves good calls
        assert hits(comm) - before == (2 if cached else 1)
        return good_call(comm)

    assert ps.run_virtual(W, fn, config=CFG) == [True] * W


def test_closed_communicator_raises_on_a_call_that_was_cached():
    def fn(comm):
        x = x4(3)
        comm.all_reduce(x)
        comm.close()
        with pytest.raises(PurlinClosedError, match="^all_reduce: the communicator is closed"):
            comm.all_reduce(x)
        assert comm.cache_info().calls == 0
        return True

    assert ps.run_virtual(W, fn, config=CFG) == [True] * W


def test_broken_communicator_raises_on_a_cache_hit():
    def fn(comm):
        x = x4(3)
        comm.all_reduce(x)
        before = hits(comm)
        comm._engine.mark_broken("test: broken on purpose")
        with pytest.raises(PurlinBrokenError, match="^all_reduce: the communicator is broken.*on purpose"):
            comm.all_reduce(x)
        return hits(comm) - before

    assert ps.run_virtual(W, fn, config=CFG) == [1] * W


class RecordingEngine:
    """Stands in for CudaEngine under a Communicator: records each call, can report a recorded timeout."""

    name = "cuda"
    packets = False
    table_bytes = 0

    def __init__(self):
        self.broken, self.calls, self.timeout = None, [], None

    def execute(self, sched, ctx) -> None:
        self.calls.append((sched, ctx))

    def recorded_error(self):
        return PurlinTimeoutError(self.timeout, op="all_reduce", rank=0, missing=[1]) if self.timeout else None

    def check(self) -> None:
        if self.timeout:
            self.broken = self.broken or self.timeout
            raise self.recorded_error()

    def synchronize(self) -> None:
        self.check()

    def mark_broken(self, reason: str) -> None:
        self.broken = self.broken or reason

    def close(self) -> None:
        pass


def comm_over(engine, world: int = 2, rank: int = 0) -> Communicator:
    """A rank of a virtual CPU world whose engine is replaced (no other rank runs)."""
    assert isinstance(engine, Engine)  # the stand-in keeps the engine contract
    vw = VirtualWorld(world, PurlinConfig(**CFG), torch.device("cpu"))
    comm = Communicator._virtual(vw, rank, "cpu", "host")
    comm._engine.close()
    comm._engine, comm.engine_name = engine, "cuda"
    return comm


def test_recorded_timeout_raises_on_a_cache_hit():
    eng = RecordingEngine()
    comm = comm_over(eng)
    x = x4(8)
    comm.all_reduce(x)
    comm.all_reduce(x)
    before = hits(comm)
    eng.timeout = "all_reduce: rank 0 waited 10s at op #3 (notify wait)"
    with pytest.raises(PurlinTimeoutError, match="waited 10s"):
        comm.all_reduce(x)
    assert hits(comm) - before == 1 and len(eng.calls) == 2
    comm.close()


def test_a_recorded_error_raised_by_synchronize_releases_a_process_groups_memory_at_once(monkeypatch):
    class RecordedWhileWaiting(RecordingEngine):
        """The kernel records its timeout while synchronize() waits for the stream (not before)."""

        def synchronize(self) -> None:
            self.timeout = "all_reduce: rank 0 waited 10s at op #1 (notify wait)"
            self.check()

    eng = RecordedWhileWaiting()
    comm = comm_over(eng)
    comm.group = "a process group"  # a broken communicator of a process group releases its memory (closes)
    closed = []
    monkeypatch.setattr(comm, "close", lambda: closed.append(True))
    comm.all_reduce(x4(8))
    with pytest.raises(PurlinTimeoutError, match="waited 10s"):
        comm.synchronize()
    assert closed == [True] and eng.broken  # at once, not at the next call


def test_cached_calls_hand_the_engine_the_same_schedule_fingerprint_and_fresh_sequence():
    eng = RecordingEngine()
    comm = comm_over(eng, world=4, rank=1)
    x, out = x4(16, dtype=bf16), torch.empty(16, dtype=bf16)
    comm.all_reduce(x, out=out)
    comm.all_reduce(x, out=out)
    comm.all_reduce(x.clone())
    (s1, c1), (s2, c2), (s3, c3) = eng.calls
    assert s1 is s2 is s3 and c1.fingerprint == c2.fingerprint == c3.fingerprint
    assert (c1.seq, c2.seq, c3.seq) == (1, 2, 3) and c3.op == "all_reduce" and c3.dtype is bf16
    assert c2.x is x and c2.y is out and c3.y.shape == (16,) and c3.y.dtype is bf16
    assert c2._inp is None and c2._out is None  # no byte views made for a CUDA-style engine
    comm.all_reduce(x4(8), out=torch.empty(8))  # f32, the same bytes: the same schedule, its own fingerprint
    assert eng.calls[-1][0] is s1 and eng.calls[-1][1].fingerprint != c1.fingerprint
    comm.close()


# -- bounded ----------------------------------------------------------------------------------------
def test_the_cache_is_bounded_and_drops_the_oldest_first(monkeypatch):
    monkeypatch.setattr(Communicator, "CALL_CACHE_SIZE", 4)

    def fn(comm):
        assert comm.cache_info().maxsize == 4
        r = comm.rank
        for rows in range(1, 11):
            xs = inputs(rows, lambda p: (rows, 2), f32, world=2)
            assert_bits_equal(comm.all_reduce(xs[r]), all_reduce(xs, r), f"rows {rows}")
        assert comm.cache_info().calls == 4 and misses(comm) == 10
        for rows in (7, 8, 9, 10):  # the newest four: cached
            comm.all_reduce(x4(rows, 2))
        assert misses(comm) == 10
        comm.all_reduce(x4(1, 2))  # the oldest: dropped
        assert misses(comm) == 11 and comm.cache_info().calls == 4
        return True

    assert ps.run_virtual(2, fn, config=CFG) == [True, True]


def test_the_default_bound_holds():
    def fn(comm):
        limit = comm.CALL_CACHE_SIZE
        assert 16 <= limit <= 4096
        for rows in range(1, limit + 40):
            comm.all_gather(torch.zeros(rows, dtype=torch.int8))
        return comm.cache_info().calls, limit

    ((size, limit),) = ps.run_virtual(1, fn, config=CFG)
    assert size == limit


# -- CudaEngine.execute on a fake native library ----------------------------------------------------------
class FakeNativeLibrary:
    """snac_execute records the parameter struct it was given and returns ``code``."""

    def __init__(self, params, code=0):
        self.params, self.code, self.launches = params, code, []

    def snac_execute(self, pref, stream) -> int:
        return self._record(self.params, stream, "execute")

    def snac_launch(self, addr, inp, out, seq, stream) -> int:
        """What the module's snac_launch does (native/python/module.cpp), on a struct in CPU memory."""
        p = native.SnacParams.from_address(addr)
        p.input, p.output, p.desc_seq = inp, out, seq
        return self._record(p, stream, "launch")

    def _record(self, p, stream, how) -> int:
        self.launches.append(dict(ops=p.ops, n_ops=p.n_ops, n_updates=p.n_updates, tag=p.tag, input=p.input,
                                  output=p.output, dtype=p.dtype, stream=stream, packets=p.packets,
                                  desc_seq=p.desc_seq, desc_fp=p.desc_fp, desc_info=p.desc_info,
                                  rank=p.rank, world=p.world, how=how))
        return self.code

    def copy_atom(self, dst_ptr, src_ptr, nbytes, stream, max_blocks=0, device=-1) -> None:
        ctypes.memmove(dst_ptr, src_ptr, nbytes)  # tables live in CPU memory here

    def error_string(self, code: int) -> str:
        return f"fake CUDA error {code}"


def cuda_engine_on_cpu(world: int, rank: int) -> cuda_mod.CudaEngine:
    """A real CudaEngine whose tables live in CPU memory and whose library is fake (its __init__ needs a GPU)."""
    e = cuda_mod.CudaEngine.__new__(cuda_mod.CudaEngine)
    e.ws, e.rank, e.world, e.timeout_s, e.blocks = None, rank, world, 10.0, 16
    e.device, e.dlayout = torch.device("cuda", 0), DeviceLayout(world, CFG["staging_bytes"])
    e._arena = cuda_mod._Arena(torch.device("cpu"), 1 << 14)
    e._err = torch.zeros(cuda_mod.HOST_ERROR_WORDS, dtype=torch.int64).numpy()
    e._params = native.SnacParams()
    e._params.rank, e._params.world = rank, world
    e._pref = ctypes.byref(e._params)
    e.lib = FakeNativeLibrary(e._params)
    e._by_id, e._by_key, e._names = {}, {}, []
    e._index, e._stream, e._stream_handle, e.broken = 0, None, None, None
    return e


class FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


def test_cuda_execute_fills_the_parameters_and_launches_on_the_current_stream(monkeypatch):
    current = {"handle": 0x1000}
    looked_up = []

    def current_stream(device=None):
        looked_up.append(device)
        return FakeStream(current["handle"])

    monkeypatch.setattr(cuda_mod, "_current_raw_stream", lambda index: current["handle"])
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    rec = RecordingEngine()
    comm = comm_over(rec, world=4, rank=2)
    x, out = x4(64, dtype=bf16), torch.empty(64, dtype=bf16)
    comm.all_reduce(x, out=out)
    xg = x4(8, dtype=torch.int32)
    comm.all_gather(xg)
    (s_red, c_red), (s_cp, c_cp) = rec.calls
    eng = cuda_engine_on_cpu(4, 2)

    eng.execute(s_red, c_red)
    eng.execute(s_red, c_red)
    current["handle"] = 0x2000
    eng.execute(s_cp, c_cp)
    l1, l2, l3 = eng.lib.launches
    table = eng._by_id[id(s_red)][1]
    assert l1 == l2 and l1["ops"] == table.data_ptr() and l1["n_ops"] == eng._by_id[id(s_red)][2] > 0
    assert (l1["input"], l1["output"], l1["stream"]) == (x.data_ptr(), out.data_ptr(), 0x1000)
    assert l1["dtype"] == native.reduce_dtype_code(bf16) != 0
    want = cuda_mod.encode(s_red, eng.dlayout).words  # the table reached the arena through its pinned mirror
    assert table.numel() == want.size and torch.equal(table, torch.from_numpy(want))
    assert (l3["input"], l3["output"], l3["stream"], l3["dtype"]) == (xg.data_ptr(), c_cp.y.data_ptr(), 0x2000, 0)
    assert l3["ops"] != l1["ops"] and l3["tag"] != l1["tag"]
    assert len(looked_up) == 2 and eng._stream.cuda_stream == 0x2000  # a Stream object per new stream only
    assert c_red._inp is None and c_red._out is None

    eng.lib.code = 700
    with pytest.raises(PurlinCudaError, match="^all_gather: kernel launch failed: fake CUDA error 700"):
        eng.execute(s_cp, c_cp)
    with pytest.raises(PurlinBrokenError, match="^all_reduce: the communicator is broken"):
        eng.execute(s_red, c_red)
    assert len(eng.lib.launches) == 4
    comm.close()


def test_cuda_execute_raises_a_recorded_timeout_before_launching(monkeypatch):
    monkeypatch.setattr(cuda_mod, "_current_raw_stream", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    rec = RecordingEngine()
    comm = comm_over(rec, world=2, rank=0)
    comm.all_reduce(x4(4))
    sched, ctx = rec.calls[0]
    eng = cuda_engine_on_cpu(2, 0)
    eng.execute(sched, ctx)
    eng._names[0] = "all_reduce"
    # flag, op #3, notify wait, peer 1, item 0, rank 0, target 5, saw 4, tag 0
    eng._err[:9] = [1, 3, 0, 1, 0, 0, 5, 4, 0]
    with pytest.raises(PurlinTimeoutError, match="^all_reduce: rank 0 waited 10s at op #3 \\(notify wait\\)"):
        eng.execute(sched, ctx)
    assert len(eng.lib.launches) == 1 and eng.broken
    comm.close()


def fake_cuda_queries(monkeypatch, current: dict) -> None:
    monkeypatch.setattr(cuda_mod, "_current_raw_stream", lambda index: current["handle"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(current["handle"]))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


SHAPE_FIELDS = ("ops", "n_ops", "n_updates", "tag", "dtype", "packets", "desc_fp", "desc_info", "rank", "world")


def test_a_call_shape_seen_before_launches_through_one_native_call(monkeypatch):
    """The steady state of an eager call: its first call runs execute() and the engine binds the shape
    (a parameter struct of its own); later calls of that shape pass their pointers, call number and
    stream to one native call (the module's snac_launch), with the same table, dtype and description."""
    current = {"handle": 0x1000}
    fake_cuda_queries(monkeypatch, current)
    eng = cuda_engine_on_cpu(2, 1)
    eng.call_check = True  # the call description is part of the bound struct
    comm = comm_over(eng, world=2, rank=1)
    x, out = x4(64, dtype=bf16), torch.empty(64, dtype=bf16)
    assert comm.all_reduce(x, out=out) is out  # the full path: execute(), then bind
    assert comm.all_reduce(x, out=out) is out  # a hit: launch()
    current["handle"] = 0x2000
    y = comm.all_reduce(x)  # a hit, a new output
    first, again, fresh = eng.lib.launches
    assert [r["how"] for r in (first, again, fresh)] == ["execute", "launch", "launch"]
    assert all(again[k] == first[k] == fresh[k] for k in SHAPE_FIELDS), (first, again)
    assert first["n_ops"] > 0 and first["dtype"] == native.reduce_dtype_code(bf16) and first["world"] == 2
    assert [r["desc_seq"] for r in (first, again, fresh)] == [1, 2, 3]  # the call numbers
    assert (again["input"], again["output"], again["stream"]) == (x.data_ptr(), out.data_ptr(), 0x1000)
    assert y.shape == x.shape and y.dtype == bf16 and y.is_contiguous() and y.data_ptr() not in (0, out.data_ptr())
    assert (fresh["input"], fresh["output"], fresh["stream"]) == (x.data_ptr(), y.data_ptr(), 0x2000)
    assert eng._stream.cuda_stream == 0x2000  # synchronize() waits on the stream of the last launch
    assert eng._params.desc_seq == 1  # the bound struct is the shape's own: execute()'s is untouched

    xg = x4(8, dtype=torch.int32)  # another shape binds its own struct (copy-only: dtype 0)
    comm.all_gather(xg)
    comm.all_gather(xg)
    g1, g2 = eng.lib.launches[3:]
    assert (g1["how"], g2["how"]) == ("execute", "launch") and g2["ops"] == g1["ops"] != first["ops"]
    assert g2["dtype"] == 0 and g2["desc_seq"] == 5

    eng.lib.code = 700  # a failed launch breaks the engine and names the call
    with pytest.raises(PurlinCudaError, match="^all_reduce: kernel launch failed: fake CUDA error 700"):
        comm.all_reduce(x, out=out)
    with pytest.raises(PurlinBrokenError, match="^all_reduce: the communicator is broken"):
        comm.all_reduce(x, out=out)
    assert len(eng.lib.launches) == 6


def test_a_hybrid_call_launches_its_parts_in_order_and_binds_one_struct_per_part(monkeypatch):
    """all_to_all_v on an engine with packets runs hybrid: its packet part, then, where this rank has a
    pair past tuning.packet_max_bytes, its staged part; both through execute() on the first call of a
    shape, both through the bound structs (one per part, same tables) after it, on one stream."""
    fake_cuda_queries(monkeypatch, {"handle": 0x3000})
    eng = cuda_engine_on_cpu(2, 0)
    comm = comm_over(eng, world=2, rank=0)
    comm._path.packets = True  # comm_over's call path was made for the CPU engine
    big = (1 << 17) // 16  # rows of 16 bytes: a 128 KiB slice, past the 64 KiB pair limit
    x, out = torch.randn(big + 1, 4), torch.empty(2, 4)
    assert comm.all_to_all_v(x, [1, big], [1, 1], out=out) is out  # rank 0 sends rank 1 a large slice
    assert comm.all_to_all_v(x, [1, big], [1, 1], out=out) is out
    first, second = eng.lib.launches[:2], eng.lib.launches[2:4]
    assert [(r["how"], r["packets"]) for r in first + second] == [
        ("execute", 1), ("execute", 0), ("launch", 1), ("launch", 0)]
    for a, b in zip(first, second):
        assert all(a[k] == b[k] for k in SHAPE_FIELDS) and a["n_ops"] > 0
        assert (b["input"], b["output"], b["stream"]) == (x.data_ptr(), out.data_ptr(), 0x3000)
    assert [r["desc_seq"] for r in second] == [2, 2] and first[0]["ops"] != first[1]["ops"]
    small = torch.randn(3, 4)
    comm.all_to_all_v(small, [1, 2], [1, 1])  # every pair small: the packet kernel alone
    assert [(r["how"], r["packets"]) for r in eng.lib.launches[4:]] == [("execute", 1)]
    assert comm.algorithm("all_to_all_v", 1 << 30) == "hybrid"
    comm.close()


def test_a_bound_call_raises_a_recorded_timeout_before_launching(monkeypatch):
    fake_cuda_queries(monkeypatch, {"handle": 0})
    eng = cuda_engine_on_cpu(2, 0)
    comm = comm_over(eng, world=2, rank=0)
    x = x4(4)
    comm.all_reduce(x)
    comm.all_reduce(x)
    assert [r["how"] for r in eng.lib.launches] == ["execute", "launch"]
    eng._err[:9] = [1, 3, 0, 1, 0, 0, 5, 4, 0]  # flag, op #3, notify wait, peer 1, item 0, rank 0, target 5, saw 4
    with pytest.raises(PurlinTimeoutError, match="^all_reduce: rank 0 waited 10s at op #3 \\(notify wait\\)"):
        comm.all_reduce(x)
    assert len(eng.lib.launches) == 2 and eng.broken
    with pytest.raises(PurlinBrokenError, match="^all_reduce: the communicator is broken .*waited 10s"):
        comm.all_reduce(x)  # and again: the recorded timeout raised once, the communicator broken since
    assert len(eng.lib.launches) == 2


def test_a_launch_gate_sees_every_call_so_nothing_is_bound(monkeypatch):
    """Loopback virtual ranks (CUDA, world > 1) pass every eager call through the launch gate, which
    needs the call's context: their calls keep running execute(). Engines without bind() (the CPU
    engine) do too."""
    fake_cuda_queries(monkeypatch, {"handle": 0})

    class Gate:
        def __init__(self):
            self.seen = []

        def execute(self, rank, ctx, launch):
            self.seen.append(ctx.seq)
            launch()

    eng = cuda_engine_on_cpu(2, 0)
    comm = comm_over(eng, world=2, rank=0)
    comm._gate = gate = Gate()
    x = x4(16)
    for _ in range(3):
        comm.all_reduce(x)
    assert [r["how"] for r in eng.lib.launches] == ["execute"] * 3 and gate.seen == [1, 2, 3]
    assert [c.launch for c in comm._path.calls.values()] == [False]
    comm._gate = None

    def on_cpu(c):
        c.all_reduce(x4(16))
        c.all_reduce(x4(16))
        return [call.launch for call in c._path.calls.values()]

    assert ps.run_virtual(2, on_cpu, config=CFG) == [[False], [False]]


def test_the_stream_lookup_is_torchs_raw_query():
    # torch 2.11-2.14 have it (compiled code calls it); the fallback keeps other builds working
    if hasattr(torch._C, "_cuda_getCurrentRawStream"):
        assert cuda_mod._current_raw_stream is torch._C._cuda_getCurrentRawStream
    else:
        assert cuda_mod._current_raw_stream is cuda_mod._torch_current_stream


def test_v_forms_whose_sizes_every_rank_knows_take_packets_with_the_sizes_in_their_fingerprint():
    """On an engine with packets, all_gather_v and reduce_scatter_v choose the packet protocol from the
    group's largest push (the same on every rank, whatever this rank's own rows), and their fingerprint
    carries every rank's sizes: ranks that disagree on ``sizes`` get different fingerprints (their
    packets' signatures differ, so the device call check reports it). all_to_all_v runs hybrid (each pair
    by its own size), whose fingerprint carries no sizes: its ranks' sizes differ legitimately."""
    from purlin_sglang.calls import CallPath
    from purlin_sglang.collectives import CATALOG

    cfg = PurlinConfig.from_dict(CFG)
    cpu = torch.device("cpu")
    paths = [CallPath(r, 2, cpu, cfg, packets=True) for r in range(2)]
    agv, rsv, a2av = CATALOG["all_gather_v"], CATALOG["reduce_scatter_v"], CATALOG["all_to_all_v"]

    def prep(path, spec, x, ins, outs):
        return path.prepare(spec, x, None, None if spec.consume.is_copy else "sum", None, ins, outs, None)[0]

    sizes = (0, 5)  # rank 0 gives no row: its own input is empty
    calls = [prep(p, agv, torch.zeros(sizes[p.rank], 4), None, sizes) for p in paths]
    assert [c.sched.plan.algorithm for c in calls] == ["packet", "packet"]
    assert calls[0].fingerprint == calls[1].fingerprint
    other = prep(paths[1], agv, torch.zeros(5, 4), None, (1, 5))  # rank 1 believes rank 0 gives a row
    assert other.fingerprint != calls[1].fingerprint
    calls = [prep(p, rsv, torch.zeros(5, 4), sizes, None) for p in paths]
    assert [c.sched.plan.algorithm for c in calls] == ["packet", "packet"]
    assert calls[0].fingerprint == calls[1].fingerprint != prep(paths[0], rsv, torch.zeros(5, 4), (1, 4), None).fingerprint
    big = (1 << 20) // 16  # rows of 16 bytes: a 1 MiB push, past the window on every rank alike
    assert [prep(p, agv, torch.zeros((big, 0)[p.rank], 4), None, (big, 0)).sched.plan.algorithm
            for p in paths] == ["oneshot", "oneshot"]
    a2 = [prep(p, a2av, torch.zeros((2, 9)[p.rank], 4), ((1, 1), (8, 1))[p.rank], ((1, 8), (1, 1))[p.rank])
          for p in paths]
    assert [c.sched.plan.algorithm for c in a2] == ["hybrid", "hybrid"] and a2[0].fingerprint == a2[1].fingerprint
    # the public question (Communicator.algorithm): a V form's nbytes is the group's largest push
    assert [paths[0].algorithm(n, 1024) for n in ("all_gather_v", "reduce_scatter_v", "all_to_all_v")] == [
        "packet", "packet", "hybrid"]
    assert paths[0].algorithm("all_gather_v", 1 << 20) == "oneshot"
    staged = [CallPath(r, 2, cpu, cfg, packets=False) for r in range(2)]  # e.g. the CPU engine
    assert prep(staged[0], agv, torch.zeros(0, 4), None, sizes).sched.plan.algorithm == "oneshot"


def test_pending_error_is_none_where_calls_raise_as_they_run():
    def fn(c):
        before = c.pending_error()
        c.all_reduce(torch.ones(4))
        return before, c.pending_error()

    assert ps.run_virtual(2, fn) == [(None, None), (None, None)]


def test_lost_peers_is_empty_where_no_peer_process_is_watched():
    def fn(c):
        return c.lost_peers()

    assert ps.run_virtual(2, fn) == [{}, {}]
