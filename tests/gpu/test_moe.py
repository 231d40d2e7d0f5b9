"""MoE dispatch and combine on the CUDA engine (loopback virtual ranks on one GPU) against the
plain torch reference: eager exact and capacity layouts, FP8 payloads, CUDA graphs replayed with
new routings (no re-capture), a capacity overflow recorded on the device and raised at
synchronize(), bad arguments. Outputs are poisoned (graph buffers refilled with NaN) before runs."""

import os
import sys
import threading

import pytest
import torch

import purlin_sglang as ps

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "moe"))
from _moe_cases import FP8, check_results, expert_fn, make_case, run_rank  # noqa: E402

pytestmark = pytest.mark.gpu
CFG = {"staging_bytes": 1 << 20, "timeout_s": 10, "moe": {"max_tokens_per_rank": 16}}
H = 64


@pytest.fixture(autouse=True, params=[(True, 0), (False, 0), (True, 32), (False, 32)],
                ids=["one_pass", "slots", "decode", "decode_slots"])
def _mode(request, monkeypatch):
    """Every test in each mode of virtual ranks: rows straight into the receivers' outputs (moe.one_pass, the
    default) and the receive-slot path that ranks in separate processes take, each without and with the
    decode mode (moe.decode_tokens 32: every call of up to 32 tokens a rank moves packets)."""
    one_pass, decode = request.param
    monkeypatch.setitem(CFG, "moe", {**CFG["moe"], "one_pass": one_pass, "decode_tokens": decode})


def _world(world, fn, barrier, config=None):
    """ps.run_virtual on the GPU, with the test's barrier broken when a rank raises: its peers stop at once
    (a PurlinBrokenError that names the cause as a peer's) instead of waiting in the barrier until the join
    timeout, and run_virtual raises the rank's own error."""
    def body(comm):
        try:
            return fn(comm)
        except threading.BrokenBarrierError as e:
            raise ps.PurlinBrokenError(f"rank {comm.rank}: a peer rank raised (the test's barrier was broken)") from e
        except BaseException:
            barrier.abort()
            raise
    return ps.run_virtual(world, body, device="cuda", config=CFG if config is None else config)


def _run(world, xs, ids, ws, experts, capacity=None, qdtype=None, out_dtype=None):
    barrier = threading.Barrier(world)
    return _world(world, lambda c: run_rank(c, xs, ids, ws, experts, capacity, qdtype, out_dtype, barrier), barrier)


def _tiny(dev, tokens=4):
    """Every token to expert 0 twice with weight 1: the combine of 2 * rows is 2 * x."""
    return (torch.randn(tokens, H, device=dev), torch.zeros(tokens, 2, dtype=torch.int64, device=dev),
            torch.ones(tokens, 2, device=dev))


def _good_call(comm, x, ids, w, barrier) -> bool:
    d = comm.moe_dispatch(x, ids, w, num_experts=4)
    y = comm.moe_combine(d.x.clone(), d)
    comm.synchronize()
    barrier.wait()  # host copies only once every rank's kernels are done
    return torch.equal(y.cpu(), (x * 2).cpu())


def test_bad_arguments_and_limits():
    barrier = threading.Barrier(2)

    def fn(comm):
        x, ids, w = _tiny(comm.device)
        with pytest.raises(ps.PurlinValueError, match="topk_ids"):
            comm.moe_dispatch(x, ids + 9, w, num_experts=4)
        with pytest.raises(ps.PurlinValueError, match="max_tokens_per_rank"):
            comm.moe_dispatch(*_tiny(comm.device, 17), num_experts=4)
        with pytest.raises(ps.PurlinValueError, match="16 bytes"):
            comm.moe_dispatch(torch.randn(4, 3, device=comm.device), ids, w, num_experts=4)
        return _good_call(comm, x, ids, w, barrier), comm.moe_hbm_bytes

    res = _world(2, fn, barrier)
    assert all(r[0] and r[1] > 0 for r in res)


def test_bad_ids_on_one_rank_raise_on_every_rank():
    """Rank 1's ids are out of range, rank 0's are fine: both raise at once (rank 0 naming rank 1 and
    quoting its error), no kernel waits for a peer, and the next call is correct."""
    barrier = threading.Barrier(2)

    def fn(comm):
        x, ids, w = _tiny(comm.device)
        with pytest.raises(ps.PurlinValueError) as e:
            comm.moe_dispatch(x, ids + 9 * comm.rank, w, num_experts=4)
        return str(e.value), _good_call(comm, x, ids, w, barrier)

    (msg0, ok0), (msg1, ok1) = _world(2, fn, barrier)
    assert "rank 1 rejected its arguments" in msg0 and "outside [-1, 4)" in msg0  # rank 1's message, quoted
    assert "outside [-1, 4)" in msg1 and ok0 and ok1


@pytest.mark.parametrize("world,experts,topk", [(2, 4, 2), (4, 8, 3), (8, 16, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_eager_exact_random_routings(world, experts, topk, dtype):
    for seed in range(2):
        xs, ids, ws = make_case(world, experts, topk, H, dtype, seed * 5 + world, max_tokens=12)
        check_results(_run(world, xs, ids, ws, experts), xs, ids, ws, experts)


@pytest.mark.parametrize("qdtype", [None, FP8], ids=["bf16", "fp8"])
def test_eager_capacity_layout_and_fp8(qdtype):
    xs, ids, ws = make_case(4, 8, 2, H, torch.bfloat16, 21, max_tokens=12)
    cap = max(1, max(int((i.to(torch.int64) == e).sum()) for i in ids for e in range(8)))
    check_results(_run(4, xs, ids, ws, 8, capacity=cap, qdtype=qdtype), xs, ids, ws, 8, capacity=cap, dtype=qdtype)
    check_results(_run(4, xs, ids, ws, 8, qdtype=qdtype), xs, ids, ws, 8, dtype=qdtype)


def test_cpu_and_cuda_engines_agree_bitwise():
    xs, ids, ws = make_case(4, 8, 2, H, torch.bfloat16, 33, max_tokens=12)
    gpu = _run(4, xs, ids, ws, 8)
    cpu = ps.run_virtual(4, lambda c: run_rank(c, xs, ids, ws, 8), config={"staging_bytes": 1 << 16})
    for g, c in zip(gpu, cpu):
        assert torch.equal(g["y"].view(torch.int16), c["y"].view(torch.int16))


def _capture_pair(comm, barrier, one_capture, x, i, w, experts, capacity, max_tokens=None, dtype=None):
    """Dispatch -> experts -> combine once eagerly (without ``max_tokens``), then captured once (one rank
    captures at a time) with ``max_tokens``; returns the graph and its dispatch, expert and combine outputs.
    Every rank has captured when it returns."""
    def step(**kw):
        d = comm.moe_dispatch(x, i, w, num_experts=experts, capacity=capacity, dtype=dtype, **kw)
        out = expert_fn(d.x, d.expert, d.scales, x.dtype)
        return d, out, comm.moe_combine(out, d)

    step()
    comm.synchronize()
    barrier.wait()
    g = torch.cuda.CUDAGraph()
    with one_capture, comm.capture(), torch.cuda.graph(g, stream=torch.cuda.current_stream(),
                                                       capture_error_mode="thread_local"):
        d, out, y = step(max_tokens=max_tokens)
    barrier.wait()
    return g, d, out, y


def _poison(d, out, y):
    """Fills every output a replay must write with 0xFF bytes."""
    for t in (d.x, y, out, d.counts, d.expert, d.src_rank, d.src_slot):
        t.view(torch.uint8).fill_(0xFF)


def _replayed(d, out, y) -> dict:
    """A replay's outputs, copied to the host."""
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in dict(
        x=d.x, expert=d.expert, counts=d.counts, scales=d.scales, src_rank=d.src_rank, src_slot=d.src_slot,
        out=out, y=y).items()}


def _graph_world(world, experts, topk, cap, routings, qdtype=None):
    """Each rank: warm up eagerly, capture dispatch -> experts -> combine once, replay once per routing
    (new x, ids and weights copied into the static inputs; outputs poisoned first)."""
    barrier = threading.Barrier(world)
    one_capture = threading.Lock()

    def fn(comm):
        r, dev = comm.rank, comm.device
        staged = [(xs[r].to(dev), ids[r].to(dev), ws[r].to(dev)) for xs, ids, ws in routings]  # no host copies later
        sx, sid, sw = (t.clone() for t in staged[0])
        comm.synchronize()
        barrier.wait()
        g, d, out, y = _capture_pair(comm, barrier, one_capture, sx, sid, sw, experts, cap, dtype=qdtype)
        results, errors = [], []
        for i, (x_i, id_i, w_i) in enumerate(staged):
            sx.copy_(x_i)
            sid.copy_(id_i)
            sw.copy_(w_i)
            _poison(d, out, y)
            g.replay()
            try:
                comm.synchronize()
            except ps.PurlinCapacityError as e:
                errors.append((i, e.rank, e.expert, e.count))
            barrier.wait()  # every rank's replay is done before any host copy
            results.append(_replayed(d, out, y))
            barrier.wait()
        return results, errors

    return _world(world, fn, barrier)


@pytest.mark.parametrize("qdtype", [None, FP8], ids=["bf16", "fp8"])
def test_graph_replay_with_new_routings(qdtype):
    world, experts, topk, cap = 4, 8, 3, 16
    routings = [make_case(world, experts, topk, H, torch.bfloat16, 100 + s, max_tokens=10, fixed_tokens=True)
                for s in range(4)]
    res = _graph_world(world, experts, topk, cap, routings, qdtype)
    for i, (xs, ids, ws) in enumerate(routings):
        check_results([res[r][0][i] for r in range(world)], xs, ids, ws, experts, capacity=cap, dtype=qdtype)
    assert all(not r[1] for r in res)


def test_graph_capacity_overflow_is_recorded_and_raised():
    world, experts, cap = 2, 4, 3
    g = torch.Generator().manual_seed(5)

    def routing(rank1_ids):
        xs = [torch.randn(2, H, generator=g) for _ in range(world)]
        ids = [torch.tensor([[0, 2], [1, 3]]), torch.tensor(rank1_ids)]
        ws = [torch.rand(2, 2, generator=g) for _ in range(world)]
        return xs, ids, ws

    good, over, again = routing([[0, 2], [1, 3]]), routing([[3, 3], [3, 3]]), routing([[2, -1], [3, 0]])
    res = _graph_world(world, experts, 2, cap, [good, over, again])
    assert res[0][1] == [] and res[1][1] == [(1, 1, 3, 4)]  # replay 1, source rank 1, expert 3, 4 rows
    for i in (0, 2):  # correct before, and after: the communicator stays usable
        xs, ids, ws = (good, over, again)[i]
        check_results([res[r][0][i] for r in range(world)], xs, ids, ws, experts, capacity=cap)


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("qdtype", [None, FP8], ids=["as-is", "fp8"])
def test_long_token_ranges_route_in_chunks(xdtype, qdtype):
    """Over 32 tokens per block (the kernel routes 32 at a time, and every block counts all ids before its own
    range): 1100 tokens per rank at world 2 (16 blocks: 68-69 tokens each, three chunks), exact and capacity rows,
    FP8 quantised in the kernel from each input dtype; bitwise the reference, scales included."""
    world, experts, topk = 2, 6, 3
    xs, ids, ws = make_case(world, experts, topk, H, xdtype, 51 + int(qdtype is None), max_tokens=1100,
                            fixed_tokens=True)
    _exact_and_capacity_rows(world, xs, ids, ws, experts, 1100, qdtype)


def _exact_and_capacity_rows(world, xs, ids, ws, experts, max_tokens, qdtype):
    """The case run with exact rows, then with capacity rows (the routing's largest (source, expert) count),
    each checked against the reference, bitwise."""
    cap = max(int((i.to(torch.int64) == e).sum()) for i in ids for e in range(experts))
    big = {**CFG, "moe": {**CFG["moe"], "max_tokens_per_rank": max_tokens}}
    for capacity in (None, cap):
        barrier = threading.Barrier(world)
        res = _world(world, lambda c: run_rank(c, xs, ids, ws, experts, capacity, qdtype, None, barrier), barrier,
                     big)
        check_results(res, xs, ids, ws, experts, capacity=capacity, dtype=qdtype)


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hidden", [7168, 8192, 8320])
def test_fp8_rows_of_model_widths(xdtype, hidden):
    """FP8 from 16-bit rows of model widths: 7168 and 8192 are read once (a group of four warps holds the row in
    registers from its amax to its quantisation; at 7168 some lanes hold fewer units than others), 8320 is past
    what the registers hold and is read twice. 150 tokens per rank (several tokens per group and block), a
    row of zeros (scale 1), a row whose amax is its one negative spike, a row of negative elements only and,
    from fp16, a row of subnormal elements only (its amax a subnormal fp16: one that a flush to zero would
    make a scale of 1); bitwise the reference, scales included, exact and capacity layouts."""
    world, experts, topk = 2, 8, 4
    xs, ids, ws = make_case(world, experts, topk, hidden, xdtype, 71 + hidden % 7, max_tokens=150, fixed_tokens=True)
    xs[0][3] = 0
    xs[1][5] = xs[1][5] / 100
    xs[1][5][hidden // 3] = -7.5
    xs[0][7] = -xs[0][7].abs()
    if xdtype == torch.float16:
        sub = (torch.rand(hidden, generator=torch.Generator().manual_seed(hidden)) * 2 - 1) * 6e-5
        xs[1][9] = sub.to(torch.float16)
        assert xs[1][9].abs().max() < torch.finfo(torch.float16).smallest_normal
    _exact_and_capacity_rows(world, xs, ids, ws, experts, 150, FP8)


def test_bad_combine_on_one_rank_ends_every_ranks_combine():
    """Rank 1's combine arguments are bad: it raises its own error; rank 0 raises naming rank 1 well inside
    timeout_s (its kernel saw the reject bit), and the next pair is correct on both."""
    import time

    world, experts = 2, 4
    xs, ids, ws = make_case(world, experts, 2, H, torch.bfloat16, 61, max_tokens=8, empty_rank=False)
    barrier = threading.Barrier(world)

    def fn(c):
        r, dev = c.rank, c.device
        x, i, w = xs[r].to(dev), ids[r].to(dev), ws[r].to(dev)
        c.synchronize()
        barrier.wait()
        d = c.moe_dispatch(x, i, w, num_experts=experts)
        out = d.x.clone()
        t0 = time.monotonic()
        with pytest.raises(ps.PurlinValueError) as e:
            c.moe_combine(out[1:] if r == 1 else out, d)
            c.synchronize()
        took = time.monotonic() - t0
        barrier.wait()
        return str(e.value), took, run_rank(c, xs, ids, ws, experts, barrier=barrier)

    res = _world(world, fn, barrier)
    assert "expected" in res[1][0] and "rank 1 rejected its arguments" in res[0][0], (res[0][0], res[1][0])
    assert max(r[1] for r in res) < CFG["timeout_s"] / 2
    check_results([r[2] for r in res], xs, ids, ws, experts)


def _captured_pairs(world, xs, ids, ws, experts, cfg, max_tokens=None, replays=2):
    """Each rank: an eager warm-up pair, then dispatch -> experts -> combine captured once with
    ``max_tokens`` and replayed (outputs poisoned first). Returns each rank's results and its error (or
    None) of the replays."""
    barrier = threading.Barrier(world)
    one_capture = threading.Lock()

    def fn(comm):
        r, dev = comm.rank, comm.device
        x, i, w = xs[r].to(dev), ids[r].to(dev), ws[r].to(dev)
        g, d, out, y = _capture_pair(comm, barrier, one_capture, x, i, w, experts, 6, max_tokens)
        results, error = [], None
        for _ in range(replays):
            _poison(d, out, y)
            g.replay()
            try:
                comm.synchronize()
            except ps.PurlinError as e:
                error = e
                break
            results.append(_replayed(d, out, y))
        barrier.wait()  # every rank's kernels have ended
        if error is not None:
            comm.close()  # broken: run_virtual's own synchronize after fn would raise the error again
        return results, error, comm.moe_trace() if error is None else None

    return _world(world, fn, barrier, cfg)


def test_captured_calls_take_one_mode_from_max_tokens():
    """Ranks of 2 and 6 tokens, moe.decode_tokens 4: captured with max_tokens=6 on every rank, both take the
    normal mode; with decode_tokens 8, both the decode mode (its trace phases); correct either way."""
    world, experts = 2, 4
    xs, ids, ws = make_case(world, experts, 2, H, torch.bfloat16, 91, max_tokens=6, fixed_tokens=True)
    xs[0], ids[0], ws[0] = xs[0][:2], ids[0][:2], ws[0][:2]
    for limit, phase in ((4, "counts_in" if CFG["moe"]["one_pass"] else "wait"), (8, "headers_in")):
        cfg = {**CFG, "moe": {**CFG["moe"], "decode_tokens": limit, "trace": True}}
        res = _captured_pairs(world, xs, ids, ws, experts, cfg, max_tokens=6)
        for results, error, trace in res:
            assert error is None, error
            assert phase in trace["dispatch"], trace
        for i in range(2):
            check_results([res[r][0][i] for r in range(world)], xs, ids, ws, experts, capacity=6)


def test_ranks_in_different_modes_raise_not_hang():
    """Captured without max_tokens, a rank of 2 tokens takes the decode mode (moe.decode_tokens 4) and one of
    6 the normal mode: the decode rank records the mismatch at once, naming both modes; the other rank times
    out (timeout_s 2); neither hangs."""
    world, experts = 2, 4
    xs, ids, ws = make_case(world, experts, 2, H, torch.bfloat16, 93, max_tokens=6, fixed_tokens=True)
    xs[0], ids[0], ws[0] = xs[0][:2], ids[0][:2], ws[0][:2]
    cfg = {**CFG, "timeout_s": 2, "moe": {**CFG["moe"], "decode_tokens": 4}}
    res = _captured_pairs(world, xs, ids, ws, experts, cfg, replays=1)
    e0, e1 = res[0][1], res[1][1]
    assert isinstance(e0, ps.PurlinMismatchError) and "decode mode" in str(e0), e0
    assert isinstance(e1, (ps.PurlinTimeoutError, ps.PurlinMismatchError)), e1


def test_eager_calls_and_decode_graphs_switch_modes():
    """moe.decode_tokens 4 on one communicator, as a server uses it: eager calls of 2, 9, 3 and 12 tokens a
    rank (decode, normal, decode, normal mode), then a captured pair of 3 tokens (decode) replayed with new
    routings between eager pairs of 10 tokens (normal). Each call correct (outputs poisoned first), none times
    out: the modes' words stay in step across the switches."""
    world, experts, topk = 4, 8, 3
    cfg = {**CFG, "moe": {**CFG["moe"], "decode_tokens": 4, "trace": True}}
    eager = [make_case(world, experts, topk, H, torch.bfloat16, 150 + s, max_tokens=n, fixed_tokens=True)
             for s, n in enumerate((2, 9, 3, 12))]
    small = [make_case(world, experts, topk, H, torch.bfloat16, 160 + s, max_tokens=3, fixed_tokens=True)
             for s in range(3)]
    big = [make_case(world, experts, topk, H, torch.bfloat16, 170 + s, max_tokens=10, fixed_tokens=True)
           for s in range(2)]
    barrier = threading.Barrier(world)
    one_capture = threading.Lock()

    def fn(comm):
        r, dev = comm.rank, comm.device
        first, modes = [], []
        for case in eager:
            first.append(run_rank(comm, *case, experts, barrier=barrier))
            modes.append("headers_in" in comm.moe_trace()["dispatch"])
        sx, sid, sw = (t[r].to(dev) for t in small[0])
        g, d, out, y = _capture_pair(comm, barrier, one_capture, sx, sid, sw, experts, 16, max_tokens=3)
        replays, between = [], []
        for i in range(1, 3):
            sx.copy_(small[i][0][r].to(dev))
            sid.copy_(small[i][1][r].to(dev))
            sw.copy_(small[i][2][r].to(dev))
            _poison(d, out, y)
            comm.synchronize()
            barrier.wait()
            g.replay()
            comm.synchronize()
            barrier.wait()
            replays.append(_replayed(d, out, y))
            between.append(run_rank(comm, *big[i - 1], experts, barrier=barrier))
        return first, modes, replays, between

    res = _world(world, fn, barrier, cfg)
    for i, case in enumerate(eager):
        check_results([res[r][0][i] for r in range(world)], *case, experts)
    assert all(res[r][1] == [True, False, True, False] for r in range(world)), [r[1] for r in res]
    for i in range(2):
        check_results([res[r][2][i] for r in range(world)], *small[i + 1], experts, capacity=16)
        check_results([res[r][3][i] for r in range(world)], *big[i], experts)
