"""PurlinRoutes: the overrides a vLLM device communicator class gets from purlin.

Mixed in front of one of vLLM's device communicator classes (``class X(PurlinRoutes,
CpuCommunicator)``): the constructor builds a :class:`~purlin_sglang.routed.RoutedCommunicator`
on the group's CPU (gloo) group when the run's ``additional_config`` switches purlin on (see
:mod:`.settings`) and the routing table covers the group (its name before the ``:``: ``tp``,
``ep``, ...); each collective is then served by purlin where the routed communicator takes it and
handed to vLLM's own implementation (``super()``) otherwise, counted with the reason. Results
keep vLLM's conventions: ``all_gather`` and ``reduce_scatter`` along ``dim`` as
``DeviceCommunicatorBase`` does them, the V forms along dim 0 only (another dim goes to vLLM,
counted as ``dim``). With ``moe.dispatcher: purlin`` it also applies the MoE hook (:mod:`.hooks`)
and gives the EP group's MoE exchange (:mod:`.moe`) its purlin communicator. Imports nothing of vLLM.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..api import Communicator
from ..routed import RoutedCommunicator
from . import hooks
from .settings import batch_invariant, moe_on, plugin_config


class PurlinRoutes:
    """The purlin half of a vLLM device communicator (see the module docstring)."""

    def __init__(self, cpu_group: Any, device: Optional[torch.device] = None, device_group: Any = None,
                 unique_name: str = "", *args: Any, **kwargs: Any):
        super().__init__(cpu_group, device, device_group, unique_name, *args, **kwargs)
        self.purlin: Optional[RoutedCommunicator] = None
        self._vllm_path = False  # inside vLLM's own reduce_scatterv_into_output (see there)
        self.purlin_moe: Optional[Communicator] = None  # built by moe_communicator() where self.purlin is None
        from vllm.config import get_current_vllm_config_or_none

        config = plugin_config(get_current_vllm_config_or_none())
        self._purlin_config = config
        if config is None:
            return
        hooks.verify(hooks.START_UP)
        if moe_on(config):
            hooks.ensure(hooks.MOE)  # before any MoE layer exists: this process builds its groups first
        group = unique_name.split(":")[0]
        if self.world_size > 1 and config.routing.covers(group):
            self.purlin = RoutedCommunicator(cpu_group, self.device, config, name=unique_name,
                                             deterministic=batch_invariant())

    def moe_communicator(self) -> Communicator:
        """The purlin Communicator for this (EP) group's MoE exchange: the routed communicator's when the
        routing table covers the group, else one built here on the group's CPU group (collective: every
        rank of the group asks at the same layer), closed by :meth:`destroy`."""
        if self.purlin is not None and self.purlin.communicator is not None:
            return self.purlin.communicator
        if self.purlin_moe is None or self.purlin_moe.closed:
            if self._purlin_config is None:
                from ..errors import PurlinPluginError

                raise PurlinPluginError(f"purlin MoE: group {self.unique_name} was built without "
                                        "additional_config.purlin; purlin cannot be its MoE exchange")
            self.purlin_moe = Communicator(self.cpu_group, self.device, config=self._purlin_config.purlin)
        return self.purlin_moe

    def purlin_moe_capture(self) -> Any:
        """What graph capture enters for this group's MoE exchange (an object with ``capture()``), or None."""
        if self.purlin is not None and not self.purlin.disabled:
            return self.purlin
        return self.purlin_moe if self.purlin_moe is not None and not self.purlin_moe.closed else None

    def note_moe(self, op: str) -> None:
        """Count a MoE exchange call in this group's routing report (where it has a routed communicator)."""
        if self.purlin is not None:
            self.purlin.note_served(op)

    def _declined(self, op: str, reason: str) -> None:
        if self.purlin is not None:
            self.purlin.fallbacks[(op, reason)] += 1

    def _along_dim0(self, op: str, input_: Any, dim: int) -> bool:
        """Whether purlin may take a V form's call: a tensor of at least one dimension, along dim 0
        (otherwise the decline is counted, as ``not a tensor`` or ``dim``, and vLLM's path runs)."""
        if self.purlin is None:
            return False
        if not isinstance(input_, torch.Tensor) or input_.dim() < 1:
            self._declined(op, "not a tensor")
            return False
        if _axis(dim, input_) != 0:
            self._declined(op, "dim")
            return False
        return True

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        out = self.purlin.all_reduce(input_) if self.purlin is not None else None
        return out if out is not None else super().all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.purlin is not None and input_.dim() >= 1:
            d = _axis(dim, input_)
            size = input_.size()
            out = torch.empty((size[0] * self.world_size,) + tuple(size[1:]), dtype=input_.dtype, device=input_.device)
            if self.purlin.all_gather(out, input_) is not None:  # dim 0, rank order; then vLLM's own reshape
                out = out.reshape((self.world_size,) + tuple(size)).movedim(0, d)
                return out.reshape(tuple(size[:d]) + (self.world_size * size[d],) + tuple(size[d + 1:]))
        return super().all_gather(input_, dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.purlin is not None and self.world_size > 1 and input_.dim() >= 1:
            d = _axis(dim, input_)
            x = input_.movedim(0, d).contiguous()  # as DeviceCommunicatorBase.reduce_scatter
            if x.shape[0] % self.world_size == 0:
                out = torch.empty((x.shape[0] // self.world_size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
                if self.purlin.reduce_scatter(out, x) is not None:
                    return out.movedim(0, d).contiguous()
        return super().reduce_scatter(input_, dim)

    def all_gatherv(self, input_: Any, dim: int = 0, sizes: Optional[list[int]] = None) -> Any:
        if isinstance(input_, (list, tuple)) and self.purlin is not None and not self.purlin.disabled:
            # vLLM's all-gather MoE exchange gathers [hidden states, weights, ids, ...] in one call: each
            # tensor in turn (purlin's decision depends on sizes every rank knows, so ranks agree)
            return [self.all_gatherv(t, dim, sizes) for t in input_]
        if self._along_dim0("all_gather_v", input_, dim):
            out = self.purlin.all_gather_v(input_, sizes)
            if out is not None:
                return out
        return super().all_gatherv(input_, dim, sizes)

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: Optional[list[int]] = None) -> torch.Tensor:
        if not self._vllm_path and self._along_dim0("reduce_scatter_v", input_, dim):
            out = self.purlin.reduce_scatter_v(input_, sizes)
            if out is not None:
                return out
        return super().reduce_scatterv(input_, dim, sizes)

    def reduce_scatterv_into_output(self, input_: torch.Tensor, output: torch.Tensor, dim: int = -1,
                                    sizes: Optional[list[int]] = None) -> torch.Tensor:
        """The all-gather MoE exchange's combine (vLLM's CUDA class reduces straight into ``output``,
        not through ``reduce_scatterv``)."""
        if self._along_dim0("reduce_scatter_v", input_, dim) and \
                self.purlin.reduce_scatter_v(input_, sizes, output=output) is not None:
            return output
        self._vllm_path = True  # vLLM's base class goes through reduce_scatterv: not purlin a second time
        try:
            return super().reduce_scatterv_into_output(input_, output, dim, sizes)
        finally:
            self._vllm_path = False

    def destroy(self) -> None:
        if self.purlin_moe is not None:
            moe, self.purlin_moe = self.purlin_moe, None
            moe.close()
        if self.purlin is not None:
            routed, self.purlin = self.purlin, None
            routed.destroy()
        super().destroy()


def _axis(dim: int, t: torch.Tensor) -> int:
    """``dim`` of ``t`` as a non-negative index (as vLLM's communicators read a negative one)."""
    return dim + t.dim() if dim < 0 else dim
