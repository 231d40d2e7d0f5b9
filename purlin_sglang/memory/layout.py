"""The workspace layout: ONE description of where every signal word and staging byte lives.

Allocators (host shared memory now, CUDA providers next) and engines compute
offsets only through :class:`WorkspaceLayout`. All ranks' workspaces have the same
layout; a rank's signal words are written by one side only (see snac.lower).

Per rank ``r`` (int64 words unless said otherwise):

* ``desc[r][slot]``: the call descriptor ring, ``RING`` entries of
  ``[seq, fingerprint, send_bytes[0..world-1]]``; ``seq`` is written last.
* ``state[r]``: 0 healthy, 1 broken (a peer can stop waiting for a broken rank).
* ``notify[p][c][i]``: chunks producer ``p`` staged in item ``i`` for consumer ``c``.
* ``ack[p][c][i]``: chunks consumer ``c`` drained from producer ``p``'s item ``i``.
* ``staging[r]``: ``staging_bytes`` bytes, 4096-aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

RING = 4
WORD = 8
PAGE = 4096
MAGIC = 0x50524C4E  # "PRLN"
VERSION = 1

STATE_OK = 0
STATE_BROKEN = 1


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class WorkspaceLayout:
    world: int
    staging_bytes: int

    @property
    def max_items(self) -> int:
        """Staging items a plan may use per rank (the two-shot plan uses world + 1)."""
        return self.world + 1

    @property
    def desc_words(self) -> int:
        return 2 + self.world

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
    def signal_words(self) -> int:
        return self.ack_base + self.world * self.world * self.max_items

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
