"""The MoE exchange of a group on several (simulated) nodes, against the one-node reference: bitwise
dispatch rows (exact, capacity and FP8) and combine, on random routings with uneven token counts;
a capacity overflow and a bad argument on one rank raise on every rank, and the communicator stays
usable."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.testing import launch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "moe"))
from _moe_cases import FP8, check_results, make_case, run_rank  # noqa: E402

CFG = {"staging_bytes": 1 << 18, "timeout_s": 60}


def _job(rank, world, nodes, cases, shm):
    out = []
    with ps.Communicator(config={**CFG, "shm_dir": shm, "topology": {"node_of_rank": nodes}}) as comm:
        for xs, ids, ws, experts, capacity, dtype in cases:
            res = run_rank(comm, xs, ids, ws, experts, capacity=capacity, dtype=dtype)
            if res["x"].dtype == FP8:  # FP8 tensors do not travel back to the parent: their bytes do
                res["x"] = res["x"].view(torch.uint8)
            out.append(res)
    return out


LAYOUTS = {"2x2": [0, 0, 1, 1], "3x2": [0, 0, 1, 1, 2, 2], "2x2-interleaved": [0, 1, 0, 1]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dispatch_and_combine_across_nodes_equal_the_one_node_reference(name):
    nodes = LAYOUTS[name]
    world = len(nodes)
    cases = []
    for i, (experts, topk, capacity, dtype) in enumerate([(2 * world, 3, None, None), (4 * world, 4, 16, None),
                                                          (world, 2, None, FP8), (8 * world, 8, None, None)]):
        xs, ids, ws = make_case(world, experts, topk, 16, torch.bfloat16 if i % 2 else torch.float32, seed=31 + i)
        cases.append((xs, ids, ws, experts, capacity, dtype))
    with tempfile.TemporaryDirectory() as shm:
        got = launch(_job, world, nodes, cases, shm, timeout_s=300)
    for i, (xs, ids, ws, experts, capacity, dtype) in enumerate(cases):
        check_results([g[i] for g in got], xs, ids, ws, experts, capacity=capacity, dtype=dtype)


def _errors_job(rank, world, nodes, shm):
    seen = []
    with ps.Communicator(config={**CFG, "shm_dir": shm, "topology": {"node_of_rank": nodes}}) as comm:
        x = torch.randn(6, 8)
        w = torch.rand(6, 2)
        ids = torch.full((6, 2), 1, dtype=torch.int64)  # 12 rows for expert 1 from every rank
        try:
            comm.moe_dispatch(x, ids, w, num_experts=world, capacity=4)
        except ps.PurlinCapacityError as e:
            seen.append(("capacity", e.rank, e.expert, e.count))
        bad = ids.clone()
        if rank == 3:
            bad[0, 0] = world  # out of range on rank 3 only
        try:
            comm.moe_dispatch(x, bad, w, num_experts=world)
        except ps.PurlinValueError as e:
            seen.append((type(e).__name__, str(e)))
        d = comm.moe_dispatch(x, ids, w, num_experts=world)
        y = comm.moe_combine(torch.ones(d.rows, 8), d)  # every expert row 1: y = the token's weight sum
        seen.append(("ok", d.rows, torch.equal(y, (w[:, :1] + w[:, 1:]).expand(6, 8))))
        seen.append(("after", comm.all_reduce(torch.ones(2)).tolist()))
    return seen


def test_capacity_overflow_and_one_ranks_bad_argument_raise_on_every_rank():
    nodes = [0, 0, 1, 1]
    with tempfile.TemporaryDirectory() as shm:
        got = launch(_errors_job, 4, nodes, shm, timeout_s=300)
    for rank, seen in enumerate(got):
        assert seen[0] == ("capacity", 0, 1, 12), seen  # 6 tokens x 2 slots from rank 0 alone
        name, msg = seen[1]
        if rank == 3:
            assert name == "PurlinValueError" and "topk_ids holds 4" in msg, msg
        else:
            assert name == "PurlinRejectedError" and "rank 3" in msg and "topk_ids holds 4" in msg, msg
        assert seen[2] == ("ok", 48 if rank == 1 else 0, True), seen
        assert seen[3] == ("after", [4.0, 4.0]), seen


def _crossing_job(rank, world, shm):
    with ps.Communicator(config={**CFG, "shm_dir": shm, "topology": {"node_of_rank": [0, 0, 1, 1]}}) as comm:
        t = 5
        x = torch.randn(t, 8)
        # 8 experts, 2 per rank: every token picks experts 4..7, all on node 1 (ranks 2 and 3)
        ids = torch.tensor([[4, 5, 6, 7]] * t)
        d = comm.moe_dispatch(x, ids, torch.rand(t, 4), num_experts=8)
        return comm._moe.rows_across, d.rows


def test_a_token_crosses_to_a_node_once_whatever_its_experts_there():
    with tempfile.TemporaryDirectory() as shm:
        got = launch(_crossing_job, 4, shm, timeout_s=300)
    # node 0's ranks send each of their 5 tokens across once (not once per destination rank: 10);
    # node 1's ranks keep theirs inside the node
    assert [g[0] for g in got] == [5, 5, 0, 0], got
    assert [g[1] for g in got] == [0, 0, 4 * 5 * 2, 4 * 5 * 2], got  # each of rank 2, 3: 2 slots of 20 tokens
