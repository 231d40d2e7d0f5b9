"""MoEDispatch: what ``Communicator.moe_dispatch`` returns and ``moe_combine`` consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class MoEDispatch:
    """The rows this rank's experts must process, and how to send their outputs back.

    Receiver side (rows of this rank's local experts; R rows in all):

    * ``x`` [R, H]: the rows, grouped by local expert; inside a group ordered by source rank,
      then token index, then top-k slot. FP8 (``float8_e4m3fn``) when dispatched with that dtype.
    * ``expert`` [R] int32: the local expert index of each row (global id - rank * E/W); -1 on
      padding rows (capacity mode only), whose ``x`` content is unspecified.
    * ``counts`` [E/W] int32: valid rows per local expert (device tensor). In capacity mode group
      ``e`` starts at row ``e * world * capacity`` and its valid rows come first.
    * ``scales`` [R] float32 or None: per-row dequantisation scale (``x.float() * scale``) of an
      FP8 dispatch (the source token's amax / 448, or 1 for an all-zero token).
    * ``src_rank`` [R] int32, ``src_slot`` [R] int64: where each row came from (rank, and
      ``t * K + k`` on that rank); -1 on padding rows.

    Source side (this rank's own tokens, for the combine):

    * ``tokens`` (T), ``topk`` (K), ``hidden`` (H), ``num_experts`` (E), ``capacity`` (None: exact
      rows), ``weights`` [T, K] float32 and ``valid`` [T, K] bool (slot id != -1).

    ``_engine`` is engine-private state of the call (e.g. the CPU engine's split sizes); ``_owner``
    identifies the communicator that made it.
    """

    x: torch.Tensor
    expert: torch.Tensor
    counts: torch.Tensor
    scales: torch.Tensor | None
    src_rank: torch.Tensor
    src_slot: torch.Tensor
    tokens: int
    topk: int
    hidden: int
    num_experts: int
    capacity: int | None
    weights: torch.Tensor
    valid: torch.Tensor
    _engine: Any = field(default=None, repr=False)
    _owner: int = field(default=0, repr=False)

    @property
    def rows(self) -> int:
        """R: rows of ``x`` (exact: the sum of ``counts``; capacity mode: E/W * world * capacity)."""
        return int(self.x.shape[0])
