"""SGLang GroupCoordinators with CUDA tensors routed through purlin's CUDA engine (ipc provider).

Two processes on ONE GPU, each building a real SGLang ``GroupCoordinator`` the way tests/sglang
do (gloo groups; pynccl, custom AR, mscclpp and symm-mem off: NCCL cannot put two ranks on one
GPU) with ``--comm-backend purlin`` in effect. Every op goes through SGLang's own GroupCoordinator
method (its custom ops included): all_reduce (out of place and in place), all_gather_into_tensor,
reduce_scatter_tensor, all_gatherv, reduce_scatterv, all_to_all_single; each result is compared
bitwise with a CPU reference computed with torch from every rank's inputs (sums in rank order,
16-bit types accumulated in float32, as purlin does), and the routed counters show that purlin
served every call. Then SGLang's ``graph_capture`` with purlin's capture nested inside: two eager
warm-ups, a captured CUDA graph replayed with new inputs, and a call that was not warmed up
declined while capturing. Processes on one GPU time-slice (a few ms a round trip): counts are tiny.
"""

from __future__ import annotations

import os

import pytest
import torch

from purlin_sglang.testing import launch


def _sglang_problem() -> str:
    if not torch.cuda.is_available():
        return ""  # the gpu marker skips it (tests/conftest.py)
    try:
        import sglang.srt.distributed.parallel_state  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the skip reason
        return f"{type(e).__name__}: {e}"
    return ""


_SGLANG = _sglang_problem()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(_SGLANG), reason=f"needs sglang==0.5.23 importable ({_SGLANG})"),
]
ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "CUDA_MODULE_LOADING": "EAGER"}
GC_FLAGS = dict(use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False,
                use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False, use_xpu_communicator=False)
STAGING = 1 << 20


def _data(seed: int, rank: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _sum(xs: list) -> torch.Tensor:
    """purlin's reduction: rank order, 16-bit types accumulated in float32."""
    acc = xs[0].float() if xs[0].element_size() < 4 else xs[0].clone()
    for x in xs[1:]:
        acc = acc + (x.float() if x.element_size() < 4 else x)
    return acc.to(xs[0].dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _worker(rank: int, world: int, config_path: str, seed: int, replays: int) -> dict:
    torch.cuda.set_device(0)
    import sglang.srt.distributed.parallel_state as ps
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.plugins import load_plugins

    from purlin_sglang.sglang import plugin

    load_plugins()
    plugin.verify_hooks()
    with plugin.activate("purlin", config_path):
        g = GroupCoordinator([list(range(world))], 0, "gloo", group_name="tp", **GC_FLAGS)  # local_rank 0: cuda:0
    pc = g.purlin_comm
    dev = g.device
    info = {"device": str(dev), "engine": pc.engine, "memory": pc._comm.memory, "hbm": pc._comm.hbm_bytes,
            "bad": []}

    def inputs(tag: int, shape: tuple, dtype=torch.float32, rows=None) -> list:
        return [_data(seed + tag, r, ((rows[r],) + shape[1:]) if rows else shape, dtype) for r in range(world)]

    def check(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype or got.device != dev:
            info["bad"].append(f"rank {rank} {label}: got {tuple(got.shape)} {got.dtype} on {got.device}, "
                               f"want {tuple(want.shape)} {want.dtype} on {dev}")
        elif not torch.equal(_bits(got), _bits(want)):
            info["bad"].append(f"rank {rank} {label}: values differ from the CPU reference")

    # all_reduce, out of place: SGLang resolves "purlin", then its outplace_all_reduce custom op
    for tag, shape, dtype in ((1, (8, 33), torch.float32), (2, (4, 256), torch.bfloat16)):
        xs = inputs(tag, shape, dtype)
        x = xs[rank].to(dev)
        y = g.all_reduce(x)
        check(f"all_reduce {dtype}", y, _sum(xs))
        check(f"all_reduce {dtype} input kept", x, xs[rank])
    # all_reduce in place: SGLang's inplace_all_reduce custom op
    xs = inputs(3, (5, 17), torch.bfloat16)
    x = xs[rank].to(dev)
    ps.inplace_all_reduce(x, group_name=g.unique_name)
    check("all_reduce in place", x, _sum(xs))
    # all_gather_into_tensor
    xs = inputs(4, (3, 5))
    out = torch.full((world * 3, 5), float("nan"), device=dev)
    g.all_gather_into_tensor(out, xs[rank].to(dev))
    check("all_gather_into_tensor", out, torch.cat(xs))
    # reduce_scatter_tensor
    xs = inputs(5, (4 * world, 64), torch.bfloat16)
    out = torch.full((4, 64), float("nan"), dtype=torch.bfloat16, device=dev)
    g.reduce_scatter_tensor(out, xs[rank].to(dev))
    check("reduce_scatter_tensor", out, _sum(xs).chunk(world)[rank])
    # all_gatherv: per-rank sizes, a new output and a given one
    sizes = [r + 2 for r in range(world)]
    xs = inputs(6, (0, 7), rows=sizes)
    got = g.all_gatherv(xs[rank].to(dev), sizes=sizes)
    check("all_gatherv", got[0], torch.cat(xs))
    given = torch.full((sum(sizes), 7), float("nan"), device=dev)
    g.all_gatherv(xs[rank].to(dev), sizes=sizes, output=given)
    check("all_gatherv output=", given, torch.cat(xs))
    # reduce_scatterv: rank r receives sizes[r] rows of the sum
    sizes = [2 * r + 1 for r in range(world)]
    xs = inputs(7, (sum(sizes), 9))
    got = g.reduce_scatterv(xs[rank].to(dev), sizes=sizes)
    start = sum(sizes[:rank])
    check("reduce_scatterv", got, _sum(xs)[start:start + sizes[rank]])
    # all_to_all_single (equal splits)
    xs = inputs(8, (2 * world, 6))
    out = torch.full((2 * world, 6), float("nan"), device=dev)
    g.all_to_all_single(out, xs[rank].to(dev))
    check("all_to_all_single", out, torch.cat([xs[p].chunk(world)[rank] for p in range(world)]))
    torch.cuda.synchronize()
    info["eager_routed"] = dict(pc.routed)

    # CUDA graph: SGLang's graph_capture (outer) enters purlin's capture (inner)
    x_static = torch.empty((16, 64), dtype=torch.bfloat16, device=dev)
    a_static = torch.empty((3, 5), device=dev)
    ag_out = torch.empty((world * 3, 5), device=dev)
    never_warm = torch.zeros((7, 3), device=dev)

    def fill(i: int) -> tuple:
        xs, as_ = inputs(100 + 2 * i, (16, 64), torch.bfloat16), inputs(101 + 2 * i, (3, 5))
        x_static.copy_(xs[rank])
        a_static.copy_(as_[rank])
        return xs, as_

    fill(-1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with g.graph_capture() as gctx:
        info["depth_inside"] = pc._capture_depth
        for _ in range(2):  # SGLang's runner: two eager runs of the shape, inside graph_capture
            g.all_reduce(x_static)
            g.all_gather_into_tensor(ag_out, a_static)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=gctx.stream):
            y_static = g.all_reduce(x_static)
            g.all_gather_into_tensor(ag_out, a_static)
            info["declined_not_warm"] = not pc.should_all_reduce(never_warm)  # asked only: no fallback runs
            info["resolve_not_warm"] = g._resolve_outplace_all_reduce_method(never_warm)
    info["depth_after"] = pc._capture_depth
    for i in range(replays):
        xs, as_ = fill(i)
        y_static.fill_(float("nan"))
        ag_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(f"replay {i} all_reduce", y_static, _sum(xs))
        check(f"replay {i} all_gather_into_tensor", ag_out, torch.cat(as_))
    info["routed"] = dict(pc.routed)
    info["captured"] = dict(pc.captured)
    info["fallbacks"] = {f"{op}/{why}": n for (op, why), n in pc.fallbacks.items()}
    info["summary"] = pc.summary()
    del graph
    g.destroy()  # the plugin's BEFORE hook: a barrier on the CPU group, then Communicator.close()
    info["destroyed"] = g.purlin_comm is None and pc.disabled and pc._comm is None
    return info


def test_sglang_groups_route_cuda_tensors_through_purlin(tmp_path):
    seed = int.from_bytes(os.urandom(3), "little")
    cfg = tmp_path / "purlin.yaml"
    cfg.write_text(f"memory: ipc\nstaging_bytes: {STAGING}\ntimeout_s: 30\n")
    results = launch(_worker, 2, str(cfg), seed, 2, timeout_s=300, env=ENV)
    eager = {"all_reduce": 3, "all_gather": 1, "reduce_scatter": 1, "all_gather_v": 2, "reduce_scatter_v": 1,
             "all_to_all": 1}
    for rank, info in enumerate(results):
        assert info["bad"] == [], f"seed {seed}:\n" + "\n".join(info["bad"])
        assert info["device"] == "cuda:0" and info["engine"] == "cuda" and info["memory"] == "ipc", info
        assert info["hbm"] > STAGING, info
        assert info["eager_routed"] == eager, info
        assert info["depth_inside"] == 1 and info["depth_after"] == 0, info
        # two warm-ups + the captured call of each; the captured ones counted as such
        assert info["routed"] == {**eager, "all_reduce": 3 + 3, "all_gather": 1 + 3}, info
        assert info["captured"] == {"all_reduce": 1, "all_gather": 1}, info
        assert info["declined_not_warm"] is True and info["resolve_not_warm"] is None, info
        assert info["fallbacks"] == {"all_reduce/not warmed up": 1}, info
        assert info["destroyed"] is True, info
