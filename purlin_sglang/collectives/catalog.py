"""The catalog: every collective purlin_sglang ships, as namings only."""

from __future__ import annotations

from .layout import COPY, PACKED, PACKED_V, REDUCE, SCATTERED, SCATTERED_V, TRANSPOSED, TRANSPOSED_V
from .spec import CollectiveSpec

ALL_REDUCE = CollectiveSpec("all_reduce", PACKED, PACKED, REDUCE)
ALL_GATHER = CollectiveSpec("all_gather", PACKED, SCATTERED, COPY)
REDUCE_SCATTER = CollectiveSpec("reduce_scatter", SCATTERED, PACKED, REDUCE)
ALL_TO_ALL = CollectiveSpec("all_to_all", SCATTERED, TRANSPOSED, COPY)
ALL_GATHER_V = CollectiveSpec("all_gather_v", PACKED_V, SCATTERED_V, COPY)
REDUCE_SCATTER_V = CollectiveSpec("reduce_scatter_v", SCATTERED_V, PACKED_V, REDUCE)
ALL_TO_ALL_V = CollectiveSpec("all_to_all_v", SCATTERED_V, TRANSPOSED_V, COPY)
# Broadcast is the proof that a new collective is only a new naming: no planner code knows it.
BROADCAST = CollectiveSpec("broadcast", PACKED.root(), PACKED, COPY)

CATALOG: dict[str, CollectiveSpec] = {
    s.name: s
    for s in (
        ALL_REDUCE,
        ALL_GATHER,
        REDUCE_SCATTER,
        ALL_TO_ALL,
        ALL_GATHER_V,
        REDUCE_SCATTER_V,
        ALL_TO_ALL_V,
        BROADCAST,
    )
}
