"""Rank bodies for the MoE dispatcher tests: a real SGLang FusedMoE layer on gloo ranks (CPU).

Every rank publishes a ServerArgs (tp = ep = world, ``--moe-a2a-backend none``) and builds SGLang's
own parallel groups (``initialize_model_parallel`` on gloo, pynccl off through the plugin's NCCL-free
switch, since this machine has no NCCL), then a ``FusedMoE`` through SGLang's constructor, so the
dispatcher comes from the plugin's ``create_moe_dispatcher`` hook. Weights, hidden states and routing
are made from fixed seeds: the same global tensors on every rank (SGLang's replicated MoE input); a
rank loads the weights of its own experts. The layer's output is then all-reduced over SGLang's TP
group as the model code does after the experts (``tensor_model_parallel_all_reduce``).
"""

from __future__ import annotations

import torch

E, H, I, K = 8, 32, 48, 2  # experts, hidden, intermediate, top-k


def global_weights(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    return w13, w2


def routing(tokens: int, seed: int, drop: bool):
    """Hidden states [T, H] and a top-K routing: softmax top-2 of random logits, renormalised; expert
    5 never chosen (an empty expert), experts 0 and 1 favoured (uneven); with ``drop`` every 7th
    token's second slot is -1 (no expert)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    logits[:, :2] += 1.0
    logits[:, 5] = float("-inf")
    w, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if drop:
        ids[::7, 1] = -1
    return x, ids, w.to(torch.float32)


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What an FP8 dispatch delivers: per token, scale = amax / 448, rows x * (1 / scale) as
    float8_e4m3fn (the engines' own quantize_fp8), dequantised."""
    from purlin_sglang.moe.routing import quantize_fp8

    q, scale = quantize_fp8(x)
    return (q.float() * scale[:, None]).to(x.dtype)


def _setup(rank: int, world: int):
    import sglang.srt.runtime_context as rc
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="dummy", tp_size=world, ep_size=world, device="cpu", moe_a2a_backend="none")
    rc.publish(sa, role="test", ranks=rc.SpawnRanks(world_rank=rank))
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    ps.initialize_model_parallel(backend="gloo")
    from sglang.srt.layers.moe.utils import initialize_moe_config

    initialize_moe_config()


def _layer(rank: int, world: int, dtype=torch.float32):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    layer = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=I, layer_id=0, top_k=K, params_dtype=dtype)
    w13, w2 = global_weights(dtype)
    lo, hi = rank * E // world, (rank + 1) * E // world
    with torch.no_grad():
        layer.w13_weight.copy_(w13[lo:hi])
        layer.w2_weight.copy_(w2[lo:hi])
    return layer


def _forward(layer, x, ids, w):
    from sglang.srt.distributed import tensor_model_parallel_all_reduce
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    with torch.no_grad():
        out = layer.forward(x, StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=None))
        return tensor_model_parallel_all_reduce(out) if layer.moe_ep_size > 1 else out


CASES = (  # name, tokens, seed, drop, fp8 input
    ("uneven", 240, 1, False, False),
    ("dropped slots", 200, 2, True, False),
    ("fewer tokens than ranks", 3, 3, True, False),
)


def reference_layer(rank: int, world: int) -> dict:
    """One rank, all experts, SGLang's standard dispatcher. A slot of -1 (only ever the second one
    here; SGLang's native CPU forward can take neither -1 nor an expert twice in one token) becomes
    another expert than the first slot's, with weight 0: its contribution 0 * out is exactly 0."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatcher
    from sglang.srt.plugins import load_plugins

    from purlin_sglang.sglang import plugin

    load_plugins()
    _setup(rank, world)
    layer = _layer(rank, world)
    assert type(layer.dispatcher) is StandardDispatcher
    out = {}
    for name, tokens, seed, drop, _ in CASES:
        x, ids, w = routing(tokens, seed, drop)
        for fp8 in (False, True):
            xin = fp8_roundtrip(x) if fp8 else x
            other = ((ids[:, :1] + 1) % E).expand_as(ids)
            safe_ids, safe_w = torch.where(ids < 0, other, ids), torch.where(ids < 0, 0.0, w)
            out[(name, fp8)] = _forward(layer, xin, safe_ids, safe_w)
    assert plugin.active_settings().backend == "nccl"
    return out


def purlin_layer(rank: int, world: int, config_path: str, fp8_config_path: str, none_config_path: str) -> dict:
    """EP over ``world`` ranks, experts through purlin's dispatcher (exact rows, fixed rows, FP8 rows);
    then a layer built with ``moe.dispatcher: none`` (SGLang's standard dispatcher)."""
    from sglang.srt.plugins import load_plugins

    from purlin_sglang.sglang import plugin
    from purlin_sglang.sglang.moe_dispatcher import PurlinMoEDispatcher

    load_plugins()
    plugin.verify_hooks()
    said = _keep_log("purlin_sglang.sglang.moe_dispatcher", "MoE layers dispatch and combine through purlin")
    with plugin.activate("purlin", config_path, nccl_free=True):
        _setup(rank, world)
        layer = _layer(rank, world)
    with plugin.activate("purlin", fp8_config_path, nccl_free=True):
        layer_fp8 = _layer(rank, world)
    assert isinstance(layer.dispatcher, PurlinMoEDispatcher) and isinstance(layer_fp8.dispatcher, PurlinMoEDispatcher)
    assert layer.dispatcher.wire_dtype is None and layer_fp8.dispatcher.wire_dtype is torch.float8_e4m3fn
    out = {}
    for name, tokens, seed, drop, _ in CASES:
        x, ids, w = routing(tokens, seed, drop)
        layer.dispatcher.force_fixed_rows = False
        out[(name, "exact")] = _forward(layer, x, ids, w)
        layer.dispatcher.force_fixed_rows = True
        out[(name, "fixed")] = _forward(layer, x, ids, w)
        out[(name, "fp8")] = _forward(layer_fp8, x, ids, w)
    # a shard larger than moe.max_tokens_per_rank is refused, naming the option; the layer stays usable
    x, ids, w = routing(layer.dispatcher.config.max_tokens_per_rank * world + 1, 9, False)
    try:
        _forward(layer, x, ids, w)
        out["too many"] = None
    except Exception as e:  # noqa: BLE001 - the message is checked by the test
        out["too many"] = f"{type(e).__name__}: {e}"
    x, ids, w = routing(16, 4, False)
    out["after refusal"] = _forward(layer, x, ids, w)
    out["comm"] = repr(layer.dispatcher.comm)
    pc = layer.dispatcher.group.purlin_comm  # the EP group's: its routing report counts the MoE calls
    out["moe counts"] = (pc.routed["moe_dispatch"], pc.routed["moe_combine"])
    out["dispatcher said"] = list(said)
    out["prefill warning"] = _prefill_warning(world)
    with plugin.activate("purlin", none_config_path, nccl_free=True):  # moe.dispatcher none: SGLang's own
        out["dispatcher none"] = type(_layer(rank, world).dispatcher).__name__
    from sglang.srt.distributed.parallel_state import get_moe_ep_group

    get_moe_ep_group().destroy()  # frees its purlin communicator (the MoE dispatcher's; tp is the same group)
    if rank == 0:
        out["serving config"] = _shipped_serving_config()
    return out


def _shipped_serving_config() -> dict:
    """configs/purlin-sglang-moe-nccl-free.yaml parsed by SGLang's own prepare_server_args (plugin loaded),
    as launch_server would, with a model directory that has a config.json."""
    import os
    import tempfile

    from sglang.srt.server_args import prepare_server_args

    from purlin_sglang.sglang import plugin
    from purlin_sglang.sglang.moe_config import moe_settings_of

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as model:
        with open(os.path.join(model, "config.json"), "w") as f:
            f.write("{}")
        cwd = os.getcwd()
        os.chdir(root)
        try:
            sa = prepare_server_args(["--model-path", model, "--load-format", "dummy", "--config",
                                      "configs/purlin-sglang-moe-nccl-free.yaml", "--tp-size", "2", "--ep-size", "2"])
        finally:
            os.chdir(cwd)
    settings = plugin.settings_of(sa)
    moe = moe_settings_of(settings.load_config())
    return {"backend": settings.backend, "nccl_free": settings.nccl_free, "a2a": sa.moe_a2a_backend,
            "purlin_a2a": settings.moe_a2a,
            "ep": sa.ep_size, "chunked": sa.chunked_prefill_size, "moe": (moe.dispatcher, moe.max_tokens_per_rank)}


def _keep_log(name: str, text: str) -> list:
    """The INFO+ messages of logger ``name`` that contain ``text``, collected from now on."""
    import logging

    lines: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            if text in record.getMessage():
                lines.append(record.getMessage())

    log = logging.getLogger(name)
    log.addHandler(Keep(level=logging.INFO))
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    return lines


def _prefill_warning(world: int) -> list:
    """The start-up warning when SGLang's largest prefill batch (here made 1000 tokens) gives shards over
    moe.max_tokens_per_rank (128), said once."""
    import logging
    from unittest import mock

    import sglang.srt.runtime_context as rc

    from purlin_sglang.config import MoESettings
    from purlin_sglang.sglang import moe_dispatcher

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("purlin_sglang.sglang.moe_dispatcher")
    log.addHandler(Keep(level=logging.WARNING))
    with mock.patch.object(rc, "max_prefill_buffer_tokens", lambda: 1000):
        moe_dispatcher._warn_if_prefill_exceeds(MoESettings(max_tokens_per_rank=128), world)
        moe_dispatcher._warn_if_prefill_exceeds(MoESettings(max_tokens_per_rank=128), world)
        moe_dispatcher._warn_if_prefill_exceeds(MoESettings(max_tokens_per_rank=1000), world)  # within: nothing
    return lines
