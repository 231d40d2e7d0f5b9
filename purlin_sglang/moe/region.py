"""The CUDA engine's MoE region: its layout (:class:`MoELayout`, ONE description of every MoE offset;
the kernels compute none) and the loopback world's one allocation (:class:`SharedRegions`).

A rank's MoE region is separate from the collectives' workspace (peers may still read that
staging) and is made on the first CUDA MoE call (collective; loopback: one allocation for every
virtual rank). Per rank, in bytes (M = moe.max_tokens_per_rank, W ranks, K top-k, L = E/W):

* ``state`` (128): my epochs, exit counters, fatal word (native/moe/moe_kernel.cuh).
* ``done[W]`` (8 each): the combine's done counters, one added by every block of a consumer every
  call.
* ``count[2 parities][W producers]``: ``align16(24 + 4 * max_local)`` each: [epoch, tokens, meta,
  rows per local expert]; written by every producer every call (also when it sends nothing).
* ``recv[2][W][M]`` slots of ``hdr + payload``: ``hdr = align16(4 * (2K + 2))`` (token index, local
  expert and j per k, fp8 scale), ``payload = H * element size``. Each token arrives once per rank.
* ``ret[2][M * K]`` rows of ``H * element size``: the source's return slots for the combine.
* ``ptr[2 parities]`` (``PURLIN_MOE_PTR_WORDS`` words: the one-pass call's output pointers and
  capacity, the combine's expert_out and its epoch word, which the receive-slot combine uses only to
  say a rank rejected its arguments) and ``ddone[W]`` (8 each: the dispatch's "rows delivered"
  counters, one added by every block of a producer every call).
* one-pass mode (virtual ranks, ``moe.one_pass``): no ``recv`` and no ``ret``. A few KiB.
* decode windows (``moe.decode_tokens`` D > 0, either mode): ``win[2][W producers]`` of ``2 *
  count_bytes + D * 2 * (hdr + payload)`` (a producer's header and token slots as 16-byte packets
  of 8 payload bytes) and ``rwin[2]`` of ``align128(16 W) + D * K * 2 * ret`` (a header packet per
  rank, then the return rows of slot t * K + k as packets). At D 8, W 8, K 8, H 7168, bf16: 7.0 MiB.

Both halves (parity = epoch & 1) make back-to-back dispatches (or combines) safe with no
acknowledgement: a producer writes parity p again two calls later, after it saw, in the call
between, its consumer's word of that call, which the consumer writes only after it finished the
call that read parity p. Footprint: ``2*W*M*(hdr + H*e_d) + 2*M*K*H*e_x`` plus a few KiB; at
M 128, W 8, K 8, H 7168, bf16: 56.2 MiB (fp8 dispatch: 42.2 MiB); in one-pass mode 36 KiB; the decode
windows add theirs (the packets' windows follow the same parity argument: every rank sends every rank
a header packet every call and waits for all of them).

Virtual ranks on one GPU share one allocation (:class:`SharedRegions`, which the virtual world
holds and the MoE context hands the CUDA part); a process group's rank gets its own from the
configured device provider (:mod:`.cuda`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..abi import MOE_MAX_EXPERTS as MAX_EXPERTS, MOE_PTR_WORDS as PTR_WORDS, MOE_STATE_BYTES as STATE_BYTES
from ..errors import PurlinValueError


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def header_bytes(topk: int) -> int:
    return _align(4 * (2 * topk + 2), 16)


@dataclass(frozen=True)
class MoELayout:
    world: int
    max_tokens: int  # M: receive slots per producer and return rows per k
    topk: int  # K the region was sized for (calls may use fewer)
    payload_bytes: int  # largest dispatch row (H * element size)
    ret_bytes: int  # largest combine row
    one_pass: bool = False  # one-pass mode: no receive slots, no return rows (virtual ranks)
    decode_tokens: int = 0  # D: token slots of the decode mode's windows (0: no decode mode)

    @property
    def state_off(self) -> int:
        return 0

    @property
    def done_off(self) -> int:
        return STATE_BYTES

    @property
    def count_bytes(self) -> int:
        return _align(24 + 4 * (MAX_EXPERTS // self.world), 16)

    @property
    def count_off(self) -> int:
        return _align(self.done_off + 8 * self.world, 128)

    @property
    def ptr_off(self) -> int:
        return _align(self.count_off + 2 * self.world * self.count_bytes, 128)

    @property
    def ddone_off(self) -> int:
        return self.ptr_off + 2 * PTR_WORDS * 8

    @property
    def recv_off(self) -> int:
        return _align(self.ddone_off + 8 * self.world, 4096)

    @property
    def recv_parity_bytes(self) -> int:
        if self.one_pass:
            return 0
        return self.world * self.max_tokens * (header_bytes(self.topk) + _align(self.payload_bytes, 16))

    @property
    def ret_off(self) -> int:
        return _align(self.recv_off + 2 * self.recv_parity_bytes, 4096)

    @property
    def ret_parity_bytes(self) -> int:
        return 0 if self.one_pass else self.max_tokens * self.topk * _align(self.ret_bytes, 16)

    @property
    def win_off(self) -> int:
        return _align(self.ret_off + 2 * self.ret_parity_bytes, 4096)

    @property
    def win_bytes(self) -> int:
        if not self.decode_tokens:
            return 0
        slot = header_bytes(self.topk) + _align(self.payload_bytes, 16)
        return _align(2 * self.count_bytes + self.decode_tokens * 2 * slot, 128)

    @property
    def rwin_off(self) -> int:
        return _align(self.win_off + 2 * self.world * self.win_bytes, 4096)

    @property
    def rwin_parity_bytes(self) -> int:
        if not self.decode_tokens:
            return 0
        rows = self.decode_tokens * self.topk * 2 * _align(self.ret_bytes, 16)
        return _align(_align(16 * self.world, 128) + rows, 128)

    @property
    def rank_bytes(self) -> int:
        return _align(self.rwin_off + 2 * self.rwin_parity_bytes, 4096)

    def decode_fits(self, topk: int, payload_bytes: int, ret_bytes: int) -> bool:
        """Whether a call with these rows fits the decode windows (the region has them; top-k and rows
        no larger than they were sized for)."""
        return (self.decode_tokens > 0 and topk <= self.topk and payload_bytes <= self.payload_bytes
                and ret_bytes <= self.ret_bytes)

    def fits(self, topk: int, payload_bytes: int, ret_bytes: int | None = None) -> bool:
        """Whether a call with these rows fits (fewer top-k, smaller rows: yes)."""
        if self.one_pass:  # rows go straight into the callers' tensors: any row size
            return topk <= self.topk
        recv = self.world * self.max_tokens * (header_bytes(topk) + payload_bytes)
        ok = topk <= self.topk and recv <= self.recv_parity_bytes
        if ret_bytes is not None:
            ok = ok and self.max_tokens * topk * ret_bytes <= self.ret_parity_bytes
        return ok


class LoopbackMoERegion:
    """Every virtual rank's MoE region in ONE allocation (zeroed, then the stream synchronized)."""

    def __init__(self, layout: MoELayout, device: torch.device):
        self.layout = layout
        self._buf = torch.zeros(layout.rank_bytes * layout.world, dtype=torch.uint8, device=device)
        torch.cuda.current_stream(device).synchronize()  # zeroed before any rank's kernel runs
        base = self._buf.data_ptr()
        self.base_ptrs = [base + r * layout.rank_bytes for r in range(layout.world)]

    def close(self) -> None:
        self._buf = None


class SharedRegions:
    """The loopback world's MoE region, made by the first virtual rank that needs it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.region: LoopbackMoERegion | None = None

    def get(self, layout: MoELayout, device: torch.device) -> LoopbackMoERegion:
        with self._lock:
            if self.region is None:
                self.region = LoopbackMoERegion(layout, device)
            elif self.region.layout != layout:
                raise PurlinValueError(
                    f"moe_dispatch: the virtual ranks' first MoE calls disagree on the region ({self.region.layout} "
                    f"vs {layout}): hidden size, top-k or dtype differ between ranks")
            return self.region

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
        self.region = None
