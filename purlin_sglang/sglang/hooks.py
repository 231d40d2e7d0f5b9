"""The datapath hook functions the plugin installs into SGLang (the list of targets is in plugin.py;
the start-up hooks, which verify these, are there too).

Each one keeps SGLang's behaviour unchanged unless the group has a purlin communicator
(``self.purlin_comm``, set only with ``--comm-backend purlin``) and the call is eligible;
otherwise it calls the original. Nothing here imports sglang at module import time.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

PURLIN_METHOD = "purlin"  # our name in GroupCoordinator's out-of-place all-reduce methods


def _pc(group: Any):
    pc = getattr(group, "purlin_comm", None)
    return None if pc is None or pc.disabled else pc


# -- GroupCoordinator (its __init__ hook is plugin.coordinator_init) -------------------------------
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
        out = pc.all_reduce(input_) if not pc.bypassed else None
        if out is not None:
            return out
        with pc.bypass():
            return original(self, input_, "auto")
    return original(self, input_, outplace_all_reduce_method)


def all_reduce_in_place(original, self, input_):
    pc = _pc(self)
    if pc is not None and not pc.bypassed and pc.all_reduce(input_, out=input_) is not None:
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
