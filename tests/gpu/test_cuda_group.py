"""The CUDA engine across processes: ``Communicator(group, "cuda")`` with the ipc and torch providers.

Two processes on one GPU (gloo group; each process its own CUDA context, time-sliced, a few ms a
round trip, so calls are few). In each worker a CPU communicator on the same group is the oracle:
every collective's CUDA result must be bitwise the CPU engine's, on fresh random inputs, outputs
poisoned first. Also: CUDA-graph replay with new inputs, a rank that skips a call (a timeout that
names the peer, then a new communicator works), a config mismatch refused on every rank.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from purlin_sglang.testing.collectives import COLLECTIVES, assert_bits_equal, case, case_call, case_expected, case_inputs  # noqa: E402
from _workers import mismatches_vs_cpu  # noqa: E402

from purlin_sglang.testing import launch  # noqa: E402

pytestmark = pytest.mark.gpu
ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "CUDA_MODULE_LOADING": "EAGER"}
# PyTorch refuses two ranks on one GPU unless told otherwise (memory/torch_symm.py).
MEMORY_ENV = {"ipc": {}, "torch": {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}}
STAGING = 1 << 20


def _cases(seed: int) -> list[dict]:
    cs = [case(c, torch.float32, rows=3, width=5, seed=seed + i) for i, c in enumerate(COLLECTIVES)]
    cs += [
        case("all_reduce", torch.bfloat16, rows=64, width=33, seed=seed + 20),           # one-shot
        case("all_reduce", torch.bfloat16, rows=2048, width=129, seed=seed + 21),        # two-shot (528 KB)
        case("all_reduce", torch.float16, rows=7, width=3, op="max", seed=seed + 22),    # odd bytes
        case("reduce_scatter", torch.float32, rows=5, width=11, op="min", seed=seed + 23),
        case("all_gather", torch.uint8, rows=3 * STAGING // 2, width=None, seed=seed + 24),  # > staging
        case("all_to_all", torch.int64, rows=1, width=1, seed=seed + 25),
        case("all_gather", torch.bfloat16, rows=0, width=4, seed=seed + 26),             # empty
    ]
    return cs


def _device(rank: int, placement: str) -> int:
    return 0 if placement == "one_gpu" else rank % torch.cuda.device_count()


def _collectives_worker(rank, world, memory, seed, placement):
    import purlin_sglang as ps

    dev = _device(rank, placement)
    torch.cuda.set_device(dev)
    cfg = {"memory": memory, "staging_bytes": STAGING, "timeout_s": 30}
    cuda = ps.Communicator(None, f"cuda:{dev}", config=cfg)
    cpu = ps.Communicator(None, "cpu", config={"staging_bytes": STAGING, "timeout_s": 30})
    info = {"engine": cuda.engine_name, "memory": cuda.memory, "hbm": cuda.hbm_bytes, "repr": repr(cuda)}
    bad = mismatches_vs_cpu(cuda, cpu, _cases(seed), rank, world)
    # In place (all_reduce and broadcast may run with out=x).
    for c in (case("all_reduce", torch.bfloat16, rows=9, width=17, seed=seed + 40),
              case("broadcast", torch.float32, rows=4, width=6, root=1, seed=seed + 41)):
        xs = case_inputs(c, world)
        want, _ = case_expected(c, world, rank, xs)
        x = xs[rank].to(cuda.device)
        case_call(cuda, c, x, x)
        cuda.synchronize()
        try:
            assert_bits_equal(x.cpu(), want, f"rank {rank}: {c['coll']} in place")
        except AssertionError as e:
            bad.append(str(e))
    import torch.distributed as dist

    dist.barrier()  # no peer still reads my memory (Communicator.close is local)
    cuda.close()
    cpu.close()
    info["bad"] = bad
    info["hbm_after_close"] = cuda.hbm_bytes
    return info


def _graph_worker(rank, world, memory, seed, replays):
    import purlin_sglang as ps

    torch.cuda.set_device(0)
    comm = ps.Communicator(None, "cuda", config={"memory": memory, "staging_bytes": STAGING, "timeout_s": 30})
    dev = comm.device
    shapes = {"ar": ((256, 16), torch.bfloat16), "ag": ((5, 7), torch.float32)}
    x = {k: torch.empty(s, dtype=d, device=dev) for k, (s, d) in shapes.items()}
    y = {"ar": torch.empty_like(x["ar"]), "ag": torch.empty((5 * world, 7), dtype=torch.float32, device=dev)}

    def calls():
        comm.all_reduce(x["ar"], out=y["ar"])
        comm.all_gather(x["ag"], out=y["ag"])

    def inputs(i):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        return {k: [torch.randn(s, generator=g).to(d) for _ in range(world)] for k, (s, d) in shapes.items()}

    for k, v in inputs(-1).items():
        x[k].copy_(v[rank])
    calls()  # warm-up: every op table exists before the capture
    comm.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        calls()
    bad = 0
    for i in range(replays):
        xs = inputs(i)
        for k in x:
            x[k].copy_(xs[k][rank])
            y[k].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want_ar = sum(t.float() for t in xs["ar"]).to(torch.bfloat16)  # two ranks: one addition, exact order-free
        want_ag = torch.cat(xs["ag"])
        bad += not torch.equal(y["ar"].cpu(), want_ar) or not torch.equal(y["ag"].cpu(), want_ag)
    import torch.distributed as dist

    dist.barrier()
    comm.close()
    return bad


def _timeout_worker(rank, world, memory, timeout):
    from purlin_sglang.errors import PurlinTimeoutError

    cfg, comm, x = _after_one_call(memory, timeout)
    t0 = time.monotonic()
    outcome, pending = "ok", None
    try:
        if rank == 0:  # rank 1 skips the second call
            comm.all_reduce(x)
            while pending is None and time.monotonic() - t0 < timeout + 10:  # what the plugin's watch reads
                pending = comm.pending_error()
                time.sleep(0.05)
        comm.synchronize()
    except PurlinTimeoutError as e:
        outcome = ("timeout", str(e), e.rank, tuple(e.missing), str(pending) if pending is not None else None,
                   time.monotonic() - t0)
    elapsed = time.monotonic() - t0
    return outcome, elapsed, _closed_then_a_fresh_one(comm, cfg, rank)


def _after_one_call(memory, timeout):
    """A CUDA communicator of this process group on GPU 0 that has made one all_reduce: (config, it, x)."""
    import purlin_sglang as ps

    torch.cuda.set_device(0)
    cfg = {"memory": memory, "staging_bytes": STAGING, "timeout_s": timeout}
    comm = ps.Communicator(None, "cuda", config=cfg)
    x = torch.ones(1000, device=comm.device)
    comm.all_reduce(x)
    return cfg, comm, x


def _closed_then_a_fresh_one(comm, cfg, rank):
    """``comm`` closed once every rank got here (no kernel polls a peer's memory any more), then a new
    communicator's all_reduce of rank + 1 (every rank's result)."""
    import torch.distributed as dist

    import purlin_sglang as ps

    dist.barrier()
    comm.close()
    fresh = ps.Communicator(None, "cuda", config=cfg)
    y = fresh.all_reduce(torch.full((8,), float(rank + 1), device=fresh.device))
    fresh.synchronize()
    again = y.cpu().tolist()
    dist.barrier()
    fresh.close()
    return again


def _reject_worker(rank, world, memory, timeout, how, seed):
    """Rank 1 rejects its own arguments of one call (an out= of another dtype). ``all_reduce``: rank 0's kernel
    waits for rank 1 in that call. ``broadcast``: rank 0 is the broadcast's root, whose part does not wait for
    rank 1; its next call (an all_reduce) does. Then every rank checks three collectives on fresh inputs."""
    import purlin_sglang as ps
    from purlin_sglang.errors import PurlinRejectedError

    cfg, comm, x = _after_one_call(memory, timeout)
    comm.synchronize()
    dev = comm.device
    t0 = time.monotonic()
    outcome = None
    try:
        bad = torch.empty(1000, dtype=torch.float16, device=dev) if rank == 1 else None
        if how == "all_reduce":
            comm.all_reduce(x, out=bad)  # rank 1: an out= of another dtype, found before its launch
        else:
            comm.broadcast(x, root=0, out=bad)
            comm.all_reduce(x)  # rank 0: this call's kernel waits for rank 1
        comm.synchronize()
        outcome = ("ok",)
    except PurlinRejectedError as e:
        outcome = ("rejected", str(e), e.rank, e.cause, time.monotonic() - t0)
    except ps.PurlinValueError as e:
        outcome = ("own", str(e), time.monotonic() - t0)
    # the same communicator, on fresh inputs every rank can recompute (integer values: every sum is exact)
    g = [torch.Generator().manual_seed(seed + q) for q in range(world)]
    xs = [torch.randint(-1000, 1000, (4096,), generator=g[q]).float() for q in range(world)]
    root_x = torch.randint(0, 1 << 20, (777,), generator=torch.Generator().manual_seed(seed + 99), dtype=torch.int32)
    after = []
    try:
        y = comm.all_reduce(xs[rank].to(dev))
        ag = comm.all_gather(xs[rank][:100].to(dev))
        b = comm.broadcast(root_x.to(dev) if rank == 1 else torch.full((777,), -7, dtype=torch.int32, device=dev),
                           root=1)
        comm.synchronize()
        after = [torch.equal(y.cpu(), sum(xs)), torch.equal(ag.cpu(), torch.cat([v[:100] for v in xs])),
                 torch.equal(b.cpu(), root_x)]
    except ps.PurlinError as e:
        after = [f"{type(e).__name__}: {e}"]
    return outcome, after, _closed_then_a_fresh_one(comm, cfg, rank)


def _splits_worker(rank, world, memory, how):
    import purlin_sglang as ps

    cfg, comm, _ = _after_one_call(memory, 20.0)
    send = [rank + q + 1 for q in range(world)]  # rank p sends p + q + 1 rows to rank q
    recv = [p + rank + 1 for p in range(world)]
    bad = [n + (rank == 1 and p == 0) for p, n in enumerate(recv)]  # rank 1 expects one row more from rank 0
    x = torch.arange(sum(send), dtype=torch.float32, device=comm.device) + 100 * rank
    t0 = time.monotonic()
    try:
        if how == "disagree":
            comm.all_to_all_v(x, send, bad)
        else:  # rank 1's input has a row less than its splits say: its own error, announced in the split check
            comm.all_to_all_v(x[:-1] if rank == 1 else x, send, recv)
        comm.synchronize()
        err = None
    except (ps.PurlinMismatchError, ps.PurlinRejectedError) as e:
        err = f"{type(e).__name__}: {e}"
    except ps.PurlinValueError as e:
        err = f"own: {e}"
    elapsed = time.monotonic() - t0
    y = comm.all_to_all_v(x, send, recv)  # usable: the next call is the next call on both ranks
    comm.synchronize()
    return err, elapsed, y.cpu().tolist(), _closed_then_a_fresh_one(comm, cfg, rank)


def _mismatch_worker(rank, world, memory):
    import purlin_sglang as ps
    from purlin_sglang.errors import PurlinConfigError

    torch.cuda.set_device(0)
    t0 = time.monotonic()
    try:
        ps.Communicator(None, "cuda", config={"memory": memory, "staging_bytes": STAGING << rank})
        return "no error", time.monotonic() - t0
    except PurlinConfigError as e:
        return str(e), time.monotonic() - t0


@pytest.mark.parametrize("memory", ["ipc", "torch"])
@pytest.mark.parametrize("placement", ["one_gpu", "per_rank_gpu"])
def test_every_collective_bitwise_cpu_engine(memory, placement):
    if placement == "per_rank_gpu" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one per rank)")
    seed = int.from_bytes(os.urandom(3), "little")
    env = {**ENV, **(MEMORY_ENV[memory] if placement == "one_gpu" else {})}
    results = launch(_collectives_worker, 2, memory, seed, placement, timeout_s=240, env=env)
    for rank, info in enumerate(results):
        assert info["engine"] == "cuda" and info["memory"] == memory, info
        assert info["hbm"] > STAGING and info["hbm_after_close"] == 0, info
        assert info["bad"] == [], f"seed {seed} rank {rank}:\n" + "\n".join(info["bad"])


def _heap_worker(rank, world, memory, seed):
    """Inputs in the symmetric heap of a CUDA process group (its own staging region wrapped as a tensor
    through the CUDA array interface): all_reduce (direct one-shot and two-shot), all_gather and
    reduce_scatter read the peer's inputs in place, bitwise the CPU engine's staged results."""
    import purlin_sglang as ps

    torch.cuda.set_device(0)
    cfg = {"memory": memory, "staging_bytes": STAGING, "symmetric_bytes": 8 << 20, "timeout_s": 30,
           "tuning": {"packet_max_bytes": 0, "table": "thresholds"}}
    cuda = ps.Communicator(None, "cuda:0", config=cfg)
    cpu = ps.Communicator(None, "cpu", config={"staging_bytes": STAGING, "timeout_s": 30})
    bad, algs = [], set()
    for i, (coll, rows) in enumerate((("all_reduce", 64), ("all_reduce", 4096), ("all_gather", 33),
                                      ("reduce_scatter", 64))):
        c = case(coll, torch.bfloat16 if coll != "all_gather" else torch.float32, rows=rows, width=129,
                 seed=seed + i)
        xs = case_inputs(c, world)
        x = cuda.symmetric_empty(xs[rank].shape, xs[rank].dtype)
        x.copy_(xs[rank].to(x.device))
        got = case_call(cuda, c, x, None)
        cuda.synchronize()
        want = case_call(cpu, c, xs[rank].clone(), None)
        try:
            assert_bits_equal(got.cpu(), want, f"rank {rank}: {coll} {rows} rows, input in the heap")
        except AssertionError as e:
            bad.append(str(e))
        algs |= {cl.sched.plan.algorithm for cl in cuda._path.calls.values()}
    import torch.distributed as dist

    dist.barrier()
    cuda.close()
    cpu.close()
    return bad, sorted(algs)


def test_a_cuda_process_group_reads_heap_inputs_in_place():
    """Two processes on one GPU (ipc): inputs in the symmetric heap are read in place by the peer's
    kernels (direct one-shot and two-shot), bitwise the CPU engine."""
    seed = int.from_bytes(os.urandom(3), "little")
    res = launch(_heap_worker, 2, "ipc", seed, timeout_s=240, env=ENV)
    for bad, algs in res:
        assert bad == [] and algs == ["direct", "direct-twoshot"], f"seed {seed}: {bad} {algs}"


@pytest.mark.parametrize("memory", ["ipc", "torch"])
def test_cuda_graph_replays_with_new_inputs(memory):
    seed = int.from_bytes(os.urandom(3), "little")
    res = launch(_graph_worker, 2, memory, seed, 20, timeout_s=180, env={**ENV, **MEMORY_ENV[memory]})
    assert res == [0, 0], f"seed {seed}: wrong replays per rank {res}"


def test_skipped_call_times_out_naming_the_peer_then_a_new_communicator_works():
    timeout = 3.0
    res = launch(_timeout_worker, 2, "ipc", timeout, timeout_s=120, env=ENV)
    (out0, elapsed0, again0), (out1, _, again1) = res
    assert out1 == "ok", out1
    assert out0[0] == "timeout", out0
    _, msg, rank, missing, pending, _ = out0
    assert msg.startswith("all_reduce: rank 0 waited") and "rank 1" in msg, msg
    assert rank == 0 and missing == (1,), out0
    assert pending == msg  # pending_error(), read while the call was outstanding, is what synchronize raised
    assert elapsed0 < timeout + 5, elapsed0
    assert again0 == again1 == [3.0] * 8


@pytest.mark.parametrize("how", ["all_reduce", "broadcast"])
def test_a_rank_that_rejects_its_arguments_stops_its_peer_at_once_and_the_group_stays_usable(how):
    """A CUDA process group: rank 1's out= has another dtype. all_reduce: rank 0's kernel, already waiting for
    rank 1, stops on rank 1's rejected descriptor; broadcast: rank 0, the root, finishes its part and stops in
    its next call. Rank 0 raises PurlinRejectedError quoting rank 1's error well before timeout_s, both ranks
    reset the communicator's state, and the same communicator's next calls are correct on both."""
    timeout = 20.0
    seed = int.from_bytes(os.urandom(3), "little")
    res = launch(_reject_worker, 2, "ipc", timeout, how, seed, timeout_s=120, env=ENV)
    (out0, after0, again0), (out1, after1, again1) = res
    assert out1[0] == "own" and "dtype" in out1[1], out1
    assert out1[2] < 5.0, out1  # rank 1 waits in the reset for rank 0 only: not the 20 s timeout
    assert out0[0] == "rejected", out0
    _, msg, rank, cause, elapsed = out0
    assert rank == 1 and cause == out1[1] and f'"{out1[1]}"' in msg and "stays usable" in msg, out0
    assert elapsed < 2.0, elapsed  # not the 20 s timeout
    assert after0 == after1 == [True, True, True], (seed, after0, after1)
    assert again0 == again1 == [3.0] * 8


@pytest.mark.parametrize("how", ["disagree", "reject"])
def test_all_to_all_v_split_errors_raise_on_both_ranks_at_once_and_the_group_stays_usable(how):
    """The host split check (config split_check) of a CUDA process group. disagree: rank 1 expects one row more
    from rank 0 than rank 0 sends; both ranks raise the same PurlinMismatchError naming both arguments.
    reject: rank 1's input is a row short; it raises its own error and rank 0 a PurlinRejectedError quoting it.
    Before anything moves, within seconds; then a correct all_to_all_v gives the right rows on both."""
    res = launch(_splits_worker, 2, "ipc", how, timeout_s=120, env=ENV)
    want = ("PurlinMismatchError: all_to_all_v: rank 0 sends 2 rows to rank 1 (its input_splits[1]), but rank 1 "
            "expects 3 rows from rank 0 (its output_splits[0])")
    if how == "reject":
        own = res[1][0]
        assert own.startswith("own: all_to_all_v:"), own
        want = f'PurlinRejectedError: all_to_all_v: rank 1 rejected its arguments of call #2: "{own[5:]}"'
    rows = {p: [float(v + 100 * p) for v in range(sum(p + q + 1 for q in range(2)))] for p in range(2)}
    for r, (err, elapsed, y, again) in enumerate(res):
        assert err is not None and (want in err or (how == "reject" and r == 1)), (r, err)
        assert elapsed < 5.0, (r, elapsed)
        start = {p: sum(p + q + 1 for q in range(r)) for p in range(2)}
        assert y == [v for p in range(2) for v in rows[p][start[p]:start[p] + p + r + 1]], (r, y)
        assert again == [3.0] * 8


def test_config_mismatch_is_refused_on_every_rank():
    res = launch(_mismatch_worker, 2, "ipc", timeout_s=60, env=ENV)
    for msg, elapsed in res:
        # the key that differs, every rank's value; the keys that agree are not named
        assert msg.startswith(f"Communicator: ranks disagree on staging_bytes (rank 0={STAGING}, rank 1={STAGING << 1})"), msg
        assert "memory" not in msg, msg
        assert elapsed < 20, elapsed
