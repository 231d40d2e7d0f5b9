"""The framework-neutral routed communicator (purlin_sglang.routed): no framework imported, the
routing table and its counters, the deterministic mode as an argument, config errors naming the
caller's flag. The SGLang adapter's own tests (tests/sglang) run through it too."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

import _routed_workers as W
import purlin_sglang.routed as routed
from purlin_sglang.errors import PurlinConfigError
from purlin_sglang.routed import PluginConfig
from purlin_sglang.testing import launch

FRAMEWORKS = ("sglang", "vllm", "purlin_sglang.sglang")


def test_the_routed_layer_imports_no_framework():
    for path in sorted(Path(routed.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if isinstance(node, ast.ImportFrom) and node.level:
                names = ["purlin_sglang." * (node.level == 2) + (node.module or "")]
            for n in names:
                assert not any(n == f or n.startswith(f + ".") for f in FRAMEWORKS), (path.name, n)


@pytest.mark.parametrize("deterministic", [False, True])
def test_routes_counts_and_the_deterministic_mode(deterministic):
    facts = launch(W.convention, 2, deterministic, timeout_s=120)
    for f in facts:
        # deterministic: every enabled reduction on purlin at every size; the copy ops keep their bounds
        assert f["served_big"] is deterministic, f
        want = {"all_gather/size": 1} if deterministic else {"all_gather/size": 1, "all_reduce/size": 1}
        assert f["fallbacks"] == want, f
        assert f"routed all_reduce={2 if deterministic else 1}" in f["summary"], f


def test_config_errors_name_the_callers_flag(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing:\n  all_reduce:\n    max_byte: 4\n")
    with pytest.raises(PurlinConfigError, match=r"^--my-flag .*bad.yaml: unknown key 'routing.all_reduce.max_byte'"):
        PluginConfig.from_yaml(bad, flag="--my-flag")
    with pytest.raises(PurlinConfigError, match=r"^config .*bad.yaml"):
        PluginConfig.from_yaml(bad)


def test_error_watch_seconds_are_a_plugin_key():
    assert PluginConfig().error_watch_s == 0.5
    assert PluginConfig.from_dict({"error_watch_s": 0, "report_interval_s": 3}).error_watch_s == 0.0
    with pytest.raises(PurlinConfigError, match="key 'error_watch_s': need seconds >= 0"):
        PluginConfig.from_dict({"error_watch_s": -1})


class _Watched:
    """What the error watch reads of a communicator: pending_error(), lost_peers() and config.timeout_s."""

    config = types.SimpleNamespace(timeout_s=20.0)
    looks = 0

    def pending_error(self):
        self.looks += 1
        return None

    def lost_peers(self):
        return {}


class _Recording(_Watched):
    """A communicator whose device records an error at its ``after``-th look (pending_error)."""

    def __init__(self, after):
        self.after, self.looks = after, 0

    def pending_error(self):
        from purlin_sglang.errors import PurlinTimeoutError

        self.looks += 1
        if self.after is None or self.looks < self.after:
            return None
        return PurlinTimeoutError("all_reduce: rank 1 waited 20s at op #0 (notify wait) for rank 0", op="all_reduce",
                                  rank=1, missing=[0])


def _watcher():
    import threading

    rc = routed.RoutedCommunicator.__new__(routed.RoutedCommunicator)
    rc.name, rc.rank, rc._watch_stop = "tp", 1, threading.Event()
    return rc


def _run_watch(rc, comm, looks: int) -> None:
    """The watch thread over ``comm`` until it has looked ``looks`` times, then stopped as destroy() does."""
    import threading

    t = threading.Thread(target=rc._watch_errors, args=(comm, 0.01))
    t.start()
    while comm.looks < looks and t.is_alive():
        t.join(0.02)
    rc._watch_stop.set()
    t.join(10)
    assert not t.is_alive()


def test_the_error_watch_logs_each_recorded_error_once(caplog):
    rc, comm = _watcher(), _Recording(after=3)
    with caplog.at_level("ERROR", logger="purlin_sglang.routed.communicator"):
        _run_watch(rc, comm, 10)  # the same record seen again and again: logged once
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["purlin[tp]: rank 1: PurlinTimeoutError: all_reduce: rank 1 waited 20s at op #0 (notify wait) "
                     "for rank 0"]


def test_the_error_watch_ends_when_the_group_is_destroyed():
    import threading

    rc, comm = _watcher(), _Recording(after=None)
    t = threading.Thread(target=rc._watch_errors, args=(comm, 0.01))
    t.start()
    time_limit = 10
    while comm.looks < 2 and time_limit > 0:
        t.join(0.05)
        time_limit -= 0.05
    rc._watch_stop.set()  # what destroy() does
    t.join(10)
    assert not t.is_alive() and comm.looks >= 2


def test_the_error_watch_logs_a_later_error_after_one_was_cleared(caplog):
    from purlin_sglang.errors import PurlinCapacityError, PurlinTimeoutError

    overflow = PurlinCapacityError("moe_dispatch: rank 0 routed 9 rows to expert 3, more than capacity=8", rank=0,
                                   expert=3, count=9, capacity=8)
    timeout = PurlinTimeoutError("moe_combine: rank 1 waited 20s for rank 0's done word", op="moe_combine", rank=1,
                                 missing=[0])
    seen = [None, overflow, overflow, None, timeout]  # the overflow raised (cleared) by a call, then a timeout

    class Sequence(_Watched):
        def pending_error(self):
            self.looks += 1
            return seen[min(self.looks, len(seen)) - 1]

    rc, comm = _watcher(), Sequence()
    with caplog.at_level("ERROR", logger="purlin_sglang.routed.communicator"):
        _run_watch(rc, comm, 12)
    assert [r.getMessage().split(": ", 2)[2].split(":")[0] for r in caplog.records] == [
        "PurlinCapacityError", "PurlinTimeoutError"]


def test_the_error_watch_logs_each_peer_that_exits_once(caplog):
    class Losing(_Watched):
        def pending_error(self):
            return None

        def lost_peers(self):
            self.looks += 1
            return {} if self.looks < 3 else {2: 4242} if self.looks < 5 else {0: 4240, 2: 4242}

    rc, comm = _watcher(), Losing()
    with caplog.at_level("ERROR", logger="purlin_sglang.routed.communicator"):
        _run_watch(rc, comm, 10)
    assert [r.getMessage() for r in caplog.records] == [
        f"purlin[tp]: rank 1: peer rank {peer} (pid {pid}) has exited; this rank's calls that need it end with "
        "PurlinTimeoutError after timeout_s (20s)" for peer, pid in ((2, 4242), (0, 4240))]
