"""One benchmark case: a collective at one size, its buffers, its call and its torch reference.

Buffers are 1-D (dim 0 = elements). Sliced payloads are rounded to a multiple of
``world * (16 bytes / element size)`` elements so that every rank's slice is 16-byte aligned;
the bytes actually moved are what is reported. V forms use equal splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REDUCING = ("all_reduce", "reduce_scatter", "reduce_scatter_v")
ROOT = 0


@dataclass(frozen=True)
class Case:
    """Shapes of one (collective, size, world): element counts of a rank's input and output."""

    collective: str
    nominal: int      # requested bytes
    world: int
    in_numel: int
    out_numel: int
    elsize: int

    @property
    def nbytes(self) -> int:
        """Bytes in the nccl-tests sense: the output for all_gather, otherwise the per-rank input."""
        if self.collective in ("all_gather", "all_gather_v"):
            return self.out_numel * self.elsize
        return self.in_numel * self.elsize

    @property
    def reduces(self) -> bool:
        return self.collective in REDUCING


def make_case(collective: str, nbytes: int, world: int, dtype: torch.dtype) -> Case:
    e = torch.empty((), dtype=dtype).element_size()
    unit = max(1, 16 // e)
    want = max(1, nbytes // e)

    def rounded(m: int) -> int:
        return max(m, (want // m) * m)

    if collective in ("all_gather", "all_gather_v"):
        total = rounded(world * unit)
        return Case(collective, nbytes, world, total // world, total, e)
    if collective in ("reduce_scatter", "reduce_scatter_v"):
        n = rounded(world * unit)
        return Case(collective, nbytes, world, n, n // world, e)
    if collective in ("all_to_all", "all_to_all_v", "all_reduce"):
        n = rounded(world * unit)
        return Case(collective, nbytes, world, n, n, e)
    if collective == "broadcast":
        n = rounded(unit)
        return Case(collective, nbytes, world, n, n, e)
    raise ValueError(f"bench: unknown collective {collective!r}")


def fresh_input(case: Case, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Random normal data (never zeros), reproducible from ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(case.in_numel, dtype=dtype, device=device, generator=gen)


def purlin_call(comm, case: Case, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One purlin_sglang call of ``case`` into ``out`` (reductions sum; broadcast from rank 0)."""
    n, name = case.world, case.collective
    if name == "broadcast":
        return comm.broadcast(x, root=ROOT, out=out)
    if name == "all_gather_v":
        return comm.all_gather_v(x, [case.in_numel] * n, out=out)
    if name == "reduce_scatter_v":
        return comm.reduce_scatter_v(x, [case.out_numel] * n, out=out)
    if name == "all_to_all_v":
        splits = [case.in_numel // n] * n
        return comm.all_to_all_v(x, splits, splits, out=out)
    return getattr(comm, name)(x, out=out)


def reference(case: Case, xs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What rank ``rank`` must receive, from every rank's input (purlin_sglang.reference: sums in rank
    order, 16-bit floats accumulated in float32). V forms use equal splits."""
    from .. import reference as R

    n, name = case.world, case.collective
    if name == "broadcast":
        return R.broadcast(xs, rank, ROOT)
    if name in ("reduce_scatter", "reduce_scatter_v"):
        return R.reduce_scatter(xs, rank)
    if name in ("all_to_all", "all_to_all_v"):
        return R.all_to_all(xs, rank)
    if name in ("all_reduce", "all_gather", "all_gather_v"):
        return getattr(R, name)(xs, rank)
    raise ValueError(f"bench: unknown collective {name!r}")


def abs_scale(case: Case, xs: list[torch.Tensor], rank: int) -> torch.Tensor | None:
    """For reductions, the sum of |contributions| each output element gets (f32); None for copies."""
    if not case.reduces:
        return None
    n = case.world
    if case.collective == "all_reduce":
        parts = xs
    else:
        parts = [x.chunk(n)[rank] for x in xs]
    acc = parts[0].float().abs()
    for p in parts[1:]:
        acc.add_(p.float().abs())
    return acc


def compare(case: Case, got: torch.Tensor, want: torch.Tensor,
            scale: torch.Tensor | None = None) -> tuple[bool, bool, float]:
    """(correct, bitwise exact, max abs error).

    Copies must be exact. A sum may differ from the reference (f32, rank order) by what any
    summation order can round: ``world * eps * sum|x|`` per element (``scale`` from abs_scale).
    """
    if got.shape != want.shape:
        return False, False, float("inf")
    exact = bool(torch.equal(got, want))
    if exact:
        return True, True, 0.0
    diff = (got.float() - want.float()).abs()
    err = float(diff.max()) if diff.numel() else 0.0
    if not case.reduces or scale is None:
        return False, False, err
    eps = torch.finfo(want.dtype).eps
    tol = case.world * eps * scale + torch.finfo(want.dtype).tiny
    return bool((diff <= tol).all()), False, err


def check(case: Case, got: torch.Tensor, xs: list[torch.Tensor], rank: int) -> tuple[bool, bool, float]:
    """Compare rank ``rank``'s output with the reference computed from every rank's input ``xs``."""
    want = reference(case, xs, rank)
    return compare(case, got, want, abs_scale(case, xs, rank))
