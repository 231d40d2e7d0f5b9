"""Symmetric memory providers: staging buffers and signal words for every rank.

The GPU providers (``IpcWorkspace``, ``TorchSymmWorkspace``, ``NvshmemWorkspace``) and the
``DeviceWorkspace`` protocol are imported on first use (module ``__getattr__``), so importing
this package imports neither cuda-python nor torch's symmetric memory, and loads no NVSHMEM.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import providers
from .host import HostWorkspace
from .layout import WorkspaceLayout

PROVIDERS = providers.choices()  # the values of config ``memory`` (memory/providers.py)

# GPU providers by name: "module:class", resolved on first use. Each class implements
# DeviceWorkspace and has create(layout_nbytes, group, device_index, rank, world, *, layout=None).
DEVICE_PROVIDERS = providers.device_targets()

_LAZY = {target.rpartition(":")[2]: target for target in DEVICE_PROVIDERS.values()}
_LAZY["DeviceWorkspace"] = "purlin_sglang.memory.device:DeviceWorkspace"


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def device_provider(name: str) -> type:
    """The GPU provider class registered as ``name`` (memory/providers.py: "ipc", "torch", "nvshmem");
    loads nothing from CUDA.

    Raises :class:`~purlin_sglang.errors.PurlinUnavailableError` for a provider that is not here.
    """
    target = DEVICE_PROVIDERS.get(name)
    if target is None:
        from ..errors import PurlinUnavailableError

        raise PurlinUnavailableError(
            f"memory provider {name!r} has no GPU implementation here; available: {', '.join(DEVICE_PROVIDERS)}"
        )
    return _resolve(target)


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _resolve(target)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "HostWorkspace", "WorkspaceLayout", "PROVIDERS", "DEVICE_PROVIDERS", "device_provider", "providers",
    "IpcWorkspace", "TorchSymmWorkspace", "NvshmemWorkspace", "DeviceWorkspace",
]
