"""Tuning policy: the knobs the planner reads to pick a regime, chunk size and slots."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ALIGN = 16  # bytes: the alignment unit of partitions, chunks and staging slots


class TuningPolicy(BaseModel):
    """How the planner chooses between the latency and the throughput regime.

    * ``algorithm``: ``auto`` picks ``oneshot`` up to ``oneshot_max_bytes`` of payload
      (and when the size is unknown on the host, ``twoshot``) for reductions into a
      packed output; ``oneshot`` / ``twoshot`` force one.
    * ``slots``: staging slots per item, used cyclically (2 = double buffering).
    * ``max_chunk_bytes``: the largest chunk; chunks are otherwise as large as the
      staging budget allows, so small payloads run in a single chunk.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: Literal["auto", "oneshot", "twoshot"] = "auto"
    oneshot_max_bytes: int = Field(256 * 1024, ge=0)
    slots: int = Field(2, ge=1, le=64)
    max_chunk_bytes: int = Field(4 * 1024 * 1024, ge=ALIGN)
