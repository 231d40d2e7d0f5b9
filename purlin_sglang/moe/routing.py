"""The source-side routing prologue, shared by both engines: plain device ops, no host sync.

For every (token t, slot k) with a valid id: the destination rank ``dst = id // (E/W)``, the
local expert ``le = id % (E/W)`` and ``j``, the index of (t, k) among this rank's slots routed
to the same global expert in (t, k) order (a stable sort by expert: the histogram + scan of the
plan's Route step). Also per global expert the row counts, and per destination rank the tokens
it receives (each token once per rank) and their order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class Route:
    dst: torch.Tensor  # [T, K] int64, -1 for skipped slots
    le: torch.Tensor  # [T, K] int64, -1 for skipped slots
    j: torch.Tensor  # [T, K] int64, -1 for skipped slots
    valid: torch.Tensor  # [T, K] bool
    counts: torch.Tensor  # [E] int64 rows per global expert from this rank
    to_rank: torch.Tensor  # [T, W] bool: token t goes to rank d
    tokens_to: torch.Tensor  # [W] int64 tokens sent to each rank
    slots_to: torch.Tensor  # [W] int64 (t, k) slots routed to each rank


def route(ids: torch.Tensor, num_experts: int, world: int) -> Route:
    """Device ops only (no host sync; capturable). Ids outside [0, num_experts) are skipped slots
    (the API rejects them before, except under graph capture, where the CUDA engine records them)."""
    t, k = ids.shape
    dev = ids.device
    ids = ids.to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    local = num_experts // world
    dst = torch.where(valid, ids // local, -1)
    le = torch.where(valid, ids % local, -1)
    g = torch.where(valid, ids, num_experts).reshape(-1)
    counts_ext = _histogram(g, num_experts)
    starts = torch.cumsum(counts_ext, 0) - counts_ext
    order = torch.argsort(g, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(g.numel(), device=dev)
    j = torch.where(valid, (pos - starts[g]).reshape(t, k), -1)
    hit = torch.zeros(t, world + 1, dtype=torch.int64, device=dev)
    hit.scatter_(1, torch.where(valid, dst, world), 1)
    to_rank = hit[:, :world] > 0
    d_of = torch.where(valid, dst, world).reshape(-1)
    slots = torch.zeros(world + 1, dtype=torch.int64, device=dev).scatter_add_(0, d_of, torch.ones_like(d_of))
    return Route(dst, le, j, valid, counts_ext[:num_experts], to_rank, to_rank.sum(0), slots[:world])


def _histogram(g: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E + 1] int64 counts of the flat ids ``g`` (skipped slots mapped to E); bincount would sync on CUDA."""
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=g.device)
    return counts.scatter_add_(0, g, torch.ones_like(g))


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: rows per global expert (slots with ids outside [0, E) skipped); device ops, no sync."""
    ids = ids.to(torch.int64).reshape(-1)
    g = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    return _histogram(g, num_experts)[:num_experts]


def send_positions(to_rank: torch.Tensor) -> torch.Tensor:
    """[T, W] int64: the position of token t in the send list to rank d (token order), -1 if not sent."""
    r = to_rank.to(torch.int64)
    return torch.where(to_rank, torch.cumsum(r, 0) - 1, -1)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 (e4m3fn): ``scale = amax / 448`` (1 for an all-zero row), ``q = x * (1 / scale)``,
    each step rounded to nearest in float32 (as SGLang's per-token quantisation multiplies by the inverse)."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1) if x.shape[0] else torch.zeros(0, device=x.device)
    # Divisions by tensors, not by Python numbers: CUDA divides by a CPU scalar as a multiply by its
    # reciprocal, which differs from a true division in the last bit (the dispatch kernel uses
    # __fdiv_rn and __frcp_rn: the engines' scales and rows are bitwise equal).
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    inv = torch.ones_like(scale) / scale
    q = (xf * inv[:, None]).to(torch.float8_e4m3fn)
    return q, scale
