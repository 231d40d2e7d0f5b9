"""The FP8 wire format of a dispatch, pinned against an independent float32 computation in numpy:
scale = amax / 448 (1 for an all-zero row), q = e4m3(x * (1 / scale)), every step rounded to nearest
in float32. The CUDA kernel computes the same steps (__fdiv_rn, __frcp_rn, __fmul_rn) and the GPU
tests compare its rows with these bitwise."""
from __future__ import annotations

import numpy as np
import torch

from purlin_sglang.moe.reference import reference_dispatch
from purlin_sglang.moe.routing import quantize_fp8

FP8 = torch.float8_e4m3fn


def _numpy_fp8(x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    xf = x.to(torch.float32).numpy()
    amax = np.abs(xf).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    inv = (np.float32(1.0) / scale).astype(np.float32)
    prod = (xf * inv[:, None]).astype(np.float32)
    return torch.from_numpy(prod).to(FP8), scale


def _rows(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 512, generator=g) * torch.rand(64, 1, generator=g) * 40).to(dtype)
    x[3] = 0  # an all-zero row: scale 1
    x[5, 7] = -1e4  # a negative spike sets the amax
    return x


def test_rows_are_the_input_times_the_inverse_scale():
    for seed, dtype in ((1, torch.bfloat16), (2, torch.float16), (3, torch.float32)):
        x = _rows(seed, dtype)
        q, scale = quantize_fp8(x)
        want_q, want_scale = _numpy_fp8(x)
        assert q.dtype == FP8 and scale.dtype == torch.float32
        assert torch.equal(scale, torch.from_numpy(want_scale))
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert float(scale[3]) == 1.0 and not q[3].float().any()
        assert float(q[5, 7].float()) == -448.0


def test_the_multiplication_is_what_the_rows_hold_not_a_division():
    """Where x / scale and x * (1 / scale) round to different FP8 values (they do for some elements of
    a few thousand rows), the rows hold the product's."""
    x = torch.cat([_rows(seed, torch.bfloat16) for seed in range(4, 40)])
    q, scale = quantize_fp8(x)
    xf = x.to(torch.float32)
    by_division = (xf / scale[:, None]).to(FP8).view(torch.uint8)
    by_product = (xf * (torch.ones_like(scale) / scale)[:, None]).to(FP8).view(torch.uint8)
    differ = by_division != by_product
    assert differ.any(), "no element tells the two definitions apart: widen the sample"
    assert torch.equal(q.view(torch.uint8)[differ], by_product[differ])


def test_the_reference_dispatch_quantises_the_same_way():
    x = _rows(41, torch.bfloat16)[:8]
    ids = torch.tensor([[0, 1]] * 8)
    (d,) = reference_dispatch([x], [ids], [torch.ones(8, 2)], num_experts=2, world=1, dtype=FP8)
    q, scale = quantize_fp8(x)
    for row in range(d.x.shape[0]):
        t = int(d.src_slot[row]) // 2
        assert torch.equal(d.x[row].view(torch.uint8), q[t].view(torch.uint8))
        assert float(d.scales[row]) == float(scale[t])
