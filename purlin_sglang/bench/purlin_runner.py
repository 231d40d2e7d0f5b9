"""Time purlin_sglang collectives on virtual ranks (``run_virtual``), eager or as CUDA graphs.

One ``run_virtual`` world per (collective, world, mode) runs every size in turn, so a failure
costs that collective's rows only. Per size, each rank: makes fresh random inputs, checks one
call against the torch reference, warms up, then times ``iters`` calls (eager) or ``iters``
replays of a graph holding ``graph_calls`` calls (graph). The time of an iteration is the
slowest rank's; rows keep every rank's samples reduced that way.
"""

from __future__ import annotations

import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from . import cases as _cases
from .cases import Case, fresh_input, purlin_call
from .metrics import human_bytes
from .timing import sync, time_each, time_graph_replays
from .traffic import last_call


@dataclass
class Options:
    dtype: torch.dtype
    iters: int
    warmup: int
    graph_calls: int
    rotate: int
    l2_bytes: int
    seed: int
    timeout_s: float
    tuning: dict | None = None  # the communicators' tuning section (e.g. a forced algorithm: tune.py)
    symmetric: bool = False  # inputs in the communicators' symmetric heap (the direct plans where they apply)
    launch_ahead: bool = False  # graph replays enqueued behind a GPU sleep (timing.time_graph_replays)

    def buffers(self, case: Case, sharing_l2: int) -> int:
        """Input buffers to rotate through: ``rotate`` when the inputs sharing one L2 exceed it."""
        return self.rotate if sharing_l2 * case.in_numel * case.elsize > self.l2_bytes else 1


def input_seed(seed: int, case_index: int, rank: int, buf: int) -> int:
    return (seed * 1_000_003 + case_index * 10_007 + rank * 101 + buf) % (1 << 62)


def rank_stream(comm) -> Any:
    if comm.device.type != "cuda":
        return None
    s = getattr(comm, "stream", None)
    return s if isinstance(s, torch.cuda.Stream) else torch.cuda.current_stream(comm.device)


def settle(stream, barrier) -> None:
    """Every loopback rank's work done before the next step: this rank's stream synchronized, then a barrier
    (no host copy, capture or local kernel of a rank may queue behind a peer's kernel that waits for it)."""
    sync(stream)
    barrier.wait()


def run_purlin(collective: str, world: int, mode: str, cases: list[Case], opts: Options,
               device: torch.device) -> list[dict]:
    """Per-rank results of every case (raises what ``run_virtual`` raises)."""
    from ..api import run_virtual

    board: dict[tuple[int, int], torch.Tensor] = {}
    barrier = threading.Barrier(world)
    check_lock = threading.Lock()  # one reference at a time: bounds the memory it needs
    where: dict[int, tuple[Case, str]] = {}  # rank -> the case and stage it is in (for a failure's message)

    def fn(comm):
        r, dev, stream = comm.rank, comm.device, rank_stream(comm)
        # One capture stream per rank for the whole run, made here once: torch's 32 pooled streams
        # go round robin, so a stream made per case would soon be another rank's capture or replay
        # stream, and two ranks on one stream wait for each other (timeouts, or CUDA's "invalid
        # argument" when one rank enqueues into a stream another rank is capturing).
        side = torch.cuda.Stream(dev) if mode == "graph" and dev.type == "cuda" else None
        mine = []
        for ci, case in enumerate(cases):
            where[r] = (case, "inputs")
            # on one device every rank's inputs share one L2
            nbuf = opts.buffers(case, world if dev.type == "cuda" else 1)
            xs = [fresh_input(case, opts.dtype, dev, input_seed(opts.seed, ci, r, j)) for j in range(nbuf)]
            if opts.symmetric:  # the same allocations on every rank: the same heap offsets
                xs = [comm.symmetric_empty(x.shape, x.dtype).copy_(x) for x in xs]
            out = torch.empty(case.out_numel, dtype=opts.dtype, device=dev)
            board[(ci, r)] = xs[0]
            sync(stream)
            barrier.wait()
            where[r] = (case, "checked call")
            got = purlin_call(comm, case, xs[0], out)
            for x in xs[1:] if opts.symmetric else ():  # each heap buffer is its own plan (its offset):
                purlin_call(comm, case, x, torch.empty_like(out))  # run each once before any capture
            algorithm, moved = last_call(comm, case.out_numel)  # this case's call: a new shape, filed last
            sync(stream)
            with check_lock:
                ok, exact, err = _cases.check(case, got, [board[(ci, p)] for p in range(world)], r)
            barrier.wait()  # every rank has read every input: the board may go
            del board[(ci, r)]

            def step(i: int) -> None:
                purlin_call(comm, case, xs[i % nbuf], out)

            where[r] = (case, "timing")
            if mode == "eager":
                for i in range(opts.warmup):
                    step(i)
                sync(stream)
                barrier.wait()
                samples = time_each(step, opts.iters, stream)
            else:
                samples = graph_samples(comm, step, stream, side, barrier, opts,
                                         lambda stage, r=r, c=case: where.__setitem__(r, (c, stage)))
            mine.append({"ok": ok, "exact": exact, "err": err, "samples": samples, "buffers": nbuf,
                         "algorithm": algorithm, "plan_bytes": moved})
            if r == 0:
                sys.stderr.write(f"  purlin {mode:<5} world {world} {collective:<16} {human_bytes(case.nbytes):>6} "
                                 f"{'ok' if ok else 'WRONG'}\n")
                sys.stderr.flush()
            del xs, out, got
        return comm.engine_name, mine

    first: list[BaseException] = []

    def guarded(comm):
        try:
            return fn(comm)
        except threading.BrokenBarrierError:
            raise
        except BaseException as e:
            # where it happened: the rank, case, stage and innermost frame (CUDA errors from torch
            # name no call of ours otherwise); the report prints it after the message
            tb = traceback.extract_tb(e.__traceback__)
            frame = f"{tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno} {tb[-1].name}" if tb else "?"
            case, stage = where.get(comm.rank, (None, "setup"))
            at = f"{human_bytes(case.nbytes)}, {stage}" if case is not None else stage
            e.purlin_where = f"rank {comm.rank}, {at}, in {frame}"
            first.append(e)
            barrier.abort()  # release the ranks waiting at a host barrier
            raise

    try:
        config = {"timeout_s": opts.timeout_s, **({"tuning": opts.tuning} if opts.tuning else {})}
        if opts.symmetric:  # every case's input buffers, each at a heap alignment boundary (nothing is freed)
            from ..memory.heap import ALIGN

            config["symmetric_bytes"] = ALIGN + sum(
                opts.buffers(c, world if device.type == "cuda" else 1) * -(-c.in_numel * c.elsize // ALIGN) * ALIGN
                for c in cases)
        return run_virtual(world, guarded, device=device, config=config)
    except BaseException as e:
        if first and first[0] is not e:
            raise first[0] from None
        raise


_CAPTURE_LOCK = threading.Lock()


class GraphPool:
    """One memory pool for the graphs a rank captures one after another (:func:`graph_samples`), so that
    a rank holds the memory of at most two of them, not a cached pool per graph. torch frees a pool
    with the last graph that uses it (and refuses a capture into a freed one), so the pool keeps its
    latest graph alive until the next one has been captured; then that graph, never replayed again,
    is dropped and its memory serves the later captures."""

    def __init__(self):
        self.handle = torch.cuda.graph_pool_handle()
        self.last = None


def graph_samples(comm, step, stream, side, barrier, opts: Options, stage=lambda name: None,
                  pool: GraphPool | None = None) -> list[float]:
    """Capture ``graph_calls`` calls in one graph on this rank's own stream; time its replays.

    ``pool``: the :class:`GraphPool` the capture allocates from, for a caller that captures several
    graphs one after another (none: a private pool, freed with the graph when this returns).

    CUDAGraph.capture_begin/end are used rather than the ``torch.cuda.graph`` context because
    that context synchronizes the whole device and empties the cache on entry, which would
    interfere with the other virtual ranks capturing at the same time; the capture is
    thread-local for the same reason.
    """
    stage("capture")
    side.wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    # One capture at a time in the process: torch registers its CUDA generator's state with the
    # graph being captured and refuses while another thread's capture is open ("Cannot register
    # the state during capturing stage"; seen at 1 MiB, 8 ranks). Captured calls do not run, so
    # the ranks capturing in turn cannot wait on each other.
    with _CAPTURE_LOCK, comm.capture():
        with torch.cuda.stream(side):
            g.capture_begin(pool=pool.handle if pool is not None else None, capture_error_mode="thread_local")
            try:
                for j in range(opts.graph_calls):
                    step(j)
            finally:
                g.capture_end()
    # No rank replays before every rank has captured: a replayed call waits for the other ranks'
    # kernels, and a rank still capturing may block in CUDA (graph instantiation) until the device's
    # running work ends, which would then wait for each other until the timeout.
    # bench_cuda_engine.py has this barrier too.
    barrier.wait()
    stage("replays")
    samples = time_graph_replays(g, side, opts.graph_calls, opts.warmup, opts.iters, barrier.wait,
                                 ahead=opts.launch_ahead)
    if pool is not None:
        pool.last = g  # keeps the pool alive for the next capture; the graph before it is dropped
    del g
    return samples
