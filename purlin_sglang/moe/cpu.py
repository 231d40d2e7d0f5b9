"""The CPU engine's MoE part (:class:`CpuMoE`): the steps of a MoE plan (:mod:`.plan`) over the
communicator's collectives, as the context hands them over. The oracle of the CUDA part.

CountExchange is the wing's (:mod:`.exchange`: every rank's header and counts, so every rank sees
the whole count matrix and all of them raise the same error for a bad call: the communicator stays
usable); PutRows and PutBack are all_to_all_v calls of packed byte rows (header + payload), each
token once per destination rank; Expand and WeightedReduce are local. Blocks the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .dispatch import MoEDispatch
from .engine import MoEContext
from .exchange import CountExchange, raise_rejected, status_words
from .namings import MOE_COMBINE, MOE_DISPATCH
from .plan import MoEPlan, make_moe_plan
from .routing import Route, quantize_fp8, route


def combine_status(ctx: MoEContext, error: Exception | None = None) -> None:
    """Every rank says whether it accepted its combine arguments (one all-gather); if a rank did not, every
    rank raises now (that rank ``error``, the others a PurlinRejectedError naming it and quoting it) and no rank runs the combine's exchange."""
    got = ctx.all_gather(torch.tensor(status_words(error), dtype=torch.int64, device=ctx.device))
    raise_rejected(MOE_COMBINE.name, got.view(ctx.world, -1), error)


def token_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The bytes [len(index), row bytes] of rows ``index`` of the 2-D ``src``."""
    row_bytes = src.element_size() * src.shape[1]
    if not src.shape[0]:
        return torch.empty(0, row_bytes, dtype=torch.uint8, device=src.device)
    return src.reshape(src.shape[0], -1).view(torch.uint8)[index]


def scale_words(scales: Optional[torch.Tensor], t_of: torch.Tensor) -> torch.Tensor:
    """[len(t_of), 1] int64: the float32 bits of tokens ``t_of``'s scales (1 without FP8), a header word."""
    sc = (scales[t_of] if scales is not None else torch.ones(len(t_of), device=t_of.device)).to(torch.float32)
    return sc.view(torch.int32).to(torch.int64)[:, None]


def pack(header: torch.Tensor, body: torch.Tensor) -> torch.Tensor:
    """Packed rows [n, 8 w + b] uint8: the int64 ``header`` words [n, w], then the ``body`` bytes [n, b]."""
    return torch.cat([header.contiguous().view(torch.uint8).reshape(len(header), 8 * header.shape[1]), body], 1)


def header_of(rows: torch.Tensor, words: int) -> torch.Tensor:
    """The int64 header words [n, words] of packed ``rows``."""
    return rows[:, : words * 8].reshape(-1).view(torch.int64).reshape(len(rows), words)


@dataclass
class Routed:
    """A dispatch after its prologue: the route, the payload rows, the count matrix [W, E] and the
    tokens matrix [W, W] (``tokens[p, d]``: tokens rank p sends to rank d), and the packed rows this
    rank sends, one per (destination rank, token) in that order (``d_of``, ``t_of``): a header of
    ``2K + 2`` int64 words (token, local expert and index per slot, the scale's bits), then the payload."""

    r: Route
    payload: torch.Tensor
    scales: Optional[torch.Tensor]
    matrix: torch.Tensor
    tokens: torch.Tensor
    d_of: torch.Tensor
    t_of: torch.Tensor
    packed: torch.Tensor


def prologue(ctx: MoEContext, exchange: CountExchange, plan: MoEPlan, x: torch.Tensor, ids: torch.Tensor) -> Routed:
    """Route, quantise, the count exchange (every rank raises alike for a bad call), and pack the rows."""
    world, e_n = ctx.world, plan.num_experts
    r = route(ids, e_n, world)
    payload, scales = (quantize_fp8(x) if plan.quant == "fp8" else (x, None))
    # CountExchange: header agreement, then counts per global expert and tokens per destination rank
    both = exchange.run(x, ids, e_n, plan.capacity, plan.quant, torch.cat([r.counts, r.tokens_to]))
    matrix, tokens = both[:, :e_n], both[:, e_n:]
    # PutRows' rows: each token once per destination rank, in (rank, token) order, header + payload bytes
    pairs = r.to_rank.t().nonzero()  # (d, t), d-major then t: the send order
    d_of, t_of = pairs[:, 0], pairs[:, 1]
    hdr_le = torch.where(r.dst[t_of] == d_of[:, None], r.le[t_of], -1)
    hdr_j = torch.where(r.dst[t_of] == d_of[:, None], r.j[t_of], -1)
    header = torch.cat([t_of[:, None], hdr_le, hdr_j, scale_words(scales, t_of)], dim=1)
    packed = pack(header, token_rows(payload, t_of))
    return Routed(r, payload, scales, matrix, tokens, d_of, t_of, packed.contiguous())


def put_rows(ctx: MoEContext, routed: Routed) -> tuple[torch.Tensor, torch.Tensor]:
    """PutRows in one all_to_all_v: (the packed rows received, the source rank of each)."""
    me, tokens = ctx.rank, routed.tokens
    recv = ctx.all_to_all_v(routed.packed, routed.r.tokens_to.tolist(), tokens[:, me].tolist())
    return recv, torch.repeat_interleave(torch.arange(ctx.world), tokens[:, me]).to(recv.device)


def dispatch(ctx: MoEContext, exchange: CountExchange, plan: MoEPlan, x: torch.Tensor, ids: torch.Tensor,
             ws: torch.Tensor, put: Callable = put_rows) -> MoEDispatch:
    """The prologue, PutRows (``put``: rows and their source ranks; one all_to_all_v by default), then
    Expand."""
    routed = prologue(ctx, exchange, plan, x, ids)
    recv, src = put(ctx, routed)
    return expand(ctx, plan, routed, recv, src, x.shape[1], ws)


def expand(ctx: MoEContext, plan: MoEPlan, routed: Routed, recv: torch.Tensor, src: torch.Tensor, hidden: int,
           ws: torch.Tensor) -> MoEDispatch:
    """Expand: one row per (token, slot) received, at group(le) + offset(source, le) + j."""
    world, me, local, e_n = ctx.world, ctx.rank, plan.local_experts, plan.num_experts
    r, payload = routed.r, routed.payload
    dev = payload.device
    matrix = routed.matrix.to(dev)  # the count exchange's (on the host)
    t_n, k_n = r.dst.shape
    row_bytes = payload.element_size() * hidden
    hw = 2 * k_n + 2
    n_recv = recv.shape[0]
    rh = header_of(recv, hw)
    recv = recv.reshape(n_recv, hw * 8 + row_bytes)
    rbody = recv[:, hw * 8:]
    mine = matrix[:, me * local:(me + 1) * local]  # [W, L] rows from source p for local expert e
    group = mine.sum(0)
    off = torch.cumsum(mine, 0) - mine  # offset of source p inside group e
    if plan.capacity is None:
        base = torch.cumsum(group, 0) - group
        total = int(group.sum())
    else:
        base = torch.arange(local, dtype=torch.int64, device=dev) * (world * plan.capacity)
        total = local * world * plan.capacity
    le, j = rh[:, 1:1 + k_n], rh[:, 1 + k_n:1 + 2 * k_n]
    tok_i, k_i = (le >= 0).nonzero(as_tuple=True)
    lev = le[tok_i, k_i]
    rows = base[lev] + off[src[tok_i], lev] + j[tok_i, k_i]
    out_dtype = payload.dtype
    xo = torch.zeros(total, row_bytes, dtype=torch.uint8, device=dev)
    xo[rows] = rbody[tok_i]
    expert = torch.full((total,), -1, dtype=torch.int32, device=dev)
    expert[rows] = lev.to(torch.int32)
    src_rank = torch.full((total,), -1, dtype=torch.int32, device=dev)
    src_rank[rows] = src[tok_i].to(torch.int32)
    src_slot = torch.full((total,), -1, dtype=torch.int64, device=dev)
    src_slot[rows] = rh[tok_i, 0] * k_n + k_i
    out_scales = None
    if plan.quant == "fp8":
        out_scales = torch.ones(total, dtype=torch.float32, device=dev)
        out_scales[rows] = rh[tok_i, hw - 1].to(torch.int32).view(torch.float32)
    return MoEDispatch(
        x=xo.view(out_dtype).reshape(total, hidden), expert=expert, counts=group.to(torch.int32),
        scales=out_scales, src_rank=src_rank, src_slot=src_slot, tokens=t_n, topk=k_n, hidden=hidden,
        num_experts=e_n, capacity=plan.capacity, weights=ws.to(torch.float32), valid=r.valid,
        _engine=r.slots_to.tolist(), _owner=ctx.owner)


def combine(ctx: MoEContext, expert_out: torch.Tensor, d: MoEDispatch) -> torch.Tensor:
    world = ctx.world
    t_n, k_n, hidden = d.tokens, d.topk, d.hidden
    # PutBack: every valid row to its source, grouped by source rank, with its slot index
    key = torch.where(d.src_rank >= 0, d.src_rank.to(torch.int64), world)
    order = torch.argsort(key, stable=True)
    n_back = torch.bincount(key, minlength=world + 1)[:world]
    order = order[: int(n_back.sum())]
    row_bytes = expert_out.element_size() * hidden
    packed = pack(d.src_slot[order][:, None], token_rows(expert_out, order))
    back = ctx.all_to_all_v(packed.contiguous(), n_back.tolist(), list(d._engine)).reshape(-1, 8 + row_bytes)
    slots = header_of(back, 1).reshape(-1)
    ret = torch.zeros(t_n * k_n, row_bytes, dtype=torch.uint8, device=expert_out.device)
    ret[slots] = back[:, 8:]
    ret = ret.view(expert_out.dtype).reshape(t_n, k_n, hidden)
    # WeightedReduce: float32, k = 0..K-1, skipped slots skipped (not added as zeros)
    acc = torch.zeros(t_n, hidden, dtype=torch.float32, device=expert_out.device)
    for k in range(k_n):
        m = d.valid[:, k]
        if bool(m.any()):
            acc[m] = acc[m] + d.weights[m, k, None] * ret[m, k].to(torch.float32)
    return acc.to(expert_out.dtype)


class CpuMoE:
    """The CPU engine's MoE part (a :class:`~.engine.MoEEngine`): the functions above over the context's
    collectives, one plan per call shape. Every call blocks the host and raises its own errors."""

    hbm_bytes = 0

    def __init__(self, ctx: MoEContext):
        self.ctx = ctx
        self.exchange = CountExchange(ctx)
        self._plans: dict[tuple, MoEPlan] = {}

    def _plan(self, kind: str, num_experts: int, capacity: int | None, quant: str) -> MoEPlan:
        key = (kind, num_experts, capacity, quant)
        plan = self._plans.get(key)
        if plan is None:
            spec = MOE_DISPATCH if kind == "dispatch" else MOE_COMBINE
            plan = self._plans[key] = make_moe_plan(spec, self.ctx.world, self.ctx.rank, num_experts,
                                                    capacity=capacity, quant=quant)
        return plan

    def reject(self, error) -> None:
        """This rank's arguments are bad: tell the peers (they wait in the header exchange) and raise."""
        self.exchange.reject(error)

    def dispatch(self, x, ids, weights, num_experts: int, capacity, quant: str, capturing: bool,
                 max_tokens=None) -> MoEDispatch:
        plan = self._plan("dispatch", num_experts, capacity, quant)
        return dispatch(self.ctx, self.exchange, plan, x, ids, weights)

    def reject_combine(self, error) -> None:
        combine_status(self.ctx, error)

    def combine(self, expert_out, d: MoEDispatch) -> torch.Tensor:
        combine_status(self.ctx)
        return combine(self.ctx, expert_out, d)

    def recorded_error(self) -> None:
        return None  # calls block and raise as they run

    def check(self, fatal_only: bool = False) -> None:
        """Nothing is recorded for later: CPU MoE calls raise their own errors."""

    def synchronize(self) -> None:
        """A no-op: CPU MoE calls have finished when they return."""

    def trace(self) -> None:
        """No kernel phases to stamp on the CPU."""
        return None

    def close(self) -> None:
        self._plans.clear()
        self.ctx = self.exchange = None
