"""The packet protocol on the GPU (loopback ranks on one GPU): every collective with a packet form
(all_reduce, all_gather, reduce_scatter, all_to_all, and the rooted ones: broadcast, in place
included, gather, reduce, scatter) runs PACKET_PUT / PACKET_COPY / PACKET_REDUCE tables, bitwise the
CPU engine (which runs oneshot for the same calls), at edge sizes, every copy dtype, every reduce op,
in place, and in one sequence with staged calls. all_to_all_v has no packet form: it runs hybrid in
the same sequences (each pair by its size: packets, or a one-shot of the large pairs); all_gather_v
and reduce_scatter_v take packets, empty slices among them.
Short on purpose (device time is scarce): a handful of check() calls, each one sequence of calls."""

from __future__ import annotations


import pytest
import torch

from _engine_check import CFG, SEED, check  # noqa: E402
from purlin_sglang.testing.collectives import (  # noqa: E402
    COPY_DTYPES, OPS, case, hybrid_cases, packet_cases, rooted_packet_cases, user_spec, v_packet_cases,
)
import purlin_sglang as ps  # noqa: E402
from purlin_sglang.snac.policy import PACKET_WINDOW_BYTES  # noqa: E402

pytestmark = pytest.mark.gpu
FORCED = {**CFG, "tuning": {"algorithm": "packet"}}


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_forced_packets_every_fixed_size_collective(world):
    """0 bytes, 1 element, odd byte counts, a full window per push; V calls interleaved; the in-place
    all_reduce and broadcast (both packets) at the end of the same sequence."""
    check(world, packet_cases(SEED + world), config=FORCED)


@pytest.mark.parametrize("world", [3, 8])
def test_forced_packets_every_copy_dtype_and_every_reduce_op(world):
    cases = [case(coll, dt, rows=rows, width=width, seed=SEED + 7 * i + rows)
             for i, dt in enumerate(COPY_DTYPES) for coll in ("all_gather", "all_to_all")
             for rows, width in ((1, None), (3, 5))]
    cases += [case(coll, dt, rows=5, width=33, op=op, seed=SEED + 100 + i)
              for i, (dt, op) in enumerate((d, o) for d in (torch.bfloat16, torch.float16, torch.float32) for o in OPS)
              for coll in ("all_reduce", "reduce_scatter")]
    check(world, cases, config=FORCED)


@pytest.mark.parametrize("world", [2, 8])
def test_auto_packets_interleaved_with_staged_calls(world):
    """auto: the small calls take packets; payloads past a window stage (oneshot / twoshot) in between,
    so windows and staging alternate within one sequence."""
    check(world, packet_cases(SEED + 50 + world, large=True))


@pytest.mark.parametrize("world", [3, 8])
def test_rooted_forms_take_packets_back_to_back_with_the_root_moving(world):
    """Broadcast, gather, reduce, scatter under auto (packets), the root a new rank each call, 0-byte
    calls among them, packet all_reduces in between: the ranks a rooted naming leaves silent exchange
    one empty packet per call, without which a root could overwrite a window before it is read."""
    rooted = [user_spec(n) for n in ("gather", "reduce", "scatter")] + ["broadcast"]
    algs = ps.run_virtual(world, lambda comm: [comm.algorithm(s, 40 * 33 * 4) for s in rooted], device="cuda",
                          config=CFG)
    assert algs == [["packet"] * 4] * world
    check(world, rooted_packet_cases(SEED + 300 + world, world))


@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize("raised", [False, True])
def test_v_forms_take_packets_with_empty_slices(world, raised):
    """all_gather_v and reduce_scatter_v under auto: empty slices (one empty packet each way), calls
    empty on every rank, a 252 KiB push (packets with packet_max_bytes raised to the window, else
    staged), a fixed packet all_reduce and a hybrid all_to_all_v in between; bitwise the CPU engine."""
    cfg = {**CFG, "tuning": {"packet_max_bytes": PACKET_WINDOW_BYTES}} if raised else CFG
    check(world, v_packet_cases(SEED + world), config=cfg, inplace=False)


@pytest.mark.parametrize("world", [3, 8])
def test_all_to_all_v_runs_hybrid_with_pairs_on_both_sides_of_the_limit(world):
    """all_to_all_v under auto, packet_max_bytes 200: in one call pairs of at most 200 bytes go as packets
    (the packet kernel), larger ones through a one-shot of those pairs (the interpreter, after it on the
    same stream), each such pair exchanging one empty packet; calls all small (no staged kernel on any
    rank), all large, empty on every rank, a packet all_reduce and a staged all_gather in between;
    bitwise the CPU engine."""
    cfg = {**CFG, "tuning": {"packet_max_bytes": 200}}
    algs = ps.run_virtual(world, lambda comm: comm.algorithm("all_to_all_v", 64), device="cuda", config=cfg)
    assert algs == ["hybrid"] * world
    check(world, hybrid_cases(SEED + 400 + world), config=cfg, inplace=False)


def test_a_packet_table_longer_than_the_shared_copy_is_read_from_global_memory():
    """The packet kernel keeps up to 32 records in shared memory (snac/packet.cuh kPacketTableRecords).
    all_to_all at 17 ranks is 16 puts and 17 copies, 33 records: read from global memory; all_gather at 17
    (one put, 17 copies) from shared memory; a one-element all_to_all between them. Bitwise the CPU engine."""
    cases = [case("all_to_all", torch.bfloat16, rows=3, width=5, seed=SEED + 400),
             case("all_gather", torch.float32, rows=2, width=7, seed=SEED + 401),
             case("all_to_all", torch.int8, rows=1, width=1, seed=SEED + 402)]
    check(17, cases, config=FORCED)
