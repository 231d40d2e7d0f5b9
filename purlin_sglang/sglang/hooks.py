"""The hook functions the plugin installs into SGLang (the list of targets is in plugin.py).

Each one keeps SGLang's behaviour unchanged unless the group has a purlin communicator
(``self.purlin_comm``, set only with ``--comm-backend purlin``) and the call is eligible;
otherwise it calls the original. Nothing here imports sglang at module import time.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

PURLIN_METHOD = "purlin"  # our name in GroupCoordinator's out-of-place all-reduce methods


def _pc(group: Any):
    pc = getattr(group, "purlin_comm", None)
    return None if pc is None or pc.disabled else pc


# -- server args ---------------------------------------------------------------------------------
def add_cli_args(result: Any, parser: argparse.ArgumentParser) -> None:
    """AFTER ServerArgs.add_cli_args: add --comm-backend and --purlin-config (once per parser)."""
    from . import plugin

    if "--comm-backend" in parser._option_string_actions:
        return None
    group = parser.add_argument_group("purlin_sglang (communicator backend)")
    group.add_argument(
        "--comm-backend", type=plugin.backend_arg, choices=plugin.BACKENDS, default="nccl",
        help="Communicator for the parallel groups' collectives: 'nccl' (SGLang's own paths, unchanged) or "
             "'purlin' (purlin_sglang above the routing table's size thresholds, NCCL otherwise).",
    )
    group.add_argument(
        "--purlin-config", type=str, default=None, metavar="PATH",
        help="YAML file for --comm-backend purlin: PurlinConfig keys and an optional 'routing:' table "
             "(see configs/purlin.yaml).",
    )
    group.add_argument(
        "--purlin-nccl-free", action="store_true", default=False,
        help="Opt-in: run every tensor-parallel rank on the visible GPU(s) without NCCL (several ranks may share "
             "one GPU): ranks' GPU ids fold onto the visible GPUs, the device groups are gloo, pynccl and custom "
             "all-reduce are off; with --comm-backend purlin every device collective goes through purlin (use "
             "configs/purlin-nccl-free.yaml), with nccl SGLang's own collectives run on gloo (a reference).",
    )
    return None


def from_cli_args(result: Any, cls: Any, args: argparse.Namespace) -> None:
    """AFTER ServerArgs.from_cli_args: carry the choice on the record (an underscore attribute pickles)."""
    from . import plugin

    plugin.set_comm_backend(result, getattr(args, "comm_backend", "nccl"), getattr(args, "purlin_config", None),
                            bool(getattr(args, "purlin_nccl_free", False)))
    return None


# -- GroupCoordinator ----------------------------------------------------------------------------
_OFF_WITH_PURLIN = ("use_custom_allreduce", "use_mscclpp", "use_torch_symm_mem_all_reduce")


def coordinator_init(original, self, *args, **kwargs):
    """AROUND GroupCoordinator.__init__: with purlin, switch SGLang's competing all-reduce paths off
    in this process (custom AR, mscclpp, torch symm-mem, FlashInfer fusion: see conflicts.py) and for
    this group, and attach ``self.purlin_comm`` (collective over the group's CPU group, on the group's
    device: the CUDA engine for CUDA groups). PyNccl stays: it is the fallback.

    With ``--purlin-nccl-free`` (either backend; single_gpu.py) pynccl is off too (NCCL refuses several
    ranks on one GPU): the fallback is then SGLang's torch.distributed path on the gloo device group."""
    from . import conflicts, plugin

    settings = plugin.active_settings()
    if settings.backend != "purlin" and not settings.nccl_free:
        self.purlin_comm = None
        return original(self, *args, **kwargs)
    plugin.verify_hooks(plugin.NCCL_FREE_TARGETS if settings.backend != "purlin" else plugin.WORKER_TARGETS)
    conflicts.switch_off("--comm-backend purlin" if settings.backend == "purlin" else "--purlin-nccl-free")
    params = inspect.signature(original).parameters
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    off = _OFF_WITH_PURLIN + (("use_pynccl",) if settings.nccl_free else ())
    for name in off:
        if name in params:
            bound.arguments[name] = False
    self.purlin_comm = None
    original(*bound.args, **bound.kwargs)
    if settings.backend != "purlin":
        return
    group_name = self.unique_name.split(":")[0]
    config = settings.load_config()
    if self.world_size > 1 and config.routing.covers(group_name):
        from .communicator import PurlinGroupCommunicator

        try:
            self.purlin_comm = PurlinGroupCommunicator(self.cpu_group, self.device, config, name=self.unique_name)
        except Exception as e:
            raise plugin.PurlinPluginError(
                f"--comm-backend purlin: cannot build the purlin communicator for group {self.unique_name} "
                f"on {self.device}: {e}; run with --comm-backend nccl, or fix the cause"
            ) from e
        logger.info("purlin_sglang: group %s: %d ranks on %s through purlin (engine %s)", self.unique_name,
                    self.world_size, self.device, self.purlin_comm.engine)
    elif config.routing.covers(group_name):
        logger.info("purlin_sglang: group %s has one rank: no collective to route", self.unique_name)


def resolve_outplace_all_reduce_method(original, self, input_, *args, **kwargs):
    """AROUND: answer ``"purlin"`` for eligible tensors, otherwise SGLang's own choice.

    A query: it counts nothing (the op that then runs counts its own fallback)."""
    pc = _pc(self)
    if pc is not None and pc.would_all_reduce(input_):
        return PURLIN_METHOD
    return original(self, input_, *args, **kwargs)


def all_reduce_out_place(original, self, input_, outplace_all_reduce_method):
    """AROUND: run ``"purlin"`` (and eligible ``"auto"``) on purlin; any decline runs the original."""
    pc = _pc(self)
    if pc is not None and outplace_all_reduce_method in (PURLIN_METHOD, "auto"):
        out = pc.all_reduce(input_) if not pc._bypass else None
        if out is not None:
            return out
        with pc.bypass():
            return original(self, input_, "auto")
    return original(self, input_, outplace_all_reduce_method)


def all_reduce_in_place(original, self, input_):
    pc = _pc(self)
    if pc is not None and not pc._bypass and pc.all_reduce(input_, out=input_) is not None:
        return None
    return original(self, input_)


def can_use_flashinfer_allreduce(original, self, input_):
    """AROUND: FlashInfer's allreduce-only path yields to purlin for tensors purlin takes."""
    pc = _pc(self)
    if pc is not None and pc.would_all_reduce(input_):
        return False
    return original(self, input_)


def all_gather_into_tensor(original, self, output, input):
    pc = _pc(self)
    if pc is not None and pc.all_gather(output, input) is not None:
        return None
    return original(self, output, input)


def reduce_scatter_tensor(original, self, output, input):
    pc = _pc(self)
    if pc is not None and pc.reduce_scatter(output, input) is not None:
        return output
    return original(self, output, input)


def all_to_all_single(original, self, output, input):
    pc = _pc(self)
    if pc is not None and pc.all_to_all(output, input) is not None:
        return None
    return original(self, output, input)


def all_gatherv(original, self, input_, sizes=None, output=None):
    """AROUND: one tensor, or a list whose every entry is eligible (then each on purlin, in order)."""
    pc = _pc(self)
    if pc is not None:
        if isinstance(input_, torch.Tensor):
            out = pc.all_gather_v(input_, sizes, output)
            if out is not None:
                return [out]
        elif output is None and input_ and all(pc.why_not_all_gather_v(t, sizes) is None for t in input_):
            return [pc.all_gather_v(t, sizes) for t in input_]
    return original(self, input_, sizes=sizes, output=output)


def reduce_scatterv(original, self, input_, output=None, sizes=None):
    pc = _pc(self)
    if pc is not None:
        out = pc.reduce_scatter_v(input_, sizes, output)
        if out is not None:
            return out
    return original(self, input_, output=output, sizes=sizes)


@contextlib.contextmanager
def graph_capture(original, self, *args, **kwargs):
    """AROUND: SGLang's capture context (outer), then purlin's ``capture()`` (inner) for its body.

    Inside, SGLang's CUDA-graph runner warms every shape up eagerly (served by purlin and
    remembered), then captures; see PurlinGroupCommunicator for what is served while capturing."""
    pc = _pc(self)
    with original(self, *args, **kwargs) as ctx:
        if pc is None:
            yield ctx
        else:
            with pc.capture():
                yield ctx


def destroy(self, *args, **kwargs):
    """BEFORE GroupCoordinator.destroy: free purlin's memory (and log its summary) while the CPU group
    exists (on CUDA, after a bounded barrier on it: peers read this rank's memory)."""
    pc = getattr(self, "purlin_comm", None)
    if pc is not None:
        pc.destroy()
        self.purlin_comm = None
    return None
