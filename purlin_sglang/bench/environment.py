"""What every bench result records about where it ran (one helper for all bench commands)."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
from typing import Any

import torch


def dist_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    """Where a bench ran: date, host, Python, torch, GPUs, purlin's build, SGLang; ``device`` as given."""
    from .. import __version__, native

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": gpus[0] if gpus else None,
        "gpu_count": len(gpus),
        "cpu_count": os.cpu_count(),
        "purlin_sglang": __version__,
        "native_build_info": native.build_info(),
        "sglang": dist_version("sglang"),
        "device": device,
    }
