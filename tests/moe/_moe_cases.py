"""Random MoE routings and the checks shared by the CPU and GPU MoE tests.

A case is per-rank inputs (x, topk_ids, topk_weights) with uneven token counts (some ranks 0),
ids of -1, experts nobody routes to, and tokens that name the same expert twice. ``check_rank``
runs one rank's dispatch -> synthetic experts -> combine on a communicator and returns what the
parent compares with :mod:`purlin_sglang.moe.reference`.
"""

from __future__ import annotations

import torch

from purlin_sglang.moe.reference import reference_combine, reference_dispatch

FP8 = torch.float8_e4m3fn


def make_case(world: int, num_experts: int, topk: int, hidden: int, dtype: torch.dtype, seed: int,
              max_tokens: int = 9, empty_rank: bool = True, dup: bool = True, fixed_tokens: bool = False):
    g = torch.Generator().manual_seed(seed)
    toks = [int(torch.randint(0, max_tokens + 1, (1,), generator=g)) for _ in range(world)]
    if fixed_tokens:  # graph replays: static shapes
        toks = [max_tokens] * world
    if empty_rank and world > 1 and not fixed_tokens:
        toks[seed % world] = 0
    # experts in the upper half of rank 0's range are never routed to (empty experts)
    local = num_experts // world
    allowed = [e for e in range(num_experts) if not (e < local and e >= (local + 1) // 2)] or list(range(num_experts))
    allowed_t = torch.tensor(allowed)
    xs, ids, ws = [], [], []
    for t in toks:
        xs.append((torch.randn(t, hidden, generator=g) * 3).to(dtype))
        pick = allowed_t[torch.randint(0, len(allowed), (t, topk), generator=g)]
        pick[torch.rand(t, topk, generator=g) < 0.15] = -1
        if dup and t and topk > 1:
            pick[0, 1] = pick[0, 0]  # one token names the same expert twice
        ids.append(pick.to(torch.int32 if seed % 2 else torch.int64))
        ws.append(torch.rand(t, topk, generator=g).to(torch.float32 if seed % 3 else torch.bfloat16))
    return xs, ids, ws


def expert_fn(d_x: torch.Tensor, expert: torch.Tensor, scales, out_dtype: torch.dtype) -> torch.Tensor:
    """A deterministic stand-in for the experts: (x * scale) * (1 + e / 8) + e, poison on padding rows."""
    xf = d_x.to(torch.float32)
    if scales is not None:
        xf = xf * scales[:, None]
    e = expert.to(torch.float32)[:, None]
    out = (xf * (1 + e / 8) + e).to(out_dtype)
    return torch.where(expert[:, None] < 0, float("nan"), out)  # padding rows must be ignored (capturable)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.numel() else t.reshape(-1).view(torch.uint8)


def run_rank(comm, xs, ids, ws, num_experts, capacity=None, dtype=None, out_dtype=None, barrier=None):
    """``barrier`` (CUDA loopback): inputs are copied and the stream synchronized before any rank calls,
    and results are read after every rank finished (no host copies while peers' kernels wait)."""
    r = comm.rank
    dev = comm.device
    x, i, w = xs[r].to(dev), ids[r].to(dev), ws[r].to(dev)
    if barrier is not None:
        comm.synchronize()
        barrier.wait()
    d = comm.moe_dispatch(x, i, w, num_experts=num_experts, capacity=capacity, dtype=dtype)
    out = expert_fn(d.x, d.expert, d.scales, out_dtype or xs[r].dtype)
    y = comm.moe_combine(out, d)
    if barrier is not None:
        comm.synchronize()
        barrier.wait()
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in dict(
        x=d.x, expert=d.expert, counts=d.counts, scales=d.scales, src_rank=d.src_rank, src_slot=d.src_slot,
        out=out, y=y).items()}


def check_results(results, xs, ids, ws, num_experts, capacity=None, dtype=None):
    """Compare every rank's dispatch (valid rows bitwise) and combine (bitwise with the float32
    k-order reference, and close to the float64 one) with the reference."""
    world = len(results)
    ref = reference_dispatch(xs, ids, ws, num_experts, world, capacity=capacity, dtype=dtype)
    for q, (got, want) in enumerate(zip(results, ref)):
        assert got["x"].shape == want.x.shape, (q, got["x"].shape, want.x.shape)
        for f in ("expert", "counts", "src_rank", "src_slot"):
            assert torch.equal(got[f].to(want.__dict__[f].dtype), want.__dict__[f]), (q, f, got[f], want.__dict__[f])
        valid = want.expert >= 0
        assert torch.equal(bits(got["x"][valid]), bits(want.x[valid])), (q, "x")
        if dtype == FP8:
            assert torch.equal(bits(got["scales"][valid]), bits(want.scales[valid])), (q, "scales")
        else:
            assert got["scales"] is None
    outs = [r["out"] for r in results]
    y32 = reference_combine(outs, ref, ids, ws, world)
    y64 = reference_combine(outs, ref, ids, ws, world, accumulate=torch.float64)
    for q in range(world):
        got = results[q]["y"]
        assert got.shape == y32[q].shape and got.dtype == outs[q].dtype
        assert torch.equal(bits(got), bits(y32[q])), (q, got, y32[q])
        tol = 1e-5 if got.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.to(torch.float64), y64[q].to(torch.float64), rtol=tol, atol=tol)
