"""Tuning policy: the knobs the planner reads to pick a regime, chunk size and slots."""

from __future__ import annotations

from pydantic import Field, field_validator

from ..config_model import ConfigModel
from . import registry

ALIGN = 16  # bytes: the alignment unit of partitions, chunks and staging slots
# Payload of one push, one rank to another per call (the receive window); the windows take
# 2 parities x world producers x 2 x this per rank (packets are twice their payload): 8 MiB at 8 ranks.
PACKET_WINDOW_BYTES = 256 * 1024
AUTO = "auto"  # tuning.algorithm: the selector decides (snac/planner.py select)


def max_items(world: int) -> int:
    """Staging items per rank that any plan of ``world`` ranks may use (the two-shot plan's world + 1).

    The one place this is decided: the planner, the lowering and the workspace layouts read it."""
    return world + 1


class TuningPolicy(ConfigModel):
    """How the planner chooses between the latency and the throughput regime.

    * ``algorithm``: ``auto``, or a name a registered algorithm is forced by (snac/registry.py; the
      built-in ones: ``packet``, ``oneshot``, ``twoshot``). Where the engine has the packet protocol
      (the CUDA engine; the CPU engine runs ``oneshot`` instead, with bitwise the same result),
      ``auto`` picks ``packet`` for
      every collective with a packet form (fixed sizes: all_reduce, all_gather, reduce_scatter,
      all_to_all, rooted namings too, and user namings like them) while the largest single push
      (the input, or one slice of a sliced input) is at most ``packet_max_bytes``. Otherwise,
      for reductions into a packed output on every rank (all_reduce), ``oneshot`` up to
      ``oneshot_max_bytes``, else ``twoshot`` (also when the size is unknown on the host);
      everything else runs ``oneshot``. ``packet`` / ``oneshot`` / ``twoshot`` force one where
      the collective has it (``packet`` only up to 256 KiB per push, the size of a receive
      window; larger calls are refused), else ``oneshot``. ``auto`` also takes packets for V forms
      whose sizes every rank passes whole (all_gather_v, reduce_scatter_v), from the group's largest
      push; never for rooted V forms. all_to_all_v (each rank knows only its own splits) runs
      ``hybrid`` under ``auto`` and ``packet`` on such engines: each pair of at most
      ``packet_max_bytes`` (a whole window when packets are forced) as packets, a larger one
      through a one-shot of those pairs (planner.has_hybrid_form).
    * ``table``: path of a tuning table (JSON, written by ``purlin-sglang tune``; snac/table.py).
      Under ``auto``, where the table applies (this GPU model or ``cpu``, the communicator's
      placement, the world size, the collective), its measured band for the call's size replaces
      the two thresholds above; elsewhere the thresholds decide. Unset (the default): the tables
      shipped in ``purlin_sglang/tables/`` (today two, measured with loopback ranks on an H200 and
      on an H100 80GB HBM3: each applies to virtual worlds on its own GPU model only);
      ``"thresholds"``: the thresholds alone.
    * ``slots``: staging slots per item, used cyclically (2 = double buffering).
    * ``max_chunk_bytes``: the largest chunk; chunks are otherwise as large as the
      staging budget allows, so small payloads run in a single chunk.
    """

    algorithm: str = AUTO
    packet_max_bytes: int = Field(64 * 1024, ge=0, le=PACKET_WINDOW_BYTES)  # measured: RESULTS.md
    oneshot_max_bytes: int = Field(256 * 1024, ge=0)
    table: str | None = Field(None, min_length=1)
    slots: int = Field(2, ge=1, le=64)
    max_chunk_bytes: int = Field(4 * 1024 * 1024, ge=ALIGN)

    @field_validator("algorithm")
    @classmethod
    def _registered(cls, value: str) -> str:
        names = registry.forced_names()
        if value != AUTO and value not in names:
            raise ValueError(f"must be '{AUTO}' or one of {', '.join(repr(n) for n in names)} (a registered algorithm)")
        return value
