"""Run by the vLLM venv's python (tests/vllm/test_vllm_adapter.py): WORLD gloo ranks build vLLM
0.33.0's own groups (init_distributed_environment, initialize_model_parallel under a VllmConfig
whose additional_config is given as JSON), after vLLM's own load_general_plugins() (purlin's entry
point there makes the platform answer purlin's communicator class where additional_config switches
purlin on, unless VLLM_PLUGINS leaves it out), run every
routed collective through vLLM's GroupCoordinator and compare each with the same collective done
by gloo on the group's CPU group (reductions summed in rank order: bitwise). Prints one JSON line: the facts of every rank.

    python tests/vllm/_vllm_job.py WORLD ADDITIONAL_CONFIG_JSON
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def rank_main(rank: int, world: int, extra: dict) -> dict:
    import torch
    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import get_tp_group, init_distributed_environment, initialize_model_parallel
    from vllm.platforms import current_platform

    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM worker does first: purlin's entry point installs its hooks
    with set_current_vllm_config(VllmConfig(additional_config=extra)):
        facts_plugin = current_platform.get_device_communicator_cls()  # as GroupCoordinator asks it
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{os.environ['PURLIN_TEST_PORT']}")
        initialize_model_parallel(tensor_model_parallel_size=world)
        g = get_tp_group()
    comm = g.device_communicator
    gen = torch.Generator().manual_seed(1000 + rank)
    facts: dict = {"class": type(comm).__name__, "purlin": getattr(comm, "purlin", None) is not None,
                   "platform_answers": facts_plugin, "checks": {}}

    def check(name, got, want, exact):
        # (callers compute ``want`` first: vLLM's own all_reduce on the CPU reduces its input in place);
        # bitwise where purlin serves (its rank order), close where vLLM's own path runs (gloo's order)
        exact = exact and facts["purlin"]
        ok = got.shape == want.shape and (torch.equal(got, want) if exact else
                                          torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
        facts["checks"][name] = bool(ok)

    def gloo_all_reduce(x):
        """Every rank's x moved by gloo, summed in rank order (16-bit floats in float32): purlin's
        order, so purlin's results compare bitwise."""
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=g.cpu_group)
        acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        acc = parts[0].to(acc_dtype)
        for p in parts[1:]:
            acc = acc + p.to(acc_dtype)
        return acc.to(x.dtype)

    def gloo_all_gather(x, dim):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=g.cpu_group)
        return torch.cat(parts, dim=dim)

    def gloo_all_gather_v(x, sizes):  # gloo gathers equal shapes: pad to the largest, then cut
        n = max(sizes)
        padded = torch.zeros((n,) + tuple(x.shape[1:]), dtype=x.dtype)
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=g.cpu_group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)], 0)

    for dtype, exact in ((torch.float32, True), (torch.bfloat16, True), (torch.int64, True)):
        name = str(dtype).replace("torch.", "")
        x = (torch.randn(6, 8, generator=gen) * 4).to(dtype)
        want = gloo_all_reduce(x)
        check(f"all_reduce/{name}", g.all_reduce(x.clone()), want, exact)
    x = torch.randn(4, 6, generator=gen)
    for dim in (0, -1):
        check(f"all_gather/dim{dim}", g.all_gather(x, dim), gloo_all_gather(x, dim), True)
    y = torch.randn(2 * world, 3 * world, generator=gen)
    for dim in (0, -1):
        d = dim % y.dim()
        full = gloo_all_reduce(y)  # before vLLM's call, which might reduce in place
        # vLLM's convention (DeviceCommunicatorBase.reduce_scatter): the chunks of y.movedim(0, d) along dim 0
        want = full.movedim(0, d).contiguous().chunk(world, 0)[rank].movedim(0, d).contiguous()
        check(f"reduce_scatter/dim{dim}", g.reduce_scatter(y, dim), want, True)
    sizes = [r + 1 for r in range(world)]
    xv = torch.randn(sizes[rank], 5, generator=gen)
    zv = torch.randn(sum(sizes), 5, generator=gen)
    lo = sum(sizes[:rank])
    facts["vllm_lacks"] = []
    for name, call, want in (
            ("all_gatherv", lambda: g.all_gatherv(xv, 0, sizes), gloo_all_gather_v(xv, sizes)),
            ("reduce_scatterv", lambda: g.reduce_scatterv(zv.clone(), 0, sizes), gloo_all_reduce(zv)[lo:lo + sizes[rank]])):
        try:
            check(name, call(), want, True)
        except NotImplementedError:  # vLLM's CPU communicator has no V forms; purlin serves them
            facts["vllm_lacks"].append(name)
    # the all-gather MoE exchange's two calls (DP > 1): several tensors gathered in one call (hidden
    # states, weights, ids), and a reduce straight into a given output
    iv = torch.randint(0, 9, (sizes[rank], 2), generator=gen, dtype=torch.int32)
    zo = torch.randn(sum(sizes), 5, generator=gen)
    want_x, want_i = gloo_all_gather_v(xv, sizes), gloo_all_gather_v(iv, sizes)
    try:
        got = g.all_gatherv([xv, iv], 0, sizes)
        check("all_gatherv/list/0", got[0], want_x, True)
        check("all_gatherv/list/1", got[1], want_i, True)
    except NotImplementedError:
        facts["vllm_lacks"].append("all_gatherv/list")
    want = gloo_all_reduce(zo)[lo:lo + sizes[rank]]
    out = torch.full((sizes[rank], 5), float("nan"))
    try:
        ret = g.reduce_scatterv_into_output(zo.clone(), out, 0, sizes)
        check("reduce_scatterv_into_output", out, want, True)
        facts["checks"]["reduce_scatterv_into_output/returns_output"] = ret is out
    except NotImplementedError:
        facts["vllm_lacks"].append("reduce_scatterv_into_output")
    big = torch.randn(64, 1024, generator=gen)  # 256 KiB: above the routing limit the tests configure
    # (a call purlin declines runs vLLM's own path, whose order is gloo's: close, not bitwise)
    want = gloo_all_reduce(big)
    check("all_reduce/big", g.all_reduce(big.clone()), want, False)
    if facts["purlin"]:
        facts["routed"] = dict(comm.purlin.routed)
        facts["fallbacks"] = {f"{op}/{why}": n for (op, why), n in comm.purlin.fallbacks.items()}
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    return facts


def main(body=None) -> int:
    """Run ``body`` (default :func:`rank_main`) on ``argv[1]`` gloo ranks with the JSON ``argv[2]``; print the
    ranks' results as one ``RESULT`` line (the other vLLM jobs call this too)."""
    body = body or rank_main
    world, extra = int(sys.argv[1]), json.loads(sys.argv[2])
    import socket

    from purlin_sglang.testing import launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = launch(body, world, extra, timeout_s=300, env={"PURLIN_TEST_PORT": str(port),
                                                              "VLLM_TARGET_DEVICE": "cpu"})
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
