"""memory/procs.py: a peer process named by its pid and start time, watched through /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from purlin_sglang.memory.procs import exited, own_identity, start_ticks, watchable

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/stat"), reason="needs /proc (Linux)")


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_own_identity_reads_this_process_start_time():
    me = own_identity()
    assert me["pid"] == os.getpid() and isinstance(me["start"], int) and me["start"] > 0
    assert start_ticks(me["pid"]) == me["start"] and not exited(me["pid"], me["start"])


def test_only_peers_whose_pid_shows_their_start_time_are_watched():
    child = _sleeper()
    try:
        me, start = own_identity(), start_ticks(child.pid)
        peers = watchable({0: me, 1: {"pid": child.pid, "start": start}, 2: {"pid": child.pid, "start": start + 1},
                           3: {"pid": child.pid, "start": None}, 4: {"pid": 2 ** 22 + 7, "start": 5}})
        assert peers == {0: (me["pid"], me["start"]), 1: (child.pid, start)}  # 2: another process under that pid
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("reaped", [False, True], ids=["zombie", "reaped"])
def test_a_killed_peer_is_seen_as_exited(reaped):
    child = _sleeper()
    start = start_ticks(child.pid)
    assert not exited(child.pid, start)
    child.kill()
    if reaped:
        child.wait()
    else:  # killed, not yet waited for: a zombie until its parent reaps it
        deadline = time.monotonic() + 10
        while not exited(child.pid, start) and time.monotonic() < deadline:
            time.sleep(0.01)
    try:
        assert exited(child.pid, start)
        assert exited(child.pid, start + 1)  # a pid whose start time changed: another process
    finally:
        child.wait()


def test_the_ipc_workspace_names_its_lost_peers():
    from purlin_sglang.memory.ipc import IpcWorkspace

    child = _sleeper()
    ws = IpcWorkspace.__new__(IpcWorkspace)  # the set-up needs a GPU; lost_peers reads only ws.peers
    ws.peers = watchable({1: {"pid": child.pid, "start": start_ticks(child.pid)}, 2: own_identity()})
    assert ws.lost_peers() == {}
    child.kill()
    child.wait()
    assert ws.lost_peers() == {1: child.pid}
