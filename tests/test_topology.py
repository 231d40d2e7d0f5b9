"""A group's nodes (config ``topology.node_of_rank``, else the ranks' hosts). A group on several
nodes runs in two levels (tests/multinode); where it cannot (``topology.inter_node: off``, nodes
with different numbers of ranks) it is refused at construction on every rank, with an error naming
the nodes, and leaves no shared-memory file."""

import os
import tempfile

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.errors import PurlinConfigError, PurlinUnavailableError
from purlin_sglang.memory import bootstrap
from purlin_sglang.testing import launch

CFG = {"staging_bytes": 1 << 16, "timeout_s": 30}


def _mp_nodes(rank, world, nodes, shm_dir, inter="auto"):
    cfg = {**CFG, "shm_dir": shm_dir, **({"topology": {"node_of_rank": nodes(rank), "inter_node": inter}}
                                         if nodes else {})}
    try:
        with ps.Communicator(config=cfg) as comm:
            out = comm.all_reduce(torch.ones(3))
            return "ok", comm.node_of_rank, out.tolist()
    except ps.PurlinError as e:
        return type(e).__name__, str(e), sorted(os.listdir(shm_dir))


def test_one_host_is_one_node():
    with tempfile.TemporaryDirectory() as d:
        res = launch(_mp_nodes, 3, None, d, timeout_s=120)
    assert all(r == ("ok", (0, 0, 0), [3.0, 3.0, 3.0]) for r in res), res


def _two_nodes(rank):
    return [0, 0, 1, 1]


def test_a_group_on_two_nodes_runs_in_two_levels():
    with tempfile.TemporaryDirectory() as d:
        res = launch(_mp_nodes, 4, _two_nodes, d, timeout_s=120)
    assert all(r == ("ok", (0, 0, 1, 1), [4.0, 4.0, 4.0]) for r in res), res


def test_a_group_on_two_nodes_is_refused_on_every_rank_naming_them_when_inter_node_is_off():
    with tempfile.TemporaryDirectory() as d:
        res = launch(_mp_nodes, 4, _two_nodes, d, "off", timeout_s=120)
    for name, msg, files in res:
        assert name == "PurlinTopologyError", (name, msg)
        assert "spans 2 nodes (node 0: ranks [0, 1]; node 1: ranks [2, 3]; from topology.node_of_rank)" in msg, msg
        assert files == [], files  # refused before any shared memory is made


def _uneven(rank):
    return [0, 0, 0, 1]


def test_nodes_with_different_numbers_of_ranks_are_refused_on_every_rank():
    with tempfile.TemporaryDirectory() as d:
        res = launch(_mp_nodes, 4, _uneven, d, timeout_s=120)
    for name, msg, files in res:
        assert name == "PurlinTopologyError" and "different numbers of the group's ranks" in msg, (name, msg)
        assert "node 0: ranks [0, 1, 2]; node 1: ranks [3]" in msg, msg
        assert files == [], files


def _disagree(rank):
    return [0, 0] if rank == 0 else [0, 1]


def _short(rank):
    return [0]


@pytest.mark.parametrize("nodes,want", [(_disagree, "the ranks disagree on topology.node_of_rank"),
                                        (_short, "topology.node_of_rank has 1 entries, the group has 2 ranks")])
def test_a_bad_topology_is_a_config_error_on_every_rank(nodes, want):
    with tempfile.TemporaryDirectory() as d:
        res = launch(_mp_nodes, 2, nodes, d, timeout_s=120)
    assert all(r[0] == "PurlinConfigError" and want in r[1] for r in res), res


def test_node_ids_are_checked_by_the_config():
    with pytest.raises(PurlinConfigError, match="topology.node_of_rank"):
        ps.PurlinConfig.from_dict({"topology": {"node_of_rank": [0, -1]}})
    with pytest.raises(PurlinConfigError, match="topology.node_of_rank"):
        ps.PurlinConfig.from_dict({"topology": {"node_of_rank": []}})
    assert ps.PurlinConfig.from_dict({"topology": {"node_of_rank": [0, 0]}}).topology.node_of_rank == (0, 0)


def test_virtual_ranks_are_one_node():
    assert ps.run_virtual(2, lambda c: c.node_of_rank, config={"topology": {"node_of_rank": [0, 0]}}) == [(0, 0)] * 2
    with pytest.raises(PurlinUnavailableError, match="one node"):
        ps.run_virtual(2, lambda c: c.node_of_rank, config={"topology": {"node_of_rank": [0, 1]}})


def test_a_host_is_its_name_and_boot():
    ident = bootstrap.node_identity()
    assert ident.startswith(__import__("socket").gethostname())
