"""The plain torch reference of every collective: what each rank must receive, from torch.distributed's
semantics (all_gather == all_gather_into_tensor, reduce_scatter == reduce_scatter_tensor, all_to_all(_v)
== all_to_all_single, along dim 0). The one reference of the package: the CLI demo, the bench and the
tests check against it. (The MoE reference is purlin_sglang/moe/reference.py.)

Reductions are DEFINED as: accumulate (16-bit floats in float32, every other dtype in its own) in rank
order 0..n-1, then cast back. Every engine computes exactly that, so results compare bitwise.

Each function takes every rank's input ``xs`` (in rank order) and the rank ``r`` whose output it
returns. Host-side and slow; for checks, not for serving.
"""

from __future__ import annotations

from typing import Sequence

import torch

_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def reduce_ref(tensors: Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor:
    """The defined reduction of equally shaped tensors: accumulate in rank order, then cast."""
    dtype = tensors[0].dtype
    acc = tensors[0].to(_ACC.get(dtype, dtype)).clone()
    for t in tensors[1:]:
        t = t.to(acc.dtype)
        if op == "sum":
            acc = acc + t
        elif op == "max":
            acc = torch.maximum(acc, t)
        elif op == "min":
            acc = torch.minimum(acc, t)
        else:
            raise ValueError(f"reduce_ref: unknown op {op!r}; use 'sum', 'max' or 'min'")
    return acc.to(dtype)


def two_level_reduce(tensors: Sequence[torch.Tensor], nodes: Sequence[int], op: str = "sum") -> torch.Tensor:
    """The defined reduction of a group on several nodes (``nodes[r]``: rank r's node id): each node's
    ranks reduced in rank order (:func:`reduce_ref`), then the node results in ascending node id."""
    return reduce_ref([reduce_ref([t for t, n in zip(tensors, nodes) if n == node], op)
                       for node in sorted(set(nodes))], op)


def all_reduce(xs, r: int, op: str = "sum") -> torch.Tensor:
    return reduce_ref(xs, op)


def all_gather(xs, r: int) -> torch.Tensor:
    return torch.cat(list(xs))


def reduce_scatter(xs, r: int, op: str = "sum") -> torch.Tensor:
    n = len(xs)
    return reduce_ref([x.chunk(n)[r] if x.shape[0] else x for x in xs], op)


def all_to_all(xs, r: int) -> torch.Tensor:
    n = len(xs)
    return torch.cat([x[r * (x.shape[0] // n):(r + 1) * (x.shape[0] // n)] for x in xs])


def all_gather_v(xs, r: int) -> torch.Tensor:
    return torch.cat(list(xs))


def reduce_scatter_v(xs, r: int, sizes: Sequence[int], op: str = "sum") -> torch.Tensor:
    """``sizes[q]``: rows rank q receives."""
    return reduce_ref([x.split(list(sizes))[r] for x in xs], op)


def all_to_all_v(xs, r: int, send: Sequence[Sequence[int]]) -> torch.Tensor:
    """``send[p][q]``: rows rank p sends to rank q (rank p's input_splits)."""
    return torch.cat([x.split(list(send[p]))[r] for p, x in enumerate(xs)])


def broadcast(xs, r: int, root: int) -> torch.Tensor:
    return xs[root].clone()


def gather(xs, r: int, root: int) -> torch.Tensor | None:
    """Every rank's input, concatenated, at the root (None elsewhere: nothing is written)."""
    return torch.cat(list(xs)) if r == root else None


def reduce(xs, r: int, root: int, op: str = "sum") -> torch.Tensor | None:
    """The reduction at the root (None elsewhere: nothing is written)."""
    return reduce_ref(xs, op) if r == root else None


def scatter(xs, r: int, root: int, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Slice ``r`` of the root's input (equal slices, or ``sizes[q]`` rows for rank q)."""
    if sizes is not None:
        return xs[root].split(list(sizes))[r].clone()
    rows = xs[root].shape[0] // len(xs)
    return xs[root][r * rows:(r + 1) * rows].clone()


__all__ = ["reduce_ref", "two_level_reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_v",
           "reduce_scatter_v", "all_to_all_v", "broadcast", "gather", "reduce", "scatter"]
