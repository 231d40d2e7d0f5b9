"""The CUDA engine with loopback virtual ranks on one GPU: bitwise the CPU engine on every
collective, size, dtype and op; CUDA graphs replayed many times; timeouts that name op, rank and peer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import purlin_sglang as ps  # noqa: E402
from _engine_check import CFG, SEED, check  # noqa: E402
from purlin_sglang.testing.collectives import COLLECTIVES, OPS, REDUCE_DTYPES, REDUCING, case, make_input  # noqa: E402
from purlin_sglang.errors import PurlinTimeoutError  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_every_collective_every_world(world):
    cases = [case(coll, torch.float32, rows=2, width=3, seed=SEED + i, root=world - 1, salt=world)
             for i, coll in enumerate(COLLECTIVES)]
    cases += [case(coll, torch.bfloat16, rows=3, width=5, seed=SEED + 50 + i, root=0, salt=1)
              for i, coll in enumerate(COLLECTIVES)]
    check(world, cases)


@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_reductions_every_dtype_and_op(dtype, op):
    cases = [case(coll, dtype, rows=3, width=37, op=op, seed=SEED + i, root=1) for i, coll in enumerate(REDUCING)]
    check(4, cases, inplace=False)


@pytest.mark.parametrize("rows,width", [(0, 4), (1, None), (1, 3), (3, 7)], ids=["0", "1elem", "6B", "odd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.complex64, torch.int64], ids=str)
def test_edge_sizes(rows, width, dtype):
    colls = COLLECTIVES if dtype in REDUCE_DTYPES else tuple(c for c in COLLECTIVES if c not in REDUCING)
    check(3, [case(coll, dtype, rows=rows, width=width, seed=SEED + rows, root=2) for coll in colls])


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
def test_all_reduce_algorithms(world, algorithm):
    cfg = {**CFG, "tuning": {"algorithm": algorithm}}
    cases = [case("all_reduce", dt, rows=rows, width=width, op=op, seed=SEED + rows)
             for dt, rows, width, op in [(torch.bfloat16, 1024, 1024, "sum"), (torch.float32, 33, 3, "max"),
                                         (torch.float16, 1, 1, "min"), (torch.int32, 7, 129, "sum")]]
    check(world, cases, config=cfg)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_packet_all_reduce_every_dtype_and_edge_sizes(world):
    """The packet protocol (forced): a full 64 KiB window, partial last packets, every reduce dtype."""
    cfg = {**CFG, "tuning": {"algorithm": "packet"}}
    cases = [case("all_reduce", dt, rows=rows, width=width, op=op, seed=SEED + rows)
             for dt, rows, width, op in [(torch.bfloat16, 8, 4096, "sum"), (torch.float32, 33, 3, "max"),
                                         (torch.float16, 1, 1, "min"), (torch.int32, 7, 129, "sum"),
                                         (torch.bfloat16, 3, 5, "max"), (torch.float64, 3, 5, "sum"),
                                         (torch.int64, 5, 3, "min"), (torch.float16, 0, 8, "sum")]]
    check(world, cases, config=cfg)


@pytest.mark.parametrize("world", [2, 8])
def test_packet_calls_interleaved_with_staged_calls(world):
    """auto: small all_reduces take packets, the rest staging; windows and staging never collide."""
    cases = []
    for i in range(6):
        cases += [case("all_reduce", torch.bfloat16, rows=16, width=64 + i, seed=SEED + i),            # packet
                  case("all_gather", torch.float32, rows=5, width=7 + i, seed=SEED + 10 + i),         # oneshot
                  case("all_reduce", torch.float32, rows=2, width=3 + i, op="max", seed=SEED + 20 + i),  # packet
                  case("all_reduce", torch.bfloat16, rows=1024, width=160, seed=SEED + 30 + i)]       # twoshot
    check(world, cases)


@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
def test_payloads_larger_than_staging(world, algorithm):
    cfg = {"staging_bytes": 8192, "timeout_s": 8, "tuning": {"algorithm": algorithm}}
    cases = [case(coll, torch.float32, rows=rows, width=257, seed=SEED + 3, root=1)
             for coll, rows in [("all_reduce", 100), ("all_gather", 60), ("reduce_scatter", 33),
                                ("all_to_all", 33), ("broadcast", 100), ("all_to_all_v", 9)]]
    cases.append(case("all_reduce", torch.bfloat16, rows=200, width=257, op="max", seed=SEED + 4))
    check(world, cases, config=cfg)


def test_communicator_reports_engine_and_memory():
    def fn(comm):
        return comm.engine_name, comm.memory, comm.hbm_bytes, comm.device.type

    res = ps.run_virtual(2, fn, device="cuda", config={"staging_bytes": 1 << 20})
    assert all(r[0] == "cuda" and r[1] == "loopback" and r[2] >= (1 << 20) and r[3] == "cuda" for r in res)


def _graph_calls(comm, bufs):
    """A sequence of different collectives on static buffers."""
    x16, x32, big, a2a = bufs["x16"], bufs["x32"], bufs["big"], bufs["a2a"]
    comm.all_reduce(x16, out=bufs["o16"])
    comm.all_gather(x32, out=bufs["ag"])
    comm.reduce_scatter(big, "max", out=bufs["rs"])
    comm.all_to_all(a2a, out=bufs["a2"])
    comm.all_reduce(big, out=bufs["obig"])


def _graph_expected(world, r, s):
    from purlin_sglang.testing.collectives import all_gather, all_reduce, all_to_all, reduce_scatter

    xs = {k: [make_input(s * 10 + j, p, shp, dt) for p in range(world)]
          for j, (k, shp, dt) in enumerate(_GRAPH_INPUTS(world))}
    return xs, {
        "o16": all_reduce(xs["x16"], r), "ag": all_gather(xs["x32"], r), "rs": reduce_scatter(xs["big"], r, "max"),
        "a2": all_to_all(xs["a2a"], r), "obig": all_reduce(xs["big"], r),
    }


def _GRAPH_INPUTS(world):
    return [("x16", (4096,), torch.bfloat16), ("x32", (5, 3), torch.float32),
            ("big", (world * 64, 1031), torch.float32), ("a2a", (world * 3, 7), torch.float16)]


@pytest.mark.parametrize("world", [4, 8])
def test_cuda_graphs_replay_concurrently(world):
    replays, sets = (1000 if world == 4 else 300), 3
    cfg = {"staging_bytes": 1 << 20, "timeout_s": 30, "tuning": {"oneshot_max_bytes": 16384}}
    barrier = threading.Barrier(world)
    one_capture = threading.Lock()  # captures one at a time (torch.cuda.graph synchronizes the device)

    def fn(comm):
        r, dev = comm.rank, comm.device
        data = []
        for s in range(sets):
            xs, want = _graph_expected(world, r, SEED + s)
            data.append(({k: v[r].to(dev) for k, v in xs.items()}, {k: v.to(dev) for k, v in want.items()}))
        bufs = {k: v.clone() for k, v in data[0][0].items()}
        bufs.update({k: torch.full_like(v, float("nan")) for k, v in data[0][1].items()})
        _graph_calls(comm, bufs)  # warm-up: encodes every op table outside the capture
        comm.synchronize()
        barrier.wait()
        g = torch.cuda.CUDAGraph()
        with one_capture, comm.capture(), torch.cuda.graph(g, stream=torch.cuda.current_stream(),
                                                           capture_error_mode="thread_local"):
            _graph_calls(comm, bufs)
        barrier.wait()
        bad = 0
        for i in range(replays):
            inp, want = data[i % sets]
            for k, v in inp.items():
                bufs[k].copy_(v)
            for k in want:
                bufs[k].fill_(float("nan"))
            g.replay()
            if i % 10 == 0 or i >= replays - sets:
                bad += sum(not torch.equal(bufs[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
        comm.synchronize()
        return bad

    assert ps.run_virtual(world, fn, device="cuda", config=cfg) == [0] * world, f"seed {SEED}"


@pytest.mark.parametrize("check_on", [True, False])
def test_eager_calls_after_the_first_of_a_shape_launch_through_the_bound_struct(check_on):
    """One rank (no launch gate): the first call of a shape runs execute() and binds it; every later
    call is one native call (CudaEngine.launch, the module's snac_launch) on that shape's own struct,
    with new pointers each call: new inputs, out= and a new output, two shapes interleaved, the
    packet and the staged kernel. World 1 sums one rank: each output is its input, bitwise."""
    cfg = {**CFG, "device_call_check": check_on}

    def fn(comm):
        xs = [torch.randn(n, device=comm.device).to(torch.bfloat16) for n in (4096, 4096, 4096, 300000, 300000)]
        outs = [comm.all_reduce(x) for x in xs]  # 8 KiB: packets; 600 KB: staged
        out = torch.full_like(xs[1], float("nan"))
        assert comm.all_reduce(xs[1], out=out) is out
        g = torch.randn(5, 3, device=comm.device)
        gathered = [comm.all_gather(g) for _ in range(3)]
        comm.synchronize()
        launches = [type(c.launch).__name__ for c in comm._path.calls.values()]
        return [torch.equal(o, x) for o, x in zip(outs, xs)] + [torch.equal(out, xs[1])] + [
            torch.equal(a, g) for a in gathered], launches

    (same, launches), = ps.run_virtual(1, fn, device="cuda", config=cfg)
    assert all(same), same
    assert launches == ["_Launch"] * 3, launches  # two all_reduce shapes and the all_gather, each bound


def test_timeout_names_op_rank_and_peer_then_a_new_world_works():
    timeout = 2.0

    first = threading.Barrier(3)

    def fn(comm):
        x = torch.ones(1000, device=comm.device)
        torch.cuda.current_stream().synchronize()
        first.wait()
        comm.all_reduce(x)
        if comm.rank != 2:  # rank 2 skips the second call
            comm.all_reduce(x)
        comm.synchronize()

    t0 = time.monotonic()
    with pytest.raises(PurlinTimeoutError) as info:
        ps.run_virtual(3, fn, device="cuda", config={"timeout_s": timeout, "staging_bytes": 1 << 20})
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < timeout + 5, elapsed
    assert msg.startswith("all_reduce: rank ") and "rank 2" in msg and info.value.missing == (2,), msg
    assert info.value.rank in (0, 1)
    again = threading.Barrier(3)

    def fresh(c):  # every device buffer exists before any rank's kernel spins (a loopback rule: DESIGN.md)
        x, y = torch.full((8,), float(c.rank), device=c.device), torch.empty(8, device=c.device)
        torch.cuda.current_stream().synchronize()
        again.wait()
        return c.all_reduce(x, out=y).cpu()

    res = ps.run_virtual(3, fresh, device="cuda", config={"timeout_s": timeout})
    assert all(torch.equal(t, torch.full((8,), 3.0)) for t in res)


def test_ranks_keep_streams_of_their_own_when_rank_code_makes_many_streams():
    """Two ranks on one stream wait for each other (packets queued behind a spinning kernel). Rank
    code that makes more streams than torch's pool of 32 must not land on another rank's stream."""
    world, n = 8, 64 * 1024 // 2
    seen: dict[int, int] = {}
    ready = threading.Barrier(world)  # no rank allocates while another's kernel spins (DESIGN.md)

    def fn(comm):
        own = torch.cuda.current_stream().cuda_stream
        extra = [torch.cuda.Stream() for _ in range(40)]  # more than the pool's 32: it wraps
        assert own not in {s.cuda_stream for s in extra}, "a pooled stream is this rank's own stream"
        gen = torch.Generator(device="cuda").manual_seed(SEED + comm.rank)
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.full_like(x, float("nan"))
        torch.cuda.current_stream().synchronize()
        ready.wait()
        comm.all_reduce(x, out=out)
        comm.synchronize()
        seen[comm.rank] = own
        return x.cpu(), out.cpu()

    res = ps.run_virtual(world, fn, device="cuda", config=CFG)
    assert len(set(seen.values())) == world, f"ranks share streams: {seen}"
    acc = res[0][0].float()
    for x, _ in res[1:]:
        acc += x.float()  # rank order, f32: what the engine computes
    for r, (_, got) in enumerate(res):
        assert torch.equal(got, acc.to(torch.bfloat16)), f"rank {r}: all_reduce differs (seed {SEED})"
