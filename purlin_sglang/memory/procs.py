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


def _stat(pid: int) -> Optional[list[bytes]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, first), or None where
    it cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # the command name may hold spaces: count after its ')'
    return fields if len(fields) > 19 else None


def start_ticks(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (field 22 of ``/proc/<pid>/stat``), or None where it cannot be
    read (no such process, no /proc)."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except ValueError:
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
    A zombie (exited, not yet reaped) counts as exited. One read of /proc."""
    fields = _stat(pid)
    if fields is None or fields[19] != str(start).encode():
        return True
    return fields[0] in (b"Z", b"X")
