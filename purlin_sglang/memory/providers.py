"""The symmetric-memory providers by name: the one list that config validation (``memory``), the engines,
the CLI (``purlin-sglang info``) and the SGLang plugin read.

Each entry says which engine runs on the provider, which ranks it serves (the processes of a
torch.distributed group, or virtual ranks of one process: ``run_virtual``) and, for a GPU provider that
each rank builds for itself, the class that builds it (``"module:class"``, imported on first use; it
implements memory/device.py's DeviceWorkspace). The order is the preference: for one engine and one
kind of ranks, the first provider listed is what ``memory: auto`` picks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PurlinConfigError

AUTO = "auto"  # the config value: the engine's first provider for its kind of ranks
HOST = "host"  # the CPU engine's: its workspace is made by memory/bootstrap.py (groups) or virtual.py


@dataclass(frozen=True)
class Provider:
    name: str
    engine: str  # the engine that runs on it ("cpu", "cuda"; engines/__init__.py)
    groups: bool  # serves the ranks of a process group (Communicator)
    virtual: bool  # serves virtual ranks of one process (run_virtual)
    summary: str
    target: str = ""  # "module:class" of the per-rank GPU workspace (device_provider); "" for none


PROVIDERS: tuple[Provider, ...] = (
    Provider("ipc", "cuda", True, False, "CUDA IPC / virtual-memory handles between the ranks' processes",
             "purlin_sglang.memory.ipc:IpcWorkspace"),
    Provider("torch", "cuda", True, False, "torch symmetric memory",
             "purlin_sglang.memory.torch_symm:TorchSymmWorkspace"),
    Provider("nvshmem", "cuda", True, False, "one NVSHMEM symmetric heap (the nvidia-nvshmem wheel at build time)",
             "purlin_sglang.memory.nvshmem:NvshmemWorkspace"),
    Provider("loopback", "cuda", False, True, "every virtual rank in one allocation on one GPU"),
    Provider(HOST, "cpu", True, True, "host shared memory (the CPU engine)"),
)
_BY_NAME = {p.name: p for p in PROVIDERS}


def names() -> tuple[str, ...]:
    """Every provider's name, in preference order."""
    return tuple(_BY_NAME)


def choices(*, groups: bool = False) -> tuple[str, ...]:
    """The values ``memory`` takes: ``auto`` and every provider (``groups``: those that serve process groups)."""
    return (AUTO,) + tuple(p.name for p in PROVIDERS if p.groups or not groups)


def find(name: str) -> Provider | None:
    return _BY_NAME.get(name)


def for_engine(engine: str, *, virtual: bool) -> tuple[str, ...]:
    """The providers ``engine`` runs on, for virtual ranks or for process groups; the first is ``auto``'s."""
    return tuple(p.name for p in PROVIDERS if p.engine == engine and (p.virtual if virtual else p.groups))


def prose(items: tuple[str, ...]) -> str:
    """``items`` joined for a message: "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def device_targets() -> dict[str, str]:
    """{name: "module:class"} of the GPU providers each rank builds (memory.device_provider)."""
    return {p.name: p.target for p in PROVIDERS if p.target}


def check_name(value: str) -> str:
    """``value`` if ``memory`` may take it, else a ValueError naming the choices (config validation)."""
    if value != AUTO and value not in _BY_NAME:
        raise ValueError(f"must be one of {', '.join(choices())}")
    return value


def check_for_groups(value: str, source: str) -> None:
    """Refuse a provider that serves no process group (``loopback``: virtual ranks of one process only)
    where the ranks are processes, as they are under the SGLang plugin: PurlinConfigError naming the key."""
    p = find(value)
    if p is not None and not p.groups:
        raise PurlinConfigError(
            f"{source}: key 'memory': {value!r} serves virtual ranks of one process only (run_virtual), and "
            f"these ranks are processes; use one of {', '.join(choices(groups=True))}")


def describe() -> str:
    """One line per provider: name, engine, the ranks it serves, what it is (``purlin-sglang info``)."""
    def ranks(p: Provider) -> str:
        return "process groups and virtual ranks" if p.groups and p.virtual else (
            "process groups" if p.groups else "virtual ranks")

    return "; ".join(f"{p.name} ({p.engine} engine, {ranks(p)}): {p.summary}" for p in PROVIDERS)
