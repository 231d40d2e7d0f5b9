"""Tuning policy: the knobs the planner reads to pick a regime, chunk size and slots."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ALIGN = 16  # bytes: the alignment unit of partitions, chunks and staging slots
PACKET_WINDOW_BYTES = 64 * 1024  # payload one packet call may carry per rank (memory.layout.PACKET_MAX_BYTES)


class TuningPolicy(BaseModel):
    """How the planner chooses between the latency and the throughput regime.

    * ``algorithm``: for reductions into a packed output on every rank (all_reduce),
      ``auto`` picks ``packet`` up to ``packet_max_bytes`` of payload where the engine has
      the packet protocol (the CUDA engine; the CPU engine runs ``oneshot`` instead, with
      bitwise the same result), ``oneshot`` up to ``oneshot_max_bytes``, else ``twoshot``
      (also when the size is unknown on the host); ``packet`` / ``oneshot`` / ``twoshot``
      force one (``packet`` only up to 64 KiB, the size of a receive window).
    * ``slots``: staging slots per item, used cyclically (2 = double buffering).
    * ``max_chunk_bytes``: the largest chunk; chunks are otherwise as large as the
      staging budget allows, so small payloads run in a single chunk.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: Literal["auto", "packet", "oneshot", "twoshot"] = "auto"
    packet_max_bytes: int = Field(64 * 1024, ge=0, le=PACKET_WINDOW_BYTES)  # measured: RESULTS.md
    oneshot_max_bytes: int = Field(256 * 1024, ge=0)
    slots: int = Field(2, ge=1, le=64)
    max_chunk_bytes: int = Field(4 * 1024 * 1024, ge=ALIGN)
