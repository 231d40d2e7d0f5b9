"""A plain torch reference of MoE dispatch and combine over lists of per-rank tensors.

Written as loops straight from the definition (no code shared with the engines), so that it can
check them. Public: the SGLang tests and ``bench moe`` import it.

* :func:`reference_dispatch` (xs, ids, ws, num_experts, world, capacity=None, dtype=None): per
  rank ``q`` a :class:`RefDispatch` with the rows of q's local experts, grouped by local expert,
  then source rank, token index and k (capacity mode: group e at row e*world*capacity, compact,
  padding rows with expert -1 and zero x). Raises ``ValueError`` naming the source rank, the
  expert and the count when a (source, expert) pair exceeds ``capacity``.
* :func:`reference_combine` (expert_outs, dispatches, ids, ws, world, accumulate=torch.float32):
  per source rank the [T, H] result ``sum_k w[t,k] * out[row of (t,k)]``, accumulated in
  ``accumulate`` in the order k = 0..K-1 (slots with id -1 skipped), in expert_outs' dtype.
  ``accumulate=torch.float32`` is the bitwise contract of both engines; ``torch.float64`` is the
  exact-arithmetic reference for tolerance checks.
* :func:`reference_moe` (xs, ids, ws, num_experts, world, expert_fn): dispatch, ``expert_fn(rank,
  local_expert, rows)`` per group, combine: a whole expert-parallel MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

FP8 = torch.float8_e4m3fn


@dataclass
class RefDispatch:
    x: torch.Tensor  # [R, H] (fp8 when quantised)
    expert: torch.Tensor  # [R] int32, -1 padding
    counts: torch.Tensor  # [E/W] int32
    scales: torch.Tensor | None  # [R] float32 (fp8 only)
    src_rank: torch.Tensor  # [R] int32, -1 padding
    src_slot: torch.Tensor  # [R] int64 (t*K + k), -1 padding


def _quant_row(row: torch.Tensor) -> tuple[torch.Tensor, float]:
    xf = row.to(torch.float32)
    amax = xf.abs().max() if xf.numel() else torch.tensor(0.0)
    scale = (amax / 448.0) if float(amax) > 0 else torch.tensor(1.0)
    scale = scale.to(torch.float32)
    inv = torch.ones_like(scale) / scale
    return (xf * inv).to(FP8), float(scale)


def reference_dispatch(xs: Sequence[torch.Tensor], ids: Sequence[torch.Tensor], ws: Sequence[torch.Tensor],
                       num_experts: int, world: int, capacity: int | None = None,
                       dtype: torch.dtype | None = None) -> list[RefDispatch]:
    if num_experts % world:
        raise ValueError(f"reference_dispatch: num_experts={num_experts} is not a multiple of world={world}")
    local = num_experts // world
    xs = [x.cpu() for x in xs]
    ids = [i.cpu().to(torch.int64) for i in ids]
    hidden = xs[0].shape[1]
    quant = dtype == FP8
    out_dtype = FP8 if quant else xs[0].dtype
    result = []
    for q in range(world):
        rows: list[list[tuple]] = [[] for _ in range(local)]  # per local expert: (p, t, k)
        for e in range(local):
            g = q * local + e
            for p in range(world):
                n = 0
                for t in range(ids[p].shape[0]):
                    for k in range(ids[p].shape[1]):
                        if int(ids[p][t, k]) == g:
                            rows[e].append((p, t, k))
                            n += 1
                if capacity is not None and n > capacity:
                    raise ValueError(f"reference_dispatch: rank {p} routes {n} rows to expert {g} "
                                     f"(capacity {capacity})")
        per_group = [len(r) for r in rows]
        total = local * world * capacity if capacity is not None else sum(per_group)
        x = torch.zeros(total, hidden, dtype=torch.float32)
        expert = torch.full((total,), -1, dtype=torch.int32)
        src_rank = torch.full((total,), -1, dtype=torch.int32)
        src_slot = torch.full((total,), -1, dtype=torch.int64)
        scales = torch.ones(total, dtype=torch.float32) if quant else None
        xq = torch.zeros(total, hidden, dtype=out_dtype)
        for e in range(local):
            base = e * world * capacity if capacity is not None else sum(per_group[:e])
            for i, (p, t, k) in enumerate(rows[e]):
                r = base + i
                if quant:
                    xq[r], scales[r] = _quant_row(xs[p][t])
                else:
                    xq[r] = xs[p][t]
                expert[r], src_rank[r], src_slot[r] = e, p, t * ids[p].shape[1] + k
        del x
        result.append(RefDispatch(xq, expert, torch.tensor(per_group, dtype=torch.int32), scales, src_rank, src_slot))
    return result


def reference_combine(expert_outs: Sequence[torch.Tensor], dispatches: Sequence[RefDispatch],
                      ids: Sequence[torch.Tensor], ws: Sequence[torch.Tensor], world: int,
                      accumulate: torch.dtype = torch.float32) -> list[torch.Tensor]:
    where: dict[tuple[int, int], tuple[int, int]] = {}
    for q, d in enumerate(dispatches):
        for r in range(d.src_rank.shape[0]):
            p = int(d.src_rank[r])
            if p >= 0:
                where[(p, int(d.src_slot[r]))] = (q, r)
    outs = [o.cpu() for o in expert_outs]
    dtype = outs[0].dtype
    hidden = outs[0].shape[1]
    ys = []
    for p in range(world):
        idp, wp = ids[p].cpu().to(torch.int64), ws[p].cpu()
        t_n, k_n = idp.shape
        y = torch.zeros(t_n, hidden, dtype=accumulate)
        for t in range(t_n):
            acc = torch.zeros(hidden, dtype=accumulate)
            for k in range(k_n):
                if int(idp[t, k]) < 0:
                    continue
                q, r = where[(p, t * k_n + k)]
                w = wp[t, k].to(torch.float32).to(accumulate)
                acc = acc + w * outs[q][r].to(accumulate)
            y[t] = acc
        ys.append(y.to(dtype))
    return ys


def reference_moe(xs: Sequence[torch.Tensor], ids: Sequence[torch.Tensor], ws: Sequence[torch.Tensor],
                  num_experts: int, world: int,
                  expert_fn: Callable[[int, int, torch.Tensor], torch.Tensor],
                  accumulate: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """A whole EP MoE layer: ``expert_fn(rank, local_expert, rows [n, H]) -> [n, H]`` per group."""
    ds = reference_dispatch(xs, ids, ws, num_experts, world)
    outs = []
    for q, d in enumerate(ds):
        out = torch.zeros(d.x.shape, dtype=xs[0].dtype)
        for e in range(num_experts // world):
            m = d.expert == e
            if bool(m.any()):
                out[m] = expert_fn(q, e, d.x[m]).to(out.dtype)
        outs.append(out)
    return reference_combine(outs, ds, ids, ws, world, accumulate=accumulate)


__all__ = ["RefDispatch", "reference_dispatch", "reference_combine", "reference_moe"]
