"""SGLang's real FusedMoE layer with purlin as its MoE dispatcher, on 4 gloo ranks (CPU engine),
against the same layer on one rank with all experts (SGLang's standard dispatcher)."""

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang.srt.layers.moe.fused_moe_triton.layer")

import torch  # noqa: E402

import _moe_workers as W  # noqa: E402

from purlin_sglang.testing import launch  # noqa: E402

WORLD = 4
MAX_TOKENS = 128


def _config(tmp_path, name: str, moe: str) -> str:
    p = tmp_path / name
    p.write_text(f"timeout_s: 30\nstaging_bytes: 1048576\nmoe:\n{moe}")
    return str(p)


@pytest.fixture(scope="module")
def reference():
    return launch(W.reference_layer, 1, timeout_s=180)[0]


def test_fused_moe_through_purlin_matches_one_rank(tmp_path, reference):
    """Uneven routing with an expert no token chooses, slots of -1, a batch smaller than the world (a
    rank with no token): exact rows, fixed rows (capacity mode, padding rows kept out of SGLang's native
    forward) and FP8 rows on the wire, each against the one-rank layer.

    Tolerance: purlin moves rows and sums the top-k in float32 in k order, as SGLang's native forward
    does, so the only difference left is in the experts' float32 GEMMs, which see the same rows but in
    batches of another size (a rank's share of one expert, not every token of it): BLAS may block a
    different row count differently, changing a dot product's summation order (a few ulp; I=48 terms of
    O(1)). Hence atol = rtol = 1e-5; exact rows and fixed rows give the experts the same rows in the
    same order, so those two must agree bitwise, and so must every rank after the all-reduce. FP8: the
    reference gets the FP8 round trip of its input (per-token scale amax / 448), which is what the
    experts receive, so the same tolerance applies."""
    cfg = _config(tmp_path, "moe.yaml", f"  dispatcher: purlin\n  max_tokens_per_rank: {MAX_TOKENS}\n")
    fp8 = _config(tmp_path, "moe-fp8.yaml", f"  dispatcher: purlin\n  max_tokens_per_rank: {MAX_TOKENS}\n  dtype: fp8\n")
    none = _config(tmp_path, "moe-none.yaml", "  dispatcher: none\n")
    got = launch(W.purlin_layer, WORLD, cfg, fp8, none, timeout_s=240)
    bitwise = 0
    for name, tokens, *_ in W.CASES:
        for mode in ("exact", "fixed", "fp8"):
            mine = got[0][(name, mode)]
            assert mine.shape == (tokens, W.H), (name, mode, mine.shape)
            for r in range(1, WORLD):
                assert torch.equal(got[r][(name, mode)], mine), (name, mode, r)
            ref = reference[(name, mode == "fp8")]
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5, msg=f"{name} {mode}")
            bitwise += torch.equal(mine, ref)
        assert torch.equal(got[0][(name, "exact")], got[0][(name, "fixed")]), name
    # FP8 on the wire is not a no-op: the results differ from the unquantised input's
    assert not torch.equal(reference[("uneven", True)], reference[("uneven", False)])
    print(f"bitwise equal to the one-rank layer: {bitwise} of {3 * len(W.CASES)}")
    for f in got:
        assert f["too many"].startswith("PurlinError: purlin MoE dispatcher: a batch of 513 tokens over 4 ranks"), f
        assert "moe.max_tokens_per_rank 128" in f["too many"], f
        assert f["after refusal"].shape == (16, W.H)
        assert "engine=cpu" in f["comm"], f
        # every successful dispatch and combine is in the group's routing report (the refusal is not);
        # the start-up line says purlin dispatches, once per process although two layers were built
        assert f["moe counts"] == (3 * len(W.CASES) + 1,) * 2, f["moe counts"]
        assert len(f["dispatcher said"]) == 2, f["dispatcher said"]  # two configs: activations' dtype, fp8
        assert "engine cpu" in f["dispatcher said"][0] and "float8_e4m3fn" in f["dispatcher said"][1], f
        assert f["dispatcher none"] == "StandardDispatcher", f
        assert len(f["prefill warning"]) == 1 and "shards of 250 tokens per rank, more than " \
            "moe.max_tokens_per_rank 128" in f["prefill warning"][0], f["prefill warning"]
    # the shipped serving config (configs/purlin-sglang-moe-nccl-free.yaml) as SGLang parses it
    assert got[0]["serving config"] == {"backend": "purlin", "nccl_free": True, "a2a": "none", "purlin_a2a": True,
                                        "ep": 2,
                                        "chunked": 2048, "moe": ("purlin", 1024)}, got[0]["serving config"]
    # every rank computed the same layer output after the refusal
    assert all(torch.equal(f["after refusal"], got[0]["after refusal"]) for f in got)


def test_hook_calls_through_without_purlin():
    """The hook leaves SGLang's choice alone unless purlin is the backend and moe.dispatcher is purlin."""
    from purlin_sglang.sglang import moe_hooks, plugin

    calls = []

    def original(*args, **kwargs):
        calls.append(args)
        return "sglang's"

    assert moe_hooks.create_moe_dispatcher(original, "cfg", "qm") == "sglang's"
    with plugin.activate("purlin", None):  # purlin without a config file: no moe section
        assert moe_hooks.create_moe_dispatcher(original, "cfg", "qm") == "sglang's"
    assert calls == [("cfg", "qm"), ("cfg", "qm")]



def test_a_cuda_ep_group_across_nodes_keeps_sglangs_dispatcher_with_the_reason():
    """purlin's MoE exchange across nodes cannot be captured, so a CUDA EP group on several nodes keeps
    SGLang's dispatcher (the hook logs and counts why); one node, or the CPU, keeps purlin's."""
    import types

    from purlin_sglang.multinode.layout import NodeLayout
    from purlin_sglang.sglang import moe_dispatcher, moe_hooks

    def comm(nodes, device):
        return types.SimpleNamespace(layout=NodeLayout(tuple(nodes)), device=torch.device(device))

    why = moe_dispatcher.across_nodes(comm([0, 0, 1, 1], "cuda"))
    assert why is not None and "spans 2 nodes" in why and "eager only" in why
    assert moe_dispatcher.across_nodes(comm([0, 0, 1, 1], "cpu")) is None
    assert moe_dispatcher.across_nodes(comm([0, 0], "cuda")) is None
    assert moe_dispatcher.across_nodes(types.SimpleNamespace(device=torch.device("cuda"))) is None  # one node

    class Refusing:
        def __init__(self, *a, **k):
            raise moe_dispatcher.KeepSGLangDispatcher(why)

    saved = (moe_hooks.purlin_moe_config, moe_dispatcher.why_not, moe_dispatcher.PurlinMoEDispatcher)
    import sglang.srt.layers.moe as sgl_moe

    saved_a2a = sgl_moe.get_moe_a2a_backend
    try:
        moe_hooks.purlin_moe_config = lambda: object()
        moe_dispatcher.why_not = lambda cfg: None
        moe_dispatcher.PurlinMoEDispatcher = Refusing
        sgl_moe.get_moe_a2a_backend = lambda: types.SimpleNamespace(is_none=lambda: True)
        before = moe_hooks.FALLBACKS[why]
        assert moe_hooks.create_moe_dispatcher(lambda *a, **k: "sglang's", "cfg", "qm") == "sglang's"
        assert moe_hooks.FALLBACKS[why] == before + 1
    finally:
        moe_hooks.purlin_moe_config, moe_dispatcher.why_not, moe_dispatcher.PurlinMoEDispatcher = saved
        sgl_moe.get_moe_a2a_backend = saved_a2a
