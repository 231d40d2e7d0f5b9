"""A process group's workspace, made together by every rank (what ``Communicator`` builds on).

:func:`group_workspace` gives this rank its workspace for the engine's memory provider:

* ``host`` (the CPU engine): rank 0 creates one ``/dev/shm`` file, every other rank maps it. Every
  rank learns the file's name before the file exists and unlinks it as it leaves, mapped or failed,
  so whichever rank dies wherever, the file is gone once the surviving ranks have returned or raised.
* a GPU provider (``ipc``, ``torch``, ``nvshmem``): the ranks first agree on what shapes the
  workspace (``staging_bytes`` and the provider; a mismatch is a PurlinConfigError on every rank),
  then the provider allocates this rank's memory and maps its peers'.

:func:`report_started` ends construction: every rank tells every rank whether its engine started.
Every phase ends in an all-gather over the group's CPU (gloo) group (:mod:`.setup_phase`), so a
rank that fails is reported to every rank and no rank is left blocked in a collective. Collective
over ``group``; blocks the host; call inside :func:`setup_phase.bounded` to bound every wait.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import PurlinConfigError, PurlinUnavailableError
from . import providers, setup_phase
from .host import SHM_DIR, HostWorkspace, shared_path, unlink_shared
from .layout import DeviceLayout, WorkspaceLayout

OP = "Communicator"  # the name set-up errors start with


def node_identity() -> str:
    """This process's host: its name and, where Linux has one, its boot id (two hosts of one name
    still differ)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def node_of_rank(group: Any, rank: int, world: int, configured: Any) -> tuple[tuple[int, ...], Any]:
    """(the node of every rank of ``group``, every rank's host or None) (the first set-up phase;
    collective): the config's ``topology.node_of_rank`` where set (equal on every rank; hosts None),
    else the ranks' hosts, numbered in rank order of first appearance. What a layout of several
    nodes runs is the caller's choice (:mod:`purlin_sglang.multinode`)."""
    seen = setup_phase.gather_status(group, world, ("ok", (node_identity(), configured)), OP)
    hosts = [s[1][0] for s in seen]
    given = [s[1][1] for s in seen]
    if any(g != given[0] for g in given):
        raise PurlinConfigError(f"{OP}: the ranks disagree on topology.node_of_rank: {given} (rank order); "
                                "every rank needs the same config")
    if given[0] is None:
        ids: dict[str, int] = {}
        return tuple(ids.setdefault(h, len(ids)) for h in hosts), tuple(hosts)
    nodes = tuple(int(n) for n in given[0])
    if len(nodes) != world:
        raise PurlinConfigError(f"{OP}: topology.node_of_rank has {len(nodes)} entries, the group has {world} "
                                "ranks; give one node id per rank")
    return nodes, None


def group_workspace(memory: str, group: Any, rank: int, world: int, staging_bytes: int, *,
                    shm_dir: str = SHM_DIR, device_index: int = 0) -> Any:
    """This rank's workspace on provider ``memory`` (``host`` or a GPU provider's name: memory/providers.py)."""
    if memory == providers.HOST:
        return host_workspace(group, rank, world, staging_bytes, shm_dir)
    return device_workspace(memory, group, rank, world, staging_bytes, device_index)


def host_workspace(group: Any, rank: int, world: int, staging_bytes: int, shm_dir: str) -> HostWorkspace:
    """Rank 0 creates a shared workspace file in ``shm_dir``, every other rank maps it.

    No file outlives the call on a surviving rank. Rank 0 names the file to every rank before it
    creates it, and every rank that knows the name unlinks it as it leaves, mapped or failed
    (unlinking is idempotent): after success, once every rank has mapped it; after a failure, a
    survivor that raises removes a dead creator's file. A rank that raises has released its mapping.
    """
    layout = WorkspaceLayout(world, staging_bytes)
    path, ws, problem = None, None, None
    try:
        # Phase 1: every rank learns the file's name, before the file exists, and rank 0's staging size.
        seen = setup_phase.gather_status(group, world, ("ok", (shared_path(shm_dir) if rank == 0 else None,
                                                               staging_bytes)), OP)
        path, staging_seen = seen[0][1]
        if rank == 0:
            try:
                ws = HostWorkspace.create_shared(layout, path)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                problem = ("error", "unavailable", setup_phase.as_status(e)[2])
        elif staging_seen != staging_bytes:
            problem = ("error", "config", f"rank 0 uses staging_bytes={staging_seen}, rank {rank} uses "
                                          f"{staging_bytes}; every rank needs the same config")
        # Phase 2: the file exists, or every rank learns why not.
        setup_phase.raise_failures(OP, setup_phase.gather_status(group, world, problem or ("ok", None), OP),
                                   per_rank=True)
        if rank != 0:
            try:
                ws = HostWorkspace.open_shared(layout, path)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                problem = ("error", "unavailable", setup_phase.as_status(e)[2])
        # Phase 3: every rank has mapped the file, or every rank learns who could not.
        setup_phase.raise_failures(OP, setup_phase.gather_status(group, world, problem or ("ok", None), OP),
                                   per_rank=True)
    except BaseException:
        if ws is not None:
            ws.close()
        raise
    finally:
        if path is not None:
            unlink_shared(path)  # every rank has mapped it, or this rank gives up: nothing can leak
    return ws


def device_workspace(memory: str, group: Any, rank: int, world: int, staging_bytes: int, device_index: int) -> Any:
    """Every rank allocates its GPU workspace with provider ``memory`` and maps its peers'.

    The ranks first agree on (``staging_bytes``, ``memory``): an all-gather that is also the
    barrier, so a mismatch is a PurlinConfigError on every rank, naming every rank's value.
    """
    from . import device_provider

    mine = {"staging_bytes": staging_bytes, "memory": memory}
    seen = setup_phase.agree(OP, group, world, ("ok", mine))
    differ = [k for k in mine if any(v[k] != seen[0][k] for v in seen)]
    if differ:
        raise PurlinConfigError(
            f"{OP}: ranks disagree on "
            + "; ".join(f"{k} (" + ", ".join(f"rank {r}={v[k]!r}" for r, v in enumerate(seen)) + ")" for k in differ)
            + "; every rank needs the same config")
    layout = DeviceLayout(world, staging_bytes)
    return device_provider(memory).create(layout.rank_bytes, group, device_index, rank, world, layout=layout)


def report_started(group: Any, world: int, engine: str, start: Callable[[], None], cleanup: Callable[[], None]) -> None:
    """Run ``start()`` (this rank's local engine set-up), then tell every rank whether every rank managed.

    If any rank failed, ``cleanup()`` runs on every rank, then this rank's own error is re-raised
    (a rank that did start raises a PurlinUnavailableError naming the ranks that did not). If the
    exchange itself fails (a rank died or never came), ``cleanup()`` runs and this rank's own error,
    else the exchange's, is raised. An interrupt in ``start()`` runs ``cleanup()`` and is re-raised.
    """
    error = None
    try:
        start()
        mine = ("ok", None)
    except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised below
        error, mine = e, ("error", "unavailable", f"{type(e).__name__}: {e}")
    except BaseException:  # an interrupt: this rank stops here (its peers' exchange fails: their cleanup)
        cleanup()
        raise
    try:
        statuses = setup_phase.gather_status(group, world, mine, OP)
    except BaseException as exchange:
        cleanup()
        if error is not None:
            raise error from exchange
        raise
    failed = [(r, s[2]) for r, s in enumerate(statuses) if s[0] != "ok"]
    if failed:
        cleanup()
        if error is not None:
            raise error
        raise PurlinUnavailableError(f"{OP}: the {engine.upper()} engine failed to start on "
                                     + "; ".join(f"rank {r}: {m}" for r, m in failed))
