"""The workspace layout: ONE description of where every signal word and staging byte lives.

Allocators (host shared memory now, CUDA providers next) and engines compute
offsets only through :class:`WorkspaceLayout`. All ranks' workspaces have the same
layout; a rank's signal words are written by one side only (see snac.lower).

Per rank ``r`` (int64 words unless said otherwise):

* ``desc[r][slot]``: the call descriptor ring, ``RING`` entries of
  ``[seq, fingerprint, info, send_bytes[0..world-1], recv_bytes[0..world-1]]``; ``seq`` is written
  last; ``info`` is the call's description code (engines/base.py ``call_info``), for mismatch
  messages; the byte counts let every rank check every pair of a call before data moves.
* ``state[r]``: 0 healthy, 1 broken (a peer can stop waiting for a broken rank).
* ``notify[p][c][i]``: chunks producer ``p`` staged in item ``i`` for consumer ``c``.
* ``ack[p][c][i]``: chunks consumer ``c`` drained from producer ``p``'s item ``i``.
* ``reject[r][slot]``: a ring of ``RING`` entries of ``REJECT_WORDS`` words, ``[seq, nbytes,
  text...]``: why rank ``r`` rejected its own arguments of call ``seq`` (slot ``seq % RING``; UTF-8,
  at most ``REJECT_TEXT_BYTES``), written before its descriptor of that call, which then carries the
  fingerprint ``REJECTED``. A ring, so that a rank rejecting calls in a row does not overwrite the
  words of a call a peer has entered but not yet read.
* ``staging[r]``: ``staging_bytes`` bytes, 4096-aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..abi import PACKET_BYTES, PACKET_PAYLOAD, SNAC_DESC_RING, SNAC_DESC_WORDS, SNAC_EPOCH_WORDS
from ..snac.policy import PACKET_WINDOW_BYTES, max_items

RING = 4
WORD = 8
PAGE = 4096
MAGIC = 0x50524C4E  # "PRLN"
VERSION = 4  # 2: descriptors carry the call's description code; 3: the reject words; 4: recv_bytes
REJECTED = -1  # the fingerprint of a call its rank rejected (real fingerprints are >= 0)
REJECT_TEXT_BYTES = 512
REJECT_WORDS = 2 + REJECT_TEXT_BYTES // 8
RESYNC_WORDS = 2  # a rank's word in a peer's reset rendezvous: [round, call number] (DeviceLayout.resync_off)

STATE_OK = 0
STATE_BROKEN = 1


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class _RankLayout:
    """What every workspace layout is made from: the world and each rank's staging bytes."""

    world: int
    staging_bytes: int

    @property
    def max_items(self) -> int:
        """Staging items a plan may use per rank (snac.policy.max_items)."""
        return max_items(self.world)


@dataclass(frozen=True)
class WorkspaceLayout(_RankLayout):
    @property
    def desc_words(self) -> int:
        return 3 + 2 * self.world

    # word offsets (in int64 words from the start of the signal area)
    @property
    def header_words(self) -> int:
        return 4  # magic, version, world, staging_bytes

    def desc_offset(self, rank: int, slot: int) -> int:
        return self.header_words + (rank * RING + slot) * self.desc_words

    @property
    def state_base(self) -> int:
        return self.desc_offset(self.world, 0)

    @property
    def notify_base(self) -> int:
        return self.state_base + self.world

    def notify_index(self, producer: int, consumer: int, item: int) -> int:
        return self.notify_base + (producer * self.world + consumer) * self.max_items + item

    @property
    def ack_base(self) -> int:
        return self.notify_base + self.world * self.world * self.max_items

    def ack_index(self, producer: int, consumer: int, item: int) -> int:
        return self.ack_base + (producer * self.world + consumer) * self.max_items + item

    @property
    def reject_base(self) -> int:
        return self.ack_base + self.world * self.world * self.max_items

    def reject_offset(self, rank: int, slot: int) -> int:
        return self.reject_base + (rank * RING + slot) * REJECT_WORDS

    @property
    def signal_words(self) -> int:
        return self.reject_base + self.world * RING * REJECT_WORDS

    # byte offsets
    @property
    def staging_base(self) -> int:
        return _align(self.signal_words * WORD, PAGE)

    @property
    def staging_stride(self) -> int:
        return _align(self.staging_bytes, PAGE)

    def staging_offset(self, rank: int) -> int:
        return self.staging_base + rank * self.staging_stride

    @property
    def total_bytes(self) -> int:
        return self.staging_offset(self.world)


PACKET_MAX_BYTES = PACKET_WINDOW_BYTES  # payload per producer of one packet call (snac.policy; snac/packet.cuh)
ARRIVE_SLOTS = 2048  # per-rank arrival counters of the CUDA engine's "last block" signals and barriers
# From the ABI (abi.py): a packet (8 payload bytes and the epoch twice); per-block packet epochs (the CUDA
# engine's grid has at most this many blocks per rank); device call descriptors (slots per producer, words).
EPOCH_WORDS = SNAC_EPOCH_WORDS
DESC_RING, DESC_WORDS = SNAC_DESC_RING, SNAC_DESC_WORDS


@dataclass(frozen=True)
class DeviceLayout(_RankLayout):
    """One rank's GPU workspace as the CUDA engine sees it (every rank's has the same layout).

    Rank ``r`` POLLS only words in its own workspace; peers write them remotely (P2P stores):

    * ``notify[p][i]``: chunks producer ``p`` staged in its item ``i`` for ``r`` (written by ``p``).
    * ``ack[c][i]``: chunks consumer ``c`` drained from ``r``'s item ``i`` (written by ``c``).

    and ``r``'s own state, touched only by ``r``'s kernel:

    * mirrors ``sent[c][i]``, ``expect[p][i]``, ``acked[p][i]`` (int64): the values of the counters
      ``r`` writes or awaits, at the start of the next call (written back by the kernel's last block).
    * ``arrive[ARRIVE_SLOTS]``: monotonic per-op arrival counters ("last block signals", barriers).
    * ``exit``: the kernel's exit arrival counter; ``error``: non-zero once a wait timed out.
    * ``epoch[EPOCH_WORDS]``: per block of the kernel's grid, the count of packet calls it ran (latency
      regime), bumped by that block at its exit; every block runs every call, so the words agree.
    * ``desc[p][DESC_RING][DESC_WORDS]``: call descriptors, written by producer ``p`` at the start of
      each call (slot ``seq % DESC_RING``): ``seq << 32 | payload`` words carrying the call's
      folded fingerprint and description code; read by ``r`` only when a wait for ``p`` stalls.
    * ``reject[p][REJECT_WORDS]``: producer ``p``'s message when it rejected its own arguments of a call
      (written by ``p``'s host, read by ``r``'s host; see :attr:`reject_off`).
    * ``resync[p][RESYNC_WORDS]``: producer ``p``'s round of the reset that follows a rejected call
      (written by ``p``'s host, polled by ``r``'s host; see :attr:`resync_off`).
    * ``staging``: ``staging_bytes`` bytes at a 4096-aligned offset.
    * ``window[2][world]``: packet receive windows (written by the producers, pushed), one per
      epoch parity and producer, ``window_bytes`` each: ``PACKET_MAX_BYTES`` of payload as packets.

    Every offset here is in BYTES from the rank's workspace base; the kernel receives them in its
    parameter struct and computes none itself.
    """

    @property
    def grid_words(self) -> int:
        """Words of one [world][max_items] array."""
        return self.world * self.max_items

    def word(self, base: int, peer: int, item: int) -> int:
        """Byte offset of entry [peer][item] of the array at byte offset ``base``."""
        return base + (peer * self.max_items + item) * WORD

    @property
    def notify_off(self) -> int:
        return 0

    @property
    def ack_off(self) -> int:
        return self.notify_off + self.grid_words * WORD

    @property
    def sent_off(self) -> int:
        return self.ack_off + self.grid_words * WORD

    @property
    def expect_off(self) -> int:
        return self.sent_off + self.grid_words * WORD

    @property
    def acked_off(self) -> int:
        return self.expect_off + self.grid_words * WORD

    @property
    def arrive_off(self) -> int:
        return _align(self.acked_off + self.grid_words * WORD, 128)

    @property
    def exit_off(self) -> int:
        return self.arrive_off + ARRIVE_SLOTS * WORD

    @property
    def error_off(self) -> int:
        return self.exit_off + 128  # its own 128-byte line

    @property
    def epoch_off(self) -> int:
        return self.error_off + 128

    @property
    def desc_off(self) -> int:
        return _align(self.epoch_off + EPOCH_WORDS * WORD, 128)

    def desc(self, producer: int, seq: int) -> int:
        """Byte offset of ``producer``'s descriptor slot for call number ``seq``."""
        return self.desc_off + (producer * DESC_RING + seq % DESC_RING) * DESC_WORDS * WORD

    @property
    def reject_off(self) -> int:
        """Rejections, ``[producer][REJECT_WORDS]`` int64: ``[seq, nbytes, message...]``, written by producer
        ``p``'s host into this rank's workspace when ``p`` rejects its own arguments of call ``seq``
        (CudaEngine.reject); read by this rank's host once its kernel met ``p``'s rejected descriptor."""
        return _align(self.desc_off + self.world * DESC_RING * DESC_WORDS * WORD, 128)

    def reject(self, producer: int) -> int:
        """Byte offset of ``producer``'s rejection entry."""
        return self.reject_off + producer * REJECT_WORDS * WORD

    @property
    def resync_off(self) -> int:
        """The reset rendezvous, ``[producer][RESYNC_WORDS]`` int64 ``[round, call number]``: after a rejected
        call every rank's host writes its round into every rank's workspace and polls its own until every
        peer's has come (CudaEngine.resync). The reset clears every word before :attr:`reject_off` and the
        packet windows, never these: rounds only count up."""
        return _align(self.reject_off + self.world * REJECT_WORDS * WORD, 128)

    def resync(self, producer: int) -> int:
        """Byte offset of ``producer``'s reset words."""
        return self.resync_off + producer * RESYNC_WORDS * WORD

    def reset_spans(self) -> list[tuple[int, int]]:
        """``(offset, bytes)`` of what a reset clears in a rank's workspace: the protocol state (counters,
        mirrors, error word, packet epochs, descriptors) and the packet windows, back to the zeros a new
        workspace starts with. Staged payload is left as it is (no protocol state is read from it)."""
        return [(0, self.reject_off), (self.window_off, self.rank_bytes - self.window_off)]

    @property
    def signal_bytes(self) -> int:
        return self.resync_off + self.world * RESYNC_WORDS * WORD

    @property
    def staging_off(self) -> int:
        return _align(self.signal_bytes, PAGE)

    @property
    def window_bytes(self) -> int:
        """Bytes of one packet window (one parity, one producer)."""
        return PACKET_MAX_BYTES // PACKET_PAYLOAD * PACKET_BYTES

    @property
    def window_off(self) -> int:
        return self.staging_off + _align(self.staging_bytes, PAGE)

    def window(self, parity: int, producer: int) -> int:
        """Byte offset of the window of ``producer``'s packets for epoch parity ``parity``."""
        return self.window_off + (parity * self.world + producer) * self.window_bytes

    @property
    def rank_bytes(self) -> int:
        """Bytes of one rank's workspace (a multiple of 4096)."""
        return self.window_off + 2 * self.world * self.window_bytes
