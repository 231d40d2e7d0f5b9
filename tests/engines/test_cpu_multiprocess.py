"""The CPU engine across processes (host shared memory under /dev/shm), and the launch helper itself.

Each launch spawns fresh processes (a few seconds each on this machine), so one launch runs many
checks: every collective (a representative set of dtypes and ops), both all_reduce algorithms,
cyclic staging, zero-row and odd-width sizes, in-place all_reduce, a long mixed sequence, bad inputs
followed by good calls, and a communicator over a subgroup. Results come back to the parent, which
compares them bitwise with the plain torch references and across ranks.
"""

import os
import time

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.testing.collectives import (
    COLLECTIVES, REDUCING, assert_bits_equal, bits, case, case_expected, case_inputs, check_case,
)
from purlin_sglang.testing import WorkerError, launch


def mp_cases(world):
    cases = []
    for i, coll in enumerate(COLLECTIVES):
        for j, dtype in enumerate([torch.float32, torch.bfloat16, torch.int64, torch.float16]):
            if coll not in REDUCING and dtype is torch.float16:
                dtype = torch.bool
            op = ("sum", "max", "min")[(i + j) % 3] if coll in REDUCING else None
            cases.append(case(coll, dtype, rows=(0, 1, 3)[j % 3], width=(3, 1, 7)[i % 3], op=op,
                              seed=100 * i + j, root=(i + j) % world, salt=j))
    return cases


def _mp_collectives(rank, world, configs):
    """Every case under every config, checked in the worker; returns the raw bytes for the parent."""
    out = {}
    for name, cfg, cases in configs:
        with ps.Communicator(config=cfg) as comm:
            assert (comm.rank, comm.world_size) == (rank, world)
            assert comm.workspace_bytes >= world * cfg["staging_bytes"]
            out[name] = [{k: bits(v) for k, v in check_case(comm, c).items()} for c in cases]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_across_processes(world):
    cases = mp_cases(world)
    big = [case(coll, torch.float32, rows=rows, width=257, seed=7, root=world - 1, op=op)
           for coll, rows, op in [("all_reduce", 100, "sum"), ("reduce_scatter", 33, "max"), ("all_gather", 100, None),
                                  ("all_to_all", 33, None), ("broadcast", 100, None), ("reduce", 100, "min")]]
    configs = [
        ("oneshot", {"staging_bytes": 1 << 16, "timeout_s": 20, "tuning": {"algorithm": "oneshot"}}, cases),
        ("twoshot", {"staging_bytes": 1 << 16, "timeout_s": 20, "tuning": {"algorithm": "twoshot"}},
         [c for c in cases if c["coll"] == "all_reduce"]),
        ("cyclic-oneshot", {"staging_bytes": 4096, "timeout_s": 20, "tuning": {"algorithm": "oneshot"}}, big),
        ("cyclic-twoshot", {"staging_bytes": 4096, "timeout_s": 20, "tuning": {"algorithm": "twoshot"}}, big[:1]),
    ]
    results = launch(_mp_collectives, world, configs, timeout_s=120)
    # The workers already compared with the reference; check here too (the parent computes its own
    # references) and that every rank holds bitwise identical results where the collective says so.
    for name, _, cs in configs:
        for i, c in enumerate(cs):
            xs = case_inputs(c, world)
            for r in range(world):
                want, touched = case_expected(c, world, r, xs)
                if touched:
                    got = results[r][name][i]["out"]
                    assert got == bits(want), (name, c, r)
            if c["coll"] in ("all_reduce", "all_gather", "all_gather_v", "broadcast"):
                assert len({results[r][name][i]["out"] for r in range(world)}) == 1, (name, c)


def _mp_sequence(rank, world):
    return [_mp_sequence_once(rank, world) for _ in range(2)]  # two fresh communicators, same calls


def _mp_sequence_once(rank, world):
    cfg = {"staging_bytes": 8192, "timeout_s": 20}
    seen = []
    with ps.Communicator(config=cfg) as comm:
        for rep in range(2):
            for i, coll in enumerate(COLLECTIVES * 2):
                dtype = (torch.float32, torch.bfloat16, torch.int32)[(i + rep) % 3]
                op = ("sum", "max", "min")[i % 3] if coll in REDUCING else None
                c = case(coll, dtype, rows=1 + i % 4, width=1 + 2 * (i % 3), op=op, seed=i, root=i % world, salt=i)
                if rank == world - 1:
                    time.sleep(0.002)  # a lagging rank: producers run ahead into the next call
                seen.append(bits(check_case(comm, c, paths=("out",))["out"]))
        # bad inputs, each on every rank, then a good call
        for bad in (lambda: comm.all_reduce(torch.ones(3), "avg"),
                    lambda: comm.reduce_scatter(torch.ones(world + 1)),
                    lambda: comm.all_gather(torch.ones(2), out=torch.ones(3)),
                    lambda: comm.all_to_all_v(torch.ones(world), [1] * (world + 1), [1] * world),
                    lambda: comm.broadcast(torch.ones(2), world)):
            try:
                bad()
            except ps.PurlinValueError:
                pass
            else:
                raise AssertionError("a bad call was accepted")
        seen.append(bits(comm.all_reduce(torch.full((4,), float(rank)))))
    return seen


def test_long_mixed_sequence_and_bad_inputs_across_processes():
    res = launch(_mp_sequence, 3, timeout_s=120)
    for first, again in res:
        assert first == again  # repeated runs give identical bits
        assert first[-1] == bits(torch.full((4,), 3.0))


def _mp_groups(rank, world):
    import torch.distributed as dist

    res = {"env": os.environ.get("PURLIN_TEST_MARK"), "threads": torch.get_num_threads()}
    sub = dist.new_group([1, 2])  # collective over the world: every rank creates it
    if rank == 0:
        with pytest.raises(ps.PurlinValueError, match="not a member"):
            ps.Communicator(group=sub, config={"staging_bytes": 4096})
    else:
        with ps.Communicator(group=sub, config={"staging_bytes": 4096, "timeout_s": 20}) as comm:
            assert (comm.rank, comm.world_size) == (rank - 1, 2)
            res["sub"] = comm.all_gather(torch.tensor([rank * 10])).tolist(), comm.all_reduce(
                torch.tensor([float(rank)])).item()
    # ranks that disagree on staging_bytes: every rank is told (none is left blocked in a collective)
    try:
        ps.Communicator(config={"staging_bytes": 4096 * (1 + (rank == 2))})
    except ps.PurlinConfigError as e:
        res["disagree"] = str(e)
    # and the group still works afterwards
    with ps.Communicator(config={"staging_bytes": 4096, "timeout_s": 20}) as comm:
        res["after"] = comm.all_reduce(torch.tensor([1.0])).item()
    return res


def test_subgroups_config_disagreement_and_no_leftover_shared_memory():
    before = {f for f in os.listdir("/dev/shm") if f.startswith("purlin-")}
    res = launch(_mp_groups, 3, timeout_s=120, env={"PURLIN_TEST_MARK": "x"})
    after = {f for f in os.listdir("/dev/shm") if f.startswith("purlin-")}
    assert after <= before, after - before
    assert "PURLIN_TEST_MARK" not in os.environ  # env is set for the workers only
    assert [(r["env"], r["threads"]) for r in res] == [("x", 1)] * 3
    assert "sub" not in res[0] and res[1]["sub"] == res[2]["sub"] == ([10, 20], 3.0)
    for r in res:
        assert r["disagree"] == "Communicator: rank 2: rank 0 uses staging_bytes=4096, rank 2 uses 8192; every rank needs the same config"
        assert r["after"] == 3.0


def _mp_mismatch(rank, world):
    import time as _time

    with ps.Communicator(config={"staging_bytes": 4096, "timeout_s": 30}) as comm:
        comm.all_reduce(torch.ones(4))
        t0 = _time.monotonic()
        try:
            if rank == 0:
                comm.all_reduce(torch.ones(6, dtype=torch.bfloat16))
            else:
                comm.all_gather(torch.ones(3, dtype=torch.float32))
            return "ok", "", _time.monotonic() - t0
        except ps.PurlinError as e:
            return type(e).__name__, str(e), _time.monotonic() - t0


def test_processes_in_different_calls_get_a_mismatch_naming_both_calls():
    res = launch(_mp_mismatch, 2, timeout_s=120)
    calls = {0: "all_reduce(dtype=bfloat16, 12 bytes in)", 1: "all_gather(dtype=float32, 12 bytes in)"}
    found = [(r, msg, secs) for r, (kind, msg, secs) in enumerate(res) if kind == "PurlinMismatchError"]
    assert found, res
    for r, msg, secs in found:
        assert secs < 10, (r, secs)  # at once, not after timeout_s (30 s)
        assert f"rank {r} and rank {1 - r} entered call #2 with different collectives" in msg, msg
        assert f"rank {r} called {calls[r]}, rank {1 - r} called {calls[1 - r]}" in msg, msg
    assert all(kind in ("ok", "PurlinMismatchError", "PurlinBrokenError") for kind, _, _ in res), res


# -- the launch helper -----------------------------------------------------------------------
def _mp_mixed_failures(rank, world, payload):
    if rank == 0:
        raise KeyError("rank zero fails here")
    if rank == 1:
        os._exit(3)
    if rank == 2:
        time.sleep(600)  # never answers: must be killed
    return "fine", rank, world, payload


def test_launch_reports_worker_failures_and_never_hangs():
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(_mp_mixed_failures, 4, {"t": torch.arange(3)}, timeout_s=90, fail_grace_s=3)
    assert time.monotonic() - t0 < 60
    e = info.value
    assert {r: f.kind for r, f in e.failures.items()} == {0: "raised", 1: "died", 2: "timeout"}
    f0 = e.failures[0]
    assert f0.type_name == "KeyError" and isinstance(f0.exception, KeyError)
    assert "_mp_mixed_failures" in f0.traceback and 'raise KeyError("rank zero fails here")' in f0.traceback
    assert e.failures[1].exitcode == 3
    assert "rank zero fails here" in str(e) and "exit code 3" in str(e) and "rank 2 did not answer" in str(e)
    fine, rank, world, payload = e.results[3]  # a rank that answered: its result is kept
    assert (fine, rank, world) == ("fine", 3, 4) and torch.equal(payload["t"], torch.arange(3))
