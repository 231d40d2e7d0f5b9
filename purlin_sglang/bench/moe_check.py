"""Inputs, the stand-in experts and the float64 check of ``bench moe``.

The stand-in expert of global expert g scales its rows by ``s[g] = 1 + (7 g mod 31) / 31 + g / (31 E)``
(an elementwise op: the benchmark times the exchange, not expert GEMMs). The scales are distinct, and
experts 1 or a rank's worth of experts apart differ by at least 7/31, far above the rounding bound
below, so a row delivered to a wrong expert fails the check. Then, exactly, ``y[t] = x[t] * sum_k w[t, k] * s[ids[t, k]]``
over the valid slots: the float64 reference is this closed form. A result passes when every element
is within a bound derived from the roundings on the way (unit roundoff u: bf16 2^-8, e4m3 2^-4): the
expert's output rounded to bf16 (u relative), FP8 on the wire (per-token scale = amax / 448: u_e4m3
relative plus 2^-9 * scale absolute, the subnormal spacing), and the result rounded to bf16 (u
relative to |y|); 10% slack covers the float32 products and accumulation of K terms and the products
of errors.
The torch reference path rounds its partial sums to bf16 instead of each expert output: the same
bound holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
DTYPES = {"bf16": None, "fp8": FP8}


@dataclass
class Inputs:
    x: torch.Tensor  # [T, H] bf16
    ids: torch.Tensor  # [T, K] int32, distinct experts per token, some slots -1 when drop > 0
    w: torch.Tensor  # [T, K] float32 (renormalised softmax)


def make_inputs(tokens: int, hidden: int, topk: int, experts: int, seed: int, device: torch.device,
                drop_every: int = 0) -> Inputs:
    """Random tokens and a random top-k routing (distinct experts per token). Made on the CPU from
    ``seed`` (the same on every machine), then moved."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=g)
    ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(tokens, topk, generator=g), dim=1)
    if drop_every and tokens:
        ids[::drop_every, -1] = -1
    return Inputs(x.to(device), ids.to(device), w.to(device))


def expert_scale(experts: int, device: torch.device) -> torch.Tensor:
    g = torch.arange(experts, dtype=torch.float64)
    return (1.0 + torch.remainder(7 * g, 31) / 31 + g / (31 * experts)).to(torch.float32).to(device)


def run_experts(rows: torch.Tensor, scales_fp8: torch.Tensor | None, local_expert: torch.Tensor, rank: int,
                local: int, s: torch.Tensor, out: torch.Tensor | None = None, chunk: int = 8192) -> torch.Tensor:
    """The stand-in experts on dispatched rows, in bf16: ``rows * (scale * s[g])`` computed in float32
    (FP8 rows: times their dequantisation scale), ``chunk`` rows at a time so the float32 temporary
    stays small. Padding rows (expert -1) give don't-care values."""
    g = (local_expert.to(torch.int64) + rank * local).clamp(min=0)
    f = s[g] if scales_fp8 is None else s[g] * scales_fp8.to(torch.float32)
    out = torch.empty(rows.shape, dtype=torch.bfloat16, device=rows.device) if out is None else out
    for i in range(0, rows.shape[0], chunk):
        out[i:i + chunk] = (rows[i:i + chunk].to(torch.float32) * f[i:i + chunk, None]).to(torch.bfloat16)
    return out


def reference64(inp: Inputs, experts: int) -> torch.Tensor:
    """The exact result in float64 (closed form of dispatch, stand-in experts, combine)."""
    s = expert_scale(experts, torch.device("cpu")).to(torch.float64)  # the float32 values the experts use
    ids = inp.ids.cpu().to(torch.int64)
    w = inp.w.cpu().to(torch.float64)
    valid = ids >= 0
    coef = (w * s[ids.clamp(min=0)] * valid).sum(dim=1, keepdim=True)
    return inp.x.cpu().to(torch.float64) * coef


def bound64(inp: Inputs, experts: int, wire: torch.dtype | None) -> torch.Tensor:
    """Largest allowed |y - reference64| per element (see the module docstring)."""
    s = expert_scale(experts, torch.device("cpu")).to(torch.float64)
    ids = inp.ids.cpu().to(torch.int64)
    w = inp.w.cpu().to(torch.float64).abs()
    x = inp.x.cpu().to(torch.float64).abs()
    terms = (w * s[ids.clamp(min=0)] * (ids >= 0)).sum(dim=1, keepdim=True)
    per_elem = x * 2.0 ** -8
    if wire is FP8:
        scale = (x.amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-30)
        per_elem = x * (2.0 ** -4 + 2.0 ** -8) + scale * 2.0 ** -9
    y = reference64(inp, experts).abs()
    return (terms * per_elem + y * 2.0 ** -8) * 1.1 + 1e-30


def check(y: torch.Tensor, inp: Inputs, experts: int, wire: torch.dtype | None) -> tuple[bool, float, float]:
    """(ok, max |y - ref|, max |y - ref| / bound): y against the float64 reference."""
    if y.shape != inp.x.shape:
        return False, float("inf"), float("inf")
    err = (y.cpu().to(torch.float64) - reference64(inp, experts)).abs()
    if not err.numel():
        return True, 0.0, 0.0
    ratio = err / bound64(inp, experts, wire)
    finite = bool(torch.isfinite(err).all())
    return finite and bool((ratio <= 1).all()), float(err.max()), float(ratio.max())


def max_pair_load(all_ids: list[torch.Tensor], experts: int) -> int:
    """Most rows one source rank sends one expert (the smallest capacity that holds this routing)."""
    most = 0
    for ids in all_ids:
        v = ids.cpu().to(torch.int64).flatten()
        v = v[v >= 0]
        if v.numel():
            most = max(most, int(torch.bincount(v, minlength=experts).max()))
    return most


def wire_bytes(all_ids: list[torch.Tensor], experts: int, world: int, hidden: int,
               wire: torch.dtype | None) -> tuple[int, int]:
    """(dispatch, combine) payload bytes summed over ranks: a token travels once to each distinct rank
    owning one of its experts (FP8: one byte per element plus a float32 scale), and each valid
    (token, slot) row comes back in bf16. Copies to the rank itself are counted (loopback moves them too)."""
    local = experts // world
    d_rows = c_rows = 0
    for ids in all_ids:
        v = ids.cpu().to(torch.int64)
        valid = v >= 0
        c_rows += int(valid.sum())
        dest = torch.where(valid, v // local, -1)
        for t in range(0, dest.shape[0], 4096):  # distinct destination ranks per token
            blk = dest[t:t + 4096]
            hit = torch.zeros(blk.shape[0], world + 1, dtype=torch.bool)
            hit.scatter_(1, blk.clamp(min=-1) % (world + 1), True)
            d_rows += int(hit[:, :world].sum())
    row = hidden * (1 if wire is FP8 else 2) + (4 if wire is FP8 else 0)
    return d_rows * row, c_rows * hidden * 2


REFERENCE_LOOP_LIMIT = 300_000  # tokens * world * topk * experts up to which the loop reference runs


def bitwise_vs_reference(ys: list[torch.Tensor], inputs: list[Inputs], experts: int,
                         wire: torch.dtype | None) -> bool | None:
    """Every rank's result bitwise against purlin_sglang.moe.reference (dispatch, the same stand-in
    experts, combine accumulating in float32: the engines' bitwise contract), exact rows. None when
    the configuration is too large for that loop reference."""
    from ..moe.reference import reference_combine, reference_dispatch

    world = len(inputs)
    t, k = inputs[0].ids.shape
    if t * world * k * experts > REFERENCE_LOOP_LIMIT or any(y is None for y in ys):
        return None
    xs, ids, ws = [i.x.cpu() for i in inputs], [i.ids.cpu() for i in inputs], [i.w.cpu() for i in inputs]
    ds = reference_dispatch(xs, ids, ws, experts, world, dtype=wire)
    s = expert_scale(experts, torch.device("cpu"))
    local = experts // world
    outs = [run_experts(d.x, d.scales, d.expert, q, local, s) for q, d in enumerate(ds)]
    ref = reference_combine(outs, ds, ids, ws, world, accumulate=torch.float32)
    return all(torch.equal(y.cpu(), r) for y, r in zip(ys, ref))
