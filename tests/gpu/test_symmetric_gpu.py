"""The symmetric heap and the direct plans on the GPU (loopback ranks on one GPU): inputs allocated with
``Communicator.symmetric_empty`` are read in place by the peers' kernels (STAGE refs past staging),
bitwise the CPU engine running the same direct plans; and in CUDA graphs, the heap inputs rewritten
before every replay while the ranks replay concurrently."""

from __future__ import annotations

import threading

import pytest
import torch

from _engine_check import SEED  # noqa: E402
import purlin_sglang as ps  # noqa: E402
from purlin_sglang.testing.collectives import (  # noqa: E402
    PACKET_FORMS, assert_bits_equal, case_call, case_expected, case_inputs, heap_cases, heap_input, poison_like,
)

pytestmark = pytest.mark.gpu
# packets off and the built-in thresholds (the shipped H200 table would choose packets), so that every
# call would run the staged one-shot (or two-shot) and runs direct instead
HEAP = {"staging_bytes": 1 << 20, "symmetric_bytes": 8 << 20, "timeout_s": 8,
        "tuning": {"packet_max_bytes": 0, "table": "thresholds"}}


def _heap_run(world: int, cases: list[dict], device: str, config=HEAP) -> list:
    """Every case with this rank's input in a new heap tensor (the largest rows of any rank, so every
    rank allocates alike), output poisoned; every buffer made before the first collective (a device
    allocation while a peer's kernel spins would serialize the loopback ranks' streams)."""
    barrier = threading.Barrier(world)

    def fn(comm):
        jobs = []
        for c in cases:
            xs = case_inputs(c, world)
            want, _ = case_expected(c, world, comm.rank, xs)
            jobs.append((c, heap_input(comm, xs), poison_like(want).to(comm.device), xs[comm.rank]))
        barrier.wait()
        for c, x, out, _ in jobs:
            assert case_call(comm, c, x, out) is out
        comm.synchronize()
        for c, x, _, x0 in jobs:
            assert_bits_equal(x.cpu(), x0, f"{c['coll']}: the input must be left unchanged")
        algs = {c.name: c.sched.plan.algorithm for c in comm._path.calls.values()}
        return [out.cpu() for _, _, out, _ in jobs], algs

    return ps.run_virtual(world, fn, device=device, config=config)


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("twoshot", [False, True])
def test_heap_inputs_are_read_in_place_bitwise_the_cpu_engine(world, twoshot):
    """``twoshot``: the all_reduces run the direct two-shot, in chunks of 64 bytes through the shard's slots."""
    cases = heap_cases(SEED + world)
    chunks = {**HEAP["tuning"], "oneshot_max_bytes": 0, "max_chunk_bytes": 64}
    cfg = {**HEAP, "tuning": chunks} if twoshot else HEAP
    got = _heap_run(world, cases, "cuda", cfg)
    ref = _heap_run(world, cases, "cpu", cfg)
    for r in range(world):
        want = {n: "direct-twoshot" if twoshot and n == "all_reduce" else "direct" for n in PACKET_FORMS}
        assert got[r][1] == want, got[r][1]
        for i, c in enumerate(cases):
            assert_bits_equal(got[r][0][i], ref[r][0][i], f"seed {SEED} world {world} rank {r}: {c['coll']}")


@pytest.mark.parametrize("world", [4, 8])
def test_direct_calls_in_cuda_graphs_with_the_heap_inputs_rewritten_before_every_replay(world):
    replays = 200
    barrier = threading.Barrier(world)
    one_capture = threading.Lock()

    def fn(comm):
        r, dev = comm.rank, comm.device
        n = 4096
        x = comm.symmetric_empty((world * n,), torch.float32)
        big = comm.symmetric_empty((1 << 19,), torch.float32)  # 2 MiB: past oneshot_max_bytes, the direct two-shot
        big_out = torch.empty(1 << 19, device=dev)
        big_in = [torch.randn(1 << 19, generator=torch.Generator().manual_seed(SEED + 7 + p)) for p in range(world)]
        big.copy_(big_in[r].to(dev))
        ar, ag, rs = (torch.empty(world * n, device=dev), torch.empty(world * world * n, device=dev),
                      torch.empty(n, device=dev))
        gens = [torch.randn(world * n, generator=torch.Generator().manual_seed(SEED + 31 * k + p))
                for k in range(3) for p in range(world)]
        data = [g.to(dev) for g in gens]

        def calls():
            comm.all_reduce(x, out=ar)
            comm.all_gather(x, out=ag)
            comm.reduce_scatter(x, out=rs)
            comm.all_reduce(big, out=big_out)

        x.copy_(data[r])
        calls()  # warm-up: the op tables exist before the capture
        comm.synchronize()
        barrier.wait()
        g = torch.cuda.CUDAGraph()
        with one_capture, torch.cuda.graph(g, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            calls()
        barrier.wait()
        bad = 0
        for i in range(replays):
            k = i % 3
            x.copy_(data[k * world + r])
            g.replay()
            if i % 20 == 0 or i >= replays - 3:
                comm.synchronize()
                ins = [gens[k * world + p] for p in range(world)]
                want_ar = torch.stack(ins).sum(0)
                bad += not torch.allclose(ar.cpu(), want_ar, rtol=0, atol=1e-4)
                bad += not torch.equal(ag.cpu(), torch.cat(ins))
                bad += not torch.allclose(rs.cpu(), want_ar[r * n: (r + 1) * n], rtol=0, atol=1e-4)
                bad += not torch.allclose(big_out.cpu(), torch.stack(big_in).sum(0), rtol=0, atol=1e-4)
        comm.synchronize()
        return bad, sorted({c.sched.plan.algorithm for c in comm._path.calls.values()})

    res = ps.run_virtual(world, fn, device="cuda", config={**HEAP, "timeout_s": 30})
    assert res == [(0, ["direct", "direct-twoshot"])] * world, f"seed {SEED}: {res}"
