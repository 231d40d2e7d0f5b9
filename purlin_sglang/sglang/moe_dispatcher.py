"""PurlinMoEDispatcher: purlin's MoE dispatch / combine as SGLang 0.5.23's MoE token dispatcher.

A ``token_dispatcher.base.BaseDispatcher`` chosen by the ``create_moe_dispatcher`` hook
(moe_hooks.py). Its contract is the one SGLang's model code keeps for ``--moe-a2a-backend none``
(the standard dispatcher's): the MoE layer's input is the same on every rank of the EP group
(replicated, or gathered over attention DP), and its output is a partial sum that the model then
all-reduces (``reduce_results`` or the model's own all-reduce / reduce-scatter after the experts).
So each rank dispatches only its own shard of the tokens (rank r: the r-th of W near-equal
contiguous slices, ``torch.tensor_split`` order), purlin's ``moe_dispatch`` moves every routed
token once to each rank owning one of its top-k experts, the layer's experts run on the rows they
receive, ``moe_combine`` sums each token's top-k outputs with its router weights (float32, k
order) back on its source rank, and ``combine`` returns [T, H] with this rank's shard filled and
zeros elsewhere: the model's all-reduce completes it, exactly (x + 0 = x).

The experts see a standard dispatch output: ``hidden_states`` [R, H] (the rows, grouped by local
expert), ``topk_ids`` [R, 1] the local expert of each row (-1 on padding rows, which SGLang's
Triton and DeepGEMM runners skip) and ``topk_weights`` [R, 1] = 1 (the router weights are applied
by the combine). On CPU, SGLang's native MoE forward cannot take an id of -1 nor zero rows, so
padding rows are left out of what the experts see (and restored, as zeros, before the combine), and
a rank that receives no row gives the experts one zero row, whose output is dropped.

Rows: on CUDA, by default, a fixed receive buffer of ``max_tokens_per_rank`` rows per (source rank,
local expert) (``capacity=``): no host synchronisation and fixed shapes, so the layer is capturable
in SGLang's CUDA graphs; a call whose shard has more tokens than ``max_tokens_per_rank`` raises
(PurlinError, naming the option). On CPU, exact rows (``capacity=None``); the ``fixed_rows`` argument
(attribute ``force_fixed_rows``) forces either (the CPU tests use it to run the capacity path). FP8 (``moe.dtype: fp8``): rows travel as float8_e4m3fn with per-token scales and are
dequantised to the hidden states' dtype before the experts (the wire is FP8; the experts are not).

Not served (the standard dispatcher is used, logged once): EP size 1, MoE-TP > 1, fused shared
experts, ``apply_router_weight_on_input``, runners that keep global expert ids (FlashInfer,
hpc_ops). One dispatch at a time per layer (two-batch overlap is not supported).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher
from sglang.srt.layers.moe.token_dispatcher.standard import (
    StandardCombineInput,
    StandardDispatchOutput,
    _keeps_global_expert_ids,
)
from sglang.srt.layers.moe.topk import StandardTopKOutput, TopKOutputChecker
from sglang.srt.runtime_context import get_parallel

from ..config import MoESettings
from ..errors import PurlinError
from ..moe.limits import default_capacity, largest_shard, token_excess, token_shard
from .moe_config import wire_dtype

logger = logging.getLogger(__name__)

_OWN_COMMS: dict[str, Any] = {}  # group unique_name -> Communicator built here (no purlin_comm on the group)


def why_not(moe_runner_config: Any) -> Optional[str]:
    """Why this layer cannot use purlin's dispatcher (None: it can). Same on every rank."""
    parallel = get_parallel()
    if parallel.moe_ep_size <= 1:
        return "expert parallelism is off (--ep-size 1)"
    if parallel.moe_tp_size > 1:
        return f"MoE tensor parallelism {parallel.moe_tp_size} > 1 (set --ep-size to the --tp-size)"
    if moe_runner_config.num_fused_shared_experts:
        return "fused shared experts (use --disable-shared-experts-fusion)"
    if moe_runner_config.apply_router_weight_on_input:
        return "apply_router_weight_on_input"
    if moe_runner_config.num_experts % parallel.moe_ep_size:
        return f"{moe_runner_config.num_experts} experts do not split over {parallel.moe_ep_size} ranks"
    backend = moe_runner_config.runner_backend
    if _keeps_global_expert_ids(backend):
        return f"the {backend.value} MoE runner takes global expert ids"
    return None


def moe_communicator(group: Any, config_path: Optional[str] = None) -> Any:
    """The purlin Communicator for an SGLang EP group: the group's own (``purlin_comm``, set up by the
    plugin for covered groups: one workspace, entered by ``graph_capture``), else one built here over
    the group's CPU group (collective: every rank of the group builds it at the same layer)."""
    pc = getattr(group, "purlin_comm", None)
    comm = pc.communicator if pc is not None and not pc.disabled else None
    if comm is not None:
        return comm
    comm = _OWN_COMMS.get(group.unique_name)
    if comm is None or comm.closed:
        from ..api import Communicator
        from .settings import load_plugin_config

        cfg = load_plugin_config(config_path)
        comm = Communicator(group.cpu_group, group.device, config=cfg.purlin)
        _OWN_COMMS[group.unique_name] = comm
    return comm


_warned: set = set()


class KeepSGLangDispatcher(PurlinError):
    """This EP group cannot use purlin's dispatcher (the message says why): SGLang's own stays."""


def across_nodes(comm: Any) -> Optional[str]:
    """Why a CUDA EP group across nodes keeps SGLang's dispatcher, or None: purlin's MoE exchange across
    nodes reads its row counts on the host and cannot be captured in SGLang's decode CUDA graphs."""
    layout = getattr(comm, "layout", None)
    if layout is None or layout.count <= 1 or comm.device.type != "cuda":
        return None
    return (f"the EP group spans {layout.count} nodes, and purlin's MoE exchange across nodes is eager only "
            "(not capturable in CUDA graphs)")


def _say_once(text: str) -> None:
    """Log ``text`` at INFO once per process (every MoE layer builds a dispatcher)."""
    if text not in _warned:
        _warned.add(text)
        logger.info(text)


def _warn_if_prefill_exceeds(settings: MoESettings, ep_size: int) -> None:
    """Say once, at start-up, when SGLang's largest prefill batch would give shards over the limit
    (such a batch raises at its dispatch)."""
    try:
        from sglang.srt.runtime_context import max_prefill_buffer_tokens

        largest = max_prefill_buffer_tokens()
    except Exception:  # noqa: BLE001 - not published (tests, tools): nothing to compare
        return
    shard = largest_shard(largest, ep_size) if largest else 0
    excess = token_excess(settings, shard)
    if excess and (largest, excess) not in _warned:
        _warned.add((largest, excess))
        logger.warning("purlin_sglang: prefill batches of up to %d tokens give shards of %d tokens per rank, %s: "
                       "such a batch raises at its MoE dispatch; raise moe.max_tokens_per_rank to %d or lower "
                       "--chunked-prefill-size", largest, shard, excess, shard)


@dataclass
class _Pending:
    """One dispatch's state until its combine."""

    d: Any  # MoEDispatch
    tokens: int
    lo: int
    hi: int
    keep: Optional[torch.Tensor]  # rows the experts saw (CPU with padding rows), else None


class PurlinMoEDispatcher(BaseDispatcher):
    """SGLang MoE dispatcher over purlin's ``moe_dispatch`` / ``moe_combine`` (see the module doc)."""

    def __init__(self, moe_runner_config: Any, config: MoESettings, *, group: Any = None,
                 config_path: Optional[str] = None, fixed_rows: Optional[bool] = None):
        super().__init__()
        from .settings import active_settings

        parallel = get_parallel()
        self.runner_backend = moe_runner_config.runner_backend
        self.config = config
        self.num_experts = moe_runner_config.num_experts
        self.num_local_experts = moe_runner_config.num_local_experts
        self.num_local_routed_experts = self.num_local_experts
        self.moe_ep_size = parallel.moe_ep_size
        self.moe_ep_rank = parallel.moe_ep_rank
        self.local_expert_mapping = None  # read by FusedMoE.bind_full_expert_weights and AITER paths
        self.expert_mask_gpu = None
        self.group = group if group is not None else parallel.moe_ep_group
        path = config_path if config_path is not None else active_settings().config_path
        self.comm = moe_communicator(self.group, path)
        why = across_nodes(self.comm)
        if why is not None:  # the same on every rank of the group
            raise KeepSGLangDispatcher(why)
        if self.comm.world_size != self.moe_ep_size or self.comm.rank != self.moe_ep_rank:
            raise PurlinError(f"purlin MoE dispatcher: the EP group's communicator is rank {self.comm.rank} of "
                              f"{self.comm.world_size}, SGLang says rank {self.moe_ep_rank} of {self.moe_ep_size}")
        self.wire_dtype = wire_dtype(config)
        self.force_fixed_rows = fixed_rows
        self._pending: Optional[_Pending] = None
        _warn_if_prefill_exceeds(config, self.moe_ep_size)
        _say_once(f"purlin_sglang: MoE layers dispatch and combine through purlin: EP rank {self.moe_ep_rank} of "
                  f"{self.moe_ep_size} ({getattr(self.group, 'unique_name', 'group')}, engine "
                  f"{self.comm.engine_name}), rows on the wire in "
                  f"{'the activations dtype' if self.wire_dtype is None else str(self.wire_dtype).replace('torch.', '')}, "
                  f"moe.max_tokens_per_rank {config.max_tokens_per_rank}")

    def _served(self, op: str) -> None:
        """Count ``op`` in the routing report of the group's purlin communicator, where it has one."""
        pc = getattr(self.group, "purlin_comm", None)
        if pc is not None and hasattr(pc, "note_served"):
            pc.note_served(op)

    def fixed_rows(self, device: torch.device) -> bool:
        return self.force_fixed_rows if self.force_fixed_rows is not None else device.type == "cuda"

    def shard(self, tokens: int) -> tuple[int, int]:
        """This rank's token rows [lo, hi) of a replicated batch of ``tokens`` (tensor_split order)."""
        return token_shard(tokens, self.moe_ep_size, self.moe_ep_rank)

    def dispatch(self, hidden_states: torch.Tensor, topk_output: Any) -> StandardDispatchOutput:
        if TopKOutputChecker.format_is_bypassed(topk_output):
            topk_output = topk_output.to_standard()
        if not TopKOutputChecker.format_is_standard(topk_output):
            raise PurlinError(f"purlin MoE dispatcher: needs a standard top-k output, got {type(topk_output).__name__}")
        if self._pending is not None:
            raise PurlinError("purlin MoE dispatcher: dispatch called twice without a combine "
                              "(two-batch overlap is not supported)")
        tokens = hidden_states.shape[0]
        lo, hi = self.shard(tokens)
        x = hidden_states[lo:hi]
        if self.wire_dtype is torch.bfloat16 and x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        ids = topk_output.topk_ids[lo:hi]
        weights = topk_output.topk_weights[lo:hi]
        capacity = default_capacity(self.config) if self.fixed_rows(x.device) else None
        largest = largest_shard(tokens, self.moe_ep_size)  # the largest shard: every rank decides alike
        excess = token_excess(self.config, largest)
        if excess:
            raise PurlinError(f"purlin MoE dispatcher: a batch of {tokens} tokens over {self.moe_ep_size} ranks gives "
                              f"shards of up to {largest} tokens, {excess}; raise it in --purlin-config")
        wire = self.wire_dtype if self.wire_dtype is torch.float8_e4m3fn else None
        d = self.comm.moe_dispatch(x.contiguous(), ids.contiguous(), weights.contiguous(),
                                   num_experts=self.num_experts, capacity=capacity, dtype=wire, max_tokens=largest)
        self._served("moe_dispatch")
        rows = d.x
        if d.scales is not None:  # FP8 on the wire: the experts get the hidden states' dtype
            rows = (rows.to(torch.float32) * d.scales.to(torch.float32).unsqueeze(1)).to(hidden_states.dtype)
        elif rows.dtype != hidden_states.dtype:  # bf16 on the wire for other activations
            rows = rows.to(hidden_states.dtype)
        expert = d.expert
        keep = None
        if rows.device.type == "cpu" and (rows.shape[0] == 0 or bool((expert < 0).any())):
            # SGLang's native MoE forward fails on an id of -1 and on zero rows
            keep = torch.nonzero(expert >= 0).flatten()
            rows, expert = rows.index_select(0, keep), expert.index_select(0, keep)
            if rows.shape[0] == 0:  # one zero row for local expert 0; its output is dropped in combine
                rows, expert = rows.new_zeros((1, rows.shape[1])), expert.new_zeros((1,))
        self._pending = _Pending(d, tokens, lo, hi, keep)
        ones = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=rows.device)
        local = StandardTopKOutput(topk_weights=ones, topk_ids=expert.to(torch.int32).view(-1, 1),
                                   router_logits=None)
        return StandardDispatchOutput(hidden_states=rows, hidden_states_scale=None, topk_output=local)

    def combine(self, combine_input: Any) -> torch.Tensor:
        if not isinstance(combine_input, StandardCombineInput):
            raise PurlinError(f"purlin MoE dispatcher: needs a standard combine input, got {type(combine_input).__name__}")
        st, self._pending = self._pending, None
        if st is None:
            raise PurlinError("purlin MoE dispatcher: combine without a dispatch")
        out = combine_input.hidden_states
        if st.keep is not None:
            full = torch.zeros((st.d.x.shape[0], out.shape[1]), dtype=out.dtype, device=out.device)
            full.index_copy_(0, st.keep, out[:st.keep.numel()])
            out = full
        y = self.comm.moe_combine(out.contiguous(), st.d)
        self._served("moe_combine")
        result = torch.zeros((st.tokens, y.shape[1]), dtype=y.dtype, device=y.device)
        result[st.lo:st.hi] = y
        return result
