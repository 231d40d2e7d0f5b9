"""The CUDA engine's MoE glue (purlin_sglang/moe/cuda.py) on CPU, over a Python model of the kernels
(_kernel_model.py) that reads the same parameter struct: eager exact and capacity layouts, FP8,
graph-mode calls (the capturing path) repeated on one region with new routings (epochs, parities),
back-to-back dispatches, a capacity overflow and out-of-range ids recorded "on the device" and
raised at synchronize(), against the torch reference. The CUDA kernels themselves run in
tests/gpu/test_moe.py; this checks what the host fills in and the protocol the kernels follow."""

import threading

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang import native
from _kernel_model import FakeMoELib
from _moe_cases import FP8, check_results, expert_fn, make_case
from purlin_sglang.moe import cuda as cuda_moe
from purlin_sglang.moe.cuda import CudaMoE
from purlin_sglang.moe.engine import MoEContext
from purlin_sglang.moe.exchange import CountExchange
from purlin_sglang.moe.region import SharedRegions
from purlin_sglang.moe.validate import check_dispatch

H = 16


class _Stream:
    cuda_stream = 0

    def synchronize(self):
        pass


class _Group:
    def __init__(self, world):
        self.barrier, self.slots = threading.Barrier(world), [None] * world

    def all_gather(self, rank, t):
        self.slots[rank] = t.clone()
        self.barrier.wait()
        out = torch.cat(self.slots)
        self.barrier.wait()
        return out


def _context(rank, world, group, regions, cfg):
    """The MoE context a Communicator of a virtual world would build (its all_gather over ``group``)."""
    return MoEContext(rank=rank, world=world, device=torch.device("cpu"), config=cfg, owner=id(group),
                      all_gather=lambda t: group.all_gather(rank, t), all_to_all_v=None, mark_broken=lambda msg: None,
                      ranks_on_gpu=world, shared_regions=regions)


def _moe(ctx, lib):
    """A CudaMoE as its __init__ makes it, with CPU stand-ins for the pinned buffers."""
    m = CudaMoE.__new__(CudaMoE)
    m.ctx, m.lib, m.device, m.world, m.rank = ctx, lib, ctx.device, ctx.world, ctx.rank
    m.settings, m.blocks, m.one_device, m._trace = ctx.config.moe, 16, True, None
    m.one_pass = cuda_moe.one_pass_mode(ctx)
    m.layout = m.region = m._own_region = None
    m._host_error = torch.zeros(16, dtype=torch.int64)
    m._err = m._host_error.numpy()
    m._pin_up = torch.zeros(cuda_moe.PIN_WORDS, dtype=torch.int64)
    m._pin_down = torch.zeros(cuda_moe.PIN_WORDS * ctx.world, dtype=torch.int64)
    m._stream, m.broken = None, None
    m.exchange = CountExchange(ctx, m._to_device, m._to_host)
    return m


@pytest.fixture(params=[(True, 0), (False, 0), (True, 32), (False, 32)],
                ids=["one_pass", "slots", "decode", "decode_slots"])
def world_of(monkeypatch, request):
    """Virtual ranks over the kernel model, in the one-pass mode and on the receive-slot path, each without
    and with the decode mode (moe.decode_tokens 32: calls of up to 32 tokens a rank move packets)."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    one_pass, decode = request.param

    def run(world, fn, max_tokens=16, decode_tokens=None):
        moe = {"max_tokens_per_rank": max_tokens, "one_pass": one_pass,
               "decode_tokens": decode if decode_tokens is None else decode_tokens}
        cfg = ps.PurlinConfig(timeout_s=5, moe=moe)
        lib, group, regions = FakeMoELib(5.0), _Group(world), SharedRegions()
        moes = [_moe(_context(r, world, group, regions, cfg), lib) for r in range(world)]
        out, errs = [None] * world, [None] * world

        def body(r):
            try:
                out[r] = fn(moes[r])
            except BaseException as e:  # noqa: BLE001
                errs[r] = e
        threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for e in errs:
            if e is not None:
                raise e
        return out, lib
    run.one_pass, run.decode = one_pass, decode
    return run


def _call(m, xs, ids, ws, experts, capacity=None, qdtype=None, capturing=False, max_tokens=None):
    r = m.rank
    quant = check_dispatch(xs[r], ids[r], ws[r], experts, capacity, qdtype, m.world, m.device, check_values=False,
                           max_tokens=max_tokens)
    d = m.dispatch(xs[r], ids[r], ws[r], experts, capacity, quant, capturing, max_tokens=max_tokens)
    out = expert_fn(d.x, d.expert, d.scales, xs[r].dtype)
    y = m.combine(out, d)
    m.synchronize()
    return dict(x=d.x, expert=d.expert, counts=d.counts, scales=d.scales, src_rank=d.src_rank, src_slot=d.src_slot,
                out=out, y=y)


@pytest.mark.parametrize("world,experts,topk", [(2, 4, 2), (4, 8, 3), (8, 16, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_eager_exact(world_of, world, experts, topk, dtype):
    xs, ids, ws = make_case(world, experts, topk, H, dtype, 8 if world == 8 else world, max_tokens=12)
    res, lib = world_of(world, lambda m: _call(m, xs, ids, ws, experts))
    check_results(res, xs, ids, ws, experts)
    assert {b for _, b in lib.launches} == {16}
    kinds = {k for k, _ in lib.launches}  # the mode the fixture asked for, and only it
    if world_of.decode:
        assert kinds == {"dispatch-decode", "combine-decode"}
    else:
        assert kinds == ({"dispatch-one-pass", "combine-one-pass"} if world_of.one_pass else {"dispatch", "combine"})


@pytest.mark.parametrize("qdtype", [None, FP8], ids=["bf16", "fp8"])
def test_capacity_and_fp8(world_of, qdtype):
    xs, ids, ws = make_case(4, 8, 2, H, torch.bfloat16, 21, max_tokens=12)
    cap = max(1, max(int((i.to(torch.int64) == e).sum()) for i in ids for e in range(8)))
    res, _ = world_of(4, lambda m: _call(m, xs, ids, ws, 8, capacity=cap, qdtype=qdtype))
    check_results(res, xs, ids, ws, 8, capacity=cap, dtype=qdtype)
    res, _ = world_of(4, lambda m: _call(m, xs, ids, ws, 8, qdtype=qdtype))
    check_results(res, xs, ids, ws, 8, dtype=qdtype)


def test_graph_mode_calls_repeat_on_one_region_with_new_routings(world_of):
    world, experts, topk, cap = 4, 8, 3, 16  # capturing: capacity defaults to max_tokens_per_rank (16)
    routings = [make_case(world, experts, topk, H, torch.bfloat16, 100 + s, max_tokens=10, fixed_tokens=True)
                for s in range(5)]

    def fn(m):
        first = _call(m, *routings[0], experts, capacity=cap)  # warm-up: eager, makes the region
        outs = [_call(m, *rt, experts, capturing=True) for rt in routings]
        r = m.rank  # two dispatches back to back (parities), then the second one's combine
        m.dispatch(routings[1][0][r], routings[1][1][r], routings[1][2][r], experts, None, "none", True)
        last = _call(m, *routings[2], experts, capturing=True)
        return first, outs, last

    res, _ = world_of(world, fn)
    check_results([r[0] for r in res], *routings[0], experts, capacity=cap)
    for i, rt in enumerate(routings):
        check_results([r[1][i] for r in res], *rt, experts, capacity=cap)
    check_results([r[2] for r in res], *routings[2], experts, capacity=cap)


def test_overflow_and_bad_ids_are_recorded_and_raised_at_synchronize(world_of):
    world, experts, cap = 2, 4, 3
    g = torch.Generator().manual_seed(5)

    def routing(rank1_ids):
        xs = [torch.randn(2, H, generator=g) for _ in range(world)]
        return xs, [torch.tensor([[0, 2], [1, 3]]), torch.tensor(rank1_ids)], [torch.rand(2, 2, generator=g)
                                                                                 for _ in range(world)]

    good, over, bad = routing([[0, 2], [1, 3]]), routing([[3, 3], [3, 3]]), routing([[0, 7], [1, 3]])

    def fn(m):
        _call(m, *good, experts, capacity=cap)
        caught = []
        for rt in (over, bad):
            try:
                _call(m, *rt, experts, capacity=cap, capturing=True)
            except ps.PurlinCapacityError as e:
                caught.append(("capacity", e.rank, e.expert, e.count))
            except ps.PurlinValueError as e:
                caught.append(("ids", str(e)))
        return caught, _call(m, *good, experts, capacity=cap, capturing=True)

    res, _ = world_of(world, fn)
    assert res[0][0] == [] and res[1][0][0] == ("capacity", 1, 3, 4)
    assert res[1][0][1][0] == "ids" and "outside [-1, num_experts)" in res[1][0][1][1]
    check_results([r[1] for r in res], *good, experts, capacity=cap)


def test_a_bad_eager_call_on_one_rank_raises_on_every_rank_and_launches_nothing(world_of):
    """The CUDA glue's own checks (id range, max_tokens_per_rank) fail on rank 1 only: rank 1 raises its
    error, rank 0 raises naming rank 1 (the header exchange carries the rejection), no kernel runs, and
    the next call is correct."""
    world, experts = 2, 4
    xs, ids, ws = make_case(world, experts, 2, H, torch.bfloat16, 31, max_tokens=6, empty_rank=False)
    too_many = (torch.randn(17, H), torch.zeros(17, 2, dtype=torch.int64), torch.ones(17, 2))

    def fn(m):
        r, seen = m.rank, []
        for what, args in (("outside [-1, 4)", (xs[r], ids[r] + 9 * (r == 1), ws[r])),
                           ("max_tokens_per_rank", too_many if r == 1 else (xs[r], ids[r], ws[r]))):
            with pytest.raises(ps.PurlinValueError) as e:
                m.dispatch(*args, experts, None, "none", False)
            seen.append((what, str(e.value)))
        return seen, _call(m, xs, ids, ws, experts)

    res, lib = world_of(world, fn, max_tokens=16)
    for r, (seen, _) in enumerate(res):
        for what, msg in seen:
            assert what in msg and (r == 1 or "rank 1 rejected its arguments" in msg), (r, what, msg)
    check_results([out for _, out in res], xs, ids, ws, experts)
    assert len(lib.launches) == 2 * world  # the good call's dispatch and combine only


def test_a_bad_combine_on_one_rank_ends_every_ranks_combine(world_of):
    """Rank 1 rejects its combine arguments: it runs the combine kernel with nothing to put back (its reject bit
    travels with its combine's signal) and raises its own error; rank 0's kernel ends at once (no timeout), skips its reduce
    and records the rejection, which rank 0 raises naming rank 1 (at its combine's end or synchronize()); the next
    pair is correct."""
    import time

    world, experts = 2, 4
    xs, ids, ws = make_case(world, experts, 2, H, torch.bfloat16, 35, max_tokens=6, empty_rank=False)

    def fn(m):
        r = m.rank
        quant = check_dispatch(xs[r], ids[r], ws[r], experts, None, None, world, m.device, check_values=False)
        d = m.dispatch(xs[r], ids[r], ws[r], experts, None, quant, False)
        t0 = time.monotonic()
        if r == 1:
            with pytest.raises(ps.PurlinValueError, match="bad shape"):
                m.reject_combine(ps.PurlinValueError("moe_combine: bad shape"))
            seen = "own"
        else:  # raised at the end of the combine if its kernel has ended by then (the model's has), else later
            with pytest.raises(ps.PurlinValueError) as e:
                m.combine(d.x.to(torch.bfloat16), d)
                m.synchronize()
            seen = str(e.value)
        assert time.monotonic() - t0 < 4  # the model's timeout is 5 s
        m.synchronize()  # raised once, then cleared
        return seen, _call(m, xs, ids, ws, experts)

    res, lib = world_of(world, fn, max_tokens=16)
    assert "rank 1 rejected its arguments" in res[0][0], res[0][0]
    check_results([out for _, out in res], xs, ids, ws, experts)


@pytest.mark.parametrize("group, scope, gpu", [(None, "auto", True), (None, "system", False),
                                               (object(), "auto", False), (object(), "system", False)])
def test_signals_take_gpu_scope_only_for_virtual_ranks_under_auto(group, scope, gpu):
    cfg = ps.PurlinConfig(moe={"signal_scope": scope})
    ctx = MoEContext(rank=0, world=2, device=torch.device("cpu"), config=cfg, owner=0, all_gather=None,
                     all_to_all_v=None, mark_broken=None, group=group)
    assert cuda_moe.signals_at_gpu_scope(ctx) is gpu


def test_trace_words_decode_by_kind_and_phase():
    words = [0] * (2 * native.MOE_TRACE_WORDS)
    phases = native.MOE_TRACE_PHASES
    for i in range(len(phases["dispatch"])):
        words[i] = 1000 + i
    words[native.MOE_TRACE_WORDS] = 5000  # the combine's start only: a combine not yet past it
    got = cuda_moe.trace_stamps(words)
    assert got["dispatch"] == {name: 1000 + i for i, name in enumerate(phases["dispatch"])}
    assert got["combine"] == {"start": 5000}
    assert len(phases["dispatch"]) <= native.MOE_TRACE_WORDS and len(phases["combine"]) <= native.MOE_TRACE_WORDS


def test_moe_trace_is_none_on_the_cpu_engine_and_after_close():
    def fn(comm):
        d = comm.moe_dispatch(torch.randn(4, 16), torch.randint(0, 8, (4, 2)), torch.rand(4, 2), num_experts=8)
        comm.moe_combine(d.x, d)
        return comm.moe_trace()

    assert ps.run_virtual(2, fn, device="cpu", config={"moe": {"trace": True}}) == [None, None]
    comm = ps.run_virtual(1, lambda c: c, device="cpu")[0]
    comm.close()
    with pytest.raises(ps.PurlinError, match="moe_trace"):
        comm.moe_trace()


def _two_and_six_tokens(seed):
    """Rank 0 dispatches 2 tokens, rank 1 six (4 experts, top-2)."""
    xs, ids, ws = make_case(2, 4, 2, H, torch.bfloat16, seed, max_tokens=6, fixed_tokens=True)
    xs[0], ids[0], ws[0] = xs[0][:2], ids[0][:2], ws[0][:2]
    return xs, ids, ws


@pytest.mark.parametrize("limit", [4, 8])
def test_every_rank_takes_the_same_mode(world_of, limit):
    """Ranks of 2 and 6 tokens: eager calls decide from the exchanged counts and captured calls from
    max_tokens, so both ranks take the decode mode where 6 <= moe.decode_tokens and neither where not;
    correct either way."""
    xs, ids, ws = _two_and_six_tokens(95)

    def fn(m):
        eager = _call(m, xs, ids, ws, 4, capacity=6)
        captured = _call(m, xs, ids, ws, 4, capacity=6, capturing=True, max_tokens=6)
        return eager, captured

    res, lib = world_of(2, fn, decode_tokens=limit)
    for i in range(2):
        check_results([r[i] for r in res], xs, ids, ws, 4, capacity=6)
    kinds = {k.split("-", 1)[1] if "-" in k else "" for k, _ in lib.launches}
    assert kinds == ({"decode"} if limit == 8 else {"one-pass"} if world_of.one_pass else {""})


def test_ranks_in_different_modes_raise_a_mismatch_not_a_hang(world_of):
    """Captured without max_tokens, the 2-token rank takes the decode mode (moe.decode_tokens 4), the
    6-token rank the normal one: the decode rank records a MISMATCH naming both modes (fatal), the other
    rank's wait times out; both communicators are broken, nothing hangs."""
    xs, ids, ws = _two_and_six_tokens(97)

    def fn(m):
        _call(m, xs, ids, ws, 4, capacity=6)
        with pytest.raises(ps.PurlinError) as e:
            _call(m, xs, ids, ws, 4, capacity=6, capturing=True)
        return e.value

    (e0, e1), _ = world_of(2, fn, decode_tokens=4)
    assert isinstance(e0, ps.PurlinMismatchError) and "rank 0 the decode mode" in str(e0), e0
    assert isinstance(e1, ps.PurlinTimeoutError) and "rank 0" in str(e1), e1


def test_decode_windows_are_in_the_layout_and_within_the_footprint():
    """The decode windows follow the receive and return areas, hold D tokens a producer (packets: twice
    the bytes) and D * K return rows, and add about 7 MiB at the decode shape (the region stays under
    64 MiB a rank at moe.max_tokens_per_rank 128)."""
    from purlin_sglang.moe.region import MoELayout, header_bytes

    lay = MoELayout(8, 128, 8, 7168 * 2, 7168 * 2, decode_tokens=8)
    off = MoELayout(8, 128, 8, 7168 * 2, 7168 * 2)
    assert lay.win_off >= off.ret_off + 2 * off.ret_parity_bytes and lay.rwin_off >= lay.win_off + 16 * lay.win_bytes
    assert lay.win_bytes >= 2 * lay.count_bytes + 8 * 2 * (header_bytes(8) + 7168 * 2)
    assert lay.rwin_parity_bytes >= 128 + 8 * 8 * 2 * 7168 * 2
    extra = lay.rank_bytes - off.rank_bytes
    assert 6.5 * 2**20 < extra < 7.5 * 2**20 and lay.rank_bytes < 64 * 2**20
    assert lay.decode_fits(8, 7168 * 2, 7168 * 2) and not lay.decode_fits(9, 7168 * 2, 7168 * 2)
    assert not lay.decode_fits(8, 7168 * 2, 7168 * 4) and not off.decode_fits(8, 16, 16)


def test_calls_switch_between_the_decode_and_normal_modes(world_of):
    """One communicator, moe.decode_tokens 4: eager calls of 2, 9 and 12 tokens a rank and captured calls of
    3 (max_tokens 3) in turn take the decode and the normal mode by turns. Every mode's words stay in step
    across the switches (the normal modes count e * blocks arrivals, which decode calls add too): each call
    correct, none times out."""
    world, experts, topk = 4, 8, 3
    plan = [(2, False), (9, False), (3, True), (12, False), (3, True), (9, True), (1, False)]
    cases = [make_case(world, experts, topk, H, torch.bfloat16, 140 + s, max_tokens=n, fixed_tokens=True)
             for s, (n, _) in enumerate(plan)]

    def fn(m):
        return [_call(m, *case, experts, capacity=16, capturing=cap, max_tokens=n if cap else None)
                for case, (n, cap) in zip(cases, plan)]

    res, lib = world_of(world, fn, decode_tokens=4)
    for i, case in enumerate(cases):
        check_results([r[i] for r in res], *case, experts, capacity=16)
    modes = [k.endswith("decode") for k, _ in lib.launches if k.startswith("dispatch")]
    assert modes == [n <= 4 for n, _ in plan for _ in range(world)]


@pytest.mark.parametrize("seed", range(4))
def test_random_call_sequences(world_of, seed):
    """Random worlds, shapes and dtypes; four calls on one communicator (moe.decode_tokens 6), each eager
    or captured, of up to 10 tokens a rank (so the modes switch between calls), some over capacity (raised
    where seen) or with a combine one rank rejects (raised on every rank): every other call correct, none
    times out."""
    import random

    rnd = random.Random(seed * 7919 + world_of.one_pass * 2 + bool(world_of.decode))
    world = rnd.choice([1, 2, 3, 4, 8])
    experts = world * rnd.choice([1, 2, 3])
    topk = rnd.randint(1, min(6, experts))
    dtype = rnd.choice([torch.bfloat16, torch.float16, torch.float32])
    qdtype = rnd.choice([None, FP8])
    calls = []
    for c in range(4):
        n = rnd.randint(1, 10)
        captured = c > 0 and rnd.random() < 0.5
        xs, ids, ws = make_case(world, experts, topk, H, dtype, 1000 * seed + c, max_tokens=n,
                                fixed_tokens=captured)
        need = max([1] + [int((i.to(torch.int64) == e).sum()) for i in ids for e in range(experts)])
        cap = need + rnd.randint(0, 2) if captured else rnd.choice([None, need])
        fault = rnd.choice([None, None, "overflow", "reject"]) if c > 0 and world > 1 else None
        if fault == "overflow" and need > 1:
            cap = need - 1
        calls.append((xs, ids, ws, cap, captured, fault, rnd.randrange(world)))

    def fn(m):
        out = []
        for xs, ids, ws, cap, captured, fault, who in calls:
            r = m.rank
            try:
                if fault != "reject":
                    out.append(_call(m, xs, ids, ws, experts, capacity=cap, qdtype=qdtype, capturing=captured))
                    continue
                quant = check_dispatch(xs[r], ids[r], ws[r], experts, cap, qdtype, world, m.device, check_values=False)
                d = m.dispatch(xs[r], ids[r], ws[r], experts, cap, quant, captured)
                if r == who:
                    m.reject_combine(ps.PurlinValueError("moe_combine: bad shape"))
                else:
                    m.combine(expert_fn(d.x, d.expert, d.scales, xs[r].dtype), d)
                m.synchronize()
                out.append("no error")
            except (ps.PurlinCapacityError, ps.PurlinValueError) as e:
                out.append(type(e).__name__)
                m.synchronize()
        return out

    res, _ = world_of(world, fn, decode_tokens=6)
    for i, (xs, ids, ws, cap, captured, fault, who) in enumerate(calls):
        got = [r[i] for r in res]
        if fault == "reject":
            assert got == ["PurlinValueError"] * world, got
        elif any(isinstance(g, str) for g in got):  # an overflow: raised where it was seen
            assert cap is not None and all(g in ("PurlinCapacityError",) or isinstance(g, dict) for g in got), got
        else:
            check_results(got, xs, ids, ws, experts, capacity=cap, dtype=qdtype)
