"""Algorithms are registered units: one selector returns a registry entry, and nothing else branches on
algorithm names. A new algorithm is one module and its registration: the toy algorithms here (copies of
the one-shot under new names) are registered from this test alone and become selectable, by
``tuning.algorithm`` and by their own ``auto`` rule, and run on the CPU engine."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch

import purlin_sglang
import purlin_sglang as ps
from purlin_sglang import abi
from purlin_sglang.collectives import CATALOG
from purlin_sglang.errors import PurlinConfigError, PurlinPlanError, PurlinValueError
from purlin_sglang.snac import Sizes, TuningPolicy, lower, make_plan, registry, select
from purlin_sglang.snac.algorithms import BUILTIN, direct, direct_twoshot, hybrid, oneshot, packet, twoshot
from purlin_sglang.testing.collectives import COLLECTIVES, case, check_case

PACKAGE = pathlib.Path(purlin_sglang.__file__).parent
ALGORITHMS = PACKAGE / "snac" / "algorithms"
AR = CATALOG["all_reduce"]


def _toy(name: str, **changes) -> registry.Algorithm:
    """The one-shot under another name: forced by that name only, never taken by ``auto``, no fallback."""
    fields = dict(name=name, forced_by=(name,), auto=None, fallback=False, tunable=False, priority=5)
    return dataclasses.replace(oneshot.ALGORITHM, **{**fields, **changes})


@pytest.fixture
def toy():
    entry = registry.register(_toy("toy"))
    yield entry
    registry.unregister("toy")


def test_the_builtin_registry():
    assert registry.names() == ("packet", "hybrid", "oneshot", "twoshot", "direct", "direct-twoshot")
    assert registry.registered() == BUILTIN
    assert registry.fallback() is oneshot.ALGORITHM
    assert registry.forced_names() == ("packet", "oneshot", "twoshot")
    kinds = {e.name: e.kernel for e in BUILTIN}
    assert kinds == {"packet": abi.KERNEL_PACKET, "hybrid": None, "oneshot": abi.KERNEL_STAGED,
                     "twoshot": abi.KERNEL_STAGED, "direct": abi.KERNEL_STAGED, "direct-twoshot": abi.KERNEL_STAGED}
    assert registry.heap_form(oneshot.ALGORITHM) is direct.ALGORITHM
    assert registry.heap_form(twoshot.ALGORITHM) is direct_twoshot.ALGORITHM
    assert registry.heap_form(packet.ALGORITHM) is None and registry.heap_form(hybrid.ALGORITHM) is None


def test_the_selector_returns_registry_entries():
    policy = TuningPolicy()
    assert select(AR, 1024, policy, packets=True, world=4) is packet.ALGORITHM
    assert select(AR, 1024, policy, packets=False, world=4) is oneshot.ALGORITHM
    assert select(AR, 1 << 20, policy, packets=True, world=4) is twoshot.ALGORITHM
    assert select(CATALOG["all_to_all_v"], 1 << 20, policy, packets=True, world=4, push=1 << 20) is hybrid.ALGORITHM
    assert select(AR, 1024, TuningPolicy(algorithm="twoshot"), packets=True, world=4) is twoshot.ALGORITHM
    # a forced algorithm the collective lacks: the fallback
    assert select(CATALOG["all_gather"], 1 << 20, TuningPolicy(algorithm="twoshot"), world=4) is oneshot.ALGORITHM


def test_an_unregistered_name_is_refused_until_it_is_registered():
    with pytest.raises(PurlinConfigError, match="tuning.algorithm"):
        ps.PurlinConfig.from_dict({"tuning": {"algorithm": "toy"}})
    with pytest.raises(PurlinPlanError, match=r"all_reduce: algorithm must be 'packet', .* or 'direct-twoshot', "
                                              r"got 'toy'"):
        make_plan(AR, 2, 0, staging_bytes=1 << 16, algorithm="toy")
    registry.register(_toy("toy"))
    try:
        assert ps.PurlinConfig.from_dict({"tuning": {"algorithm": "toy"}}).tuning.algorithm == "toy"
        assert make_plan(AR, 2, 0, staging_bytes=1 << 16, algorithm="toy").algorithm == "toy"
    finally:
        registry.unregister("toy")
    with pytest.raises(PurlinConfigError, match="tuning.algorithm"):
        ps.PurlinConfig.from_dict({"tuning": {"algorithm": "toy"}})


def test_a_registered_algorithm_is_selectable_and_runs_on_the_cpu_engine(toy):
    assert select(AR, 4096, TuningPolicy(algorithm="toy"), world=3) is toy
    plan = make_plan(AR, 3, 1, staging_bytes=1 << 16, policy=TuningPolicy(algorithm="toy"))
    same = make_plan(AR, 3, 1, staging_bytes=1 << 16, algorithm="oneshot")
    assert plan.algorithm == "toy" and plan.program == same.program and plan.key != same.key  # its own name
    sizes = Sizes((4096,), (4096,))
    assert lower(plan, sizes).ops == lower(same, sizes).ops  # its lowering: the one-shot's
    cases = [case(coll, torch.float32, rows=rows, width=5, seed=rows, root=1, salt=rows)
             for coll in COLLECTIVES for rows in (1, 4)]

    def fn(comm):
        for c in cases:
            check_case(comm, c, paths=("out", "inplace"))
        ran = {call.sched.plan.algorithm for call in comm._path.calls.values()}
        return ran, comm.algorithm("all_reduce", 4096), comm.algorithm("all_to_all_v", 4096)

    for ran, chosen, v_chosen in ps.run_virtual(3, fn, config={"staging_bytes": 1 << 16, "timeout_s": 20,
                                                                "tuning": {"algorithm": "toy"}}):
        assert ran == {"toy"} and chosen == v_chosen == "toy"


def test_a_registered_auto_rule_takes_calls_by_its_priority():
    small = registry.register(_toy("tiny", auto=lambda sel: sel.nbytes is not None and sel.nbytes <= 64,
                                   priority=100))
    try:
        assert select(AR, 64, TuningPolicy(), packets=True, world=2) is small  # above packet's priority
        assert select(AR, 65, TuningPolicy(), packets=True, world=2) is packet.ALGORITHM
        got = ps.run_virtual(2, lambda c: (c.algorithm("all_gather", 64), c.algorithm("all_gather", 4096),
                                           check_case(c, case("all_gather", torch.int32, rows=4, width=4))))
        assert [g[:2] for g in got] == [("tiny", "oneshot")] * 2
    finally:
        registry.unregister("tiny")
    assert select(AR, 64, TuningPolicy(), packets=True, world=2) is packet.ALGORITHM


def test_the_registry_refuses_clashes():
    with pytest.raises(PurlinValueError, match="'oneshot' is already registered"):
        registry.register(oneshot.ALGORITHM)
    with pytest.raises(PurlinValueError, match="already is one"):
        registry.register(_toy("second_fallback", fallback=True))
    assert registry.find("second_fallback") is None
    with pytest.raises(PurlinValueError, match="no algorithm 'nope' is registered"):
        registry.unregister("nope")
    with pytest.raises(PurlinValueError, match="expected an Algorithm"):
        registry.register("oneshot")


def _code_strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, value) of the string constants of ``path`` that are not docstrings."""
    tree = ast.parse(path.read_text())
    scopes = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, scopes) and ast.get_docstring(n) is not None}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


# The kind of a packet wait (abi.KIND_NAMES: the name a timeout message gives it), not an algorithm.
_NOT_AN_ALGORITHM = {("abi.py", "packet")}


def test_no_code_outside_the_algorithms_names_an_algorithm():
    names = set(registry.names())
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ALGORITHMS in path.parents:
            continue
        for line, value in _code_strings(path):
            if value in names and (path.name, value) not in _NOT_AN_ALGORITHM:
                found.append(f"{path.relative_to(PACKAGE)}:{line} {value!r}")
    assert not found, "algorithm names outside snac/algorithms/ (read a registry entry instead): " + ", ".join(found)


def test_the_name_check_finds_a_branch_on_a_name(tmp_path):
    f = tmp_path / "engine.py"
    f.write_text('"""Docstrings may say packet."""\nKIND = int(plan.algorithm == "packet")\n')
    assert _code_strings(f) == [(2, "packet")]
