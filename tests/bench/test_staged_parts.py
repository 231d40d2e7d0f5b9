"""benchmarks/bench_staged_parts.py without a GPU: each variant of the one-shot schedule is what its name
says, encodes for the device, and cannot hang: every wait a rank keeps has the signals it waits for
on the peer it names (a variant that dropped a signal but kept its wait would time out on the GPU)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from purlin_sglang.engines.cuda_ops import encode
from purlin_sglang.memory.layout import DeviceLayout
from purlin_sglang.snac import (
    Copy, PacketPut, PacketReduce, Reduce, Signal, WaitDrainAll, WaitSignal, lower, make_plan, Sizes,
)

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_staged_parts.py"
_spec = importlib.util.spec_from_file_location("bench_staged_parts", _PATH)
bsp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bsp)

N = 8192


def _all(name: str, world: int):
    return [bsp.variant(name, world, r, N) for r in range(world)]


def _unmatched(scheds) -> list[str]:
    """Waits of some rank that no peer's signals satisfy: a notify wait of r on p for item i needs as
    many notifies of p to r for i; a drain-all of r needs an ack from c for every notify r sent c."""
    sent = Counter()  # (kind, from, to, item) -> signals
    waits = Counter()
    drains = set()
    for s in scheds:
        me = s.plan.rank
        for op in s.ops:
            if isinstance(op, Signal):
                sent[(op.kind, me, op.peer, op.item)] += 1
            elif isinstance(op, WaitSignal):
                waits[(op.kind, op.peer, me, op.item)] += 1
            elif isinstance(op, WaitDrainAll):
                drains.add(me)
    bad = [f"{k}: {n} waits, {sent[k]} signals" for k, n in waits.items() if sent[k] < n]
    for (kind, p, c, item), n in sent.items():
        if kind == "notify" and p in drains and sent[("ack", c, p, item)] < n:
            bad.append(f"rank {p} drains item {item} of rank {c}: {n} notifies, {sent[('ack', c, p, item)]} acks")
    return bad


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("name", list(bsp.VARIANTS))
def test_every_variant_encodes_and_keeps_no_wait_without_its_signal(name, world):
    scheds = _all(name, world)
    assert _unmatched(scheds) == []
    dl = DeviceLayout(world, bsp.STAGING)
    for s in scheds:
        encode(s, dl)


@pytest.mark.parametrize("world", [2, 8])
def test_the_variants_take_out_what_they_name(world):
    def kinds(name):
        return Counter(type(op).__name__ + (f":{op.kind}" if hasattr(op, "kind") else "")
                       for s in _all(name, world) for op in s.ops)

    full = kinds("full")
    real = Counter(type(op).__name__ + (f":{op.kind}" if hasattr(op, "kind") else "")
                   for r in range(world)
                   for op in lower(make_plan(bsp.ALL_REDUCE, world, r, staging_bytes=bsp.STAGING, algorithm="oneshot"),
                                   Sizes((N,), (N,))).ops)
    assert full == real  # the planner's own schedule, nothing taken out
    assert full["WaitDrainAll"] == world and full["Signal:ack"] == world * (world - 1)
    assert full["Copy"] == world and full["Reduce"] == world  # stage, reduce
    assert full["Signal:notify"] == full["WaitSignal:notify"] == world * (world - 1)
    assert kinds("no drain-all") == full - Counter({"WaitDrainAll": world})
    assert kinds("no drain-all, no acks") == full - Counter({"WaitDrainAll": world, "Signal:ack": world * (world - 1)})
    assert kinds("sync only (no copy, no reduce)") == full - Counter({"Copy": world, "Reduce": world})
    assert kinds("notifies and their waits only") == Counter(
        {"Signal:notify": world * (world - 1), "WaitSignal:notify": world * (world - 1)})
    assert kinds("data only (stage copy and reduce, no signal; racy)") == Counter({"Copy": world, "Reduce": world})
    assert kinds("no op (the interpreter kernel's launch)") == Counter()
    packet = [s for s in _all("packet", world)]
    assert all(s.plan.algorithm == "packet" for s in packet)
    assert sum(isinstance(op, PacketPut) for s in packet for op in s.ops) == world * (world - 1)
    assert sum(isinstance(op, PacketReduce) for s in packet for op in s.ops) == world
    assert all(not s.ops and s.plan.algorithm == "packet" for s in _all("packet kernel, no op", world))
    assert not any(isinstance(op, (Copy, Reduce))
                   for s in _all("sync only (no copy, no reduce)", world) for op in s.ops)
