"""Rank functions of tests/routed (spawned by purlin_sglang.testing.launch: importable by name)."""

from __future__ import annotations

import torch


def rows(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + 100 * rank


def convention(rank: int, world: int, deterministic: bool) -> dict:
    """RoutedCommunicator on a plain gloo group, no framework: routes, declines, counts, reports."""
    import torch.distributed as dist

    from purlin_sglang.routed import PluginConfig, RoutedCommunicator

    cfg = PluginConfig.from_dict({"staging_bytes": 1 << 20, "routing": {
        "all_reduce": {"max_bytes": 1024}, "all_gather": {"max_bytes": 64}}})
    rc = RoutedCommunicator(dist.group.WORLD, "cpu", cfg, name="t", deterministic=deterministic)
    x = rows(rank, 4)
    assert torch.equal(rc.all_reduce(x), sum(rows(r, 4) for r in range(world)))
    big = rc.all_reduce(rows(rank, 128))                                   # 1.5 KiB: above max_bytes
    served_big = big is not None
    if served_big:
        assert torch.equal(big, sum(rows(r, 128) for r in range(world)))
    assert rc.all_gather(torch.empty((world * 4, 3)), x) is None            # above all_gather's max_bytes
    with rc.bypass():
        assert rc.all_reduce(x) is None                                    # declines, counts nothing
    facts = {"served_big": served_big, "summary": rc.summary(),
             "fallbacks": {f"{op}/{why}": n for (op, why), n in rc.fallbacks.items()}}
    rc.destroy()
    assert rc.disabled and rc.all_reduce(x) is None
    return facts
