"""The host workspace file (memory/host.py, memory/bootstrap.py) outlives no failure: whichever rank of a
process group is SIGKILLed, at whatever point of ``Communicator(...)`` or of its use, no ``purlin-*`` file
is left in ``shm_dir`` and no survivor still maps one once the surviving ranks have raised, without any
later construction on the host to clean up.

Each case is one launch of two real processes (a gloo group) with a private ``shm_dir``. The victim
kills itself with SIGKILL at a set-up phase boundary (``setup_phase.gather_status``, where every rank
waits for every other), counted from the start of its construction, from the moment its own
workspace file is mapped, or from the moment the group's workspace is built; or in use, after a
collective. The survivor records at once, when it has raised, the files in ``shm_dir`` and its own
mappings of them. The construction cases fail for a lifetime in which only rank 0 unlinks the file,
or in which a survivor's error path keeps its mapping until garbage collection.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.errors import PurlinError
from purlin_sglang.memory import bootstrap, host, setup_phase
from purlin_sglang.testing import WorkerError, launch

TIMEOUT_S = 2.0  # the communicators' timeout_s: every survivor raises within it (plus process start-up)
MARKER = "victim-at-kill-point"


def _purlin_files(d) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.startswith("purlin-"))


def _mappings(d) -> list[str]:
    """This process's mappings of workspace files in ``d`` (an unlinked one shows as ``... (deleted)``)."""
    prefix = os.path.join(os.path.realpath(d), "purlin-")
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if prefix in line]


def _config(shm_dir) -> dict:
    return {"staging_bytes": 64 * 1024, "timeout_s": TIMEOUT_S, "shm_dir": str(shm_dir)}


def _die_at_kill_point(signals) -> None:
    with open(os.path.join(signals, MARKER), "w"):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_after(owner, name: str, state: dict) -> None:
    orig = getattr(owner, name)

    def armed_on_return(*a, **k):
        out = orig(*a, **k)
        state["armed"] = True
        return out

    setattr(owner, name, armed_on_return)


def _arm(signals, after: str, nth: int) -> None:
    """SIGKILL this process at its ``nth`` set-up wait after ``after``: ``start`` (the construction
    starts), ``mapped`` (its own workspace file has been created or opened, and mapped) or ``built``
    (every rank has mapped it: the group's workspace is made, the engines start next)."""
    state = {"armed": after == "start", "waits": 0}
    if after == "mapped":
        _arm_after(host.HostWorkspace, "create_shared", state)
        _arm_after(host.HostWorkspace, "open_shared", state)
    elif after == "built":
        _arm_after(bootstrap, "group_workspace", state)
    gather = setup_phase.gather_status

    def gather_or_die(*a, **k):
        if state["armed"]:
            state["waits"] += 1
            if state["waits"] == nth:
                _die_at_kill_point(signals)
        return gather(*a, **k)

    setup_phase.gather_status = gather_or_die


def _wait_for_marker(signals, limit_s: float = 60.0) -> None:
    path, deadline = os.path.join(signals, MARKER), time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the victim never reached its kill point ({path})")
        time.sleep(0.01)


def _mp_killed_in_construction(rank, world, shm_dir, signals, victim, after, nth, late):
    if rank == victim:
        _arm(signals, after, nth)
        ps.Communicator(config=_config(shm_dir))
        return "constructed"  # the kill point was never reached: the test fails on this
    if late:  # a late peer: the victim is already waiting for it (and killed there)
        _wait_for_marker(signals)
    t0 = time.monotonic()
    try:
        ps.Communicator(config=_config(shm_dir)).close()
    except PurlinError as e:  # at once, as the survivor raises
        return type(e).__name__, str(e), time.monotonic() - t0, _purlin_files(shm_dir), _mappings(shm_dir)
    return "constructed", None, time.monotonic() - t0, _purlin_files(shm_dir), _mappings(shm_dir)


def _check_survivor(info, victim: int, shm_dir) -> None:
    e = info.value
    assert e.failures[victim].kind == "died" and e.failures[victim].exitcode == -signal.SIGKILL, e
    survivor = 1 - victim
    assert survivor not in e.failures, e.failures.get(survivor)
    kind, msg, secs, files, maps = e.results[survivor]
    assert kind != "constructed", "the survivor built a communicator without its dead peer"
    assert msg.startswith("Communicator: "), msg
    assert secs < TIMEOUT_S + 8, secs
    assert files == [], f"left in shm_dir once the survivor raised: {files}"
    assert maps == [], f"still mapped by the survivor once it raised: {maps}"
    assert _purlin_files(shm_dir) == []


@pytest.mark.parametrize("victim, after, nth, late", [
    (0, "start", 1, True),  # the creator, waiting for a late peer
    (0, "mapped", 1, False),  # the creator, right after creating and mapping the file
    (0, "mapped", 2, False),  # the creator, after its peer has had the file to map
    (1, "start", 1, False),  # the peer, before it maps the file
    (1, "mapped", 1, False),  # the peer, right after mapping the file
    (0, "built", 1, False),  # the creator, while the engines start (the file is unlinked by then)
], ids=["creator-waits-for-late-peer", "creator-after-create", "creator-after-peer-mapped",
        "peer-before-map", "peer-after-map", "creator-as-engines-start"])
def test_a_rank_killed_in_construction_leaves_no_file(tmp_path, victim, after, nth, late):
    shm_dir, signals = tmp_path / "shm", tmp_path / "signals"
    shm_dir.mkdir()
    signals.mkdir()
    with pytest.raises(WorkerError) as info:
        launch(_mp_killed_in_construction, 2, str(shm_dir), str(signals), victim, after, nth, late,
               timeout_s=60, fail_grace_s=20)
    _check_survivor(info, victim, shm_dir)


def _mp_killed_in_use(rank, world, shm_dir, victim):
    comm = ps.Communicator(config=_config(shm_dir))
    total = comm.all_reduce(torch.ones(4)).sum().item()
    files, maps = _purlin_files(shm_dir), len(_mappings(shm_dir))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
    except PurlinError as e:
        return total, files, maps, type(e).__name__, time.monotonic() - t0, _purlin_files(shm_dir), _mappings(shm_dir)
    return total, files, maps, "no error", None, None, None


@pytest.mark.parametrize("victim", [0, 1], ids=["creator", "peer"])
def test_a_rank_killed_in_use_leaves_no_file(tmp_path, victim):
    """While the communicator is in use the file is already unlinked (only the mappings hold the
    memory); the survivor's call times out and releases its mapping at once."""
    with pytest.raises(WorkerError) as info:
        launch(_mp_killed_in_use, 2, str(tmp_path), victim, timeout_s=60, fail_grace_s=20)
    e = info.value
    assert e.failures[victim].kind == "died" and e.failures[victim].exitcode == -signal.SIGKILL, e
    survivor = 1 - victim
    assert survivor not in e.failures, e.failures.get(survivor)
    total, files, maps, kind, secs, files_after, maps_after = e.results[survivor]
    assert total == 8.0
    assert files == [] and maps == 1, (files, maps)  # in use: mapped, already unlinked
    assert kind == "PurlinTimeoutError", kind
    assert secs < TIMEOUT_S + 8, secs
    assert files_after == [] and maps_after == [], (files_after, maps_after)
    assert _purlin_files(tmp_path) == []


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                       check=True)
    return int(p.stdout)


def test_remove_stale_takes_only_files_of_dead_creators(tmp_path):
    """The safety net for a group whose every rank died at once: the next construction on the host
    removes a file whose creator is dead, and nothing else."""
    dead, live = _dead_pid(), os.getpid()
    names = [f"purlin-{dead}-0123456789ab", f"purlin-{live}-0123456789ab", "purlin-notes", "other-1-0123456789ab"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert host.remove_stale(str(tmp_path)) == [names[0]]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])


def test_an_interrupt_while_the_engine_starts_runs_the_cleanup_and_is_raised():
    from purlin_sglang.memory import bootstrap

    cleaned = []

    def start():
        raise KeyboardInterrupt

    def exchange(*a, **k):  # never reached: the interrupted rank does not report
        raise AssertionError("the exchange ran")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bootstrap.setup_phase, "gather_status", exchange)
        with pytest.raises(KeyboardInterrupt):
            bootstrap.report_started(None, 2, "cpu", start, lambda: cleaned.append(True))
    assert cleaned == [True]
