"""The CPU engine's MoE: the steps of a MoE plan (moe/plan.py) over the CPU engine's collectives.

CountExchange is an all-gather of every rank's header and counts (so every rank sees the whole
count matrix and all of them raise the same error for a bad call: the communicator stays
usable); PutRows and PutBack are all_to_all_v calls of packed byte rows (header + payload), each
token once per destination rank; Expand and WeightedReduce are local. Blocks the host.
"""

from __future__ import annotations

import torch

from ..errors import PurlinCapacityError, PurlinValueError
from ..native import DTYPE_CODES, reduce_dtype_code
from .dispatch import MoEDispatch
from .namings import MOE_COMBINE, MOE_DISPATCH
from .plan import MoEPlan, make_moe_plan
from .routing import quantize_fp8, route

_HEADER_FIELDS = ("num_experts", "topk_ids (K columns)", "x (hidden size)", "x dtype", "dtype", "capacity")
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """The header's code of ``x``'s dtype: the one dtype table's (native.DTYPE_CODES)."""
    return reduce_dtype_code(dtype)


def _shown(name: str, col: list[int]) -> list:
    """A header column as the user knows it (dtype codes as dtype names)."""
    return [_DTYPE_NAMES.get(v, v) for v in col] if name == "x dtype" else col


def exchange_header(comm, op: str, values: tuple[int, ...], tokens: int, to_device=None, to_host=None,
                    error: Exception | None = None) -> list[int]:
    """All-gather (status, values..., tokens) of every rank; raise PurlinValueError on every rank if a
    rank rejected its own arguments (``error``: that rank raises it, the others name that rank) or the
    ranks disagree on a value. Returns every rank's tokens. ``to_device`` / ``to_host``: how the engine
    moves small int64 vectors between host and device (default: plain torch copies)."""
    vals = [1] + [0] * (len(values) + 1) if error is not None else [0] + list(values) + [tokens]
    mine = to_device(vals) if to_device is not None else torch.tensor(vals, dtype=torch.int64, device=comm.device)
    got = comm.all_gather(mine)
    seen = (to_host(got) if to_host is not None else got.cpu()).view(comm.world_size, -1)
    bad = [q for q in range(comm.world_size) if int(seen[q, 0])]
    if bad:
        if error is not None:
            raise error
        raise PurlinValueError(f"{op}: rank(s) {bad} rejected their arguments (their error names the argument); "
                               "every rank skipped this call and the communicator stays usable")
    for i, name in enumerate(_HEADER_FIELDS[: len(values)]):
        col = seen[:, i + 1].tolist()
        if any(v != col[0] for v in col):
            raise PurlinValueError(f"{op}: the ranks disagree on {name}: {_shown(name, col)} (rank order); "
                                   "every rank must call with the same value")
    return seen[:, -1].tolist()


def reject(comm, op: str, error: Exception, to_device=None, to_host=None) -> None:
    """This rank's arguments are bad: tell the peers (they are in :func:`exchange_header`) and raise."""
    exchange_header(comm, op, (0,) * len(_HEADER_FIELDS), 0, to_device, to_host, error=error)
    raise error  # not reached: exchange_header raises it


def combine_status(comm, error: Exception | None = None) -> None:
    """Every rank says whether it accepted its combine arguments (one all-gather); if a rank did not, every
    rank raises now (that rank ``error``, the others naming it) and no rank runs the combine's exchange."""
    got = comm.all_gather(torch.tensor([int(error is not None)], dtype=torch.int64, device=comm.device))
    bad = [q for q, v in enumerate(got.tolist()) if v]
    if error is not None:
        raise error
    if bad:
        raise PurlinValueError(f"moe_combine: rank(s) {bad} rejected their arguments (their error names the "
                               "argument); every rank skipped this call and the communicator stays usable")


def overflow(plan: MoEPlan, matrix: torch.Tensor) -> PurlinCapacityError | None:
    """The first (source rank, expert) pair over capacity, as the error to raise, or None."""
    if plan.capacity is None:
        return None
    over = (matrix > plan.capacity).nonzero()
    if not over.numel():
        return None
    p, g = (int(v) for v in over[0])
    n = int(matrix[p, g])
    return PurlinCapacityError(
        f"moe_dispatch: rank {p} routed {n} rows to expert {g} (rank {g // plan.local_experts}'s local expert "
        f"{g % plan.local_experts}), more than capacity={plan.capacity}; raise capacity (or "
        "moe.max_tokens_per_rank)", rank=p, expert=g, count=n, capacity=plan.capacity)


def dispatch(comm, plan: MoEPlan, x: torch.Tensor, ids: torch.Tensor, ws: torch.Tensor,
             owner: int) -> MoEDispatch:
    world, me, local, e_n = comm.world_size, comm.rank, plan.local_experts, plan.num_experts
    t_n, k_n = ids.shape
    hidden = x.shape[1]
    # Route (source prologue)
    r = route(ids, e_n, world)
    payload, scales = (quantize_fp8(x) if plan.quant == "fp8" else (x, None))
    # CountExchange: header agreement, then counts per global expert and tokens per destination rank
    exchange_header(comm, "moe_dispatch", (e_n, k_n, hidden, dtype_code(x.dtype), int(plan.quant == "fp8"),
                                           plan.capacity or 0), t_n)
    both = comm.all_gather(torch.cat([r.counts, r.tokens_to])).view(world, e_n + world)
    matrix, tokens = both[:, :e_n], both[:, e_n:]
    err = overflow(plan, matrix)
    if err is not None:
        raise err
    # PutRows: each token once per destination rank, in (rank, token) order, header + payload bytes
    pairs = r.to_rank.t().nonzero()  # (d, t), d-major then t: the send order
    d_of, t_of = pairs[:, 0], pairs[:, 1]
    hdr_le = torch.where(r.dst[t_of] == d_of[:, None], r.le[t_of], -1)
    hdr_j = torch.where(r.dst[t_of] == d_of[:, None], r.j[t_of], -1)
    sc = (scales[t_of] if scales is not None else torch.ones(len(t_of))).to(torch.float32)
    header = torch.cat([t_of[:, None], hdr_le, hdr_j, sc.view(torch.int32).to(torch.int64)[:, None]], dim=1)
    row_bytes = payload.element_size() * hidden
    body = payload.reshape(t_n, -1).view(torch.uint8)[t_of] if t_n else torch.empty(0, row_bytes, dtype=torch.uint8)
    packed = torch.cat([header.contiguous().view(torch.uint8).reshape(len(t_of), 8 * header.shape[1]),
                        body.reshape(len(t_of), row_bytes)], 1)
    recv = comm.all_to_all_v(packed.contiguous(), r.tokens_to.tolist(), tokens[:, me].tolist())
    # Expand: one row per (token, slot), at group(le) + offset(source, le) + j
    hw = 2 * k_n + 2
    n_recv = recv.shape[0]
    rh = recv[:, : hw * 8].reshape(-1).view(torch.int64).reshape(n_recv, hw)
    recv = recv.reshape(n_recv, hw * 8 + row_bytes)
    rbody = recv[:, hw * 8:]
    mine = matrix[:, me * local:(me + 1) * local]  # [W, L] rows from source p for local expert e
    group = mine.sum(0)
    off = torch.cumsum(mine, 0) - mine  # offset of source p inside group e
    if plan.capacity is None:
        base = torch.cumsum(group, 0) - group
        total = int(group.sum())
    else:
        base = torch.arange(local, dtype=torch.int64) * (world * plan.capacity)
        total = local * world * plan.capacity
    src = torch.repeat_interleave(torch.arange(world), tokens[:, me])  # source rank of each received token
    le, j = rh[:, 1:1 + k_n], rh[:, 1 + k_n:1 + 2 * k_n]
    tok_i, k_i = (le >= 0).nonzero(as_tuple=True)
    lev = le[tok_i, k_i]
    rows = base[lev] + off[src[tok_i], lev] + j[tok_i, k_i]
    out_dtype = payload.dtype
    xo = torch.zeros(total, row_bytes, dtype=torch.uint8)
    xo[rows] = rbody[tok_i]
    expert = torch.full((total,), -1, dtype=torch.int32)
    expert[rows] = lev.to(torch.int32)
    src_rank = torch.full((total,), -1, dtype=torch.int32)
    src_rank[rows] = src[tok_i].to(torch.int32)
    src_slot = torch.full((total,), -1, dtype=torch.int64)
    src_slot[rows] = rh[tok_i, 0] * k_n + k_i
    out_scales = None
    if plan.quant == "fp8":
        out_scales = torch.ones(total, dtype=torch.float32)
        out_scales[rows] = rh[tok_i, hw - 1].to(torch.int32).view(torch.float32)
    return MoEDispatch(
        x=xo.view(out_dtype).reshape(total, hidden), expert=expert, counts=group.to(torch.int32),
        scales=out_scales, src_rank=src_rank, src_slot=src_slot, tokens=t_n, topk=k_n, hidden=hidden,
        num_experts=e_n, capacity=plan.capacity, weights=ws.to(torch.float32), valid=r.valid,
        _engine=r.slots_to.tolist(), _owner=owner)


def combine(comm, expert_out: torch.Tensor, d: MoEDispatch) -> torch.Tensor:
    world = comm.world_size
    t_n, k_n, hidden = d.tokens, d.topk, d.hidden
    # PutBack: every valid row to its source, grouped by source rank, with its slot index
    key = torch.where(d.src_rank >= 0, d.src_rank.to(torch.int64), world)
    order = torch.argsort(key, stable=True)
    n_back = torch.bincount(key, minlength=world + 1)[:world]
    order = order[: int(n_back.sum())]
    row_bytes = expert_out.element_size() * hidden
    body = expert_out.view(torch.uint8).reshape(-1, row_bytes)[order] if d.rows else \
        torch.empty(0, row_bytes, dtype=torch.uint8)
    packed = torch.cat([d.src_slot[order].contiguous().view(torch.uint8).reshape(-1, 8), body], 1)
    back = comm.all_to_all_v(packed.contiguous(), n_back.tolist(), list(d._engine)).reshape(-1, 8 + row_bytes)
    slots = back[:, :8].reshape(-1).view(torch.int64)
    ret = torch.zeros(t_n * k_n, row_bytes, dtype=torch.uint8)
    ret[slots] = back[:, 8:]
    ret = ret.view(expert_out.dtype).reshape(t_n, k_n, hidden)
    # WeightedReduce: float32, k = 0..K-1, skipped slots skipped (not added as zeros)
    acc = torch.zeros(t_n, hidden, dtype=torch.float32)
    for k in range(k_n):
        m = d.valid[:, k]
        if bool(m.any()):
            acc[m] = acc[m] + d.weights[m, k, None] * ret[m, k].to(torch.float32)
    return acc.to(expert_out.dtype)


class CpuMoE:
    """The CPU engine's MoE dispatch / combine for one Communicator (a ``MoEEngine``): collectives over
    the communicator itself, planned by :mod:`.plan` (the functions above)."""

    hbm_bytes = 0

    def __init__(self, comm):
        self.comm = comm
        self._plans: dict[tuple, object] = {}

    def _plan(self, kind: str, num_experts: int, capacity: int | None, quant: str):
        key = (kind, num_experts, capacity, quant)
        plan = self._plans.get(key)
        if plan is None:
            spec = MOE_DISPATCH if kind == "dispatch" else MOE_COMBINE
            plan = self._plans[key] = make_moe_plan(spec, self.comm.world_size, self.comm.rank, num_experts,
                                                    capacity=capacity, quant=quant)
        return plan

    def reject(self, error) -> None:
        """This rank's arguments are bad: tell the peers (they wait in the header exchange) and raise."""
        reject(self.comm, "moe_dispatch", error)

    def dispatch(self, x, ids, weights, num_experts: int, capacity, quant: str, capturing: bool):
        plan = self._plan("dispatch", num_experts, capacity, quant)
        return dispatch(self.comm, plan, x, ids, weights, id(self.comm))

    def reject_combine(self, error) -> None:
        combine_status(self.comm, error)

    def combine(self, expert_out, d):
        combine_status(self.comm)
        return combine(self.comm, expert_out, d)

    def check(self, fatal_only: bool = False) -> None:
        """Nothing is recorded for later: CPU MoE calls raise their own errors."""

    def synchronize(self) -> None:
        """A no-op: CPU MoE calls have finished when they return."""

    def close(self) -> None:
        self._plans.clear()
        self.comm = None
