"""purlin's MoE dispatch / combine as vLLM 0.33.0's expert-parallel exchange under FusedMoE.

With TP-only expert parallelism (``--enable-expert-parallel``, DP 1) vLLM gives every modular MoE
kernel a ``MoEPrepareAndFinalizeNoDPEPModular``: every rank runs all tokens through its own experts
(``expert_map`` drops the others) and the runner's TP all-reduce sums the partial outputs.
:func:`maybe_replace` (called by the ``moe_kernel`` hook, :mod:`.hooks`) puts a
:class:`PurlinPrepareAndFinalize` in its place when the run's ``additional_config`` has
``purlin: {moe: {dispatcher: purlin}}`` and the layer qualifies (:func:`why_not`); a layer it does
not serve keeps vLLM's, logged once with the reason. :data:`REPORT` counts both.

The contract is the SGLang dispatcher's (``purlin_sglang.sglang.moe_dispatcher``): the layer's
input is the same on every rank of the EP group; rank r dispatches only its shard of the tokens
(the r-th of W near-equal contiguous slices, ``torch.tensor_split`` order); purlin moves each routed
token once to every rank owning one of its top-k experts; the experts run on the rows received;
the combine sums each token's top-k outputs with its router weights (float32, k order) on its source
rank; ``finalize`` writes that rank's shard of ``output`` and zeros elsewhere, and
``output_is_reduced()`` is False, so the runner's TP all-reduce completes it exactly (x + 0 = x).

What the experts see (DeepEP high-throughput's convention, so ``expert_map`` keeps working): one
row per (token, top-k slot) routed here, grouped by local expert; ``topk_ids`` [R, 1] the row's
GLOBAL expert id, padding rows (fixed rows only) given the first expert of the next rank, which
``expert_map`` maps to -1; ``topk_weights`` [R, 1] = 1 (the router weights are applied by the
combine; with one slot of weight 1 every vLLM top-k weight-and-reduce is the identity, so finalize
takes the experts' output as is). Rows travel in the activations' dtype and are quantised after
the exchange with vLLM's own ``_quantize_input`` (per-token and static scales give what vLLM's
path gives; a dynamic per-tensor scale is taken over the rows received).

Rows: exact on CPU; on CUDA a fixed ``moe.max_tokens_per_rank`` rows per (source rank, local
expert), no host synchronisation, so the layer is capturable in vLLM's CUDA graphs
(``force_fixed_rows`` forces either). One dispatch at a time per layer (no DBO, no async).
Imports vLLM.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
    MoEPrepareAndFinalizeNoDPEPModular,
    _quantize_input,
)

from ..config import MoESettings
from ..errors import PurlinError, PurlinValueError
from ..moe.limits import default_capacity, largest_shard, token_excess, token_shard
from .settings import moe_on, plugin_config

logger = logging.getLogger(__name__)

REPORT: Counter = Counter()  # "replaced" / "kept: <reason>" -> MoE kernels built in this process
_said: set = set()


def why_not(moe_config: Any, fused_experts: Any, vllm_config: Any = None) -> Optional[str]:
    """Why purlin cannot be this layer's exchange (None: it can). The same on every rank."""
    p = moe_config.moe_parallel_config
    if not p.use_ep or p.ep_size <= 1:
        return "expert parallelism is off (--enable-expert-parallel with TP > 1)"
    if p.dp_size != 1 or p.pcp_size != 1 or p.sp_size > 1:
        return (f"DP {p.dp_size}, PCP {p.pcp_size}, SP {p.sp_size}: purlin serves TP-only expert parallelism "
                "(with DP > 1 the communicator serves vLLM's all_gatherv / reduce_scatterv exchange where "
                "routing.groups names its group, e.g. dp)")
    if p.enable_eplb or moe_config.num_logical_experts != moe_config.num_experts:
        return "EPLB / redundant experts move experts between ranks"
    if moe_config.num_experts % p.ep_size or moe_config.num_local_experts != moe_config.num_experts // p.ep_size:
        return f"{moe_config.num_experts} experts do not split evenly over {p.ep_size} ranks"
    if fused_experts.activation_format() != mk.FusedMoEActivationFormat.Standard:
        return f"{type(fused_experts).__name__} takes batched activations"
    if moe_config.is_lora_enabled:
        return "LoRA on the experts (its adapters read the layer's own tokens)"
    if getattr(moe_config, "use_deferred_moe_finalize", False):
        return "the layer defers its top-k reduction to its consumer"
    placement = getattr(getattr(vllm_config, "parallel_config", None), "expert_placement_strategy", "linear")
    if placement != "linear":
        return f"expert placement {placement!r} (purlin's ranks own contiguous experts: use 'linear')"
    return None


def maybe_replace(prepare_finalize: Any, fused_experts: Any) -> Any:
    """The prepare/finalize a ``FusedMoEKernel`` gets: purlin's where purlin's MoE is on, the given one
    is exactly ``MoEPrepareAndFinalizeNoDPEPModular`` and :func:`why_not` finds nothing; otherwise the
    given one. Collective where it replaces (the first layer may build the EP group's communicator)."""
    if type(prepare_finalize) is not MoEPrepareAndFinalizeNoDPEPModular:
        return prepare_finalize
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    config = plugin_config(vllm_config)
    if not moe_on(config):
        return prepare_finalize
    why = why_not(fused_experts.moe_config, fused_experts, vllm_config)
    if why is not None:
        REPORT[f"kept: {why}"] += 1
        if why not in _said:
            _said.add(why)
            logger.info("purlin_sglang: MoE layers keep vLLM's prepare/finalize: %s", why)
        return prepare_finalize
    pf = PurlinPrepareAndFinalize.for_layer(fused_experts.moe_config, config.purlin.moe)
    REPORT["replaced"] += 1
    if "replaced" not in _said:
        _said.add("replaced")
        logger.info("purlin_sglang: MoE layers dispatch and combine through purlin: EP rank %d of %d (engine %s, "
                    "%s rows)", pf.ep_rank, pf.ep_size, pf.comm.engine_name,
                    "fixed" if pf.comm.device.type == "cuda" else "exact")
    return pf


@dataclass
class _Pending:
    """One dispatch's state until its finalize."""

    d: Any  # MoEDispatch
    tokens: int
    lo: int
    hi: int


class PurlinPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's modular prepare/finalize over purlin's ``moe_dispatch`` / ``moe_combine`` (module doc).

    ``comm``: the purlin :class:`~purlin_sglang.Communicator` of the EP group, rank ``ep_rank`` of
    ``ep_size``; ``served(op)``: counts each call in the group's routing report (or None).
    ``calls`` counts this object's dispatches and combines. ``prepare`` and ``finalize`` are
    collective over the EP group and alternate (a second prepare before the finalize raises)."""

    def __init__(self, comm: Any, settings: MoESettings, *, ep_rank: int, ep_size: int, num_experts: int,
                 served: Any = None):
        super().__init__()
        if comm.world_size != ep_size or comm.rank != ep_rank:
            raise PurlinError(f"purlin MoE prepare/finalize: the EP communicator is rank {comm.rank} of "
                              f"{comm.world_size}, vLLM says rank {ep_rank} of {ep_size}")
        self.comm = comm
        self.settings = settings
        self.ep_rank, self.ep_size, self.num_experts = ep_rank, ep_size, num_experts
        self.local = num_experts // ep_size
        self.offset = ep_rank * self.local
        self.pad_expert = (self.offset + self.local) % num_experts  # another rank's: expert_map gives -1
        self.force_fixed_rows: Optional[bool] = None
        self.calls: Counter = Counter()
        self._served = served
        self._pending: Optional[_Pending] = None
        self._checked_map: Optional[torch.Tensor] = None

    @classmethod
    def for_layer(cls, moe_config: Any, settings: MoESettings) -> "PurlinPrepareAndFinalize":
        """The prepare/finalize of one layer, on the EP group's purlin communicator (collective the first
        time: it may be built here, see :meth:`.communicator.PurlinRoutes.moe_communicator`)."""
        from vllm.distributed import get_ep_group

        p = moe_config.moe_parallel_config
        group = get_ep_group()
        comm = group.device_communicator
        if not hasattr(comm, "moe_communicator"):
            raise PurlinError(f"purlin MoE prepare/finalize: the EP group's communicator is "
                              f"{type(comm).__name__}, not purlin's; load purlin's vLLM plugin (VLLM_PLUGINS)")
        return cls(comm.moe_communicator(), settings, ep_rank=p.ep_rank, ep_size=p.ep_size,
                   num_experts=moe_config.num_experts, served=comm.note_moe)

    # -- vLLM's prepare/finalize interface --------------------------------------------------------
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return None

    def num_dispatchers(self) -> int:
        return 1

    def output_is_reduced(self) -> bool:
        """False: ``output`` holds this rank's shard of the tokens (zeros elsewhere); the runner's TP
        all-reduce completes it."""
        return False

    def fixed_rows(self, device: torch.device) -> bool:
        return self.force_fixed_rows if self.force_fixed_rows is not None else device.type == "cuda"

    def shard(self, tokens: int) -> tuple[int, int]:
        """This rank's token rows [lo, hi) of a replicated batch of ``tokens`` (tensor_split order)."""
        return token_shard(tokens, self.ep_size, self.ep_rank)

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: Optional[torch.Tensor], apply_router_weight_on_input: bool, quant_config: Any,
                defer_input_quant: bool = False) -> mk.PrepareResultType:
        """Dispatch this rank's shard; return the rows received, their scales, None, their global expert
        ids [R, 1] and weights of 1 [R, 1]. Collective."""
        if self._pending is not None:
            raise PurlinError("purlin MoE prepare: called twice without a finalize (DBO / two-batch overlap is "
                              "not supported); run without --enable-dbo")
        if num_experts != self.num_experts:
            raise PurlinValueError(f"purlin MoE prepare: {num_experts} global experts, the layer was built for "
                                   f"{self.num_experts}")
        self._check_map(expert_map)
        weights = topk_weights
        if apply_router_weight_on_input:  # as vLLM's own prepare: weights on the input, topk 1
            if topk_ids.size(1) != 1:
                raise PurlinValueError("purlin MoE prepare: apply_router_weight_on_input needs top-k 1, got "
                                       f"{topk_ids.size(1)}")
            a1 = a1 * topk_weights.to(a1.dtype)
            weights = torch.ones_like(topk_weights)
        tokens = a1.shape[0]
        lo, hi = self.shard(tokens)
        largest = largest_shard(tokens, self.ep_size)
        excess = token_excess(self.settings, largest) if self.comm.engine_name == "cuda" else ""
        if excess:
            raise PurlinError(f"purlin MoE prepare: a batch of {tokens} tokens over {self.ep_size} ranks gives "
                              f"shards of up to {largest} tokens, {excess}; raise it in additional_config.purlin.moe "
                              "or lower --max-num-batched-tokens")
        capacity = default_capacity(self.settings) if self.fixed_rows(a1.device) else None
        d = self.comm.moe_dispatch(a1[lo:hi].contiguous(), topk_ids[lo:hi].contiguous(),
                                   weights[lo:hi].contiguous(), num_experts=self.num_experts, capacity=capacity,
                                   max_tokens=largest)
        self._count("moe_dispatch")
        self._pending = _Pending(d, tokens, lo, hi)
        ids = torch.where(d.expert < 0, self.pad_expert, d.expert + self.offset).to(topk_ids.dtype).view(-1, 1)
        ones = torch.ones((d.rows, 1), dtype=topk_weights.dtype, device=a1.device)
        a1q, a1q_scale = _quantize_input(d.x, quant_config, defer_input_quant)
        return a1q, a1q_scale, None, ids, ones

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool, weight_and_reduce_impl: Any) -> None:
        """Combine the experts' rows back to their source ranks with the router weights (float32, k order)
        and write this rank's shard of ``output`` (zeros elsewhere). Collective."""
        st, self._pending = self._pending, None
        if st is None:
            raise PurlinError("purlin MoE finalize: no prepare before it")
        hidden = output.shape[-1]
        # One slot of weight 1 per row: any weight-and-reduce is the identity, so the rows are the output.
        rows = fused_expert_output.reshape(st.d.rows, hidden)
        y = self.comm.moe_combine(rows.contiguous(), st.d)
        self._count("moe_combine")
        output.zero_()
        output[st.lo:st.hi].copy_(y)

    # -- helpers ----------------------------------------------------------------------------------
    def _count(self, op: str) -> None:
        self.calls[op] += 1
        if self._served is not None:
            self._served(op)

    def _check_map(self, expert_map: Optional[torch.Tensor]) -> None:
        """expert_map must give this rank the contiguous block purlin routes to it (checked once per map,
        eagerly: vLLM's warm-up runs come before any capture)."""
        if expert_map is None:
            raise PurlinValueError("purlin MoE prepare: vLLM passed no expert_map; purlin returns global expert "
                                   "ids, which need it (expert parallelism on)")
        if expert_map is self._checked_map or (expert_map.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        want = torch.full((self.num_experts,), -1, dtype=torch.int64)
        want[self.offset:self.offset + self.local] = torch.arange(self.local)
        if expert_map.numel() < self.num_experts or not torch.equal(expert_map[:self.num_experts].cpu().long(), want):
            raise PurlinValueError(f"purlin MoE prepare: rank {self.ep_rank}'s expert_map is not experts "
                                   f"[{self.offset}, {self.offset + self.local}) in order; purlin needs linear "
                                   "placement (--expert-placement-strategy linear, no EPLB)")
        self._checked_map = expert_map
