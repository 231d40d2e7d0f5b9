"""Which peer processes of a group are still alive: a process is named by its pid and its start time
(``/proc/<pid>/stat``, clock ticks since boot), so a reused pid is not mistaken for the peer.

A rank reports its own identity (:func:`own_identity`) when its group sets up; a peer keeps
watching only the ranks whose pid, read in its own ``/proc``, shows the start time that rank
reported (:func:`watchable`): ranks in another pid namespace (another container) or on another
host are left out rather than misread. Linux only; elsewhere nothing is watched.
"""

from __future__ import annotations

import os
from typing import Optional


def start_ticks(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (field 22 of ``/proc/<pid>/stat``), or None where it cannot be
    read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # the command name (field 2) is in parentheses and may hold spaces: count after its ')'
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def own_identity() -> dict:
    """This process's pid and start time, for its peers (``start`` None where /proc cannot be read)."""
    pid = os.getpid()
    return {"pid": pid, "start": start_ticks(pid)}


def watchable(identities: dict[int, dict]) -> dict[int, tuple[int, int]]:
    """Of ``identities`` (rank -> :func:`own_identity` of that rank), the ranks this process can watch:
    rank -> (pid, start) where this process's /proc shows that pid with that start time."""
    out = {}
    for rank, ident in identities.items():
        pid, start = ident.get("pid"), ident.get("start")
        if isinstance(pid, int) and start is not None and start_ticks(pid) == start:
            out[rank] = (pid, start)
    return out


def exited(pid: int, start: int) -> bool:
    """Whether the process (``pid``, ``start``) has exited: no such pid, or a different process under it.
    A zombie (exited, not yet reaped) counts as exited."""
    now = start_ticks(pid)
    if now != start:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] in (b"Z", b"X")
    except (OSError, ValueError):
        return True
