"""Groups on several (simulated) nodes: processes on one host, ``topology.node_of_rank`` saying which
node each is on; purlin's CPU engine inside each node, gloo between. Every collective on random
sizes and values against the torch reference: bitwise for copies, and for reductions against the
defined two-level order (reference.two_level_reduce)."""

from __future__ import annotations

import random
import tempfile

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang import reference as ref
from purlin_sglang.testing import launch

CFG = {"staging_bytes": 1 << 16, "timeout_s": 60}
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)


def _x(seed: int, rank: int, rows: int, dtype: torch.dtype, cols: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(rows, cols, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (rows, cols), generator=g, dtype=dtype)


def _cases(seed: int, world: int) -> list[tuple]:
    """The same random calls on every rank: (op, dtype, rows per rank, sizes, splits matrix, root, red)."""
    rnd = random.Random(seed)
    cases = []
    for i in range(10):
        dtype = DTYPES[i % len(DTYPES)]
        sizes = [rnd.randint(0, 5) for _ in range(world)]
        splits = [[rnd.randint(0, 4) for _ in range(world)] for _ in range(world)]
        red = rnd.choice(["sum", "sum", "max", "min"])
        cases.append((dtype, rnd.randint(1, 9), sizes, splits, rnd.randrange(world), red))
    return cases


def _job(rank, world, nodes, seed, shm):
    cfg = {**CFG, "shm_dir": shm, "topology": {"node_of_rank": nodes}}
    out = []
    with ps.Communicator(config=cfg) as comm:
        assert type(comm).__name__ == "MultiNodeCommunicator" and comm.node_of_rank == tuple(nodes)
        for i, (dtype, rows, sizes, splits, root, red) in enumerate(_cases(seed, world)):
            s = seed + i
            x = _x(s, rank, rows, dtype)
            res = {"all_reduce": comm.all_reduce(x, red), "all_gather": comm.all_gather(x),
                   "reduce_scatter": comm.reduce_scatter(_x(s, rank, rows * world, dtype), red),
                   "all_to_all": comm.all_to_all(_x(s, rank, rows * world, dtype)),
                   "all_gather_v": comm.all_gather_v(_x(s, rank, sizes[rank], dtype), sizes),
                   "reduce_scatter_v": comm.reduce_scatter_v(_x(s, rank, sum(sizes), dtype), sizes, red),
                   "all_to_all_v": comm.all_to_all_v(_x(s, rank, sum(splits[rank]), dtype), splits[rank],
                                                     [splits[p][rank] for p in range(world)])}
            b = _x(s, rank, rows, dtype)
            comm.broadcast(b, root)
            res["broadcast"] = b
            inplace = x.clone()
            comm.all_reduce(inplace, red, out=inplace)
            res["all_reduce_in_place"] = inplace
            out.append(res)
    return out


def _expected(world, nodes, seed, r):
    exp = []
    for i, (dtype, rows, sizes, splits, root, red) in enumerate(_cases(seed, world)):
        s = seed + i
        xs = [_x(s, p, rows, dtype) for p in range(world)]
        big = [_x(s, p, rows * world, dtype) for p in range(world)]
        two = ref.two_level_reduce(xs, nodes, red)
        e = {"all_reduce": two, "all_reduce_in_place": two, "all_gather": ref.all_gather(xs, r),
             "reduce_scatter": ref.two_level_reduce([x.chunk(world)[r] for x in big], nodes, red),
             "all_to_all": ref.all_to_all(big, r),
             "all_gather_v": ref.all_gather_v([_x(s, p, sizes[p], dtype) for p in range(world)], r),
             "reduce_scatter_v": ref.two_level_reduce(
                 [_x(s, p, sum(sizes), dtype).split(sizes)[r] for p in range(world)], nodes, red),
             "all_to_all_v": ref.all_to_all_v([_x(s, p, sum(splits[p]), dtype) for p in range(world)], r, splits),
             "broadcast": ref.broadcast(xs, r, root)}
        exp.append(e)
    return exp


LAYOUTS = {
    "2x2": [0, 0, 1, 1],
    "2x3": [0, 0, 0, 1, 1, 1],
    "3x2": [0, 0, 1, 1, 2, 2],
    "2x2-interleaved": [1, 0, 1, 0],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_collective_on_simulated_nodes_equals_the_reference(name):
    nodes = LAYOUTS[name]
    world = len(nodes)
    seed = sum(map(ord, name))
    with tempfile.TemporaryDirectory() as shm:
        got = launch(_job, world, nodes, seed, shm, timeout_s=300)
    for r in range(world):
        for i, (g, e) in enumerate(zip(got[r], _expected(world, nodes, seed, r))):
            for op in e:
                assert g[op].dtype == e[op].dtype and torch.equal(g[op], e[op]), (name, r, i, op, g[op], e[op])


def _errors_job(rank, world, shm):
    from purlin_sglang.collectives import CollectiveSpec
    from purlin_sglang.collectives.layout import COPY, PACKED, SCATTERED

    seen = []
    with ps.Communicator(config={**CFG, "shm_dir": shm, "topology": {"node_of_rank": [0, 0, 1, 1]}}) as comm:
        send = [1, 1, 1, 1]
        recv = [1, 1, 1, 2] if rank == 1 else [1, 1, 1, 1]  # rank 1 expects 2 rows from rank 3, which sends 1
        try:
            comm.all_to_all_v(torch.ones(4, 2), send, recv)
        except ps.PurlinMismatchError as e:
            seen.append(str(e))
        mine = CollectiveSpec("my_gather", PACKED, SCATTERED, COPY)
        try:
            comm.run(mine, torch.ones(2))
        except ps.PurlinUnavailableError as e:
            seen.append(str(e))
        seen.append(comm.all_reduce(torch.ones(3)).tolist())
        seen.append((comm.algorithm("all_reduce", 1024), comm.workspace_bytes > 0, repr(comm)))
    return seen


def test_split_disagreements_and_custom_specs_raise_on_every_rank_and_the_group_stays_usable():
    with tempfile.TemporaryDirectory() as shm:
        got = launch(_errors_job, 4, shm, timeout_s=300)
    for seen in got:
        assert "rank 3 sends 1 row to rank 1 (its input_splits[1]), but rank 1 expects 2 rows" in seen[0], seen
        assert "my_gather: a collective outside the catalog cannot run across nodes" in seen[1], seen
        assert seen[2] == [4.0, 4.0, 4.0], seen
        assert seen[3][0] == "two-level" and seen[3][1] and "nodes=2" in seen[3][2], seen
