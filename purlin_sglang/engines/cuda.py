"""The CUDA engine: runs the SAME lowered schedules as the CPU engine, one kernel launch per call.

Each schedule is encoded once (engines/cuda_ops.py) into a device op table, kept until the engine
closes (captured CUDA graphs point at it). A call fills a prebuilt parameter struct with the table,
the input and output pointers and the dtype, and launches the interpreter (native/snac/) on the
caller's current stream. It never blocks the host and never synchronizes the device.

Timeouts are reported lazily: a wait past ``timeout_s`` records the op, kind, peer and item in a
host-mapped pinned record and ends the kernel (later kernels of this rank exit at once). The host
reads the record, without a device sync, at the start of every call and in :meth:`synchronize`,
and raises :class:`PurlinTimeoutError` there: an error can surface one call late, or at
``Communicator.synchronize()``. After one the engine is broken; create a new Communicator.
"""

from __future__ import annotations

import ctypes
import time
from typing import Optional

import numpy as np
import torch

from .. import native
from ..abi import DESC_SEQ_SHIFT
from ..config import timeouts
from ..errors import (
    PurlinBrokenError, PurlinCudaError, PurlinError, PurlinMismatchError, PurlinRejectedError, PurlinTimeoutError,
    PurlinUnavailableError, text_words, words_text,
)
from ..memory.layout import ARRIVE_SLOTS, EPOCH_WORDS, REJECT_WORDS, RESYNC_WORDS, DeviceLayout
from ..snac import Schedule, registry
from .base import describe_info, fold32, mismatch_message
from .cuda_ops import ACK, BARRIER_KIND, DRAIN, KIND_NAMES, NOTIFY, PACKET_KIND, encode

MAX_BLOCKS = 16  # per rank: about what saturates one NVLink direction (ARCHITECTURE.md)
HOST_ERROR_WORDS = native.SNAC_ERROR_WORDS  # the kernels' host-mapped record (native.SNAC_ERROR_FIELDS)
REJECT_MARK = (1 << DESC_SEQ_SHIFT) - 1  # the payload of all three descriptor words of a rejected call
READ_REJECTION_S = 1.0  # how long a rank's host waits for the device copy of a peer's rejection message
RESYNC_POLL_S = 0.0002  # between two reads of a rank's reset words while it waits for its peers (CudaEngine.resync)


def desc_word(seq: int, payload: int) -> int:
    """A descriptor word as the kernels write it (native ops.cuh desc_word): ``seq << DESC_SEQ_SHIFT |
    payload``, as a signed int64."""
    v = ((seq << DESC_SEQ_SHIFT) | (payload & REJECT_MARK)) & ((1 << 64) - 1)
    return v - (1 << 64) if v >= 1 << 63 else v


def rejected_marks(theirs: int, lo: int, hi: int) -> bool:
    """Whether a MISMATCH record's peer words (word 0 as its kernel read it, words 1 and 2 of the same call)
    are those of a rejected call (:meth:`CudaEngine.reject`)."""
    return all(w != 0 and w & REJECT_MARK == REJECT_MARK for w in (theirs, lo, hi))


def _wait_stream(stream, seconds: float) -> bool:
    """Poll ``stream`` until its work is done, at most ``seconds``: a device that cannot get to it (a kernel
    of another call still spinning) must not hang the host. True when done."""
    deadline = time.monotonic() + seconds
    while not stream.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True
TABLE_ARENA_WORDS = 1 << 18  # 2 MiB of op tables per rank, allocated up front; grows by doubling


class _Arena:
    """Device memory for op tables, and a pinned host mirror of it, both allocated when the engine
    is made (outside any call).

    A table is written into the pinned mirror by the host and moved to the device by a one-block
    copy kernel on the caller's stream. No copy engine and no host-blocking copy is on the call path:
    a synchronous host-to-device copy blocks this rank's thread until its stream drains, and in
    loopback (every rank on one GPU) that stalled a peer's launches while its kernels waited for
    them until the timeout (docs/DESIGN.md, "Loopback caveats"). No device allocation happens on the
    call path either: in loopback a cudaMalloc while other ranks' kernels run serializes the streams
    (CUDA's implicit synchronization) and would cost a timeout. Regions are never reused, so the
    host never overwrites words a pending copy still reads."""

    def __init__(self, device: torch.device, words: int):
        self.device, self.used = device, 0
        self.chunks = [torch.empty(words, dtype=torch.int64, device=device)]
        self.pinned = device.type == "cuda"  # False only for the tests' CPU stand-in
        self.host = [torch.empty(words, dtype=torch.int64, pin_memory=self.pinned)]

    def put(self, words: np.ndarray, lib: native.NativeLibrary, stream: int) -> torch.Tensor:
        """The device table of ``words``, its copy enqueued on ``stream``."""
        n = max(1, int(words.size))
        cur = self.chunks[-1]
        if self.used + n > cur.numel():  # rare: a larger chunk (a device and a pinned allocation, once)
            size = max(2 * cur.numel(), n)
            cur = torch.empty(size, dtype=torch.int64, device=self.device)
            self.chunks.append(cur)
            self.host.append(torch.empty(size, dtype=torch.int64, pin_memory=self.pinned))
            self.used = 0
        view = cur[self.used: self.used + n]
        if words.size:
            staged = self.host[-1][self.used: self.used + n]
            staged.numpy()[:] = words
            lib.copy_atom(view.data_ptr(), staged.data_ptr(), n * 8, stream, max_blocks=1, device=self.device.index)
        self.used += (n + 15) // 16 * 16  # 128-byte aligned tables
        return view

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * 8 for c in self.chunks)


def grid_blocks(lib: native.NativeLibrary, world: int, ranks_on_gpu: int, device: int = -1) -> int:
    """Blocks per rank such that every rank on this GPU has all its blocks resident at once, in every
    kernel a call may launch (the staged interpreter and the packet kernel of every dtype: the native
    occupancy is the fewest blocks per SM over all of them). Raises before any launch if not even one
    block per rank fits."""
    per_sm, sms = lib.snac_occupancy(device)
    slots = per_sm * sms // max(1, ranks_on_gpu)
    if slots < 1:
        raise PurlinUnavailableError(
            f"cuda engine: {ranks_on_gpu} ranks on one GPU with {sms} SMs cannot all be resident "
            f"({per_sm} interpreter block(s) per SM); use fewer virtual ranks")
    return min(MAX_BLOCKS, EPOCH_WORDS, slots)  # one packet-epoch word per block (memory/layout.py)


class CudaEngine:
    name = "cuda"
    packets = True  # runs the packet protocol (snac/packet.cuh): the selector may take algorithms that need it
    call_check = False  # publish and check call descriptors (config device_call_check); set in __init__
    _surfaced = False  # a recorded error was raised once: later calls raise PurlinBrokenError (check)
    _last: tuple[int, int] = (0, 0)  # (call number, tag) of the last call launched (synchronize's rejection check)
    _late_reads: tuple = ()  # host buffers of reads that did not finish in time (the copy may still land)
    resync_pending: Optional[tuple[str, int]] = None  # (op, call) of a rejected call whose reset is owed (resync)
    can_resync = False  # whether a rejected call is followed by the reset (set in __init__: the call check's)
    checks_splits = False  # ranks that disagree on all_to_all_v splits are not seen by the kernels (config split_check)

    def __init__(self, ws, rank: int, world: int, timeout_s: float, *, ranks_on_gpu: int | None = None,
                 call_check: bool = False):
        if world > native.SNAC_MAX_RANKS:
            raise PurlinUnavailableError(f"cuda engine: at most {native.SNAC_MAX_RANKS} ranks, got {world}")
        self.lib = native.load()
        self.ws, self.rank, self.world, self.timeout_s = ws, rank, world, timeout_s
        self.device = torch.device("cuda", ws.device_index)
        dl: DeviceLayout = ws.layout
        self.dlayout = dl
        with torch.cuda.device(self.device):
            self.blocks = grid_blocks(self.lib, world, ranks_on_gpu or world, ws.device_index)
        self._arena = _Arena(self.device, TABLE_ARENA_WORDS)
        self._host_error = torch.zeros(HOST_ERROR_WORDS, dtype=torch.int64, pin_memory=True)
        self._err = self._host_error.numpy()
        p = native.SnacParams()
        for r, ptr in enumerate(ws.base_ptrs):
            p.bases[r] = ptr
        p.rank, p.world, p.blocks, p.max_items = rank, world, self.blocks, dl.max_items
        p.notify_off, p.ack_off, p.sent_off = dl.notify_off, dl.ack_off, dl.sent_off
        p.expect_off, p.acked_off, p.arrive_off, p.arrive_slots = dl.expect_off, dl.acked_off, dl.arrive_off, ARRIVE_SLOTS
        p.exit_off, p.error_off, p.staging_off = dl.exit_off, dl.error_off, dl.staging_off
        p.epoch_off, p.window_off, p.window_bytes = dl.epoch_off, dl.window_off, dl.window_bytes
        p.timeout_ns = timeouts(timeout_s).kernel_ns
        p.host_error = self._host_error.data_ptr()
        p.device = ws.device_index  # made current by the library before every launch
        # Call descriptors (config device_call_check): published by every kernel, compared in its waits.
        self.call_check = bool(call_check)
        p.desc_off = dl.desc_off if self.call_check else -1
        self._params = p
        self._pref = ctypes.byref(p)
        self._by_id: dict[int, tuple] = {}  # id(schedule) -> (schedule, table, n_ops, n_updates, tag)
        self._by_key: dict[tuple, tuple] = {}
        self._names: list[str] = []  # tag -> collective name, for error messages
        self._index = ws.device_index
        self._stream = None  # the torch Stream of the last launch (for synchronize) and its handle
        self._stream_handle: int | None = None
        self.broken: str | None = None
        # (peer, call) -> (the rank that rejected, its call number, its message), read from the peer's entry
        self._reject_causes: dict[tuple[int, int], tuple[int, int, str]] = {}
        self._reject_buf = None
        # A rejected call is followed by a reset of every rank's protocol state (resync), so that the
        # communicator stays usable: possible where the ranks hear of the rejection (the call check).
        self.can_resync = self.call_check and world > 1
        self._resync_rounds = 0
        self._resync_keep: list = []  # host and device buffers of the reset's copies, alive until they ran

    # -- tables --------------------------------------------------------------------------------
    def _table(self, sched: Schedule, op: str) -> tuple:
        """(schedule, table, n_ops, n_updates, tag, table pointer, reduces, kernel kind) of ``sched``, made once."""
        e = self._by_id.get(id(sched))
        if e is not None and e[0] is sched:
            return e
        key = (sched.plan, sched.sizes)
        e = self._by_key.get(key)
        if e is None:
            if torch.cuda.is_current_stream_capturing():
                raise PurlinUnavailableError(
                    f"{op}: this call's schedule (collective, sizes, dtype layout) was not run before the CUDA "
                    "graph capture began; run the same call once outside the capture (warm-up) first")
            enc = encode(sched, self.dlayout)
            table = self._arena.put(enc.words, self.lib, _current_raw_stream(self._index))
            self._names.append(op)
            e = (sched, table, enc.n_ops, enc.n_updates, len(self._names) - 1, table.data_ptr(), _has_reduce(sched),
                 _kernel_kind(sched, op))
            self._by_key[key] = e
        self._by_id[id(sched)] = e if e[0] is sched else (sched,) + e[1:]
        return self._by_id[id(sched)]

    # -- calls ---------------------------------------------------------------------------------
    def execute(self, sched: Schedule, ctx) -> None:
        """Enqueue one rank's schedule on the current stream (a hybrid schedule: its parts, one kernel
        each, in order). Collective; does not block the host."""
        if self._err[0]:
            self._raise_recorded()
        if self.broken:
            raise PurlinBrokenError(f"{ctx.op}: the communicator is broken ({self.broken})")
        for part in sched.parts or (sched,):
            e = self._by_id.get(id(part))
            if e is None or e[0] is not part:
                e = self._table(part, ctx.op)
            p = self._params
            self._fill(p, e, ctx)
            p.input, p.output = ctx.x.data_ptr(), ctx.y.data_ptr()
            self._last = (ctx.seq, e[4])
            code = self.lib.snac_execute(self._pref, self._launch_stream())
            if code:
                self._launch_failed(ctx.op, code)

    def bind(self, sched: Schedule, ctx) -> "_Launch":
        """The steady state of calls of ``ctx``'s shape (collective, sizes, dtype, fingerprint): a
        parameter struct of their own (one per part of a hybrid schedule) with everything but the
        pointers and the call number filled in, for :meth:`launch`. Call after :meth:`execute` ran such
        a call (its op tables exist)."""
        structs = []
        for part in sched.parts or (sched,):
            p = native.SnacParams.from_buffer_copy(self._params)
            self._fill(p, self._table(part, ctx.op), ctx)
            structs.append(p)
        return _Launch(structs, ctx.op)

    def launch(self, bound: "_Launch", x: torch.Tensor, y: torch.Tensor, seq: int) -> None:
        """One call of a bound shape, call number ``seq``: one native call (``snac_launch``) that writes the
        pointers and the number into the bound struct and launches (one more per further part of a hybrid
        schedule). The caller has checked the engine usable (``engines.check_usable``) and ``x`` / ``y``
        against the call's shape."""
        self._last = (seq, bound.tag)
        code = self.lib.snac_launch(bound.addr, x.data_ptr(), y.data_ptr(), seq, self._launch_stream())
        if code:
            self._launch_failed(bound.op, code)
        if bound.more:
            for addr in bound.more:
                code = self.lib.snac_launch(addr, x.data_ptr(), y.data_ptr(), seq, self._stream_handle)
                if code:
                    self._launch_failed(bound.op, code)

    def _fill(self, p: native.SnacParams, e: tuple, ctx) -> None:
        """The fields of one call's struct that its shape decides: table, dtype, call description."""
        p.ops, p.n_ops, p.n_updates, p.tag, p.packets = e[5], e[2], e[3], e[4], e[7]
        p.dtype = native.reduce_dtype_code(ctx.dtype) if e[6] else 0
        if self.call_check:
            p.desc_seq, p.desc_fp, p.desc_info = ctx.seq, fold32(ctx.fingerprint), ctx.info

    def _launch_stream(self) -> int:
        """The caller's current stream (cudaStream_t); one not launched on before is kept for synchronize()."""
        stream = _current_raw_stream(self._index)
        if stream != self._stream_handle:
            self._stream, self._stream_handle = torch.cuda.current_stream(self.device), stream
        return stream

    def _launch_failed(self, op: str, code: int) -> None:
        self.mark_broken(f"launch failed with CUDA error {code}")
        raise PurlinCudaError(f"{op}: kernel launch failed: {self.lib.error_string(code)}", code=code)

    # -- a rank's own argument error -----------------------------------------------------------
    def reject(self, seq: int, op: str, message: str) -> None:
        """This rank rejected its own arguments of call ``seq`` (``message``: its error) and launches nothing.

        With the call check on (``device_call_check``), its message and a rejected descriptor for ``seq`` (and
        for ``seq + 1``) are written into every peer's workspace (one-block copies from pinned memory on a side
        stream, the descriptor's word 0 last): a peer kernel waiting for this rank in that call stops within the
        check's 20 us and records it, and that peer raises :class:`PurlinRejectedError` quoting ``message`` at
        its next call or :meth:`synchronize`, instead of a timeout after ``timeout_s``; a peer whose part of the
        call did not wait for this rank (a broadcast's root) stops the same way in its next call that does. The
        peers' kernels of a process group are already running when this rank finds its error, so they stop
        mid-call: every rank then owes the reset of :meth:`resync` (``resync_pending``), which the communicator
        runs at the start of the rank's next call. Where the peers cannot hear of it (the check off, or the
        copies failed) the communicator is broken on every rank instead. Never raises: the caller raises its own
        error whatever happens here."""
        announced = False
        if self.call_check and self.ws is not None and not self.broken and self.world > 1:
            try:
                self._announce_rejection(seq, message, self.rank)
                announced = True
            except Exception:  # noqa: BLE001 - the caller's own error is what this rank raises
                pass
        if announced and self.can_resync:
            self.resync_pending = (op, seq)
            return
        self.mark_broken(f"{op}: this rank rejected its arguments of call #{seq} ({message}); its peers' kernels "
                         "stopped in that call, so the communicator is broken on every rank (create a new one)")

    def _announce_rejection(self, seq: int, message: str, origin: int) -> None:
        """Rank ``origin``'s rejection of call ``seq`` written into every peer's workspace: this rank's entry
        (``[seq, bytes of the message | (origin + 1) << 32, message...]``), then its rejected descriptors of
        calls ``seq`` and ``seq + 1``. Raises if the copies did not run within ``timeout_s``."""
        dl, me = self.dlayout, self.rank
        size = len(message.encode("utf-8")) | (origin + 1) << DESC_SEQ_SHIFT
        marks = [desc_word(s, REJECT_MARK) for s in (seq, seq + 1) for _ in range(3)]
        buf = _pinned_words([seq, size, *text_words(message, REJECT_WORDS - 2), *marks])
        self._reject_buf = buf  # alive until its copies ran (a copy left waiting below still reads it)
        src, nbytes = buf.data_ptr(), REJECT_WORDS * 8
        peers = [base for q, base in enumerate(self.ws.base_ptrs) if q != me]
        # in order: every message, then descriptor words 1 and 2, then word 0 (what a waiting peer compares,
        # so it finds the rest in place)
        copies = [(base + dl.reject(me), src, nbytes) for base in peers]
        for i, s in enumerate((seq, seq + 1)):
            at = src + nbytes + 24 * i
            copies += [(base + dl.desc(me, s) + 8, at + 8, 16) for base in peers]
            copies += [(base + dl.desc(me, s), at, 8) for base in peers]
        if not self._side_copies(copies, self.timeout_s):
            raise PurlinTimeoutError(f"rank {me}: the copies announcing a rejected call did not run within "
                                     f"{self.timeout_s:g}s", op="reject", rank=me)

    def _side_copies(self, copies: list[tuple[int, int, int]], seconds: float) -> bool:
        """``(dst, src, nbytes)`` one-block copies, in order, on a stream of their own; waits for them at most
        ``seconds`` (:func:`_wait_stream`). True when they ran."""
        stream = _side_stream(self.device)
        for dst, src, nbytes in copies:
            self.lib.copy_atom(dst, src, nbytes, stream.cuda_stream, max_blocks=1, device=self._index)
        return _wait_stream(stream, seconds)

    def _read_own(self, offset: int, nwords: int, seconds: float) -> Optional[list[int]]:
        """``nwords`` int64 words at byte ``offset`` of this rank's workspace, copied to the host (one side
        copy, waited for at most ``seconds``); None if the copy did not finish, its buffer then kept alive."""
        buf = _pinned_words([0] * nwords)
        if self._side_copies([(buf.data_ptr(), self.ws.base_ptrs[self.rank] + offset, nwords * 8)], seconds):
            return buf.tolist()
        self._late_reads = (*self._late_reads, buf)
        return None

    def _rejection(self) -> Optional[tuple[int, int]]:
        """(peer, call number) of a recorded MISMATCH that is a peer's rejected call, or None."""
        f = native.SNAC_ERROR_FIELDS
        if int(self._err[0]) != native.SNAC_ERROR_CODES["MISMATCH"]:
            return None
        theirs, lo, hi, mine, peer = (int(self._err[f.index(k)]) for k in ("seen", "peer_info_lo", "peer_info_hi",
                                                                               "target", "peer"))
        if not rejected_marks(theirs, lo, hi):
            return None
        return peer, (mine >> DESC_SEQ_SHIFT) & REJECT_MARK

    def _read_rejection(self) -> None:
        """A recorded rejection's entry, read from this rank's workspace (where the peer wrote it) into
        ``_reject_causes``: the rank that rejected, its call number and its message; bounded
        (READ_REJECTION_S), and left out if it cannot be read. The entry is that of the recorded call, or of
        the call before it (the peer's marks of the next call stopped this rank's kernel there)."""
        found = self._rejection()
        if found is None or found in self._reject_causes or self.ws is None:
            return
        peer, seq = found
        try:
            w = self._read_own(self.dlayout.reject(peer), REJECT_WORDS, READ_REJECTION_S)
        except Exception:  # noqa: BLE001 - the error is raised all the same, without the peer's words
            return
        if w is not None and w[0] in (seq, seq - 1):
            nbytes, origin = w[1] & REJECT_MARK, (w[1] >> DESC_SEQ_SHIFT) - 1
            text = words_text(w[2:]) + (" [...]" if nbytes > 8 * (REJECT_WORDS - 2) else "")
            self._reject_causes[found] = (origin if 0 <= origin < self.world else peer, w[0], text)

    def synchronize(self) -> None:
        """Wait for this rank's enqueued calls; raise an error one of them recorded. Blocks the host.

        Also raises a peer's rejection of the last call when this rank's part of it never waited for that
        peer (a broadcast's root), if the peer's marks have arrived by then (:meth:`_rejected_last`);
        otherwise such a rank raises it in its next call that waits for the peer."""
        if self._stream is not None:
            self._stream.synchronize()
        self.check()
        if self._rejected_last():
            self.check()

    def _rejected_last(self) -> bool:
        """Whether a peer's rejected descriptor of this rank's last call lies in this rank's workspace (one
        bounded device copy of the descriptor slots); if so, it is recorded as the kernels record one
        (a MISMATCH whose words carry the marks), for :meth:`check` to raise."""
        seq, tag = self._last
        if not (self.call_check and self.can_resync and self.ws is not None and self.world > 1 and seq > 0):
            return False
        if self._err[0] or self.broken:
            return False
        dl, me, ring = self.dlayout, self.rank, native.SNAC_DESC_RING
        nwords = self.world * ring * native.SNAC_DESC_WORDS
        try:
            w = self._read_own(dl.desc_off, nwords, READ_REJECTION_S)
        except Exception:  # noqa: BLE001 - nothing learned: the next call that waits finds it
            return False
        if w is None:
            return False
        for peer in range(self.world):
            at = (dl.desc(peer, seq) - dl.desc_off) // 8
            theirs, lo, hi = w[at:at + 3]
            if peer != me and rejected_marks(theirs, lo, hi) and (theirs >> DESC_SEQ_SHIFT) & REJECT_MARK == seq:
                f = native.SNAC_ERROR_FIELDS
                rec = {"op": 0, "kind": 0, "peer": peer, "item": 0, "rank": me, "target": desc_word(seq, 0),
                       "seen": theirs, "tag": tag, "peer_info_lo": lo, "peer_info_hi": hi, "my_info": 0}
                for k, v in rec.items():
                    self._err[f.index(k)] = v
                self._err[0] = native.SNAC_ERROR_CODES["MISMATCH"]
                return True
        return False

    def check(self) -> None:
        """Raise an error a kernel recorded, without waiting (no device sync): once, typed (a timeout, a
        mismatch, a peer's rejection); the engine is broken from then on, so the callers' usability check
        raises PurlinBrokenError quoting it at every later call. A peer's rejection instead leaves the reset
        of :meth:`resync` owed (``resync_pending``): the caller runs it before this rank's next call."""
        if self._err[0] and not self._surfaced:
            self._raise_recorded()

    def _raise_recorded(self) -> None:
        self._read_rejection()
        error = self.recorded_error()
        if isinstance(error, PurlinRejectedError) and self.can_resync:
            # A peer's rejected call: this rank passes the rejection on (so a rank waiting for this one, not
            # for the peer, stops too) and owes the reset (resync), which the communicator runs at the start
            # of this rank's next call; the engine is not broken.
            origin, seq, cause = self._rejected_call()
            try:
                self._announce_rejection(seq, cause or "", origin)
            except Exception:  # noqa: BLE001 - the reset's rendezvous waits for the ranks that did not hear
                pass
            self.resync_pending = (error.op, seq)  # after recorded_error: it reads None from now on
        else:
            self.broken = self.broken or str(error)
        self._surfaced = True
        raise error

    def _rejected_call(self) -> tuple[int, int, Optional[str]]:
        """(rank that rejected, its call number, its message or None) of the recorded rejection."""
        peer, seq = self._rejection()
        return self._reject_causes.get((peer, seq), (peer, seq, None))

    # -- the reset after a rejected call ---------------------------------------------------------
    def resync(self, seq: int) -> int:
        """The reset every rank runs after a rejected call (``resync_pending``), at the start of its next call
        (the communicator's usability check): its kernels finished (bounded by ``timeout_s``), a rendezvous of
        every rank, its protocol state cleared back to a new workspace's (:meth:`DeviceLayout.reset_spans`), a
        second rendezvous, and the host record cleared. ``seq`` is this rank's last call number; returns the
        largest of every rank's, the call number every rank continues from. Blocks the host, at most
        ``timeout_s``. A rank that does not come (dead, or one that never waits for the rejecting rank) is a
        PurlinTimeoutError naming it, and the engine is broken."""
        op, rejected = self.resync_pending or ("collective", seq)
        self.resync_pending = None
        deadline = time.monotonic() + self.timeout_s
        try:
            if self._stream is not None and not _wait_stream(self._stream, self.timeout_s):
                raise self._resync_timeout(op, rejected, "for its own kernels to finish", [self.rank])
            seen = self._resync_round(op, rejected, seq, deadline)  # no kernel of any rank runs now
            spans = self.dlayout.reset_spans()
            zeros = torch.zeros(max(n for _, n in spans), dtype=torch.uint8, device=self.device)
            self._resync_keep.append(zeros)
            own = self.ws.base_ptrs[self.rank]
            if not self._side_copies([(own + at, zeros.data_ptr(), n) for at, n in spans], _left(deadline)):
                raise self._resync_timeout(op, rejected, "for the copies clearing its workspace", [self.rank])
            seen = self._resync_round(op, rejected, max(seen), deadline)  # every rank's workspace is clear
        except PurlinError as e:
            self.mark_broken(str(e))
            raise
        except Exception as e:  # noqa: BLE001 - a CUDA call that failed: the state is unknown
            error = PurlinCudaError(f"{op}: the reset after rank {self.rank}'s view of the rejected call #{rejected} "
                                    f"failed ({type(e).__name__}: {e}); the communicator is broken")
            self.mark_broken(str(error))
            raise error from e
        self._resync_keep.clear()
        self._err[:] = 0
        self._surfaced = False
        return max(seen)

    def _resync_round(self, op: str, rejected: int, seq: int, deadline: float) -> list[int]:
        """One rendezvous: this rank's next round and ``seq`` written into every rank's reset words, then its
        own polled until every rank's round has come; returns every rank's call number."""
        self._resync_rounds += 1
        n, me, world, dl = self._resync_rounds, self.rank, self.world, self.dlayout
        post = _pinned_words([n, seq])
        self._resync_keep.append(post)
        if not self._side_copies([(base + dl.resync(me), post.data_ptr(), RESYNC_WORDS * 8)
                                  for base in self.ws.base_ptrs], _left(deadline)):
            raise self._resync_timeout(op, rejected, "for the copies of its reset words", [me])
        while True:
            w = self._read_own(dl.resync_off, RESYNC_WORDS * world, max(_left(deadline), READ_REJECTION_S))
            if w is None:
                raise self._resync_timeout(op, rejected, "for the copy of its reset words", [me])
            late = [q for q in range(world) if w[RESYNC_WORDS * q] < n]
            if not late:
                return [w[RESYNC_WORDS * q + 1] for q in range(world)]
            if time.monotonic() >= deadline:
                raise self._resync_timeout(op, rejected, "for its peers to reset", late)
            time.sleep(RESYNC_POLL_S)

    def _resync_timeout(self, op: str, rejected: int, what: str, late: list[int]) -> PurlinTimeoutError:
        ranks = ", ".join(str(q) for q in late)
        who = f" (rank{'s' if len(late) > 1 else ''} {ranks} did not come: dead, or not waiting for the rejecting " \
              "rank in any call since)" if late != [self.rank] else ""
        return PurlinTimeoutError(
            f"{op}: resetting the communicator after the rejected call #{rejected}, rank {self.rank} waited "
            f"{self.timeout_s:g}s (timeout_s) {what}{who}; the communicator is broken (create a new one on every "
            "rank)", op=op, rank=self.rank, missing=[q for q in late if q != self.rank])

    def recorded_error(self) -> Optional[PurlinError]:
        """The error a kernel of this rank recorded (the one :meth:`check` raises), or None. Reads the
        host-mapped record only: no device sync, nothing changed; safe from another thread."""
        if not self._err[0] or self.resync_pending is not None:  # (a rejection raised: its reset comes next)
            return None
        code, index, kind, peer, item, rank, target, seen, tag = (int(v) for v in self._err[:9])
        name = self._names[tag] if 0 <= tag < len(self._names) else "collective"
        if self._rejection() is not None:
            origin, seq, cause = self._rejected_call()
            quoted = f'"{cause}"' if cause is not None else "(its message could not be read)"
            after = ("every rank resets the communicator's state with the others at the start of its next call, so "
                     "it stays usable (calls this rank enqueued after that one did not run)" if self.can_resync
                     else "so the communicator is now broken")
            return PurlinRejectedError(
                f"{name}: rank {origin} rejected its arguments of call #{seq}: {quoted}; rank {rank}'s kernel stopped "
                "waiting for it (the ranks of a CUDA process group launch before they can hear of it); " + after,
                op=name, rank=origin, cause=cause or "")
        if code == native.SNAC_ERROR_CODES["MISMATCH"]:
            return PurlinMismatchError(self._mismatch_message(name, rank, peer, target, seen), op=name, rank=rank,
                                       peer=peer)
        if code == native.SNAC_ERROR_CODES["BAD_RECORD"]:
            return PurlinBrokenError(
                f"{name}: rank {rank}'s kernel met op #{index} (opcode {kind}, word 0 {seen:#x}) that it cannot "
                f"run (dtype code {target}: 0 is the copy-only kernel); the op table and the native library "
                "disagree, nothing was skipped; the communicator is now broken")
        kname = KIND_NAMES.get(kind, str(kind))
        what = {
            NOTIFY: f"chunk {target} of rank {peer}'s staging item {item} (saw {seen})",
            ACK: f"rank {peer} to drain my staging item {item} (acks {seen} < {target})",
            DRAIN: f"rank {peer} to drain the previous call's staging item {item} (acks {seen} < {target})",
            BARRIER_KIND: "the other blocks of my own grid",
            PACKET_KIND: f"rank {peer}'s packets of packet call {target} (saw epoch {seen})",
        }.get(kind, kname)
        msg = (f"{name}: rank {rank} waited {self.timeout_s:g}s at op #{index} ({kname} wait) for {what}. "
               f"Rank {peer} skipped this call or is stuck; the communicator is now broken")
        missing = [peer] if kind != BARRIER_KIND else []
        return PurlinTimeoutError(msg, op=name, rank=rank, missing=missing)

    def _mismatch_message(self, name: str, rank: int, peer: int, mine: int, theirs: int) -> str:
        """A MISMATCH record: my descriptor word 0 in ``mine``, the peer's in ``theirs`` (native.h desc_off)."""
        f = native.SNAC_ERROR_FIELDS
        lo, hi, my_info = (int(self._err[f.index(k)]) for k in ("peer_info_lo", "peer_info_hi", "my_info"))
        low = (1 << DESC_SEQ_SHIFT) - 1  # a descriptor word: seq << DESC_SEQ_SHIFT | payload (abi.py)
        seq = (mine >> DESC_SEQ_SHIFT) & low
        if lo and hi:  # the peer's description words of this same call
            peer_call = describe_info((lo & low) | (hi & low) << DESC_SEQ_SHIFT)
        else:
            peer_call = f"another call (fingerprint {theirs & low:#010x}, mine {mine & low:#010x})"
        return (mismatch_message(name, rank, peer, seq, describe_info(my_info), peer_call)
                + f" (seen by rank {rank}'s kernel while it waited for rank {peer}); the communicator is now broken")

    @property
    def table_bytes(self) -> int:
        """GPU memory held for op tables."""
        return self._arena.nbytes

    def mark_broken(self, reason: str) -> None:
        self.broken = self.broken or reason

    def close(self) -> None:
        self._by_id.clear()
        self._by_key.clear()
        self._arena = None
        self.ws = None


class _Launch:
    """One call shape's launch, prepared by :meth:`CudaEngine.bind`: its own parameter structs (kept alive
    here; ``addr`` is the first one's address for the native call, ``more`` the others', a hybrid
    schedule's later parts) and the collective's name for messages."""

    __slots__ = ("params", "addr", "more", "op", "tag")

    def __init__(self, params: list, op: str):
        self.params, self.op, self.tag = tuple(params), op, params[0].tag
        self.addr = ctypes.addressof(params[0])
        self.more = tuple(ctypes.addressof(p) for p in params[1:])


def _has_reduce(sched: Schedule) -> bool:
    return not sched.plan.spec.consume.is_copy


def _kernel_kind(sched: Schedule, op: str) -> int:
    """The kernel kind (abi.KERNEL_*) of one schedule's table: its algorithm's (snac/registry.py)."""
    kind = registry.get(sched.plan.algorithm).kernel
    if kind is None:
        raise PurlinUnavailableError(f"{op}: algorithm {sched.plan.algorithm!r} runs as parts, but this schedule "
                                     "has none; the algorithm's lowering must return Schedule.parts")
    return kind


def _torch_current_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# The cudaStream_t of the calling thread's current stream on device ``index``: torch's own raw query
# (the one its compiled code calls; no Stream object is built), else the public API. The one stream
# lookup of a call.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _torch_current_stream)


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least a millisecond (a copy is still given its chance)."""
    return max(deadline - time.monotonic(), 0.001)


def _pinned_words(words: list) -> torch.Tensor:
    """``words`` as an int64 tensor in pinned host memory (a device copy's source or destination)."""
    return torch.tensor(words, dtype=torch.int64).pin_memory()


def _side_stream(device: torch.device):
    """A stream of its own for the rejection copies (not the caller's, whose queue may hold spinning calls)."""
    return torch.cuda.Stream(device)
