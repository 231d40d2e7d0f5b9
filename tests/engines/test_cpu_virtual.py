"""The CPU engine in virtual mode (ranks as threads of one process) against plain torch references.

Every result is compared bitwise with the reference in ``purlin_sglang.testing.collectives`` (reductions are defined
as rank-order accumulation, 16-bit floats in float32), through the ``out=``, default-allocated and
in-place output paths, with outputs poisoned before each call.
"""

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.testing.collectives import (
    COLLECTIVES, COPY_DTYPES, OPS, REDUCE_DTYPES, REDUCING, assert_bits_equal, bits, case, case_inputs,
    check_case,
)

SMALL = {"staging_bytes": 1 << 20, "timeout_s": 20}
COPYING = tuple(c for c in COLLECTIVES if c not in REDUCING)


def run_cases(world, cases, config=SMALL, paths=("out", "default", "inplace")):
    return ps.run_virtual(world, lambda comm: [check_case(comm, c, paths=paths) for c in cases], config=config)


@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=str)
def test_copy_collectives_every_dtype(dtype):
    cases = [case(coll, dtype, rows=2, width=3, seed=i, root=i % 3) for i, coll in enumerate(COPYING)]
    run_cases(3, cases)


@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_reductions_every_dtype_and_op(dtype, op):
    cases = [case(coll, dtype, rows=3, width=5, op=op, seed=i, root=1) for i, coll in enumerate(REDUCING)]
    run_cases(4, cases)


@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot", "auto", "packet"])  # packet: oneshot on CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_all_reduce_algorithms(algorithm, dtype):
    cfg = {**SMALL, "tuning": {"algorithm": algorithm}}
    cases = [case("all_reduce", dtype, rows=rows, width=width, op=op, seed=rows)
             for rows, width, op in [(7, 3, "sum"), (1, 1, "max"), (0, 4, "min"), (33, 1, "sum")]]
    run_cases(3, cases, config=cfg)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_every_collective_every_world_size(world):
    cases = [case(coll, torch.float32, rows=2, width=3, seed=world, root=world - 1, salt=world)
             for coll in COLLECTIVES]
    run_cases(world, cases)


@pytest.mark.parametrize("rows,width", [(0, 4), (1, 1), (1, 3), (2, 7), (5, None)],
                         ids=["0rows", "1row-1col", "1row-odd", "odd-width", "1d"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.complex64], ids=str)
def test_edge_sizes(rows, width, dtype):
    colls = COLLECTIVES if dtype in REDUCE_DTYPES else COPYING
    run_cases(3, [case(coll, dtype, rows=rows, width=width, seed=rows, root=2) for coll in colls])


@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
def test_payloads_larger_than_staging_cycle_through_it(algorithm):
    # ~100 KB per rank through a 4 KiB staging buffer: tens of chunks per item, slots reused cyclically.
    cfg = {"staging_bytes": 4096, "timeout_s": 20, "tuning": {"algorithm": algorithm}}
    cases = [case(coll, torch.float32, rows=rows, width=257, seed=3, root=1)
             for coll, rows in [("all_reduce", 100), ("all_gather", 100), ("reduce_scatter", 33),
                                ("all_to_all", 33), ("broadcast", 100), ("gather", 100), ("scatter", 33)]]
    cases.append(case("all_reduce", torch.bfloat16, rows=200, width=257, op="max", seed=4))
    run_cases(3, cases, config=cfg, paths=("out",))


def test_v_payloads_larger_than_staging():
    cfg = {"staging_bytes": 4096, "timeout_s": 20}

    def fn(comm):
        # V sizes scaled up so that single slices span many chunks (zeros stay zeros).
        r, n = comm.rank, comm.world_size
        sizes = [0, 70, 33]
        send = [[40, 0, 61], [0, 17, 80], [55, 66, 0]]
        xs = [torch.randn(sizes[p], 129, generator=torch.Generator().manual_seed(p)) for p in range(n)]
        out = comm.all_gather_v(xs[r], sizes)
        assert_bits_equal(out, torch.cat(xs), f"rank {r} all_gather_v")
        ys = [torch.randn(sum(send[p]), 129, generator=torch.Generator().manual_seed(10 + p)) for p in range(n)]
        out = comm.all_to_all_v(ys[r], send[r], [send[p][r] for p in range(n)])
        assert_bits_equal(out, torch.cat([ys[p].split(send[p])[r] for p in range(n)]), f"rank {r} all_to_all_v")
        zs = [torch.randn(sum(sizes), 129, generator=torch.Generator().manual_seed(20 + p)) for p in range(n)]
        out = comm.reduce_scatter_v(zs[r], sizes)
        want = zs[0].split(sizes)[r] + zs[1].split(sizes)[r] + zs[2].split(sizes)[r]
        assert_bits_equal(out, want, f"rank {r} reduce_scatter_v")

    ps.run_virtual(3, fn, config=cfg)


def test_results_are_bitwise_identical_on_every_rank_and_every_run():
    # float16 sums with many ranks: an unordered reduction would differ between ranks or runs.
    def fn(comm):
        x = case_inputs(case("all_reduce", torch.float16, rows=65, width=17, seed=9), comm.world_size)[comm.rank]
        x = x * 100
        outs = [bits(comm.all_reduce(x)) for _ in range(3)]
        outs += [bits(comm.reduce_scatter(x))]
        return outs

    for algorithm in ("oneshot", "twoshot"):
        cfg = {**SMALL, "staging_bytes": 8192, "tuning": {"algorithm": algorithm}}
        first = ps.run_virtual(5, fn, config=cfg)
        again = ps.run_virtual(5, fn, config=cfg)
        assert first == again
        for per_rank in first:
            assert per_rank[0] == per_rank[1] == per_rank[2]  # repeated calls
            assert per_rank[0] == first[0][0]  # every rank
        assert len({p[3] for p in first}) == 5  # reduce_scatter: each rank its own shard


def test_many_calls_of_different_collectives_on_one_communicator():
    plan = []
    for i in range(3):
        for j, coll in enumerate(COLLECTIVES):
            dtype = [torch.float32, torch.bfloat16, torch.int32][(i + j) % 3]
            op = OPS[(i + j) % 3] if coll in REDUCING else None
            plan.append(case(coll, dtype, rows=1 + (i + j) % 3, width=1 + 2 * i, op=op, seed=10 * i + j,
                             root=(i + j) % 4, salt=i))
    cfg = {"staging_bytes": 4096, "timeout_s": 20}  # small staging: calls of different shapes reuse it
    results = run_cases(4, plan, config=cfg)
    assert len(results) == 4 and all(len(r) == len(plan) for r in results)


def test_inputs_are_not_all_zero():
    # Guards the tests above: a reference fed with zeros would pass for an engine that writes zeros.
    for dtype in COPY_DTYPES:
        x = case_inputs(case("all_gather", dtype, rows=4, width=4), 2)
        if dtype is not torch.bool:
            assert x[0].count_nonzero() == x[0].numel(), dtype
        assert 0 < x[0].count_nonzero() and not torch.equal(x[0], x[1]), dtype


@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
def test_staging_is_not_reused_before_every_reader_drained_it(algorithm):
    # One rank lags before every call, so producers run ahead into the next call while it still has
    # to read their staging from the previous one; plans change between calls (items, readers, roots,
    # chunk sizes), so the next call's staging must wait for EVERY earlier reader, not only its own.
    import time

    # e.g. broadcast(root 0) then gather(root 1): rank 0 stages for rank 1 only, while rank 2 has not
    # yet read rank 0's broadcast payload from the same staging slot.
    seq = [("all_reduce", 0), ("broadcast", 0), ("gather", 1), ("reduce", 1), ("all_gather", 0),
           ("scatter", 0), ("reduce", 1), ("all_to_all_v", 0), ("broadcast", 1), ("gather", 0),
           ("reduce_scatter", 0), ("all_reduce", 0)]
    plan = [case(coll, torch.float32, rows=24, width=9, seed=i, root=root, salt=i)
            for i, (coll, root) in enumerate(seq)]

    def fn(comm):
        for c in plan:
            if comm.rank == 2:
                time.sleep(0.03)
            check_case(comm, c, paths=("out",))

    ps.run_virtual(3, fn, config={"staging_bytes": 8192, "timeout_s": 20, "tuning": {"algorithm": algorithm}})


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)], ids=str)
def test_sums_are_close_to_a_float64_reference(dtype, tol):
    # The bitwise reference defines the rounding; this checks it (and so the engine) computes the sum.
    def fn(comm):
        xs = case_inputs(case("all_reduce", dtype, rows=16, width=8, seed=5), comm.world_size)
        exact = torch.stack([x.double() for x in xs]).sum(0)
        got = comm.all_reduce(xs[comm.rank].clone())
        torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())
        rs = comm.reduce_scatter(xs[comm.rank].clone())
        torch.testing.assert_close(rs.double(), exact.chunk(comm.world_size)[comm.rank], rtol=tol,
                                   atol=tol * exact.abs().max().item())

    ps.run_virtual(4, fn, config=SMALL)
