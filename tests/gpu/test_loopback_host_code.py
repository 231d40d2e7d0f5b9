"""Loopback virtual ranks run ordinary user code: a rank function that blocks its host right after a
collective (``.cpu()``, ``.item()``, ``print(tensor)``, a new tensor, ``torch.cuda.synchronize()``)
must not time out (issue: reliability, case 6). Random collectives, fresh worlds, every result checked
against the CPU engine bitwise. And a rank that never launches is named, with where its thread was."""

from __future__ import annotations

import os
import random

import pytest
import torch

import purlin_sglang as ps  # noqa: E402
from purlin_sglang.testing.collectives import COLLECTIVES, REDUCING, case, case_call, case_expected, case_inputs  # noqa: E402
from purlin_sglang.errors import PurlinTimeoutError  # noqa: E402

pytestmark = pytest.mark.gpu
SEED = int.from_bytes(os.urandom(3), "little")
CFG = {"staging_bytes": 1 << 20, "timeout_s": 8}


def _cases(rng: random.Random, world: int, n: int) -> list[dict]:
    out = []
    for i in range(n):
        coll = rng.choice(COLLECTIVES)
        dtype = rng.choice([torch.float32, torch.bfloat16]) if coll in REDUCING else rng.choice(
            [torch.float32, torch.bfloat16, torch.int32])
        out.append(case(coll, dtype, rows=rng.choice([1, 3, 64, 1000]), width=rng.choice([1, 7, 128]),
                        seed=SEED + i, root=rng.randrange(world), salt=world))
    return out


def _run_cases(world: int, cases: list[dict], device: str, block: bool):
    def fn(comm):
        got = []
        for j, c in enumerate(cases):
            x = case_inputs(c, world)[comm.rank].to(comm.device)  # a new device tensor between calls
            y = case_call(comm, c, x, None)
            if block:  # what users write: each of these blocks the rank's host right after the call
                kind = (j + comm.rank) % 4
                if kind == 0:
                    y = y.cpu()
                elif kind == 1:
                    _ = y.float().sum().item() if y.numel() else 0
                elif kind == 2:
                    print(f"rank {comm.rank} call {j}: {y.flatten()[:2]}")
                else:
                    torch.cuda.synchronize()
            got.append(y.cpu())
        return got

    return ps.run_virtual(world, fn, device=device, config=CFG)


@pytest.mark.parametrize("trial", range(8))
def test_blocking_host_code_in_rank_threads(trial, capsys):
    rng = random.Random(SEED * 31 + trial)
    world = rng.choice([2, 3, 4, 8])
    cases = _cases(rng, world, 6)
    got = _run_cases(world, cases, "cuda", block=True)  # a fresh world each trial
    want = _run_cases(world, cases, "cpu", block=False)
    for r in range(world):
        for j, (g, w) in enumerate(zip(got[r], want[r])):
            if not case_expected(cases[j], world, r, case_inputs(cases[j], world))[1]:
                continue  # a rooted output off its root is not written (its contents are unspecified)
            assert g.dtype == w.dtype and g.shape == w.shape, (SEED, r, j, cases[j])
            assert torch.equal(g.view(torch.uint8) if g.numel() else g, w.view(torch.uint8) if w.numel() else w), (
                SEED, r, j, cases[j])
    assert ": tensor(" in capsys.readouterr().out  # the prints in rank threads ran


def test_a_rank_that_never_launches_is_named():
    def fn(comm):
        if comm.rank == 2:
            return None  # returns without making the call its peers make
        return comm.all_reduce(torch.ones(16, device=comm.device)).cpu()

    with pytest.raises(PurlinTimeoutError) as info:
        ps.run_virtual(3, fn, device="cuda", config={"staging_bytes": 1 << 20, "timeout_s": 2})
    assert info.value.missing == (2,) and "rank 2 never reached it" in str(info.value), info.value


def test_ranks_in_different_calls_get_a_mismatch_naming_both():
    def fn(comm):
        x = torch.ones(8, device=comm.device)
        return (comm.all_reduce(x) if comm.rank == 0 else comm.all_gather(x)).cpu()

    with pytest.raises(ps.PurlinMismatchError) as info:
        ps.run_virtual(2, fn, device="cuda", config={"staging_bytes": 1 << 20, "timeout_s": 5})
    msg = str(info.value)
    assert "entered call #1" in msg and "all_reduce(dtype=float32, shape=(8,))" in msg and "all_gather(" in msg, msg


def test_worlds_one_after_another_leave_no_cached_memory_behind():
    """Each world reserves memory for its rank streams in torch's cache (reserve_bytes); those blocks can serve no
    later stream, so a world returns them when it ends: worlds made one after another (a benchmark's configs) do
    not pile them up until an allocation fails mid-run."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    for _ in range(3):
        ps.run_virtual(4, lambda c: c.all_reduce(torch.ones(8, device=c.device)).sum().item(), device="cuda",
                       config=CFG, reserve_bytes=512 << 20)
        assert torch.cuda.memory_reserved() <= before + (64 << 20), torch.cuda.memory_reserved() - before
