"""The MoE namings: expert-parallel dispatch and combine.

* ``moe_dispatch``: routed -> transposedV, copy. A rank's tokens are addressed to the ranks
  that own their top-k experts (experts split contiguously: rank ``r`` owns global experts
  ``[r*E/W, (r+1)*E/W)``); each token travels ONCE per destination rank, with a small header
  naming the local experts (and top-k slots) it goes to, and the receiver expands it into one
  row per (token, slot), grouped by local expert, rows of a group ordered by (source rank,
  token index, k).
* ``moe_combine``: transposedV -> routed, weighted reduce. Every expert-output row goes back
  to its source token's slot; the source sums ``topk_weights[t, k] * row(t, k)`` in float32
  in the fixed order k = 0..K-1 (deterministic, bitwise equal on every engine).

Sizes of both exist only on the device (the routing's counts): the plans in
:mod:`purlin_sglang.moe.plan` exchange them first.
"""

from __future__ import annotations

from ..collectives.layout import COPY, ROUTED, TRANSPOSED_V, WEIGHTED_REDUCE
from ..collectives.spec import CollectiveSpec

MOE_DISPATCH = CollectiveSpec("moe_dispatch", ROUTED, TRANSPOSED_V, COPY)
MOE_COMBINE = CollectiveSpec("moe_combine", TRANSPOSED_V, ROUTED, WEIGHTED_REDUCE)

__all__ = ["MOE_DISPATCH", "MOE_COMBINE", "ROUTED"]
