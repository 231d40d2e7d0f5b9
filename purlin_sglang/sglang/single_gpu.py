"""NCCL-free mode (``--purlin-nccl-free``): several tensor-parallel ranks on the GPUs this process sees.

NCCL refuses two ranks of one communicator on one device, so SGLang (0.5.23) cannot run TP=2 on a
single GPU. With ``--purlin-nccl-free`` (an explicit opt-in, off by default) the plugin changes four
things, each through a hook listed in plugin.HOOKS and verified with ``plugin.missing_hooks()``:

1. device ids: the launcher computes ``gpu_id = base_gpu_id + tp_rank * gpu_id_step`` (SGLang refuses
   ``--gpu-id-step 0``); :func:`reindex_device_id` (AROUND ``sglang.srt.utils.common.maybe_reindex_device_id``,
   which every scheduler process's ``gpu_id`` passes through in ``Engine._launch_scheduler_processes``)
   folds it onto the visible GPUs with :func:`map_gpu_id` (one GPU: every rank on GPU 0);
2. the distributed backend: :func:`distributed_backend` (AROUND
   ``parallel_state.get_default_distributed_backend``, what ``bootstrap._resolve_backend`` asks) answers
   ``gloo`` where SGLang would take ``nccl``: the world and every model-parallel group's device group is
   gloo (CUDA tensors work on gloo: it stages them through the host);
3. pynccl, custom all-reduce, mscclpp and torch symm-mem all-reduce are off for every GroupCoordinator
   (hooks.coordinator_init), and the process-wide competing paths are switched off (conflicts.py);
4. the V forms (``all_gatherv``, ``reduce_scatterv``), which assert pynccl, are served by purlin
   (hooks.all_gatherv / reduce_scatterv) with ``--comm-backend purlin``.

With ``--comm-backend purlin`` every device collective of the covered groups then goes through purlin over
CUDA IPC (``configs/purlin-nccl-free.yaml`` admits every size, so nothing falls back to gloo); with
``--comm-backend nccl`` SGLang's own collectives run on gloo: the reference the purlin run is checked
against. The offline benchmark's GPU-count check honours the mode (bench offline ``--nccl-free``).
Processes on one GPU time-slice: a cross-process round trip costs milliseconds, so this mode is for
correctness and plumbing, not speed. On a machine with a GPU per rank, leave it off (NCCL is there).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

FLAG = "--purlin-nccl-free"
_announced: set[str] = set()


def map_gpu_id(gpu_id: int, visible: int, base_gpu_id: int = 0) -> int:
    """The GPU a rank whose SGLang ``gpu_id`` is ``gpu_id`` runs on when only ``visible`` GPUs exist.

    Ranks past the last visible GPU wrap round to ``base_gpu_id`` (ranks of one GPU: all on it).
    Pure; ids that exist are kept.
    """
    if visible < 1:
        raise ValueError(f"{FLAG}: no GPU is visible (CUDA_VISIBLE_DEVICES?)")
    if not 0 <= base_gpu_id < visible:
        raise ValueError(f"{FLAG}: --base-gpu-id {base_gpu_id} is not one of the {visible} visible GPUs")
    if gpu_id < visible:
        return gpu_id
    return base_gpu_id + (gpu_id - base_gpu_id) % (visible - base_gpu_id)


def enabled() -> bool:
    from .settings import active_settings

    return active_settings().nccl_free


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def reindex_device_id(original, gpu_id: int, *args: Any, **kwargs: Any):
    """AROUND ``maybe_reindex_device_id(gpu_id)`` (a context manager yielding the id the scheduler gets)."""
    if enabled():
        mapped = map_gpu_id(int(gpu_id), _visible_gpus(), _base_gpu_id())
        if mapped != gpu_id:
            logger.info("purlin_sglang: %s: the rank of gpu_id %d runs on GPU %d", FLAG, gpu_id, mapped)
        gpu_id = mapped
    return original(gpu_id, *args, **kwargs)


def _base_gpu_id() -> int:
    try:
        from sglang.srt.runtime_context import get_device

        return int(get_device().base_gpu_id)
    except Exception:  # not published (a test calling the hook directly)
        return 0


def distributed_backend(original, device: str, *args: Any, **kwargs: Any) -> str:
    """AROUND ``get_default_distributed_backend(device)``: ``gloo`` instead of ``nccl`` in this mode."""
    backend = original(device, *args, **kwargs)
    if backend == "nccl" and enabled():
        if "backend" not in _announced:
            _announced.add("backend")
            logger.info("purlin_sglang: %s: torch.distributed backend gloo instead of nccl", FLAG)
        return "gloo"
    return backend
