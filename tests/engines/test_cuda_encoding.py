"""The CUDA engine's op-table encoding (engines/cuda_ops.py), checked without a GPU: a Python model
of the device interpreter (native/snac/interpreter.cuh, one block per rank) runs the encoded tables
of virtual ranks, and every collective must come out bitwise as the torch reference, over several
calls in a row (mirrors and counters carried across calls, as on the device). The model also runs
the device call check (config device_call_check): descriptors pushed at call start, read by stalled
waits, a mismatch recorded in the kernel's record format and raised by the real host decoder."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

import purlin_sglang as ps
import purlin_sglang.engines.cpu as cpu_engine
from purlin_sglang.testing.collectives import (
    COLLECTIVES, PACKET_FORMS, case, check_case, check_case_in_heap, heap_cases, hybrid_cases, packet_cases,
    rooted_packet_cases, v_packet_cases,
)
from purlin_sglang.collectives import ReduceOp
from purlin_sglang import native
from purlin_sglang.engines import cuda as cuda_mod
from purlin_sglang.engines import cuda_ops as co
from purlin_sglang.engines.base import fold32
from purlin_sglang.memory.layout import PACKET_MAX_BYTES, DeviceLayout
from purlin_sglang.snac import Buf

_REDOPS = {1: ReduceOp.SUM, 2: ReduceOp.MAX, 3: ReduceOp.MIN}
_SHARED: dict = {}
_LOCK = threading.Lock()
_RAN: list = []  # (collective, algorithm) of every schedule the model ran
_PARTS: list = []  # the number of kernels of every hybrid call the model ran (1: packet part only)


class _Sim:
    """One rank's interpreter model: int64 words of every rank, staging bytes, packet windows."""

    packets = True  # like the CUDA engine: the planner may choose the packet protocol
    table_bytes = 0

    def __init__(self, ws, rank: int, world: int, timeout_s: float, *, ranks_on_gpu: int | None = None,
                 call_check: bool = False):
        self.rank, self.world, self.broken = rank, world, None
        self.dl = DeviceLayout(world, ws.layout.staging_bytes)
        self.call_check, self._call = call_check, None  # the device call check (native.h desc_off)
        self.desc_reads = 0  # stalled waits that read a peer's descriptor
        self.timeout_s = timeout_s
        with _LOCK:
            if id(ws) not in _SHARED:
                n = self.dl.staging_off // 8
                # staging: the workspace's own bytes (a direct plan reads a peer's input in its heap, their tail)
                _SHARED[id(ws)] = ([np.zeros(n, dtype=np.int64) for _ in range(world)],
                                   [ws.staging_region(r) for r in range(world)])
            self.words, self.stage = _SHARED[id(ws)]
            self.windows = _SHARED.setdefault(("windows", id(ws)), {})  # (owner, parity, producer): [epoch, data, read]

    def mark_broken(self, reason):
        self.broken = reason

    def check(self):
        pass

    def synchronize(self):
        pass

    def close(self):
        pass

    def _buf(self, ref: int, ctx):
        buf, rank, off = _ref_fields(ref)
        base = ctx.inp if buf == co.BUF_CODES[Buf.INPUT] else ctx.out if buf == co.BUF_CODES[Buf.OUTPUT] \
            else self.stage[rank]
        return base, off

    def _span(self, ref, n, ctx):
        base, off = self._buf(ref, ctx)
        return base[off: off + n]

    def _w(self, rank, off, peer, item):
        return self.dl.word(off, peer, item) // 8

    def _reduce(self, o, sub, srcs, ctx):
        """REDUCE / PACKET_REDUCE: rank order, 16-bit floats accumulated in f32 (the atoms' rule)."""
        dt, op = ctx.dtype, _REDOPS[sub]
        acc_dt = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        vals = [v.view(dt).to(acc_dt) for v in srcs]
        acc = vals[0].clone()
        for v in vals[1:]:
            acc = acc + v if op is ReduceOp.SUM else torch.maximum(acc, v) if op is ReduceOp.MAX \
                else torch.minimum(acc, v)
        self._span(o[1], o[2], ctx).view(dt).copy_(acc.to(dt))

    def _push(self, o, e, ctx):
        """PACKET_PUT: the payload, whole, into each consumer's window [parity][me] with epoch e; a
        window is written once per call and never before its reader has read the previous one."""
        assert o[2] <= PACKET_MAX_BYTES, o
        with _LOCK:
            for peer in o[4: 4 + o[3]]:
                key = (peer, e & 1, self.rank)
                old = self.windows.get(key)
                assert old is None or (old[0] != e and old[2]), f"sim rank {self.rank}: window {key} of epoch " \
                    f"{old and old[0]} {'pushed twice' if old and old[0] == e else 'overwritten unread'} (epoch {e})"
                self.windows[key] = [e, self._span(o[1], o[2], ctx).clone(), False]

    # -- the device call check, modelled: the kernel's push_descriptor / desc_mismatch (snac/ops.cuh) --
    def _push_descriptor(self, ctx):
        seq, fp, info = ctx.seq, fold32(ctx.fingerprint), ctx.info
        self._call = (ctx.op, seq, fp, info)
        at = self.dl.desc(self.rank, seq) // 8
        for peer in range(self.world):
            if peer != self.rank:  # words 1, 2, then 0, each seq << 32 | payload (no order is relied on)
                self.words[peer][at + 1] = _desc_word(seq, info)
                self.words[peer][at + 2] = _desc_word(seq, info >> 32)
                self.words[peer][at] = _desc_word(seq, fp)

    def _desc_load(self, peer):
        """desc_load: word 0 of ``peer``'s slot for this call in my workspace (0: the check is off)."""
        if not self.call_check or peer == self.rank:
            return 0
        self.desc_reads += 1
        return int(self.words[self.rank][self.dl.desc(peer, self._call[1]) // 8])

    def _stalled(self, peer, t0, what, seen):
        """A wait on ``peer`` that has not completed: past 10 ms (the kernel's 20 us, scaled to threads)
        the peer's descriptor is read again and compared (_differs); past 20 s a model timeout. Returns
        the latest descriptor word seen."""
        dt = time.monotonic() - t0
        if self.call_check and peer != self.rank and dt > 0.01:
            seen = self._desc_load(peer)
            self._differs(peer, seen)
        if dt > 20:
            raise TimeoutError(f"sim rank {self.rank}: {what}")
        return seen

    def _differs(self, peer, theirs):
        """desc_differs: ``theirs`` of this call number with another fingerprint is a mismatch, recorded as
        the kernel records it and raised by the real host decoder (CudaEngine._raise_recorded)."""
        if self.call_check and peer != self.rank:
            op, seq, fp, info = self._call
            at = self.dl.desc(peer, seq) // 8
            mine = _desc_word(seq, fp)
            if theirs >> 32 == mine >> 32 and theirs != mine:
                lo, hi = int(self.words[self.rank][at + 1]), int(self.words[self.rank][at + 2])
                err = np.zeros(native.SNAC_ERROR_WORDS, dtype=np.int64)
                f = {n: i for i, n in enumerate(native.SNAC_ERROR_FIELDS)}
                err[[f["op"], f["kind"], f["peer"], f["rank"], f["target"], f["seen"], f["tag"]]] = [
                    0, co.NOTIFY, peer, self.rank, mine, theirs, 0]
                err[f["peer_info_lo"]] = lo if lo >> 32 == mine >> 32 else 0
                err[f["peer_info_hi"]] = hi if hi >> 32 == mine >> 32 else 0
                err[f["my_info"]] = info
                err[f["code"]] = native.SNAC_ERROR_CODES["MISMATCH"]
                host = cuda_mod.CudaEngine.__new__(cuda_mod.CudaEngine)
                host._err, host._names, host.broken, host.timeout_s = err, [op], None, self.timeout_s
                self.broken = "mismatch"
                host._raise_recorded()

    def _packets(self, ref, e, n, ctx):
        """A packet op's source: a window (wait for its producer's packets of epoch e), else a direct span."""
        buf, producer, off = _ref_fields(ref)
        if buf != co.BUF_CODES[Buf.WINDOW]:
            return self._span(ref, n, ctx)
        key, t0 = (self.rank, e & 1, producer), time.monotonic()
        seen = first = self._desc_load(key[2])  # loaded with the first packets (packet.cuh)
        while self.windows.get(key, (0,))[0] != e:
            seen = self._stalled(key[2], t0, f"no packets {key} of epoch {e}", seen)
            time.sleep(0)
        self._differs(key[2], first)  # the kernel compares the word loaded with the first packets
        win = self.windows[key]
        assert win[1].numel() == n and off == 0, (win[1].numel(), n, ref)
        win[2] = True
        return win[1]

    def _wait(self, rank_words, idx, target, peer, in_call=True):
        """wait_ge: in a wait for the peer's signal of this call, its descriptor is loaded as the wait
        begins, read again while it stalls, and the latest word compared once it completes."""
        t0 = time.monotonic()
        seen = self._desc_load(peer) if in_call else 0
        while rank_words[idx] < target:
            seen = self._stalled(peer, t0, f"word {idx} < {target}", seen)
            time.sleep(0)
        if in_call:
            self._differs(peer, seen)

    def execute(self, sched, ctx):
        _RAN.append((sched.plan.spec.name, sched.plan.algorithm))
        if sched.parts:
            _PARTS.append(len(sched.parts))
        for part in sched.parts or (sched,):  # a hybrid schedule: one kernel per part, in order
            self._kernel(part, ctx)

    def _kernel(self, sched, ctx):
        enc = co.encode(sched, self.dl)
        me, W, dl = self.rank, self.words, self.dl
        mine = W[me]
        start = mine.copy()  # mirrors as read at kernel start
        packet_call = False
        if self.call_check:
            self._push_descriptor(ctx)
        for i in range(enc.n_ops):
            o = [int(v) for v in enc.words[i * co.OP_WORDS: (i + 1) * co.OP_WORDS]]
            # word 0's fields through the ABI's constants, as snac/ops.cuh decodes them
            code = o[0] & co.OPCODE_MASK
            sub, nsrc = (o[0] >> co.SUB_SHIFT) & co.SUB_MASK, (o[0] >> co.NSRC_SHIFT) & co.NSRC_MASK
            if code == co.COPY:
                self._span(o[1], o[3], ctx).copy_(self._span(o[2], o[3], ctx))
            elif code == co.REDUCE:
                self._reduce(o, sub, [self._span(src, o[2], ctx) for src in o[3: 3 + nsrc]], ctx)
            elif code == co.SIGNAL:
                peer, item, k = o[1], o[2], o[4]
                if sub == co.NOTIFY:
                    W[peer][self._w(peer, dl.notify_off, me, item)] = start[self._w(me, dl.sent_off, peer, item)] + k
                else:
                    W[peer][self._w(peer, dl.ack_off, me, item)] = start[self._w(me, dl.acked_off, peer, item)] + k
            elif code == co.WAIT:
                peer, item, k = o[1], o[2], o[3]
                if sub == co.NOTIFY:
                    self._wait(mine, self._w(me, dl.notify_off, peer, item),
                               start[self._w(me, dl.expect_off, peer, item)] + k, peer)
                else:
                    self._wait(mine, self._w(me, dl.ack_off, peer, item),
                               start[self._w(me, dl.sent_off, peer, item)] + k, peer)
            elif code in (co.PACKET_PUT, co.PACKET_REDUCE, co.PACKET_COPY):
                e = int(start[dl.epoch_off // 8]) + 1  # the model runs one block: block 0's epoch word
                packet_call = True
                if code == co.PACKET_PUT:
                    self._push(o, e, ctx)
                elif code == co.PACKET_COPY:  # dst ref, bytes, src ref (a window or my own input)
                    self._span(o[1], o[2], ctx).copy_(self._packets(o[3], e, o[2], ctx))
                else:
                    self._reduce(o, sub, [self._packets(src, e, o[2], ctx) for src in o[3: 3 + nsrc]], ctx)
            elif code == co.DRAINALL:
                for peer in range(self.world):
                    for item in range(o[1]):
                        if peer != me:
                            self._wait(mine, self._w(me, dl.ack_off, peer, item),
                                       start[self._w(me, dl.sent_off, peer, item)], peer, in_call=False)
        if packet_call:  # each block bumps its own epoch word at its exit
            mine[dl.epoch_off // 8] += 1
        up = enc.words[enc.n_ops * co.OP_WORDS:]
        for j in range(enc.n_updates):
            mine[int(up[2 * j]) // 8] += int(up[2 * j + 1])


def _ref_fields(ref: int) -> tuple[int, int, int]:
    """(buf, rank, byte offset) of a buffer reference, as snac/ops.cuh's ref_buf / ref_rank / ref_offset."""
    u = ref & ((1 << 64) - 1)
    return (u >> co.REF_BUF_SHIFT, (u >> co.REF_RANK_SHIFT) & ((1 << co.REF_RANK_BITS) - 1),
            u & ((1 << co.REF_OFFSET_BITS) - 1))


def _desc_word(seq: int, payload: int) -> int:
    """native/snac/ops.cuh desc_word: (seq mod 2^32) << 32 | (payload mod 2^32), as an int64."""
    v = ((seq & 0xFFFFFFFF) << 32) | (payload & 0xFFFFFFFF)
    return v - (1 << 64) if v >= 1 << 63 else v


def _run_seeded(world: int, fn, cfg: dict, seed: int) -> list:
    """``run_virtual`` of ``fn`` on the model, its records cleared first; a failed check names ``seed``."""
    _RAN.clear()
    _PARTS.clear()
    try:
        return ps.run_virtual(world, fn, config=cfg)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from e


def _cases_fn(cases, paths):
    return lambda comm: [check_case(comm, c, paths=paths) for c in cases]


@pytest.fixture
def sim(monkeypatch):
    monkeypatch.setattr(cpu_engine, "CpuEngine", _Sim)  # what engines.create("cpu", ...) builds
    yield
    _SHARED.clear()


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("algorithm", ["auto", "packet", "oneshot", "twoshot"])
def test_encoded_tables_compute_every_collective(sim, world, algorithm):
    cfg = {"staging_bytes": 4096, "timeout_s": 20, "tuning": {"algorithm": algorithm}}
    cases = [case(coll, torch.float32, rows=rows, width=37, seed=world, root=world - 1, salt=world)
             for coll in COLLECTIVES for rows in (1, 9)]
    cases.append(case("all_reduce", torch.bfloat16, rows=40, width=33, op="max", seed=2))
    _run_seeded(world, _cases_fn(cases, ("out", "inplace")), cfg, world)
    if algorithm in ("auto", "packet"):  # small all_reduces take the packet protocol
        assert ("all_reduce", "packet") in _RAN, set(_RAN)


SEED = int.from_bytes(os.urandom(3), "little")  # fresh inputs every run; named in failure messages


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("algorithm", ["packet", "auto"])
def test_packet_tables_compute_every_fixed_size_collective(sim, world, algorithm):
    """The encoded packet tables (PACKET_PUT / PACKET_COPY / PACKET_REDUCE) of every collective with a
    packet form (all_gather_v and reduce_scatter_v with empty slices among them), bitwise the torch
    reference, out= and in place, interleaved with staged calls; the rooted ones (broadcast in place
    included) take packets too, and all_to_all_v runs hybrid (its pairs of at most a window: packets)."""
    # auto: a full window takes packets too (packet_max_bytes raised to the window), payloads past it stage
    cfg = {"staging_bytes": 1 << 16, "timeout_s": 20,
           "tuning": {"algorithm": algorithm, "packet_max_bytes": PACKET_MAX_BYTES}}
    cases = packet_cases(SEED + world, large=algorithm == "auto")
    _run_seeded(world, _cases_fn(cases, ("out", "inplace")), cfg, SEED + world)
    ran = {}
    for name, alg in _RAN:
        ran.setdefault(name, set()).add(alg)
    want = {coll: {"packet"} if coll in PACKET_FORMS else {"hybrid"} for coll in COLLECTIVES}
    if algorithm == "auto":
        want["all_reduce"].add("twoshot")
        want["all_gather"].add("oneshot")
    assert ran == want


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_rooted_packet_tables_back_to_back_with_the_root_moving(sim, world):
    """Broadcast (out= and in place), gather, reduce and scatter under auto take packets: the silent
    pairs exchange one empty packet each call, so calls back to back with a new root each time (0-byte
    calls among them) and packet all_reduces in between are bitwise the torch reference."""
    cfg = {"staging_bytes": 1 << 16, "timeout_s": 20}
    cases = rooted_packet_cases(SEED + world, world)
    _run_seeded(world, _cases_fn(cases, ("out", "inplace")), cfg, SEED + world)
    assert set(_RAN) == {(c, "packet") for c in ("broadcast", "gather", "reduce", "scatter", "all_reduce")}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("raised", [False, True])
def test_v_packet_tables_with_empty_slices(sim, world, raised):
    """all_gather_v and reduce_scatter_v take packets under auto: empty slices travel as one empty
    packet each way, calls empty on every rank run no op, a 252 KiB push takes packets only with
    packet_max_bytes raised to the window (else it stages); bitwise the torch reference, with a fixed
    packet all_reduce and a staged all_to_all_v in between."""
    tuning = {"packet_max_bytes": PACKET_MAX_BYTES} if raised else {}
    cfg = {"staging_bytes": 1 << 16, "timeout_s": 20, "tuning": tuning}
    cases = v_packet_cases(SEED + world)
    _run_seeded(world, _cases_fn(cases, ("out",)), cfg, SEED + world)
    ran = {}
    for name, alg in _RAN:
        ran.setdefault(name, set()).add(alg)
    v = {"packet"} if raised else {"packet", "oneshot"}
    assert ran == {"all_gather_v": v, "reduce_scatter_v": v, "all_reduce": {"packet"}, "all_to_all_v": {"hybrid"}}


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_hybrid_all_to_all_v_tables(sim, world):
    """all_to_all_v under auto runs hybrid: each pair of at most packet_max_bytes (200 here) as packets,
    each larger one through a one-shot of those pairs (its pair exchanging one empty packet); pairs on
    both sides of the limit in one call, calls all small (the packet kernel alone on every rank), all
    large, empty on every rank, between a packet all_reduce and a staged all_gather: bitwise the torch
    reference, through out= and a new output."""
    cfg = {"staging_bytes": 1 << 16, "timeout_s": 20, "tuning": {"packet_max_bytes": 200}}
    cases = hybrid_cases(SEED + world)
    _run_seeded(world, _cases_fn(cases, ("out", "default")), cfg, SEED + world)
    assert {alg for name, alg in _RAN if name == "all_to_all_v"} == {"hybrid"}
    assert {alg for name, alg in _RAN if name != "all_to_all_v"} == {"packet", "oneshot"}
    assert set(_PARTS) == {1, 2}, _PARTS  # calls with and without a staged part on some rank


def test_packet_epochs_alternate_windows_over_many_calls(sim):
    """Back-to-back packet all_reduces with new inputs each call: epochs advance, windows alternate."""
    import torch

    def fn(comm):
        bad = 0
        for i in range(12):
            x = torch.full((7, 3), float(comm.rank + i), dtype=torch.bfloat16)
            want = torch.full((7, 3), float(sum(range(comm.world_size)) + comm.world_size * i), dtype=torch.bfloat16)
            bad += not torch.equal(comm.all_reduce(x), want)
        return bad

    _RAN.clear()
    assert ps.run_virtual(3, fn, config={"timeout_s": 20}) == [0, 0, 0]
    assert _RAN.count(("all_reduce", "packet")) == 36, _RAN


def test_barriers_guard_own_shard_and_in_place_only_where_needed():
    from purlin_sglang.collectives import ALL_GATHER, ALL_REDUCE
    from purlin_sglang.snac import Sizes, lower, make_plan
    from purlin_sglang.snac.policy import TuningPolicy

    dl = DeviceLayout(4, 1 << 16)
    two = lower(make_plan(ALL_REDUCE, 4, 1, nbytes=4096, staging_bytes=1 << 16,
                          policy=TuningPolicy(algorithm="twoshot")), Sizes((4096,), (4096,)))
    one = lower(make_plan(ALL_REDUCE, 4, 1, nbytes=4096, staging_bytes=1 << 16,
                          policy=TuningPolicy(algorithm="oneshot")), Sizes((4096,), (4096,)))
    ag = lower(make_plan(ALL_GATHER, 4, 1, nbytes=4096, staging_bytes=1 << 16), Sizes((4096,), (4096,) * 4))

    def barriers(s):
        enc = co.encode(s, dl)
        w0 = [int(enc.words[i * co.OP_WORDS]) for i in range(enc.n_ops)]
        return [(w >> 24) & 1 for w in w0 if w & 0xFF == co.BARRIER]

    assert barriers(ag) == []
    assert barriers(one) == [1]  # in place only: the reduce overwrites the input the stage reads
    assert 0 in barriers(two)  # the copy out of my own reduced shard waits for every block's reduce


def test_packet_schedule_encodes_one_put_record_for_every_consumer_and_no_mirror_updates():
    from purlin_sglang.collectives import ALL_REDUCE
    from purlin_sglang.snac import Sizes, lower, make_plan
    from purlin_sglang.snac.policy import TuningPolicy

    dl = DeviceLayout(8, 1 << 16)
    sched = lower(make_plan(ALL_REDUCE, 8, 3, nbytes=8192, staging_bytes=1 << 16,
                            policy=TuningPolicy(algorithm="packet")), Sizes((8190,), (8190,)))
    enc = co.encode(sched, dl)
    recs = [[int(v) for v in enc.words[i * co.OP_WORDS: (i + 1) * co.OP_WORDS]] for i in range(enc.n_ops)]
    assert [r[0] & 0xFF for r in recs] == [co.PACKET_PUT, co.PACKET_REDUCE]
    put, red = recs
    assert put[2] == 8190 and put[3] == 7 and put[4:11] == [4, 5, 6, 7, 0, 1, 2]
    assert (red[0] >> 16) & 0xFF == 8 and red[2] == 8190
    assert [((r & ((1 << 64) - 1)) >> 62, (r >> 48) & 0x3FFF) for r in red[3:11]] == \
        [(3, 0), (3, 1), (3, 2), (0, 3), (3, 4), (3, 5), (3, 6), (3, 7)]  # windows, my own input in rank order
    assert enc.n_updates == 0  # no exit counter: each block bumps its own epoch word


def _records(sched, dl):
    enc = co.encode(sched, dl)
    assert enc.n_updates == 0 and enc.n_barriers == 0  # packets: no mirrors, no barriers
    return [[int(v) for v in enc.words[i * co.OP_WORDS: (i + 1) * co.OP_WORDS]] for i in range(enc.n_ops)]


def _buf_rank(ref: int) -> tuple[int, int, int]:
    u = ref & ((1 << 64) - 1)
    return u >> 62, (u >> 48) & 0x3FFF, u & ((1 << 48) - 1)


def test_packet_copy_records_of_all_gather_and_all_to_all():
    """PACKET_COPY = [9, dst ref, bytes, src ref]: one per producer in rank order, from its window or
    (mine) from my own input; a packed input's pushes share one PACKET_PUT, a sliced one's do not."""
    from purlin_sglang.collectives import ALL_GATHER, ALL_TO_ALL
    from purlin_sglang.snac import Sizes, lower, make_plan
    from purlin_sglang.snac.policy import TuningPolicy

    dl, n, pol = DeviceLayout(4, 1 << 16), 8190, TuningPolicy(algorithm="packet")
    ag = _records(lower(make_plan(ALL_GATHER, 4, 1, staging_bytes=1 << 16, policy=pol),
                        Sizes((n,), (n,) * 4)), dl)
    assert [r[0] for r in ag] == [co.PACKET_PUT] + [co.PACKET_COPY] * 4
    assert ag[0][2:8] == [n, 3, 2, 3, 0, 0] and _buf_rank(ag[0][1]) == (0, 1, 0)
    for p, rec in enumerate(ag[1:]):
        assert rec[2] == n and rec[4:] == [0] * (co.OP_WORDS - 4)
        assert _buf_rank(rec[1]) == (1, 1, p * n)  # OUTPUT slice p
        assert _buf_rank(rec[3]) == ((0, 1, 0) if p == 1 else (3, p, 0))  # my INPUT, else WINDOW p
    a2a = _records(lower(make_plan(ALL_TO_ALL, 4, 1, staging_bytes=1 << 16, policy=pol),
                         Sizes((n,) * 4, (n,) * 4)), dl)
    assert [r[0] for r in a2a] == [co.PACKET_PUT] * 3 + [co.PACKET_COPY] * 4
    assert [(r[3], r[4], _buf_rank(r[1])) for r in a2a[:3]] == [(1, c, (0, 1, c * n)) for c in (2, 3, 0)]
    assert _buf_rank(a2a[4][3]) == (0, 1, n)  # my own slice 1 of my input, into output slice 1
    empty = lower(make_plan(ALL_GATHER, 4, 1, staging_bytes=1 << 16, policy=pol), Sizes((0,), (0,) * 4))
    assert _records(empty, dl) == []  # no packet record: the call leaves the epoch alone on every rank


# -- the device call check (config device_call_check), in the model ----------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_the_call_check_changes_no_result_and_a_late_peer_is_no_mismatch(sim, world):
    """Every collective with the check on, each rank entering each call up to 30 ms late (so its peers'
    waits stall and read its descriptor, which then holds an earlier call, over more calls than the ring
    has slots): bitwise the torch reference, no mismatch."""
    import random

    cfg = {"staging_bytes": 1 << 16, "timeout_s": 20, "device_call_check": True}
    cases = packet_cases(SEED + 7 * world, large=True)
    rng = random.Random(SEED)
    delays = [[rng.random() * 0.03 for _ in cases] for _ in range(world)]

    def fn(comm):
        assert comm._engine.call_check
        for c, d in zip(cases, delays[comm.rank]):
            time.sleep(d)
            check_case(comm, c, paths=("out",))
        return comm._engine._call[1], comm._engine.desc_reads  # the last call number published

    res = _run_seeded(world, fn, cfg, SEED)
    assert [r[0] for r in res] == [len(cases)] * world and len(cases) > 4  # past the ring's 4 slots
    assert sum(r[1] for r in res) > 0  # stalled waits did read descriptors


@pytest.mark.parametrize("late", [None, 0, 1])
def test_ranks_in_different_calls_get_a_mismatch_from_the_device_check(sim, late):
    """A staged all_reduce on rank 0 against a packet all_gather on rank 1 at the same call number:
    each rank's wait stalls, reads the other's descriptor and raises what the host decodes from the
    kernel's record, naming both calls, long before timeout_s."""
    def fn(comm):
        comm.all_reduce(torch.ones(4))  # call #1 agrees
        if comm.rank == late:
            time.sleep(0.1)
        if comm.rank == 0:
            comm.all_reduce(torch.ones(1 << 17))  # 512 KiB: two-shot, staged
        else:
            comm.all_gather(torch.ones(64))  # 256 bytes: packets

    t0 = time.monotonic()
    with pytest.raises(ps.PurlinMismatchError) as info:
        ps.run_virtual(2, fn, config={"staging_bytes": 1 << 16, "timeout_s": 20, "device_call_check": True})
    msg = str(info.value)
    assert time.monotonic() - t0 < 10
    r = info.value.rank
    calls = {0: "all_reduce(dtype=float32, 524288 bytes in)", 1: "all_gather(dtype=float32, 256 bytes in)"}
    assert f"rank {r} and rank {1 - r} entered call #2 with different collectives" in msg, msg
    assert f"rank {r} called {calls[r]}, rank {1 - r} called {calls[1 - r]}" in msg, msg
    assert "seen by rank" in msg and "communicator is now broken" in msg, msg


@pytest.mark.parametrize("late", [0, 1])
@pytest.mark.parametrize("kind", ["dtype", "op", "staged-dtype"])
def test_calls_that_differ_but_complete_are_caught_by_the_rank_that_waits_for_a_published_descriptor(sim, late, kind):
    """Equal bytes through the same plan (the waits complete on both sides, with wrong data): the rank
    entering the call late finds its peer's descriptor already published when its first wait begins,
    and raises once that wait completes. (Ranks entering at the same instant may both miss it: the
    check is best effort there; docs/DESIGN.md.)"""
    n = 1 << 16 if kind == "staged-dtype" else 8  # 256 KiB: one-shot, staged; 32 bytes: packets
    calls = {
        "dtype": (lambda c: c.all_reduce(torch.ones(n)), lambda c: c.all_reduce(torch.ones(2 * n, dtype=torch.bfloat16))),
        "op": (lambda c: c.all_reduce(torch.ones(n)), lambda c: c.all_reduce(torch.ones(n), "max")),
        "staged-dtype": (lambda c: c.all_reduce(torch.ones(n)), lambda c: c.all_reduce(torch.ones(n // 2, dtype=torch.float64))),
    }[kind]

    def fn(comm):
        comm.all_reduce(torch.ones(4))  # call #1 agrees
        if comm.rank == late:
            time.sleep(0.1)
        calls[comm.rank](comm)

    cfg = {"staging_bytes": 1 << 16, "timeout_s": 20, "device_call_check": True,
           "tuning": {"algorithm": "oneshot" if kind == "staged-dtype" else "auto"}}
    with pytest.raises(ps.PurlinMismatchError) as info:
        ps.run_virtual(2, fn, config=cfg)
    assert "entered call #2 with different collectives" in str(info.value), info.value


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("twoshot", [False, True])
def test_direct_tables_read_heap_inputs_in_place(sim, world, twoshot):
    """Every collective with a packet form, its input in the symmetric heap, packets off (so every
    call would run the staged one-shot): the encoded direct tables (a notify, waits, copies or a
    reduce from the peers' heaps as STAGE refs past staging, acks, then a wait for the readers' acks)
    bitwise the torch reference, between staged calls; ``twoshot``: the all_reduces run the direct
    two-shot, in chunks of 64 bytes cycling through the shard's slots."""
    tuning = {"packet_max_bytes": 0, **({"oneshot_max_bytes": 0, "max_chunk_bytes": 64} if twoshot else {})}
    cfg = {"staging_bytes": 1 << 16, "symmetric_bytes": 1 << 20, "timeout_s": 20, "tuning": tuning}
    cases = heap_cases(SEED + world)

    def fn(comm):
        for i, c in enumerate(cases):
            check_case_in_heap(comm, c)
            if i % 5 == 4:
                check_case(comm, case("all_gather", torch.float32, rows=3, width=5, seed=i), paths=("out",))

    _run_seeded(world, fn, cfg, SEED + world)
    assert {"direct", "oneshot"} <= {alg for _, alg in _RAN}
    direct = {name for name, alg in _RAN if alg == "direct"}
    if twoshot:
        assert ("all_reduce", "direct-twoshot") in _RAN and direct == set(PACKET_FORMS) - {"all_reduce"}
    else:
        assert direct == set(PACKET_FORMS)
