"""Buffer layouts and consume ops: the vocabulary a collective is named in.

A layout says how one rank's buffer is cut along dim 0, relative to the ranks of
the group:

* ``packed``: one payload, not split by rank.
* ``scattered``: ``world`` slices; as an input, slice ``r`` is destined for rank
  ``r``; as an output, slice ``r`` holds rank ``r``'s own (packed) payload.
* ``transposed``: ``world`` slices; as an output, slice ``r`` holds what rank ``r``
  addressed to me; as an input, slice ``r`` goes back to rank ``r``.
* the ``V`` forms (``packedV``, ``scatteredV``, ``transposedV``): the same with
  per-rank sizes given at call time (they may differ between calls and ranks).
* ``routed`` (always variable): MoE tokens, each addressed to the ranks that own one
  of its top-k experts; a token travels once per destination RANK (not once per
  expert), and the slices exist only once the routing (device-side counts) is known.
  See :mod:`purlin_sglang.moe.namings`.

A layout may be *rooted*: only the root rank's buffer takes part (the root is a
call argument). A rooted input means only the root produces; a rooted output
means only the root consumes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LayoutKind(str, enum.Enum):
    PACKED = "packed"
    SCATTERED = "scattered"
    TRANSPOSED = "transposed"
    ROUTED = "routed"


@dataclass(frozen=True)
class Layout:
    """How one rank's buffer is divided along dim 0 (see the module docstring)."""

    kind: LayoutKind
    variable: bool = False
    rooted: bool = False

    @property
    def sliced(self) -> bool:
        """True when the buffer is cut into one slice per rank."""
        return self.kind is not LayoutKind.PACKED

    def root(self) -> "Layout":
        """The rooted form of this layout: only the root rank's buffer takes part."""
        return Layout(self.kind, self.variable, True)

    @property
    def name(self) -> str:
        base = self.kind.value + ("V" if self.variable and self.kind is not LayoutKind.ROUTED else "")
        return base + ("@root" if self.rooted else "")

    def __str__(self) -> str:
        return self.name


PACKED = Layout(LayoutKind.PACKED)
SCATTERED = Layout(LayoutKind.SCATTERED)
TRANSPOSED = Layout(LayoutKind.TRANSPOSED)
PACKED_V = Layout(LayoutKind.PACKED, variable=True)
SCATTERED_V = Layout(LayoutKind.SCATTERED, variable=True)
TRANSPOSED_V = Layout(LayoutKind.TRANSPOSED, variable=True)
ROUTED = Layout(LayoutKind.ROUTED, variable=True)


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"


@dataclass(frozen=True)
class Consume:
    """What a consumer does with the slices it reads: copy them, or reduce them with ``op``.

    Reductions accumulate 16-bit floats in float32 and always combine the
    contributions in rank order 0, 1, ..., world-1, so the result is bitwise
    identical on every rank and every run.
    """

    reduce: ReduceOp | None = None
    weighted: bool = False  # MoE combine: each contribution is scaled by its top-k weight first

    @property
    def is_copy(self) -> bool:
        return self.reduce is None

    def with_op(self, op: "ReduceOp | str") -> "Consume":
        if self.is_copy:
            return self
        return Consume(parse_op(op), self.weighted)

    @property
    def name(self) -> str:
        if self.reduce is None:
            return "copy"
        return f"{'weighted_' if self.weighted else ''}reduce({self.reduce.value})"

    def __str__(self) -> str:
        return self.name


COPY = Consume()
REDUCE = Consume(ReduceOp.SUM)
WEIGHTED_REDUCE = Consume(ReduceOp.SUM, weighted=True)


def parse_op(op: "ReduceOp | str") -> ReduceOp:
    """Turn ``"sum" | "max" | "min"`` (or a :class:`ReduceOp`) into a :class:`ReduceOp`."""
    from ..errors import PurlinValueError

    if isinstance(op, ReduceOp):
        return op
    name = getattr(op, "name", op)  # accept torch.distributed.ReduceOp-like objects
    try:
        return ReduceOp(str(name).lower())
    except ValueError:
        raise PurlinValueError(
            f"unsupported reduce op {op!r}: use one of {[o.value for o in ReduceOp]}"
        ) from None
