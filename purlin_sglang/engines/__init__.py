"""Engines: the datapaths that execute SNAC schedules. A registry, chosen by device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PurlinUnavailableError, PurlinValueError


@dataclass(frozen=True)
class EngineInfo:
    name: str
    device_type: str
    priority: int
    memories: tuple[str, ...]  # providers it can run on; the first is what "auto" picks


ENGINES: tuple[EngineInfo, ...] = (
    EngineInfo("cpu", "cpu", 0, ("host",)),
)


def cuda_engine_status() -> str:
    """Why the CUDA engine cannot be used here (this version has none yet)."""
    from .. import native

    info = native.build_info()
    parts = ["the CUDA engine is not implemented in this version of purlin_sglang (planned next)"]
    if not info.get("cuda"):
        parts.append(f"the native library was built without CUDA: {info.get('reason') or 'unknown reason'}")
    if not torch.cuda.is_available():
        parts.append("no CUDA GPU is visible to torch")
    return "; ".join(parts)


def select_engine(device: torch.device, memory: str) -> tuple[EngineInfo, str]:
    """Pick the highest-priority engine for ``device`` and resolve ``memory='auto'``."""
    if device.type == "cuda":
        raise PurlinUnavailableError(f"device {device}: {cuda_engine_status()}")
    found = sorted((e for e in ENGINES if e.device_type == device.type), key=lambda e: -e.priority)
    if not found:
        raise PurlinValueError(f"device {device}: unsupported device type; use 'cpu' or a CUDA device")
    eng = found[0]
    mem = eng.memories[0] if memory == "auto" else memory
    if mem not in eng.memories:
        raise PurlinUnavailableError(
            f"memory={memory!r} is not available for the {eng.name} engine (it supports {list(eng.memories)}); "
            "the ipc, nvshmem, torch and loopback providers belong to the CUDA engine"
        )
    return eng, mem
