"""A CUDA group on two simulated nodes: four processes on one GPU (``topology.node_of_rank`` [0, 0, 1, 1]),
the CUDA engine over CUDA IPC inside each node, gloo between the nodes (NCCL refuses several ranks on
one GPU; gloo copies CUDA tensors through host memory). Every two-level collective is compared
bitwise with the same call on a CPU communicator of the same layout (the CPU engine inside each
node), on fresh random inputs with poisoned outputs. Time-sliced processes: few calls."""

from __future__ import annotations

import pytest
import torch

from purlin_sglang.testing import launch

pytestmark = pytest.mark.gpu
ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "CUDA_MODULE_LOADING": "EAGER"}
NODES = [0, 0, 1, 1]


def _x(seed, rank, rows, dtype):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(rows, 5, generator=g).to(dtype)


def _worker(rank, world):
    import purlin_sglang as ps

    torch.cuda.set_device(0)
    topo = {"node_of_rank": NODES, "inter_node": "gloo"}
    cuda = ps.Communicator(None, "cuda:0", config={"staging_bytes": 1 << 20, "timeout_s": 60, "topology": topo})
    cpu = ps.Communicator(None, "cpu", config={"staging_bytes": 1 << 20, "timeout_s": 60, "topology": topo})
    sizes = [2, 0, 3, 1]
    splits = [[1, 0, 2, 1], [0, 1, 1, 0], [2, 2, 0, 1], [1, 0, 0, 3]]
    calls = {
        "all_reduce": lambda c, x: c.all_reduce(x),
        "all_reduce_max": lambda c, x: c.all_reduce(x, "max"),
        "all_gather": lambda c, x: c.all_gather(x),
        "reduce_scatter": lambda c, x: c.reduce_scatter(torch.cat([x] * world)),
        "all_gather_v": lambda c, x: c.all_gather_v(x[:sizes[rank]].contiguous(), sizes),
        "reduce_scatter_v": lambda c, x: c.reduce_scatter_v(torch.cat([x, x])[:sum(sizes)].contiguous(), sizes),
        "all_to_all_v": lambda c, x: c.all_to_all_v(torch.cat([x, x])[:sum(splits[rank])].contiguous(),
                                                    splits[rank], [splits[p][rank] for p in range(world)]),
    }
    bad = []
    for i, (name, call) in enumerate(calls.items()):
        for dtype in (torch.float32, torch.bfloat16):
            x = _x(i, rank, 4, dtype)
            want = call(cpu, x)
            out = torch.full_like(want, float("nan"), device="cuda:0")  # poisoned
            got = call(cuda, x.cuda())
            out.copy_(got)
            torch.cuda.synchronize()
            if not torch.equal(out.cpu().view(torch.uint8) if out.numel() else out.cpu(),
                               want.view(torch.uint8) if want.numel() else want):
                bad.append((name, str(dtype)))
    # the MoE exchange (eager): the same routing on both, dispatch rows and combine bitwise equal
    g = torch.Generator().manual_seed(7 + rank)
    t, experts = 5, 8
    x = torch.randn(t, 16, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, experts, (t, 3), generator=g)
    w = torch.rand(t, 3, generator=g)
    for dtype in (None, torch.float8_e4m3fn):
        dc = cpu.moe_dispatch(x, ids, w, num_experts=experts, dtype=dtype)
        dg = cuda.moe_dispatch(x.cuda(), ids.cuda(), w.cuda(), num_experts=experts, dtype=dtype)
        same = all(torch.equal(getattr(dg, f).cpu().view(torch.uint8) if getattr(dg, f).dtype.is_floating_point
                               else getattr(dg, f).cpu(),
                               getattr(dc, f).view(torch.uint8) if getattr(dc, f).dtype.is_floating_point
                               else getattr(dc, f)) for f in ("x", "expert", "counts", "src_rank", "src_slot"))
        eo = (dc.x.float() * 1.5).to(torch.bfloat16)
        yc = cpu.moe_combine(eo, dc)
        yg = cuda.moe_combine(eo.cuda(), dg)
        if not (same and torch.equal(yg.cpu().view(torch.uint8), yc.view(torch.uint8))):
            bad.append(("moe", str(dtype)))
    b = _x(99, rank, 3, torch.float32).cuda()
    cuda.broadcast(b, 2)
    if not torch.equal(b.cpu(), _x(99, 2, 3, torch.float32)):
        bad.append(("broadcast", "float32"))
    info = (type(cuda).__name__, cuda.engine_name)
    cuda.close()
    cpu.close()
    return bad, info


def test_two_simulated_nodes_on_one_gpu_equal_the_cpu_engine_bitwise():
    res = launch(_worker, 4, timeout_s=600, env=ENV)
    for bad, info in res:
        assert info == ("MultiNodeCommunicator", "cuda+gloo"), info
        assert bad == [], bad
