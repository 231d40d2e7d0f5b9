"""PurlinRoutes' handling of the all-gather MoE exchange's calls, without vLLM: a list of tensors
gathered in one ``all_gatherv``, and ``reduce_scatterv_into_output``, whose CUDA parent reduces straight
into the output (not through ``reduce_scatterv``) and whose CPU parent goes through ``reduce_scatterv``.
Stand-ins for vLLM's classes and for the routed communicator record what ran where."""

from __future__ import annotations

from collections import Counter

import torch

from purlin_sglang.vllm.communicator import PurlinRoutes


class Routed:
    """Serves when ``serve`` is true (the result: the input's first rows), counts the calls."""

    def __init__(self, serve: bool):
        self.serve, self.calls, self.fallbacks, self.disabled = serve, Counter(), Counter(), False

    def all_gather_v(self, inp, sizes):
        self.calls["all_gather_v"] += 1
        return torch.cat([inp] * len(sizes)) if self.serve else None

    def reduce_scatter_v(self, inp, sizes, output=None):
        self.calls["reduce_scatter_v"] += 1
        if not self.serve:
            self.fallbacks[("reduce_scatter_v", "size")] += 1
            return None
        output.copy_(inp[: output.shape[0]])
        return output


class CudaLike:
    """vLLM's CUDA class: reduce_scatterv_into_output does not call reduce_scatterv."""

    def __init__(self):
        self.vllm = Counter()

    def all_gatherv(self, input_, dim=0, sizes=None):
        self.vllm["all_gatherv"] += 1
        return [t.clone() for t in input_] if isinstance(input_, list) else input_.clone()

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        self.vllm["reduce_scatterv"] += 1
        return input_[: sizes[0]].clone()

    def reduce_scatterv_into_output(self, input_, output, dim=-1, sizes=None):
        self.vllm["reduce_scatterv_into_output"] += 1
        output.fill_(-1.0)
        return output


class BaseLike(CudaLike):
    """vLLM's base class (the CPU one inherits it): reduce_scatterv_into_output through reduce_scatterv."""

    def reduce_scatterv_into_output(self, input_, output, dim=-1, sizes=None):
        self.vllm["reduce_scatterv_into_output"] += 1
        output.copy_(self.reduce_scatterv(input_, dim, sizes))
        return output


def routes(parent: type, serve: bool):
    cls = type("Routes", (PurlinRoutes, parent), {})
    comm = cls.__new__(cls)
    parent.__init__(comm)
    comm.purlin, comm._vllm_path = Routed(serve), False
    return comm


def test_a_list_is_gathered_tensor_by_tensor_through_purlin():
    comm = routes(CudaLike, serve=True)
    x, ids = torch.randn(2, 4), torch.arange(6, dtype=torch.int32).view(2, 3)
    got = comm.all_gatherv([x, ids], 0, [2, 2])
    assert isinstance(got, list) and len(got) == 2
    assert torch.equal(got[0], torch.cat([x, x])) and torch.equal(got[1], torch.cat([ids, ids]))
    assert comm.purlin.calls["all_gather_v"] == 2 and not comm.vllm


def test_a_list_purlin_declines_goes_to_vllm_tensor_by_tensor():
    comm = routes(CudaLike, serve=False)
    got = comm.all_gatherv([torch.ones(2, 4), torch.zeros(2, 3)], 0, [2, 2])
    assert [g.shape for g in got] == [(2, 4), (2, 3)] and comm.vllm["all_gatherv"] == 2


def test_reduce_into_output_is_served_by_purlin():
    for parent in (CudaLike, BaseLike):
        comm = routes(parent, serve=True)
        z, out = torch.randn(6, 4), torch.full((2, 4), float("nan"))
        assert comm.reduce_scatterv_into_output(z, out, 0, [2, 4]) is out
        assert torch.equal(out, z[:2]) and comm.purlin.calls["reduce_scatter_v"] == 1 and not comm.vllm


def test_reduce_into_output_purlin_declines_asks_purlin_once():
    # the base class's path re-enters reduce_scatterv: purlin is not asked (nor the decline counted) twice
    for parent, vllm_calls in ((CudaLike, {"reduce_scatterv_into_output": 1}),
                               (BaseLike, {"reduce_scatterv_into_output": 1, "reduce_scatterv": 1})):
        comm = routes(parent, serve=False)
        z, out = torch.randn(6, 4), torch.full((2, 4), float("nan"))
        assert comm.reduce_scatterv_into_output(z, out, 0, [2, 4]) is out
        assert comm.purlin.calls["reduce_scatter_v"] == 1 and comm.purlin.fallbacks[("reduce_scatter_v", "size")] == 1
        assert dict(comm.vllm) == vllm_calls, comm.vllm
        assert not comm._vllm_path  # reset for the next call


def test_a_list_goes_to_vllm_whole_when_purlin_is_disabled():
    comm = routes(CudaLike, serve=False)
    comm.purlin.disabled = True
    got = comm.all_gatherv([torch.ones(2, 4), torch.zeros(2, 3)], 0, [2, 2])
    assert len(got) == 2 and comm.vllm["all_gatherv"] == 1 and not comm.purlin.calls
