"""Virtual ranks: N ranks as threads of one process (what ``run_virtual`` runs on).

:class:`VirtualWorld` is their shared memory (host memory for the CPU engine, one loopback GPU
allocation for the CUDA engine); :func:`run_ranks` runs one function per rank in its own thread
(on CUDA: on a stream of its own, see :func:`rank_streams`) and reports the root-cause error.

The rest of this module is the launch gate that makes ordinary host code in loopback rank
threads safe.

Virtual ranks on one GPU are threads of one process, each enqueuing its kernels on its own stream.
A rank's collective kernel waits on the device for its peers' kernels. If a rank thread, right
after a call, blocks the host (``.cpu()``, ``.item()``, ``print(tensor)``: a synchronous copy that
waits for its stream), and a peer's thread has not launched its part yet, that peer's launch can
stall behind the blocked copy, and the first wait of the collective times out.

The gate closes that window: in eager mode, a virtual CUDA rank launches a call only once every
virtual rank has reached it, and returns only once every virtual rank has enqueued it (two
host-side rendezvous per call, bounded by the config's ``timeout_s``). What remains unsafe is named
in :func:`purlin_sglang.run_virtual`'s docstring.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any, Callable

import torch

from .config import PurlinConfig
from .engines.base import first_split_mismatch, mismatch_message
from .errors import (PurlinBrokenError, PurlinError, PurlinMismatchError, PurlinTimeoutError, PurlinUnavailableError,
                     rejected_error)
from .memory import HostWorkspace, WorkspaceLayout
from .memory.heap import region_bytes


class VirtualWorld:
    """Shared state of N virtual ranks in one process: host memory (CPU) or one loopback GPU allocation."""

    def __init__(self, world: int, config: PurlinConfig, device: torch.device):
        self.world, self.config = world, config
        nodes = config.topology.node_of_rank
        if nodes is not None and (len(nodes) != world or len(set(nodes)) > 1):
            raise PurlinUnavailableError(
                f"run_virtual: topology.node_of_rank {list(nodes)} does not describe {world} virtual ranks on one "
                "node (they are threads of one process); to simulate several nodes, run processes with a "
                "Communicator each")
        self.gate = None
        if device.type == "cuda":
            from .memory.loopback import LoopbackWorld
            from .moe.region import SharedRegions

            # eager calls return once every rank launched; one rank has no peer to wait for (no gate)
            self.gate = LaunchGate(world, config.timeouts.call_s) if world > 1 else None
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self.workspace = LoopbackWorld(world, region_bytes(config.staging_bytes, config.symmetric_bytes), index)
            self.moe_regions = SharedRegions()  # the MoE region, made by the first MoE call
        else:
            self.device = torch.device("cpu")
            self.moe_regions = None  # the CPU engine's MoE has no region
            self.workspace = HostWorkspace.private(
                WorkspaceLayout(world, region_bytes(config.staging_bytes, config.symmetric_bytes)))

    def rank_workspace(self, rank: int):
        return self.workspace.view(rank) if self.device.type == "cuda" else self.workspace

    def close(self) -> None:
        if self.device.type == "cuda":
            self.workspace.close()
            self.moe_regions.close()


def run_world(world: int, fn: Callable[[Any], Any], device: torch.device, config: PurlinConfig, reserve_bytes: int,
              *, make: Callable[..., Any], mark_broken: Callable[[Any, str], None]) -> list:
    """The body of :func:`purlin_sglang.run_virtual` (which documents it): a virtual world of ``world``
    ranks, ``make(vworld, rank, engine name, memory)`` builds each rank's communicator, ``fn`` runs
    once per rank (:func:`run_ranks`), ``mark_broken(comm, why)`` releases a failed rank's peers."""
    from . import engines

    engine, memory = engines.select_engine(device, config.memory, virtual=True)
    vworld = VirtualWorld(world, config, device)
    comms: list[Any] = []
    try:
        comms = [make(vworld, r, engine.name, memory) for r in range(world)]
    except BaseException:
        for c in comms:
            c.close()
        vworld.close()
        raise
    on_gpu = vworld.device.type == "cuda"

    def call(r: int) -> Any:
        out = fn(comms[r])
        if on_gpu and not comms[r].closed:
            comms[r].synchronize()  # results complete, and a recorded timeout raised here
        return out

    def on_error(r: int, e: BaseException) -> None:
        mark_broken(comms[r], f"rank {r} raised {type(e).__name__}: {e}")

    def close() -> None:
        for c in comms:
            c.close()

    return run_ranks(vworld, call, on_error, close, reserve_bytes)


def run_ranks(vworld: VirtualWorld, call: Callable[[int], Any], on_error: Callable[[int, BaseException], None],
              close: Callable[[], None], reserve_bytes: int) -> list:
    """Run ``call(r)`` for every rank r, each in its own thread; return the results in rank order.

    On CUDA each rank runs on a stream of its own (inputs made before are complete before any rank
    starts). ``on_error(r, e)`` runs in rank r's thread when ``call`` raised (release its peers
    there); ``close()`` frees the ranks' resources once every thread has ended (on CUDA, after
    every rank's kernels have ended). Raises the first root-cause error (not a PurlinBrokenError
    that only follows from another rank's failure), or PurlinTimeoutError for a rank thread that
    does not return within the configured join timeout (its cause and a note: the error of a rank that
    raised, which may have left it waiting in the caller's own code, where purlin cannot release it).
    """
    world, cuda = vworld.world, vworld.device.type == "cuda"
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world
    if cuda:
        streams, release_streams = rank_streams(vworld.device, world)
        reserve(vworld.device, streams, reserve_bytes)
        torch.cuda.synchronize(vworld.device)

    def body(r: int) -> None:
        try:
            if cuda:
                with torch.cuda.device(vworld.device), torch.cuda.stream(streams[r]):
                    results[r] = call(r)
            else:
                results[r] = call(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e
            on_error(r, e)
            if vworld.gate is not None:
                vworld.gate.fail(r, f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=body, args=(r,), name=f"purlin-vrank{r}", daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    join_s = vworld.config.timeouts.join_s
    try:
        for r, t in enumerate(threads):
            t.join(join_s)
            if t.is_alive():
                err = PurlinTimeoutError(f"run_virtual: rank {r} did not return within {join_s:g}s", rank=r,
                                         missing=[r])
                failed = _failures(errors)
                if not failed:
                    raise err
                # a rank that raised may have left this one waiting in the caller's own code (a barrier of
                # the caller's, say), which purlin cannot release: that error is the root cause
                q, e = _root(failed)
                err.add_note(f"run_virtual: rank {q} had raised {type(e).__name__}: {e}")
                raise err from e
    finally:
        if cuda:  # every rank's kernels have ended (at worst by their timeouts) before memory is freed
            torch.cuda.synchronize(vworld.device)
        close()
        vworld.close()
        if cuda and not any(t.is_alive() for t in threads):
            release_streams()  # (a rank thread still alive keeps its stream: leaked, not freed under it)
            # torch caches freed blocks per stream: those of the rank streams (the reserve among them) can
            # serve no later stream, so worlds made one after another would pile them up until an
            # allocation fails and torch frees its cache mid-run, a device-wide wait that a spinning
            # kernel turns into a hang (or a failed graph capture). Back to the driver now, while no
            # kernel runs; torch's other unused cached blocks go with them.
            torch.cuda.empty_cache()
    failed = _failures(errors)
    if failed:
        r, e = _root(failed)
        if len(failed) > 1 and isinstance(e, Exception):
            e.add_note(f"run_virtual: ranks {[f[0] for f in failed]} failed; this is rank {r}'s error")
        raise e
    return results


def _failures(errors: list[BaseException | None]) -> list[tuple[int, BaseException]]:
    return [(r, e) for r, e in enumerate(errors) if e is not None]


def _root(failed: list[tuple[int, BaseException]]) -> tuple[int, BaseException]:
    """The first rank's error that is not a PurlinBrokenError (which only follows from another rank's
    failure), else the first."""
    return ([f for f in failed if not isinstance(f[1], PurlinBrokenError)] or failed)[0]


def reserve(device: torch.device, streams: list, nbytes: int) -> None:
    """Fill torch's caching allocator for each stream (its blocks serve later allocations on that
    stream without a cudaMalloc): one large block of ``nbytes`` and 16 MiB of small blocks."""
    for s in streams:
        with torch.cuda.device(device), torch.cuda.stream(s):
            big = torch.empty(max(0, int(nbytes)), dtype=torch.uint8, device=device)
            small = [torch.empty(1 << 19, dtype=torch.uint8, device=device) for _ in range(32)]
            del big, small


def rank_streams(device: torch.device, n: int) -> tuple[list, Callable[[], None]]:
    """``n`` CUDA streams of the rank threads, and a function that releases them.

    Not torch's pool: ``torch.cuda.Stream()`` hands out 32 pooled streams round robin, so a rank's
    stream could be the very stream another rank (or code in a rank thread that makes its own
    ``torch.cuda.Stream()``) runs on; two ranks on one stream wait for each other's kernels and time
    out. Streams of their own come from cuda-python when it is importable; otherwise pooled streams,
    checked to be distinct here (code in rank threads must then not make streams of its own).
    """
    from .memory.ipc import error_text, load_cudart

    try:
        cudart = load_cudart()
    except PurlinUnavailableError:
        cudart = None
    if cudart is not None:
        handles = []
        with torch.cuda.device(device):
            for _ in range(n):
                err, h = cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)
                if int(err) != 0:
                    for made in handles:
                        cudart.cudaStreamDestroy(made)
                    raise PurlinError(f"run_virtual: cudaStreamCreateWithFlags: {error_text(cudart, err)}")
                handles.append(h)

        def release() -> None:
            for h in handles:
                cudart.cudaStreamDestroy(h)

        return [torch.cuda.ExternalStream(int(h), device=device) for h in handles], release
    streams = [torch.cuda.Stream(device=device) for _ in range(n)]
    if len({s.cuda_stream for s in streams}) != n:
        raise PurlinError(f"run_virtual: torch's stream pool gave {n} ranks fewer than {n} distinct streams; "
                          "install cuda-python so the ranks get streams of their own")
    return streams, lambda: None


def _describe(call: tuple) -> str:
    """A gate entry's call as the user wrote it: ``op(dtype=..., shape=(...))`` (or the text given)."""
    what, op = call[2], call[3]
    if isinstance(what, tuple):
        dtype, shape = what
        return f"{op}(dtype={str(dtype).replace('torch.', '')}, shape={tuple(shape)})"
    return str(what)


class LaunchGate:
    """Two host-side rendezvous per eager call of the virtual ranks, both bounded by ``timeout_s``:

    * :meth:`enter` before a rank launches call ``seq``: every rank has reached the call, so no
      rank's kernel of this call is in flight while another rank is still in host code before it
      (a device allocation or a synchronize there would wait for that kernel, which waits for it);
    * :meth:`launched` after it: every rank has enqueued the call, so a rank that blocks its host
      right after (``.cpu()``, ``.item()``) cannot stall a peer's launch.
    """

    def __init__(self, world: int, timeout_s: float):
        self.world, self.timeout_s = world, timeout_s
        self._counts = {"reach": [0] * world, "launch": [0] * world}
        self._failed: dict[int, str] = {}
        # call number -> per rank: (seq, fingerprint, description, op, splits) of its entry. Kept by call
        # number, not as each rank's latest call: a rank that raised and entered its next call must not
        # hide its entry of this one from a slower peer's check
        self._calls: dict[int, list] = {}
        self._rejects: dict[int, dict[int, str]] = {}  # call number -> {rank: its error}: arguments rejected
        self._cond = threading.Condition()

    def enter(self, rank: int, seq: int, op: str, fingerprint: int = 0, what: Any = "", splits: Any = None) -> None:
        """Meet every rank at call ``seq``; ranks whose calls differ (``fingerprint``: the call's
        cross-rank invariants; ``what``: how to name it, a string or (dtype, shape), formatted only
        for the error: nothing is formatted on the hot path) get a PurlinMismatchError naming both sides.
        ``splits`` (an exchange's (input rows per peer, output rows per peer)): where two ranks disagree on
        the rows between them, every rank raises the same PurlinMismatchError naming both arguments."""
        with self._cond:
            self._calls.setdefault(seq, [None] * self.world)[rank] = (seq, fingerprint, what or op, op, splits)
            _forget_before(self._calls, seq - 8)
        self._meet("reach", rank, seq, op)
        with self._cond:
            rejected = self._rejects.get(seq)
            if rejected:
                raise rejected_error(op, dict(rejected), seq)
            calls = self._calls[seq]
            mine = calls[rank]
            for peer, theirs in enumerate(calls):
                if theirs is not None and theirs[1] != mine[1]:
                    raise PurlinMismatchError(
                        mismatch_message(op, rank, peer, seq, _describe(mine), _describe(theirs)),
                        op=op, rank=rank, peer=peer)
            if splits is not None and all(c is not None and c[4] for c in calls):
                why = first_split_mismatch(op, [c[4][0] for c in calls], [c[4][1] for c in calls])
                if why is not None:
                    raise PurlinMismatchError(why, op=op, rank=rank)

    def reject(self, rank: int, seq: int, op: str, cause: str) -> None:
        """Rank ``rank`` rejected its own arguments of call ``seq`` (``cause``: its error message): it
        reaches the call without launching it, and waits (bounded by the timeout) until every rank has
        reached it; each peer then raises a PurlinRejectedError quoting ``cause`` from :meth:`enter` and
        launches nothing either. The caller raises its own error."""
        with self._cond:
            self._rejects.setdefault(seq, {})[rank] = cause
            _forget_before(self._rejects, seq - 8)
        try:
            self._meet("reach", rank, seq, op)
        except PurlinError:
            pass  # a peer that failed or never comes: the caller raises its own error all the same

    def launched(self, rank: int, seq: int, op: str) -> None:
        self._meet("launch", rank, seq, op)

    def execute(self, rank: int, ctx: Any, launch: Callable[[], None]) -> None:
        """``launch()`` (rank ``rank``'s launch of call ``ctx``, an engines.base.CallContext) between
        :meth:`enter` and :meth:`launched`; under graph capture, where nothing runs, without them."""
        if torch.cuda.is_current_stream_capturing():
            launch()
            return
        self.enter(rank, ctx.seq, ctx.op, ctx.fingerprint, (ctx.dtype, ctx.x.shape), ctx.splits)
        launch()
        self.launched(rank, ctx.seq, ctx.op)

    def _meet(self, what: str, rank: int, seq: int, op: str) -> None:
        counts = self._counts[what]
        with self._cond:
            if seq > counts[rank]:
                counts[rank] = seq
                self._cond.notify_all()
            done = self._cond.wait_for(lambda: self._failed or min(counts) >= seq, self.timeout_s)
            if self._failed and min(counts) < seq:
                r, why = next(iter(self._failed.items()))
                raise PurlinBrokenError(f"{op}: rank {r} failed before it {what}ed call #{seq} ({why})")
            if not done:
                late = [r for r, n in enumerate(counts) if n < seq]
                who = f"rank {late[0]}" if len(late) == 1 else f"ranks {late}"
                raise PurlinTimeoutError(
                    f"{op}: rank {rank} waited {self.timeout_s:g}s (timeout_s) for call #{seq}: {who} never "
                    f"{'reached' if what == 'reach' else 'launched'} it (loopback virtual ranks). Where their "
                    f"threads were:\n{thread_stacks(late)}",
                    op=op, rank=rank, missing=late)

    def fail(self, rank: int, why: str) -> None:
        """Rank ``rank`` raised: release the ranks waiting for it."""
        with self._cond:
            self._failed.setdefault(rank, why)
            self._cond.notify_all()


def _forget_before(by_call: dict, seq: int) -> None:
    """Drop the gate's entries of calls before ``seq``: every rank is past them (ranks meet at every call,
    so none lags by more than one)."""
    for old in [s for s in by_call if s < seq]:
        del by_call[old]


def thread_stacks(ranks: list[int]) -> str:
    """The current Python stacks of the rank threads ``purlin-vrank<r>`` (the innermost frames)."""
    names = {f"purlin-vrank{r}": r for r in ranks}
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        if t.name in names and t.ident in frames:
            stack = "".join(traceback.format_stack(frames[t.ident], limit=6))
            out.append(f"  rank {names[t.name]} ({t.name}):\n{stack}")
    return "\n".join(out) if out else "  (no rank thread is alive)"
