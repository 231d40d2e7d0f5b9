"""purlin_sglang/capture.py on the CPU: Communicator.capture() keeps Python's cyclic collector off while any
capture context of the process is open (overlapping contexts of several rank threads included) and puts
back the state it found; a communicator dropped while its thread captures is closed once the capture ends,
not inside it."""

from __future__ import annotations

import gc
import threading

import pytest

import purlin_sglang as ps
from purlin_sglang import api, capture


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_capture_contexts_of_several_ranks_pause_the_collector_until_the_last_exits(collector_on):
    inside, first_out = threading.Barrier(2), threading.Event()
    seen = {}

    def fn(comm):
        with comm.capture():
            inside.wait()
            seen[comm.rank, "inside"] = gc.isenabled()
            if comm.rank == 1:
                first_out.wait(10)  # rank 0 has left its context; mine is still open
                seen[1, "after rank 0 left"] = gc.isenabled()
        if comm.rank == 0:
            first_out.set()
        return True

    assert ps.run_virtual(2, fn) == [True, True]
    assert seen == {(0, "inside"): False, (1, "inside"): False, (1, "after rank 0 left"): False}
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(collector_on):
    gc.disable()
    with capture.collection_paused():
        assert not gc.isenabled()
    with capture.collection_paused():
        pass
    assert not gc.isenabled()


def test_a_communicator_dropped_while_capturing_is_closed_after_the_capture(monkeypatch):
    capturing = [True]
    monkeypatch.setattr(api, "capturing_here", lambda: capturing[0])
    monkeypatch.setattr(capture, "capturing_here", lambda: capturing[0])
    closed = []

    class Comm:
        def close(self):
            closed.append(self)

    with capture.collection_paused():
        c = Comm()
        api.Communicator.__del__(c)  # what the finaliser does when the collector or a refcount drops it
        assert closed == []
    assert closed == []  # the context ended, but this thread still captures (torch.cuda.graph outside it)
    capturing[0] = False
    with capture.collection_paused():
        pass
    assert closed == [c]
    api.Communicator.__del__(c)  # not capturing: closed at once
    assert closed == [c, c]
