"""The CUDA engine's MoE part (:class:`CudaMoE`, a :class:`~.engine.MoEEngine`): one kernel per call.

Dispatch: one kernel (native/moe/moe_kernel.cuh: route and FP8 quantisation in the kernel, put rows,
count words, wait, expand) over the caller's x and topk ids as they are. Combine: the
combine kernel (put back, done words, wait, weighted reduce). Nothing blocks the host in graph
mode; every wait is bounded by ``timeout_s``.

Virtual ranks (one process) take the one-pass mode by default (``moe.one_pass``; moe_kernel.cuh, "one-pass
mode"): a source writes each (token, expert) row once, straight into the receiver's ``x`` (and its
expert, source, slot and scale), and the combine reads each expert output where it lies and reduces
it; ``out_ref`` ([T, K], receiver << 32 | row) carries each slot's row from the dispatch to its
combine. Ranks in separate processes cannot address each other's tensors and take the receive-slot
path above. Both modes give the same outputs, bitwise.

Decode mode (``moe.decode_tokens`` D, default 0: off; moe_kernel.cuh, "decode mode"): a call in which every
rank dispatches at most D tokens, in either mode above, moves its rows as flag-in-data packets into
per-source windows of the receiver's region and back, one round an op (no count, delivered, ready or
done words). Every rank of a call must take it alike: an eager call decides from the token counts
its exchange gathered; a captured call from ``max_tokens`` (the most tokens any rank dispatches,
the same on every rank; default this rank's own). A rank whose peer took the other mode records a
mismatch (fatal) or times out. Outputs bitwise those of the other modes; ``out_ref`` holds each
slot's receiver (-1: not delivered).

Modes:

* graph mode (under CUDA graph capture, or ``capacity=`` given): ``world * capacity`` rows per local
  expert (capacity defaults to ``moe.max_tokens_per_rank`` under capture). A (source, expert)
  pair over capacity is recorded by the device (its rows past capacity are not delivered) and
  raised as PurlinCapacityError at the next MoE call or ``synchronize()``; so are ids out of range
  under capture (PurlinValueError). Eager calls with ``capacity=`` also exchange the counts first
  and raise at once, on every rank.
* eager exact (no capacity, not capturing): the counts (and a header of the call's shape) are
  all-gathered first (the wing's count exchange, :mod:`.exchange`, over the context's all_gather:
  the CUDA engine's) and read on the host (a sync), which sizes the rows exactly (capacity = the
  largest count) and catches a hidden-size mismatch on every rank.

The MoE region (:mod:`.region`) is made on the first call: collective, blocks the host,
not capturable (warm up before capturing). Its geometry comes from that call; a later call with
larger rows or top-k raises PurlinValueError. Errors the kernels record are decoded through
``native.MOE_ERROR_CODES``, the table the library's layout is checked against at load.
"""

from __future__ import annotations

import ctypes

import torch

from .. import native
from ..capture import capturing_here
from ..errors import (
    PurlinBrokenError, PurlinCapacityError, PurlinCudaError, PurlinError, PurlinMismatchError, PurlinTimeoutError,
    PurlinUnavailableError, PurlinValueError,
)
from .dispatch import MoEDispatch
from .engine import MoEContext
from .exchange import CountExchange
from .limits import default_capacity, token_excess
from .region import MAX_EXPERTS, MoELayout, header_bytes
from .routing import expert_counts
from .validate import check_id_range

PIN_WORDS = MAX_EXPERTS + 16
MAX_BLOCKS = 16  # per rank (as the SNAC engine): every rank of a GPU co-resident with a wide margin
MAX_TOPK = 32  # top-k columns one warp's lanes rank at once (native/moe/moe_kernel.cuh)
_CODES = {getattr(torch, n): native.DTYPE_CODES[n] for n in ("bfloat16", "float16", "float32")}  # combine dtypes
# The kernels' host-mapped error record (moe_kernel.cuh record()): word i holds field i; word 0 is the code, a
# value of native.MOE_ERROR_CODES (0: none). ``kind`` names the call whose wait or check recorded it.
RECORD_FIELDS = ("code", "kind", "rank", "peer", "expert", "count", "cap", "epoch", "seen")
KIND_DISPATCH, KIND_COMBINE, KIND_DISPATCH_PACKETS, KIND_COMBINE_PACKETS = 0, 1, 2, 3
KINDS = {KIND_DISPATCH: ("moe_dispatch", "count word"), KIND_COMBINE: ("moe_combine", "done word"),  # op, word
         KIND_DISPATCH_PACKETS: ("moe_dispatch", "decode packets"), KIND_COMBINE_PACKETS: ("moe_combine", "decode packets")}
FATAL = ("TIMEOUT", "MISMATCH")  # the codes that break the communicator; the others are raised once


def recorded_error(words, timeout_s: float) -> tuple[PurlinError, bool] | None:
    """The error the record ``words`` holds and whether it is fatal (:data:`FATAL`), or None when it holds
    none. The code is looked up by name in ``native.MOE_ERROR_CODES``; one it does not name reads as a
    timeout."""
    if not words[0]:  # the check before every call: one word read
        return None
    f = dict(zip(RECORD_FIELDS, (int(v) for v in words[:len(RECORD_FIELDS)])))
    name = {v: k for k, v in native.MOE_ERROR_CODES.items()}.get(f["code"], "TIMEOUT")
    op, what = KINDS.get(f["kind"], KINDS[KIND_DISPATCH])
    rank, peer, epoch, count, cap = f["rank"], f["peer"], f["epoch"], f["count"], f["cap"]
    if name == "OVERFLOW":
        error: PurlinError = PurlinCapacityError(
            f"{op}: rank {peer} routed {count} rows to expert {f['expert']}, more than capacity={cap} (seen by rank "
            f"{rank}, call #{epoch}); the rows past capacity were not delivered; raise capacity or "
            "moe.max_tokens_per_rank", rank=peer, expert=f["expert"], count=count, capacity=cap)
    elif name == "BAD_IDS":
        error = PurlinValueError(f"{op}: topk_ids held {count} id(s) outside [-1, num_experts) in a captured call "
                                 f"(#{epoch}); they were skipped")
    elif name == "REJECTED":
        error = PurlinValueError(f"{op}: rank {peer} rejected its arguments of MoE combine #{epoch} (its error names "
                                 "the argument); no rank reduced that call's outputs; the communicator stays usable")
    elif name == "MISMATCH" and (count ^ cap) & native.MOE_DECODE_META:
        error = PurlinMismatchError(
            f"{op}: rank {peer} and rank {rank} took different MoE modes in call #{epoch} (rank "
            f"{peer if count & native.MOE_DECODE_META else rank} the decode mode): in a captured call every rank must "
            "pass the same max_tokens to moe_dispatch (the most tokens any rank dispatches), or have its tokens on "
            "the same side of moe.decode_tokens; the communicator is now broken", op=op, rank=rank, peer=peer)
    elif name == "MISMATCH" and count == cap:
        error = PurlinMismatchError(
            f"{op}: rank {peer} sent {f['seen']} tokens in the decode mode, more than rank {rank}'s windows hold "
            "(moe.decode_tokens differs between ranks); the communicator is now broken", op=op, rank=rank, peer=peer)
    elif name == "MISMATCH":
        error = PurlinMismatchError(
            f"{op}: rank {peer} dispatched rows of another shape (meta {count:#x}, mine {cap:#x}: hidden size, top-k "
            "or expert count differ between ranks); the communicator is now broken", op=op, rank=rank, peer=peer)
    else:
        name = "TIMEOUT"
        error = PurlinTimeoutError(
            f"{op}: rank {rank} waited {timeout_s:g}s for rank {peer}'s {what} of MoE call #{epoch} (saw "
            f"#{f['seen']}). Rank {peer} skipped this call or is stuck{_mode_hint(f['kind'])}; the communicator is "
            "now broken",
            op=op, rank=rank, missing=[peer])
    return error, name in FATAL


def _mode_hint(kind: int) -> str:
    """A timeout's hint where a peer may have taken the other MoE mode (decode or not)."""
    if kind in (KIND_DISPATCH_PACKETS, KIND_COMBINE_PACKETS):
        return " (or took the normal mode: see moe.decode_tokens and moe_dispatch's max_tokens)"
    return ""


class _State:
    """What a dispatch leaves for its combine (kept alive with the MoEDispatch)."""

    __slots__ = ("valid", "src", "slot", "rows", "cap", "index", "ref", "decode", "counts")

    def __init__(self, valid, src, slot, rows, cap, index, ref=None, decode=False, counts=None):
        self.valid, self.src, self.slot, self.rows, self.cap, self.index = valid, src, slot, rows, cap, index
        self.ref = ref  # one-pass mode: [T, K] receiver << 32 | row there; decode mode: the receiver (-1: none)
        self.decode, self.counts = decode, counts  # decode mode: the combine's too; out_counts (valid rows)



def trace_stamps(words, one_pass: bool = False, decode: bool = False) -> dict[str, dict[str, int]]:
    """The kernels' trace words (``2 * MOE_TRACE_WORDS``, rows dispatch and combine) by kind and phase
    name (the one-pass and decode modes' kernels have their own phases); a phase not stamped yet (0) is
    left out."""
    out = {}
    table = (native.MOE_TRACE_PHASES_DECODE if decode else
             native.MOE_TRACE_PHASES_ONE_PASS if one_pass else native.MOE_TRACE_PHASES)
    for row, (kind, phases) in enumerate(table.items()):
        base = row * native.MOE_TRACE_WORDS
        out[kind] = {name: int(words[base + i]) for i, name in enumerate(phases) if words[base + i]}
    return out

def one_pass_mode(ctx: MoEContext) -> bool:
    """Whether the kernels take the one-pass mode: virtual ranks (one process, every rank's tensors
    addressable) and ``moe.one_pass`` on."""
    return ctx.group is None and ctx.config.moe.one_pass


def signals_at_gpu_scope(ctx: MoEContext) -> bool:
    """Whether the kernels' count and done words may signal at GPU scope: every rank's region lies on
    this GPU (virtual ranks) and ``moe.signal_scope`` is ``auto``."""
    return ctx.group is None and ctx.config.moe.signal_scope == "auto"


class CudaMoE:
    """The CUDA engine's MoE part for one rank (see the module doc). Made by the Communicator when it
    starts (a pinned allocation, an occupancy query); the region comes with the first call."""

    def __init__(self, ctx: MoEContext):
        self.ctx = ctx
        self.lib = native.load()
        self.device = ctx.device
        self.world, self.rank = ctx.world, ctx.rank
        self.settings = ctx.config.moe
        with torch.cuda.device(self.device):
            per_sm, sms = self.lib.moe_occupancy(self.device_index)
        slots = per_sm * sms // ctx.ranks_on_gpu
        if slots < 1:
            raise PurlinUnavailableError(f"moe_dispatch: {self.world} virtual ranks cannot all be resident on "
                                         f"{sms} SMs ({per_sm} MoE block(s) per SM)")
        self.blocks = min(MAX_BLOCKS, slots)
        self.one_device = signals_at_gpu_scope(ctx)
        self.one_pass = one_pass_mode(ctx)
        self.layout: MoELayout | None = None
        self.last_decode = False  # whether the last dispatch took the decode mode (its combine does too)
        self.region = None
        self._own_region = None  # a process group's region (closed here); loopback's belongs to the world
        self._host_error = torch.zeros(native.MOE_ERROR_WORDS, dtype=torch.int64, pin_memory=True)
        self._err = self._host_error.numpy()
        # the kernels' phase stamps (moe.trace): pinned, written by the device, read after a sync
        self._trace = (torch.zeros(2 * native.MOE_TRACE_WORDS, dtype=torch.int64, pin_memory=True)
                       if self.settings.trace else None)
        # Pinned staging of the eager count exchange (header and count matrix), moved by one-block copy
        # kernels on the caller's stream: no pageable copy and no copy engine on the call path (a
        # pageable copy there can keep a loopback rank's grid from becoming resident while its peers'
        # grids wait for it: the loopback caveat of docs/DESIGN.md).
        self._pin_up = torch.zeros(PIN_WORDS, dtype=torch.int64, pin_memory=True)
        self._pin_down = torch.zeros(PIN_WORDS * self.world, dtype=torch.int64, pin_memory=True)
        self._stream = None
        self.broken: str | None = None
        self.exchange = CountExchange(ctx, self._to_device, self._to_host)

    @property
    def device_index(self) -> int:
        """The CUDA device the library makes current before each launch (-1, the library's current device,
        only for the tests' CPU stand-in: a Communicator's CUDA device always has an index)."""
        return self.device.index if self.device.index is not None else -1

    # -- the region ------------------------------------------------------------------------------------
    def _region(self, topk: int, payload_bytes: int, ret_bytes: int, capturing: bool) -> MoELayout:
        if self.layout is not None:
            if not self.layout.fits(topk, payload_bytes):
                raise PurlinValueError(
                    f"moe_dispatch: rows of {payload_bytes} bytes with top-{topk} do not fit the MoE region made by "
                    f"the first call ({self.layout}); make the first call with the largest hidden size and top-k")
            return self.layout
        if capturing:
            raise PurlinUnavailableError("moe_dispatch: the MoE region is made on the first call, which cannot be "
                                         "captured; run the call once outside the CUDA graph capture (warm-up)")
        ctx = self.ctx
        layout = MoELayout(self.world, self.settings.max_tokens_per_rank, topk, payload_bytes, ret_bytes,
                           one_pass=self.one_pass, decode_tokens=self.settings.decode_tokens)
        if ctx.shared_regions is not None:
            self.region = ctx.shared_regions.get(layout, self.device)
        else:
            from ..memory import device_provider

            self._own_region = device_provider(ctx.memory).create(
                layout.rank_bytes, ctx.group, self.device.index, self.rank, self.world, layout=layout)
            self.region = self._own_region
        self.layout = layout
        return layout

    @property
    def hbm_bytes(self) -> int:
        return self.layout.rank_bytes if self.layout is not None else 0

    def _params(self, layout: MoELayout) -> native.MoeParams:
        p = native.MoeParams()
        for r, ptr in enumerate(self.region.base_ptrs):
            p.bases[r] = ptr
        p.rank, p.world, p.blocks, p.max_tokens = self.rank, self.world, self.blocks, layout.max_tokens
        p.count_off, p.count_bytes, p.done_off = layout.count_off, layout.count_bytes, layout.done_off
        p.recv_off, p.recv_parity_bytes = layout.recv_off, layout.recv_parity_bytes
        p.ret_off, p.ret_parity_bytes, p.state_off = layout.ret_off, layout.ret_parity_bytes, layout.state_off
        p.timeout_ns = int(self.ctx.config.timeout_s * 1e9)
        p.host_error = self._host_error.data_ptr()
        p.device = self.device_index  # made current by the library before the launch
        p.one_device = int(self.one_device)
        p.trace = self._trace.data_ptr() if self._trace is not None else None
        p.one_pass, p.ptr_off, p.ddone_off = int(layout.one_pass), layout.ptr_off, layout.ddone_off
        p.decode_tokens, p.win_off, p.win_bytes = layout.decode_tokens, layout.win_off, layout.win_bytes
        p.rwin_off, p.rwin_parity_bytes = layout.rwin_off, layout.rwin_parity_bytes
        return p

    def _launch(self, fn, p, op: str) -> None:
        stream = torch.cuda.current_stream(self.device)
        self._stream = stream
        code = fn(ctypes.byref(p), stream.cuda_stream)
        if code:
            raise PurlinCudaError(f"{op}: kernel launch failed: {self.lib.error_string(code)}", code=code)

    # -- errors ----------------------------------------------------------------------------------------
    def check(self, fatal_only: bool = False) -> None:
        """Raise an error a MoE kernel recorded (no device sync).

        Fatal ones (a timeout, ranks disagreeing on the rows' shape) always: the communicator is
        broken. The others (a capacity overflow, ids out of range in a captured call, a peer that rejected
        its combine arguments) only when
        ``fatal_only`` is false, which is in :meth:`synchronize` and at the end of ``moe_combine``
        after its kernel is enqueued: raising before a call would make this rank skip it while its
        peers wait for it, and raising in a dispatch would make the caller skip the combine."""
        if self.broken:
            raise PurlinBrokenError(f"moe: the communicator is broken ({self.broken})")
        found = recorded_error(self._err, self.ctx.config.timeout_s)
        if found is None:
            return
        error, fatal = found
        if not fatal:
            if fatal_only:
                return
            self._err[:] = 0  # raised once
            raise error from None
        self.broken = str(error)
        self.ctx.mark_broken(self.broken)
        raise error

    def recorded_error(self) -> PurlinError | None:
        """The error a MoE kernel of this rank recorded (raised at the next check), or None; reads the
        host-mapped record only, changes nothing, safe from another thread."""
        found = recorded_error(self._err, self.ctx.config.timeout_s)
        return found[0] if found is not None else None

    # -- small host <-> device moves of the eager exchange ----------------------------------------------
    def _to_device(self, values) -> torch.Tensor:
        """int64 values on the device, copied from pinned memory by a one-block kernel (the previous
        use of the staging ended: every eager exchange ends with a stream synchronize)."""
        n = len(values)
        self._pin_up.numpy()[:n] = values
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.lib.copy_atom(out.data_ptr(), self._pin_up.data_ptr(), n * 8, stream, max_blocks=1,
                           device=self.device_index)
        return out

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of the int64 device tensor ``t`` (a one-block kernel writes pinned memory; then
        this stream is synchronized: blocks the host)."""
        n = t.numel()
        stream = torch.cuda.current_stream(self.device)
        self.lib.copy_atom(self._pin_down.data_ptr(), t.data_ptr(), n * 8, stream.cuda_stream, max_blocks=1,
                           device=self.device_index)
        stream.synchronize()
        return self._pin_down[:n].clone()

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self.check()

    def trace(self) -> dict[str, dict[str, int]] | None:
        """The phase stamps of this rank's last dispatch and combine (after a synchronize), or None
        without ``moe.trace``."""
        if self._trace is None:
            return None
        if self._stream is not None:
            self._stream.synchronize()
        return trace_stamps(self._trace.tolist(), self.one_pass, self.last_decode)

    # -- calls -----------------------------------------------------------------------------------------
    def _check_local(self, x, ids, num_experts: int, quant: str, capturing: bool) -> int:
        """This engine's limits and (eager) the id range: PurlinValueError naming the argument. Returns
        the bytes of one payload row on the wire."""
        op = "moe_dispatch"
        t_n, k_n = ids.shape
        hidden = x.shape[1]
        excess = token_excess(self.settings, t_n)
        if excess:
            raise PurlinValueError(f"{op}: x has {t_n} tokens, {excess} (the CUDA engine's MoE region is sized by it)")
        if k_n > MAX_TOPK:
            raise PurlinValueError(f"{op}: topk_ids has {k_n} columns; the CUDA engine supports top-k <= {MAX_TOPK}")
        if num_experts > MAX_EXPERTS:
            raise PurlinValueError(f"{op}: num_experts={num_experts}; the CUDA engine supports at most {MAX_EXPERTS}")
        payload_bytes = hidden * (1 if quant == "fp8" else x.element_size())
        if (hidden * x.element_size()) % 16 or payload_bytes % 16:
            raise PurlinValueError(f"{op}: x rows of {hidden} elements are not a multiple of 16 bytes "
                                   f"({'fp8' if quant == 'fp8' else x.dtype}); the CUDA engine moves 16-byte vectors")
        if not capturing and ids.numel():  # ids in range: read through pinned memory (blocks the host)
            lo, hi = self._to_host(torch.stack([ids.min(), ids.max()]).to(torch.int64)).tolist()
            check_id_range(lo, hi, num_experts)
        return payload_bytes

    def reject(self, error: PurlinValueError) -> None:
        """This rank's arguments are bad (eager): tell the peers, which wait in the header exchange, and
        raise ``error``; they raise too, naming this rank, and no rank launches."""
        self.exchange.reject(error)

    def decode_mode(self, layout: MoELayout, tokens: int, max_tokens, capturing: bool, topk: int, payload_bytes: int,
                    ret_bytes: int) -> bool:
        """Whether this call takes the decode mode, decided alike on every rank: the most tokens any rank
        dispatches (eager: from the exchange; captured: ``max_tokens``, else this rank's ``tokens``) is at
        most ``moe.decode_tokens`` and the rows fit the decode windows."""
        limit = self.settings.decode_tokens
        if not limit or not layout.decode_fits(topk, payload_bytes, ret_bytes):
            return False
        most = max(self.exchange.tokens) if not capturing else (max_tokens if max_tokens is not None else tokens)
        return most <= limit

    def dispatch(self, x, ids, ws, num_experts: int, capacity, quant: str, capturing: bool,
                 max_tokens=None) -> MoEDispatch:
        self.check(fatal_only=True)
        op = "moe_dispatch"
        try:
            payload_bytes = self._check_local(x, ids, num_experts, quant, capturing)
        except PurlinValueError as e:
            if capturing:
                raise
            self.reject(e)  # raises on this rank; the peers raise naming it
        world, local = self.world, num_experts // self.world
        t_n, k_n = ids.shape
        hidden = x.shape[1]
        cap, index, rows_exact = capacity, None, None
        if not capturing:  # eager: every rank learns every count (header first: shapes must agree)
            matrix = self.exchange.run(x, ids, num_experts, capacity, quant, expert_counts(ids, num_experts))
            if capacity is None:
                mine = matrix[:, self.rank * local:(self.rank + 1) * local]
                cap = max(1, int(mine.max()) if mine.numel() else 1)
                rows_exact = mine.sum(0)
        elif cap is None:
            cap = default_capacity(self.settings)
        layout = self._region(k_n, payload_bytes, hidden * x.element_size(), capturing)
        x = x.contiguous()
        x = x if x.data_ptr() % 16 == 0 else x.clone()  # a view at an odd offset: the kernel moves 16-byte vectors
        ids = ids.contiguous()
        dev = self.device
        rows = local * world * cap
        fp8 = quant == "fp8"
        out_x = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=dev)
        out_expert = torch.empty(rows, dtype=torch.int32, device=dev)
        out_src = torch.empty(rows, dtype=torch.int32, device=dev)
        out_slot = torch.empty(rows, dtype=torch.int64, device=dev)
        out_counts = torch.empty(local, dtype=torch.int32, device=dev)
        out_scales = torch.empty(rows, dtype=torch.float32, device=dev) if fp8 else None
        valid = torch.empty(t_n, k_n, dtype=torch.bool, device=dev)
        decode = self.decode_mode(layout, t_n, max_tokens, capturing, k_n, payload_bytes, hidden * x.element_size())
        ref = torch.empty(t_n, k_n, dtype=torch.int64, device=dev) if layout.one_pass or decode else None
        p = self._params(layout)
        p.decode = int(decode)
        p.local, p.topk, p.tokens, p.capacity = local, k_n, t_n, cap
        p.payload_bytes, p.hdr_bytes = payload_bytes, header_bytes(k_n)
        p.slot_bytes = p.hdr_bytes + payload_bytes
        p.x, p.ids, p.ids_bytes = x.data_ptr(), ids.data_ptr(), ids.element_size()
        p.x_dtype, p.quant = native.DTYPE_CODES.get(str(x.dtype).removeprefix("torch."), 0), int(fp8)
        p.out_x, p.out_expert, p.out_src, p.out_slot = (out_x.data_ptr(), out_expert.data_ptr(), out_src.data_ptr(),
                                                        out_slot.data_ptr())
        p.out_counts, p.out_valid = out_counts.data_ptr(), valid.data_ptr()
        p.out_scales = out_scales.data_ptr() if out_scales is not None else None
        p.out_ref = ref.data_ptr() if ref is not None else None
        if rows_exact is not None:  # exact rows: the valid rows of each group, known from the counts
            index = torch.cat([torch.arange(e * world * cap, e * world * cap + int(n), dtype=torch.int64, device=dev)
                               for e, n in enumerate(rows_exact.tolist())])  # made on the device: no copy
        self._launch(self.lib.moe_dispatch, p, op)
        self.last_decode = decode
        state = _State(valid, out_src, out_slot, rows, cap, index, ref, decode, out_counts)
        d_x, d_expert, d_src, d_slot, d_scales = out_x, out_expert, out_src, out_slot, out_scales
        if index is not None:
            d_x, d_expert, d_src, d_slot = out_x[index], out_expert[index], out_src[index], out_slot[index]
            d_scales = out_scales[index] if out_scales is not None else None
        return MoEDispatch(
            x=d_x, expert=d_expert, counts=out_counts, scales=d_scales, src_rank=d_src, src_slot=d_slot, tokens=t_n,
            topk=k_n, hidden=hidden, num_experts=num_experts, capacity=None if rows_exact is not None else cap,
            weights=ws if ws.dtype == torch.float32 and ws.is_contiguous() else ws.to(torch.float32).contiguous(),
            valid=valid, _engine=state, _owner=self.ctx.owner)

    def reject_combine(self, error: PurlinValueError) -> None:
        """This rank's combine arguments are bad: run the combine kernel with nothing to put back, so the
        peers' combines end at once (this rank's pointer block says it rejected: they skip their
        reduce and raise at their next check) instead of waiting out the timeout; then raise ``error``."""
        if self.layout is not None and self.region is not None and not capturing_here():
            p = self._params(self.layout)
            p.local, p.topk, p.tokens, p.capacity, p.dtype, p.reject = 1, 1, 0, 1, _CODES[torch.float32], 1
            p.decode = int(self.last_decode)  # the peers run the combine of the last dispatch's mode
            self._launch(self.lib.moe_combine, p, "moe_combine")
        raise error

    def combine(self, expert_out, d: MoEDispatch) -> torch.Tensor:
        self.check(fatal_only=True)
        op = "moe_combine"
        st: _State = d._engine
        layout = self.layout
        ret_bytes = d.hidden * expert_out.element_size()
        if ret_bytes % 16:
            raise PurlinValueError(f"{op}: expert_out rows of {ret_bytes} bytes are not a multiple of 16 bytes")
        if st.decode and not layout.decode_fits(d.topk, 0, ret_bytes):
            self.reject_combine(PurlinValueError(
                f"{op}: expert_out rows of {ret_bytes} bytes ({expert_out.dtype}) do not fit the decode mode's "
                f"windows made by the first call ({layout}); combine in the dispatched x's dtype or narrower"))
        if not st.decode and not layout.fits(d.topk, 0, ret_bytes):
            raise PurlinValueError(f"{op}: expert_out rows of {ret_bytes} bytes ({expert_out.dtype}) do not fit the "
                                   f"MoE region made by the first call ({layout}); combine in the dispatched x's dtype "
                                   "or narrower")
        full = expert_out if expert_out.data_ptr() % 16 == 0 else expert_out.clone()
        if st.index is not None:
            full = torch.empty(st.rows, d.hidden, dtype=expert_out.dtype, device=self.device)
            full[st.index] = expert_out
        y = torch.empty(d.tokens, d.hidden, dtype=expert_out.dtype, device=self.device)
        p = self._params(layout)
        p.local, p.topk, p.tokens, p.capacity = d.num_experts // self.world, d.topk, d.tokens, st.cap
        p.ret_bytes, p.dtype = ret_bytes, _CODES[expert_out.dtype]
        p.expert_out, p.row_src, p.row_slot = full.data_ptr(), st.src.data_ptr(), st.slot.data_ptr()
        p.weights, p.valid, p.y = d.weights.data_ptr(), st.valid.data_ptr(), y.data_ptr()
        p.row_ref = st.ref.data_ptr() if st.ref is not None else None
        p.decode, p.row_counts = int(st.decode), st.counts.data_ptr()
        self._launch(self.lib.moe_combine, p, op)
        if not capturing_here():
            self.check()  # an overflow or bad ids recorded by an earlier dispatch: every rank ran this call
        return y

    def close(self) -> None:
        if self._own_region is not None:
            self._own_region.close()
        self._own_region = self.region = None
