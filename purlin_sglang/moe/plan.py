"""MoE plans: the SNAC program of an expert-parallel dispatch or combine, as plain data.

A MoE call moves sizes that exist only on the device (the routing's counts), so its plan is a
short fixed program whose sizes every engine resolves itself; the structure never depends on
the routing. Steps, in order:

dispatch (``moe_dispatch``: routed -> transposedV copy)
  1. ``Route``         source prologue: per (token, k) the destination rank, local expert and
                       row index j within (source, expert); counts per global expert (a
                       histogram + scan on the device; quantises rows to FP8 if asked).
  2. ``CountExchange`` every producer tells every consumer, EVERY call (also when it sends
                       nothing), how many tokens it sends and how many rows each of the
                       consumer's local experts gets; the word carries the call's epoch.
  3. ``PutRows``       each routed token once per destination RANK, with a header
                       (token index, local expert and j per k slot, fp8 scale).
  4. ``Wait``          for every producer's count word of this epoch (bounded by timeout_s).
  5. ``Expand``        the consumer copies each received token into one row per slot, at
                       group(expert) + offset(source, expert) + j: rows grouped by local
                       expert, then source rank, token index, k; padding rows get expert -1.

combine (``moe_combine``: transposedV -> routed weighted reduce)
  1. ``PutBack``       every valid row goes back to its source rank, into slot t*K + k of
                       the source's return region (each slot is written by one row).
  2. ``Notify``/``Wait`` a done counter per (consumer, producer), every call.
  3. ``WeightedReduce`` y[t] = sum_k w[t,k] * ret[t*K+k] in float32, k = 0..K-1, slots with
                       id -1 skipped; written in the expert output's dtype.

Engines: the CPU engine (the oracle) runs CountExchange as an all-gather of count vectors and
PutRows / PutBack as all_to_all_v calls through its staging; the CUDA engine runs every step of a
call, the route and the FP8 quantisation included, in one kernel (native/moe/) over a dedicated
double-buffered MoE region (moe/region.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..collectives import CollectiveSpec
from ..errors import PurlinValueError
from .namings import MOE_COMBINE, MOE_DISPATCH


@dataclass(frozen=True)
class MoEStep:
    kind: str  # route | count_exchange | put_rows | wait | expand | put_back | notify | weighted_reduce
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class MoEPlan:
    """One rank's MoE program: which experts it owns, how rows are laid out, the steps."""

    spec: CollectiveSpec
    world: int
    rank: int
    num_experts: int
    capacity: int | None  # rows per (source rank, local expert); None: exact sizes (eager)
    quant: str  # "none" | "fp8"
    steps: tuple[MoEStep, ...]

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def expert_range(self) -> tuple[int, int]:
        n = self.local_experts
        return self.rank * n, (self.rank + 1) * n

    @property
    def key(self) -> tuple:
        return (self.spec.name, self.world, self.num_experts, self.capacity, self.quant)

    def __str__(self) -> str:
        lo, hi = self.expert_range
        rows = "exact rows" if self.capacity is None else f"capacity {self.capacity} rows per (source, expert)"
        head = (f"{self.spec} on rank {self.rank} of {self.world}: experts [{lo}, {hi}), {rows}, "
                f"payload {self.quant}")
        return "\n".join([head] + [f"  {i}. {s}" for i, s in enumerate(self.steps)])


def make_moe_plan(spec: CollectiveSpec, world: int, rank: int, num_experts: int, *,
                  capacity: int | None = None, quant: str = "none") -> MoEPlan:
    """The plan of ``spec`` (MOE_DISPATCH or MOE_COMBINE) for ``rank``; raises PurlinValueError
    when ``num_experts`` does not split evenly over ``world``."""
    if spec not in (MOE_DISPATCH, MOE_COMBINE):
        raise PurlinValueError(f"make_moe_plan: {spec.name} is not a MoE naming")
    if num_experts < 1 or num_experts % world:
        raise PurlinValueError(
            f"{spec.name}: num_experts={num_experts} must be a positive multiple of the world size {world} "
            "(experts are split contiguously over the ranks)")
    if spec is MOE_DISPATCH:
        layout = "exact" if capacity is None else f"{world}*{capacity} rows per local expert"
        steps = (
            MoEStep("route", "per (t,k): destination rank, local expert, j; counts per expert"
                    + ("; fp8 rows + per-token scales" if quant == "fp8" else "")),
            MoEStep("count_exchange", "to every consumer, every call, with the epoch"),
            MoEStep("put_rows", "each token once per destination rank + header"),
            MoEStep("wait", "every producer's count word of this epoch"),
            MoEStep("expand", f"one row per slot, grouped by local expert ({layout}); pads expert -1"),
        )
    else:
        steps = (
            MoEStep("put_back", "each valid row to slot t*K+k of its source"),
            MoEStep("notify", "a done word with the epoch to every source, every call"),
            MoEStep("wait", "every consumer's done word of this epoch"),
            MoEStep("weighted_reduce", "float32, k = 0..K-1, id -1 skipped; out in expert_out's dtype"),
        )
    return MoEPlan(spec, world, rank, num_experts, capacity, quant, steps)
