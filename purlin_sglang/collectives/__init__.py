"""Collectives as namings: input layout + output layout + consume op."""

from .catalog import (
    ALL_GATHER,
    ALL_GATHER_V,
    ALL_REDUCE,
    ALL_TO_ALL,
    ALL_TO_ALL_V,
    BROADCAST,
    CATALOG,
    REDUCE_SCATTER,
    REDUCE_SCATTER_V,
)
from .layout import (
    COPY,
    PACKED,
    PACKED_V,
    REDUCE,
    ROUTED,
    SCATTERED,
    SCATTERED_V,
    TRANSPOSED,
    TRANSPOSED_V,
    WEIGHTED_REDUCE,
    Consume,
    Layout,
    LayoutKind,
    ReduceOp,
    parse_op,
)
from .spec import CollectiveSpec

__all__ = [
    "ALL_GATHER", "ALL_GATHER_V", "ALL_REDUCE", "ALL_TO_ALL", "ALL_TO_ALL_V", "BROADCAST",
    "CATALOG", "REDUCE_SCATTER", "REDUCE_SCATTER_V", "COPY", "PACKED", "PACKED_V", "REDUCE",
    "SCATTERED", "SCATTERED_V", "TRANSPOSED", "TRANSPOSED_V", "Consume", "Layout", "LayoutKind",
    "ReduceOp", "parse_op", "CollectiveSpec", "ROUTED", "WEIGHTED_REDUCE",
]
