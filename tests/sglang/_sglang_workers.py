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
    facts["communicator"] = type(pc.communicator).__name__
    g.destroy()
    assert g.purlin_comm is None and pc.disabled
    return facts


def spanning_group_kept_on_sglang(rank: int, world: int, config_path: str) -> dict:
    """A group on two (simulated) nodes that purlin may not join (topology.inter_node off): the group
    keeps SGLang's own path, with the reason logged and counted; its collectives still work."""
    import logging

    from sglang.srt.plugins import load_plugins

    from purlin_sglang.sglang import plugin

    load_plugins()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("purlin_sglang").addHandler(handler)
    try:
        with plugin.activate("purlin", config_path):
            g = _coordinator(world, rank)
    finally:
        logging.getLogger("purlin_sglang").removeHandler(handler)
    pc = g.purlin_comm
    x = _rows(rank, 4)
    y = x.clone()
    g._all_reduce_in_place(y)  # SGLang's own path (torch.distributed on the gloo group)
    facts = {"disabled": pc.disabled, "unavailable": pc.unavailable,
             "fallbacks": {f"{op}/{why}": n for (op, why), n in pc.fallbacks.items()},
             "all_reduce_ok": torch.equal(y, sum(_rows(r, 4) for r in range(world))),
             "logged": [m for m in records if "spans 2 nodes" in m]}
    g.destroy()
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
    from purlin_sglang.routed import PluginConfig

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


def communicator_deterministic(rank: int, world: int) -> dict:
    """Under SGLANG_ENABLE_DETERMINISTIC_INFERENCE=1 (what --enable-deterministic-inference sets) the
    reduce ops stay on purlin at every size; the other ops keep their thresholds."""
    import os

    import torch.distributed as dist

    from purlin_sglang.sglang.communicator import PurlinGroupCommunicator
    from purlin_sglang.routed import PluginConfig

    os.environ["SGLANG_ENABLE_DETERMINISTIC_INFERENCE"] = "1"
    cfg = PluginConfig.from_dict({"staging_bytes": 1 << 20, "routing": {
        "all_reduce": {"max_bytes": 1024}, "reduce_scatter": {"min_bytes": 1 << 20}, "all_gather": {"max_bytes": 64},
        "reduce_scatter_v": {"enabled": False}}})
    pc = PurlinGroupCommunicator(dist.group.WORLD, "cpu", cfg, name="det")
    big = torch.randn(256, 8, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16)
    got_big = pc.all_reduce(big)                                   # 4 KiB: above the configured max_bytes
    assert got_big is not None
    alone = pc.all_reduce(big[:1].clone())                         # the same row alone: bitwise the same
    assert alone is not None and torch.equal(alone[0].view(torch.int16), got_big[0].view(torch.int16))
    out = torch.empty((2, 8), dtype=torch.bfloat16)
    assert pc.reduce_scatter(out, big[: 2 * world].clone()) is out   # below the configured min_bytes
    whole = pc.all_reduce(big[: 2 * world].clone())               # reduce_scatter == a slice of all_reduce
    assert torch.equal(out.view(torch.int16), whole[2 * rank: 2 * rank + 2].view(torch.int16))
    assert pc.all_gather(torch.empty((world * 4, 8), dtype=torch.bfloat16), big[:4].clone()) is None  # still bounded
    facts = {"fallbacks": {f"{op}/{why}": n for (op, why), n in pc.fallbacks.items()},
             "reduce_scatter_v": pc.routing.route("reduce_scatter_v").enabled}
    pc.destroy()
    return facts


# -- SGLang's competing all-reduce paths (conflicts.py) ------------------------------------------
CONFLICT_LEAVES = {"disable_custom_all_reduce": False, "enable_mscclpp": True, "enable_torch_symm_mem": True,
                   "flashinfer_allreduce_fusion_backend": "trtllm"}
CONFLICT_FLAGS = ("_ENABLE_CUSTOM_ALL_REDUCE", "_ENABLE_MSCCLPP", "_ENABLE_TORCH_SYMM_MEM_ALL_REDUCE",
                  "_ENABLE_FLASHINFER_ALLREDUCE_ONLY")


def publish_server_args_for_test(**fields):
    """Publish a ServerArgs in this process as a scheduler does before it builds its groups, but
    without the derived leaves (they import model configs, which need torchvision: not in the CPU
    install). Underscore names are set on the record (as from_cli_args does for the plugin)."""
    from unittest import mock

    import sglang.srt.runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="dummy", **{k: v for k, v in fields.items() if not k.startswith("_")})
    for k, v in fields.items():
        if k.startswith("_"):
            setattr(sa, k, v)
    with mock.patch.object(rc, "_install_derived_leaves", lambda tops, server_args: None):
        rc.get_context().set_server_args(sa)
    return sa


class _Lines:
    """A logging handler that keeps the messages of the purlin_sglang loggers."""

    def __init__(self):
        import logging

        self.lines = []
        outer = self

        class H(logging.Handler):
            def emit(self, record):
                outer.lines.append((record.levelname, record.getMessage()))

        self.handler = H(level=logging.INFO)
        log = logging.getLogger("purlin_sglang")
        log.addHandler(self.handler)
        log.setLevel(logging.INFO)


def conflicting_paths(rank: int, world: int, backend: str, config_path: str) -> dict:
    """Every competing path on (leaves published, flags set as bootstrap._set_all_reduce_flags would);
    then the worker's own groups are built, the published record deciding the backend (no activate())."""
    import sglang.srt.distributed.parallel_state as ps
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_context, get_exec

    load_plugins()
    logs = _Lines()
    publish_server_args_for_test(**CONFLICT_LEAVES, enable_symm_mem=True, _purlin_comm_backend=backend,
                                 _purlin_config_path=config_path)
    # what bootstrap._set_all_reduce_flags() sets from these leaves (that module is not importable here)
    ps.set_custom_all_reduce(True)
    ps.set_mscclpp(True)
    ps.set_torch_symm_mem_all_reduce(True)
    ps.set_flashinfer_allreduce_only(True)
    g = _coordinator(world, rank)
    after_first = list(logs.lines)
    g2 = GroupCoordinator([list(range(world))], rank, "gloo", group_name="attention_tp", **GC_FLAGS)
    comm = get_exec().comm
    facts = {
        "leaves": {k: getattr(comm, k) for k in CONFLICT_LEAVES},
        "flags": {f: getattr(ps, f) for f in CONFLICT_FLAGS},
        "purlin": [x.purlin_comm is not None for x in (g, g2)],
        "ca": [x.ca_comm is not None for x in (g, g2)],
        "after_first": after_first,
        "lines": list(logs.lines),
        "override_sources": [src for src, _ in get_context().overrides_log()],
    }
    if backend == "purlin":  # SGLang's own reader of the fusion setting (layers/flashinfer_comm_fusion.py)
        from sglang.srt.layers.flashinfer_comm_fusion import resolve_flashinfer_allreduce_fusion_backend

        facts["fusion_backend"] = resolve_flashinfer_allreduce_fusion_backend()
    g.destroy()
    g2.destroy()
    return facts


# -- CUDA-graph capture logic, on the CPU engine ---------------------------------------------------
def capture_paths(rank: int, world: int, config_path: str) -> dict:
    """graph_capture nesting and the warm-up rule. The CPU has no CUDA graphs, so two stand-ins:
    ``pc.is_capturing`` (the stream-capture predicate) is a flag the test sets, and SGLang's own
    ``GroupCoordinator.graph_capture`` (which needs CUDA) is replaced by a recording context; the
    hook function around it is the plugin's real one."""
    import contextlib

    from sglang.srt.plugins import load_plugins

    from purlin_sglang.routed import communicator as routed_communicator
    from purlin_sglang.sglang import hooks, plugin

    load_plugins()
    with plugin.activate("purlin", config_path):
        g = _coordinator(world, rank)
    pc = g.purlin_comm
    capturing = {"on": False}
    pc.is_capturing = lambda: capturing["on"]  # fake stream-capture predicate
    events = []
    real_capture = pc._comm.capture

    @contextlib.contextmanager
    def spy_capture():  # the purlin Communicator's capture(), recorded
        with real_capture():
            events.append("purlin enter")
            try:
                yield
            finally:
                events.append("purlin exit")

    pc._comm.capture = spy_capture

    @contextlib.contextmanager
    def fake_sglang_graph_capture(self, *args, **kwargs):  # stands in for GroupCoordinator.graph_capture
        events.append("sglang enter")
        try:
            yield "sglang-context"
        finally:
            events.append("sglang exit")

    def sglang_all_reduce(t):  # GroupCoordinator.all_reduce's GPU branch, in order
        method = g._resolve_outplace_all_reduce_method(t)
        if method is not None:
            return g._all_reduce_out_place(t, method)
        t = t.clone()
        g._all_reduce_in_place(t)
        return t

    def full(rows, cols=3):
        return sum(_rows(r, rows, cols) for r in range(world))

    x, y = _rows(rank, 2 * world), _rows(rank, 3 * world)  # y is never warmed up
    sizes, other = [r + 1 for r in range(world)], [r + 2 for r in range(world)]
    mine, big = _rows(rank, sizes[rank]), _rows(rank, sum(sizes))
    checks = {}

    def ops():  # each op once, on the shapes SGLang's runner would warm up and then capture
        checks.setdefault("all_reduce", []).append(torch.equal(sglang_all_reduce(x), full(2 * world)))
        ag = torch.empty((world * x.shape[0], 3))
        g._all_gather_into_tensor(ag, x)
        checks.setdefault("all_gather", []).append(torch.equal(ag, torch.cat([_rows(r, 2 * world) for r in range(world)])))
        rs = torch.empty((2, 3))
        g._reduce_scatter_tensor(rs, x)
        checks.setdefault("reduce_scatter", []).append(torch.equal(rs, full(2 * world).chunk(world)[rank]))
        a2a = torch.empty_like(x)
        g._all_to_all_single(a2a, x)
        want = torch.cat([_rows(p, 2 * world).chunk(world)[rank] for p in range(world)])
        checks.setdefault("all_to_all", []).append(torch.equal(a2a, want))
        gv = g.all_gatherv(mine, sizes=sizes)[0]
        checks.setdefault("all_gather_v", []).append(torch.equal(gv, torch.cat([_rows(r, sizes[r]) for r in range(world)])))
        rsv = g.reduce_scatterv(big, sizes=sizes)
        start = sum(sizes[:rank])
        checks.setdefault("reduce_scatter_v", []).append(torch.equal(rsv, full(sum(sizes))[start:start + sizes[rank]]))

    with hooks.graph_capture(fake_sglang_graph_capture, g) as ctx:
        events.append("body")
        depth_inside = pc._capture_depth
        for _ in range(2):  # SGLang's warm-up runs: eager, inside graph_capture
            ops()
        capturing["on"] = True  # torch.cuda.graph(...) begins
        ops()
        # not warmed up: these run SGLang's original path (gloo here); the rest are only asked
        not_warm = {"all_reduce": torch.equal(sglang_all_reduce(y), full(3 * world))}
        ag = torch.empty((world * y.shape[0], 3))
        g._all_gather_into_tensor(ag, y)
        not_warm["all_gather"] = torch.equal(ag, torch.cat([_rows(r, 3 * world) for r in range(world)]))
        not_warm["resolve"] = g._resolve_outplace_all_reduce_method(y)
        not_warm["reduce_scatter"] = pc.should_reduce_scatter(torch.empty((3, 3)), y)
        not_warm["all_to_all"] = pc.should_all_to_all(torch.empty_like(y), y)
        not_warm["all_gather_v"] = pc.why_not_all_gather_v(_rows(rank, other[rank]), other)
        capturing["on"] = False
    after = {"depth": pc._capture_depth, "ctx": ctx}
    try:  # an error inside the body unwinds both contexts
        with hooks.graph_capture(fake_sglang_graph_capture, g):
            raise KeyError("inside")
    except KeyError:
        after["error_depth"] = pc._capture_depth
    # least recently used keys are forgotten beyond WARM_KEYS (then such a call falls back: safe)
    saved, routed_communicator.WARM_KEYS = routed_communicator.WARM_KEYS, 2
    try:
        for rows in (1, 2, 3):
            pc.all_reduce(_rows(rank, rows))
        after["warm_lru"] = [pc.is_warm(pc.all_reduce_key(_rows(rank, r))) for r in (1, 2, 3)]
    finally:
        routed_communicator.WARM_KEYS = saved
    facts = {"events": events, "depth_inside": depth_inside, "after": after, "checks": checks, "not_warm": not_warm,
             "routed": dict(pc.routed), "captured": dict(pc.captured),
             "fallbacks": {f"{op}/{why}": n for (op, why), n in pc.fallbacks.items()}, "summary": pc.summary()}
    g.destroy()
    return facts


def nccl_free_groups(rank: int, world: int, config_path: str) -> dict:
    """--purlin-nccl-free: gloo backend answered for cuda, pynccl / custom AR off whatever SGLang asks, and the
    V forms (which need pynccl in SGLang) served by purlin; with nccl the same group runs SGLang's own paths."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.plugins import load_plugins

    from purlin_sglang.sglang import plugin

    load_plugins()
    asked = dict(GC_FLAGS, use_pynccl=True, use_custom_allreduce=True)
    facts = {"backend_default": ps.get_default_distributed_backend("cuda")}
    sizes = [r + 1 for r in range(world)]
    x = _rows(rank, sizes[rank])
    with plugin.activate("nccl", None, nccl_free=True):
        facts["backend_nccl_free"] = ps.get_default_distributed_backend("cuda")
        facts["backend_cpu"] = ps.get_default_distributed_backend("cpu")
        ref = GroupCoordinator([list(range(world))], rank, "gloo", group_name="tp", **asked)
    facts["ref"] = dict(use_pynccl=ref.use_pynccl, ca=ref.use_custom_allreduce, purlin=ref.purlin_comm is not None)
    try:
        ref.all_gatherv(x, sizes=sizes)
        facts["ref_gatherv"] = "ran"
    except Exception as e:  # noqa: BLE001 - SGLang's all_gatherv needs pynccl
        facts["ref_gatherv"] = type(e).__name__
    with plugin.activate("purlin", config_path, nccl_free=True):
        g = GroupCoordinator([list(range(world))], rank, "gloo", group_name="tp", **asked)
    facts["purlin"] = dict(use_pynccl=g.use_pynccl, ca=g.use_custom_allreduce, purlin=g.purlin_comm is not None)
    got = g.all_gatherv(x, sizes=sizes)
    facts["gatherv_ok"] = torch.equal(got[0], torch.cat([_rows(r, sizes[r]) for r in range(world)]))
    full = sum(_rows(r, sum(sizes)) for r in range(world))
    rs = g.reduce_scatterv(_rows(rank, sum(sizes)), sizes=sizes)
    facts["scatterv_ok"] = torch.equal(rs, full.split(sizes)[rank])
    facts["routed"] = dict(g.purlin_comm.routed)
    for c in (g, ref):
        c.destroy()
    return facts
