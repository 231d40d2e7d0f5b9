"""Whether each memory provider can run in this installation (what ``purlin-sglang info`` reports).

Kept apart from the package's ``__init__``: the answer for ``nvshmem`` reads the native build info.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

from ..errors import PurlinValueError
from . import PROVIDERS


def _ipc() -> str:
    for module in ("cuda.bindings.runtime", "cuda.cudart"):  # cuda-python; < 12.6 spelled it cuda.cudart
        try:
            if importlib.util.find_spec(module) is not None:
                return ""
        except ImportError:
            pass
    return "needs cuda-python (cuda.bindings.runtime is not importable); pip install cuda-python"


def _torch() -> str:
    from .setup_phase import _Fail
    from .torch_symm import _load_symm_mem

    try:
        _load_symm_mem()
    except _Fail as e:
        return e.message
    return ""


def _nvshmem() -> str:
    from .nvshmem import nvshmem_status

    return nvshmem_status()["reason"] or ""


# provider -> what it lacks here ("" if nothing); host and loopback need nothing beyond their engine
_MISSING: dict[str, Callable[[], str]] = {"host": str, "loopback": str, "ipc": _ipc, "torch": _torch,
                                          "nvshmem": _nvshmem}


def provider_status(name: str) -> str:
    """What provider ``name`` lacks in this installation ("" if nothing), found without allocating anything or
    touching a GPU (whether a GPU is there is the engine's question: engines.cuda_engine_status)."""
    check = _MISSING.get(name)
    if check is None:
        raise PurlinValueError(f"provider_status: unknown memory provider {name!r}; known: {', '.join(PROVIDERS[1:])}")
    return check()
