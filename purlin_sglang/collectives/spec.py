"""CollectiveSpec: a collective named by input layout, output layout and consume op.

A spec is pure data; it holds no orchestration. The SNAC planner derives who
stages what, who is notified and who reads which peer's staging from these three
fields alone, which is why a new collective is a new spec and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PurlinPlanError
from .layout import COPY, Consume, Layout, LayoutKind


@dataclass(frozen=True)
class CollectiveSpec:
    """``name``: ``input`` layout -> ``output`` layout, consumed by ``consume``.

    Semantics, for a consumer ``c`` and a producer ``p``:

    * what ``p`` sends to ``c``: its input slice ``c`` if the input is sliced,
      else its whole input;
    * where it lands in ``c``'s output: output slice ``p`` if the output is
      sliced, else the whole output (so several producers must be reduced);
    * a rooted input has one producer (the root); a rooted output one consumer.
    """

    name: str
    input: Layout
    output: Layout
    consume: Consume = COPY

    def __post_init__(self) -> None:
        check_spec(self)

    @property
    def variable(self) -> bool:
        """True when sizes are given per rank at call time (the V forms)."""
        return self.input.variable

    @property
    def rooted(self) -> bool:
        return self.input.rooted or self.output.rooted

    def with_consume(self, consume: Consume) -> "CollectiveSpec":
        return CollectiveSpec(self.name, self.input, self.output, consume)

    def __str__(self) -> str:
        return f"{self.name}: {self.input} -> {self.output}, {self.consume}"


def check_spec(spec: CollectiveSpec) -> None:
    """Reject namings that do not describe a collective; the message says why."""
    i, o, c = spec.input, spec.output, spec.consume
    where = f"spec {spec.name!r} ({i} -> {o}, {c})"
    if not spec.name or not spec.name.replace("_", "").isalnum():
        raise PurlinPlanError(f"spec name {spec.name!r} must be a non-empty identifier")
    if LayoutKind.ROUTED in (i.kind, o.kind) or c.weighted:
        _check_routed(spec, where)
        return
    if i.variable != o.variable:
        raise PurlinPlanError(f"{where}: input and output must both be V forms or both fixed")
    if i.rooted and o.rooted:
        raise PurlinPlanError(f"{where}: a rooted input and a rooted output move nothing")
    if o.sliced and not c.is_copy:
        raise PurlinPlanError(
            f"{where}: each output slice has one producer, so there is nothing to reduce; "
            "use a packed output for a reduction"
        )
    if not o.sliced and c.is_copy and not i.rooted:
        raise PurlinPlanError(
            f"{where}: every rank would copy into the same packed output; "
            "use a reduce, a sliced output, or a rooted input"
        )
    if i.rooted and o.sliced:
        raise PurlinPlanError(f"{where}: a rooted input has one producer; use a packed output")
    if o.kind is LayoutKind.SCATTERED and i.sliced:
        raise PurlinPlanError(
            f"{where}: a scattered output holds each rank's whole payload, so the input must be packed; "
            "use a transposed output for data addressed per rank"
        )
    if o.kind is LayoutKind.TRANSPOSED and not i.sliced:
        raise PurlinPlanError(
            f"{where}: a transposed output holds what each rank addressed to me, so the input must be sliced"
        )


def _check_routed(spec: CollectiveSpec, where: str) -> None:
    """The two MoE namings: routed -> transposedV copy (dispatch), and its reverse with a weighted
    reduce (combine). Each output row of a combine sums the rows its token was routed to, so a
    reduce into a sliced (routed) output is what it means; nothing else may use ``routed``."""
    i, o, c = spec.input, spec.output, spec.consume
    dispatch = i.kind is LayoutKind.ROUTED and o.kind is LayoutKind.TRANSPOSED and c.is_copy
    combine = i.kind is LayoutKind.TRANSPOSED and o.kind is LayoutKind.ROUTED and c.weighted
    if not (dispatch or combine) or not (i.variable and o.variable) or spec.rooted:
        raise PurlinPlanError(
            f"{where}: a routed layout pairs only with transposedV: routed -> transposedV copy (dispatch) "
            "or transposedV -> routed weighted reduce (combine)"
        )
