"""Engines: the datapaths that execute SNAC schedules. A registry, chosen by device.

Every engine implements :class:`~.base.Engine` and is built by name with :func:`create`; its MoE
part, which lives in the MoE wing (:mod:`purlin_sglang.moe`), implements
:class:`~purlin_sglang.moe.engine.MoEEngine` and is built with :func:`create_moe`. The classes are
imported on first use.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import PurlinBrokenError, PurlinClosedError, PurlinUnavailableError, PurlinValueError
from ..memory import providers


@dataclass(frozen=True)
class EngineInfo:
    name: str
    device_type: str
    priority: int
    memories: tuple[str, ...]  # providers it runs on for process groups; the first is what "auto" picks
    virtual_memories: tuple[str, ...] = ()  # providers for run_virtual (ranks in one process)
    engine: str = ""  # "module:class" of the collectives engine (an Engine)
    moe: str = ""  # "module:class" of the engine's MoE part (a moe.engine.MoEEngine), built with a MoEContext


# Each engine's providers come from memory/providers.py: for process groups, and for virtual ranks.
ENGINES: tuple[EngineInfo, ...] = tuple(
    EngineInfo(name, name, priority, providers.for_engine(name, virtual=False),
               providers.for_engine(name, virtual=True), engine, moe)
    for name, priority, engine, moe in (
        ("cpu", 0, "purlin_sglang.engines.cpu:CpuEngine", "purlin_sglang.moe.cpu:CpuMoE"),
        ("cuda", 10, "purlin_sglang.engines.cuda:CudaEngine", "purlin_sglang.moe.cuda:CudaMoE"),
    )
)
_BY_NAME = {e.name: e for e in ENGINES}


def cuda_engine_status() -> str:
    """Why the CUDA engine cannot be used here ("" if it can)."""
    from .. import native

    info = native.build_info()
    parts = []
    if not info.get("cuda"):
        parts.append(f"the native library was built without CUDA: {info.get('reason') or 'unknown reason'}")
    if not torch.cuda.is_available():
        parts.append("no CUDA GPU is visible to torch")
    elif info.get("cuda"):
        parts.append(_arch_gap(info.get("archs") or []))
    parts = [p for p in parts if p]
    if parts:
        return "the CUDA engine cannot run: " + "; ".join(parts)
    return ""


def _arch_gap(archs: list) -> str:
    """Why this process's GPU cannot run kernels built for ``archs`` ("" if it can): it is older than all of them."""
    built = [int(m.group()) for a in archs if (m := re.match(r"\d+", str(a)))]
    major, minor = torch.cuda.get_device_capability()
    sm = 10 * major + minor
    if built and sm < min(built):
        return (f"the GPU is sm_{sm}, older than every architecture the native library was built for "
                f"({', '.join(map(str, archs))}); reinstall with PURLIN_CUDA_ARCHS={sm}")
    return ""


class CommunicatorKind(NamedTuple):
    """A communicator this version can build: ``engine``, ``mode`` ("virtual": run_virtual; "group": a
    Communicator over a process group) and ``memory`` (the provider), with why it cannot be built here:
    ``engine_why`` (the engine cannot run) and ``memory_why`` (the provider lacks something); "" if not."""

    engine: str
    mode: str
    memory: str
    engine_why: str
    memory_why: str


def communicators() -> list[CommunicatorKind]:
    """Every communicator this version can build, and whether it can here (what ``purlin-sglang info``
    reports). Loads no memory provider and allocates nothing."""
    from ..memory.status import provider_status

    out = []
    for eng in ENGINES:
        engine_why = cuda_engine_status() if eng.device_type == "cuda" else ""
        for mode, memories in (("virtual", eng.virtual_memories), ("group", eng.memories)):
            for mem in memories:
                out.append(CommunicatorKind(eng.name, mode, mem, engine_why, provider_status(mem)))
    return out


def select_engine(device: torch.device, memory: str, *, virtual: bool = False) -> tuple[EngineInfo, str]:
    """Pick the highest-priority engine for ``device`` and resolve ``memory='auto'``.

    ``virtual``: ranks are threads of this process (run_virtual), served by the engine's
    ``virtual_memories`` (loopback on CUDA); otherwise ranks are processes of a group.
    """
    found = sorted((e for e in ENGINES if e.device_type == device.type), key=lambda e: -e.priority)
    if not found:
        raise PurlinValueError(f"device {device}: unsupported device type; use 'cpu' or a CUDA device")
    eng = found[0]
    if eng.device_type == "cuda":
        why = cuda_engine_status()
        if why:
            raise PurlinUnavailableError(f"device {device}: {why}")
    mems = eng.virtual_memories if virtual else eng.memories
    mem = mems[0] if memory == providers.AUTO else memory
    if mem not in mems:
        raise PurlinUnavailableError(
            f"memory={memory!r} is not available for the {eng.name} engine "
            f"{'with virtual ranks' if virtual else 'with a process group'} (it supports {list(mems)}); "
            f"{_provider_hint(eng, mem)}"
        )
    return eng, mem


def _provider_hint(eng: EngineInfo, mem: str) -> str:
    """Which engine ``mem`` belongs to (memory/providers.py), or which of this engine's providers serve which ranks."""
    p = providers.find(mem)
    if p is not None and p.engine != eng.name:
        return f"the {mem} provider belongs to the {p.engine.upper()} engine"
    return (f"run_virtual uses {providers.prose(eng.virtual_memories)}; process groups use "
            f"{providers.prose(eng.memories)}")


def _info(name: str) -> EngineInfo:
    info = _BY_NAME.get(name)
    if info is None:
        raise PurlinUnavailableError(f"engine {name!r} is not registered; engines: {', '.join(_BY_NAME)}")
    return info


def _resolve(target: str) -> Any:
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def create(name: str, ws: Any, rank: int, world: int, timeout_s: float, *, ranks_on_gpu: int,
           call_check: bool = False) -> Any:
    """Build the engine registered as ``name`` over this rank's workspace ``ws`` (an :class:`~.base.Engine`).

    ``ranks_on_gpu``: how many ranks' grids must be co-resident on this rank's GPU at once (the
    world for virtual ranks of one process, 1 for a rank that is a process of its own); host
    engines ignore it. ``call_check``: device engines publish call descriptors and compare their
    peers' in their waits (config ``device_call_check``); host engines always check. Local:
    builds nothing on other ranks.
    """
    return _resolve(_info(name).engine)(ws, rank, world, timeout_s, ranks_on_gpu=ranks_on_gpu, call_check=call_check)


def create_moe(name: str, ctx: Any) -> Any:
    """Build the MoE part (a :class:`~purlin_sglang.moe.engine.MoEEngine`) of engine ``name`` with the
    :class:`~purlin_sglang.moe.engine.MoEContext` ``ctx`` its Communicator built. Local."""
    return _resolve(_info(name).moe)(ctx)


def check_usable(name: str, engine: Any, moe: Any) -> None:
    """Raise the error an earlier call of ``engine`` (or of its MoE part ``moe``) recorded (no device
    sync), or PurlinBrokenError when the engine is broken: the checks before every call."""
    engine.check()
    if moe is not None:
        moe.check(fatal_only=True)  # only a fatal error an earlier MoE call recorded
    if engine.broken:
        raise _broken(name, engine.broken, "")


def closed_error(name: str, broken_reason: str | None) -> PurlinClosedError | PurlinBrokenError:
    """The error of a call on a closed communicator (closed by :meth:`close`, or released when broken)."""
    if broken_reason:
        return _broken(name, broken_reason, "its memory was released then; ")
    return PurlinClosedError(f"{name}: the communicator is closed; create a new one")


def _broken(name: str, reason: str, released: str) -> PurlinBrokenError:
    return PurlinBrokenError(f"{name}: the communicator is broken by an earlier failure ({reason}); {released}"
                             "create a new Communicator on every rank")
