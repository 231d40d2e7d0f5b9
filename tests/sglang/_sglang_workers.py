"""Rank bodies for the SGLang plugin tests (top level, so that launch() can spawn them)."""

from __future__ import annotations

import torch

GC_FLAGS = dict(use_pynccl=False, use_mscclpp=False, use_custom_allreduce=True,
                use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False, use_xpu_communicator=False)


def _coordinator(world: int, rank: int):
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator([list(range(world))], rank, "gloo", group_name="tp", **GC_FLAGS)


def _rows(rank: int, rows: int, cols: int = 3, dtype=torch.float32) -> torch.Tensor:
    """Deterministic per-rank data (small integers: sums are exact), so any rank can build a reference."""
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(-8, 8, (rows, cols), generator=g).to(dtype)


def routed_collectives(rank: int, world: int, config_path: str) -> dict:
    """purlin on: every routed GroupCoordinator op runs on purlin and matches the original path / a reference."""
    from sglang.srt.plugins import load_plugins

    from purlin_sglang.sglang import plugin

    load_plugins()
    plugin.verify_hooks()
    with plugin.activate("purlin", config_path):
        g = _coordinator(world, rank)
    pc = g.purlin_comm
    assert pc is not None and not pc.disabled and pc.world_size == world
    assert g.ca_comm is None and g.use_custom_allreduce is False  # turned off by the plugin
    facts = {}
    x = _rows(rank, 4 * world)

    # all-reduce: resolution names purlin; out-of-place ("purlin" and "auto") and in-place.
    assert g._resolve_outplace_all_reduce_method(x) == "purlin"
    with pc.bypass():
        ref = x.clone()
        g._all_reduce_in_place(ref)  # the original path: torch.distributed on the gloo group
        assert g._resolve_outplace_all_reduce_method(x) is None
    out = g._all_reduce_out_place(x, "purlin")
    out_auto = g._all_reduce_out_place(x, "auto")
    y = x.clone()
    g._all_reduce_in_place(y)
    for got in (out, out_auto, y):
        assert torch.equal(got, ref), (got, ref)
    assert torch.equal(ref, sum(_rows(r, 4 * world) for r in range(world)))
    xb = x.to(torch.bfloat16)
    with pc.bypass():
        refb = xb.clone()
        g._all_reduce_in_place(refb)
    assert torch.equal(g._all_reduce_out_place(xb, "purlin"), refb)

    # all-gather (all_gather_into_tensor), also into a flat output
    ag = torch.empty((world * x.shape[0], x.shape[1]))
    g._all_gather_into_tensor(ag, x)
    with pc.bypass():
        ag_ref = torch.empty_like(ag)
        g._all_gather_into_tensor(ag_ref, x)
    assert torch.equal(ag, ag_ref)
    assert torch.equal(ag, torch.cat([_rows(r, 4 * world) for r in range(world)]))
    flat = torch.empty(ag.numel())
    g._all_gather_into_tensor(flat, x)
    assert torch.equal(flat, ag.reshape(-1))

    # reduce-scatter (reduce_scatter_tensor): gloo has no reduce_scatter, so against the reference
    rs = torch.empty((x.shape[0] // world, x.shape[1]))
    assert g._reduce_scatter_tensor(rs, x) is rs
    full = sum(_rows(r, 4 * world) for r in range(world))
    assert torch.equal(rs, full.chunk(world)[rank])

    # all_to_all_single (equal splits)
    a2a = torch.empty_like(x)
    g._all_to_all_single(a2a, x)
    expect = torch.cat([_rows(p, 4 * world).chunk(world)[rank] for p in range(world)])
    assert torch.equal(a2a, expect)

    # V forms (the original paths need pynccl, absent on CPU: against the reference)
    sizes = [r + 1 for r in range(world)]
    mine = _rows(rank, sizes[rank])
    gv = g.all_gatherv(mine, sizes=sizes)
    assert isinstance(gv, list) and len(gv) == 1
    assert torch.equal(gv[0], torch.cat([_rows(r, sizes[r]) for r in range(world)]))
    gv_out = torch.empty((sum(sizes), 3))
    g.all_gatherv(mine, sizes=sizes, output=gv_out)
    assert torch.equal(gv_out, gv[0])
    two = g.all_gatherv([mine, mine * 2], sizes=sizes)
    assert torch.equal(two[1], gv[0] * 2)
    big = _rows(rank, sum(sizes))
    rsv = g.reduce_scatterv(big, sizes=sizes)
    start = sum(sizes[:rank])
    assert torch.equal(rsv, sum(_rows(r, sum(sizes)) for r in range(world))[start:start + sizes[rank]])

    facts["routed"] = dict(pc.routed)
    facts["fallbacks"] = {f"{op}/{why}": n for (op, why), n in pc.fallbacks.items()}
    facts["summary"] = pc.summary()
    g.destroy()
    assert g.purlin_comm is None and pc.disabled
    return facts


def fallback_paths(rank: int, world: int, config_path: str) -> dict:
    """Ineligible calls (size, dtype, layout, disabled op) run the original path and are counted."""
    from sglang.srt.plugins import load_plugins

    from purlin_sglang.sglang import plugin

    load_plugins()
    with plugin.activate("purlin", config_path):  # the config caps all_reduce at 64 bytes, no all_gather
        g = _coordinator(world, rank)
    pc = g.purlin_comm
    small = _rows(rank, 2, 2)                       # 16 bytes: purlin
    large = _rows(rank, 64)                         # 768 bytes: too large, NCCL's path
    ints = _rows(rank, 2, 2).to(torch.uint8)        # purlin does not reduce uint8
    strided = _rows(rank, 4, 4)[:, ::2]             # not contiguous
    assert g._resolve_outplace_all_reduce_method(small) == "purlin"
    assert g._resolve_outplace_all_reduce_method(large) is None
    for t in (small, large, ints, strided):
        got = g._all_reduce_out_place(t, "auto")
        ref = sum(_rows(r, *t.shape if t.is_contiguous() else (4, 4)).to(t.dtype) for r in range(world))
        ref = ref if t.is_contiguous() else ref[:, ::2]
        assert torch.equal(got, ref), (t.dtype, got, ref)
    ag = torch.empty((world * 2, 2))
    g._all_gather_into_tensor(ag, small)            # all_gather disabled in the routing table
    assert torch.equal(ag, torch.cat([_rows(r, 2, 2) for r in range(world)]))
    facts = {"routed": dict(pc.routed), "fallbacks": {f"{op}/{why}": n for (op, why), n in pc.fallbacks.items()}}
    g.destroy()
    return facts


def nccl_unchanged(rank: int, world: int) -> dict:
    """Default backend: no purlin communicator; the hooked methods call straight through."""
    from sglang.srt.plugins import load_plugins

    from purlin_sglang.sglang import plugin

    load_plugins()
    assert plugin.active_settings().backend == "nccl"
    g = _coordinator(world, rank)
    assert g.purlin_comm is None
    x = _rows(rank, 2 * world)
    assert g._resolve_outplace_all_reduce_method(x) is None
    out = g._all_reduce_out_place(x, "auto")
    ag = torch.empty((world * x.shape[0], x.shape[1]))
    g._all_gather_into_tensor(ag, x)
    assert torch.equal(out, sum(_rows(r, 2 * world) for r in range(world)))
    assert torch.equal(ag, torch.cat([_rows(r, 2 * world) for r in range(world)]))
    g.destroy()
    return {"ok": True}


def group_not_covered(rank: int, world: int) -> bool:
    """A group outside the routing table's ``groups`` gets no purlin communicator."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.plugins import load_plugins

    from purlin_sglang.sglang import plugin

    load_plugins()
    with plugin.activate("purlin"):
        g = GroupCoordinator([list(range(world))], rank, "gloo", group_name="pp", **GC_FLAGS)
    assert g.purlin_comm is None and g.ca_comm is None
    g.destroy()
    return True


def communicator_alone(rank: int, world: int) -> dict:
    """PurlinGroupCommunicator on a plain gloo group, without SGLang."""
    import torch.distributed as dist

    from purlin_sglang.sglang.communicator import PurlinGroupCommunicator
    from purlin_sglang.sglang.routing import PluginConfig

    cfg = PluginConfig.from_dict({"staging_bytes": 1 << 20, "routing": {"all_reduce": {"max_bytes": 1024}}})
    pc = PurlinGroupCommunicator(dist.group.WORLD, "cpu", cfg, name="t")
    x = _rows(rank, 4)
    assert pc.should_all_reduce(x) and torch.equal(pc.all_reduce(x), sum(_rows(r, 4) for r in range(world)))
    assert pc.all_reduce(_rows(rank, 128)) is None                       # above max_bytes
    out = torch.empty((world * 4, 3))
    assert pc.all_gather(out, x) is out
    assert pc.all_gather(torch.empty(5), x) is None                       # wrong output size
    with pc.bypass():
        assert pc.all_reduce(x) is None
    facts = {"fallbacks": {f"{op}/{why}": n for (op, why), n in pc.fallbacks.items()}, "summary": pc.summary()}
    pc.destroy()
    pc.destroy()
    assert pc.disabled and pc.all_reduce(x) is None
    return facts
