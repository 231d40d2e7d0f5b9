"""The catalog: every shipped collective is a naming (input layout, output layout, consume op), the
planner knows none of them by name, and namings that describe no collective are rejected."""

import ast
import pathlib

import pytest

import purlin_sglang
from purlin_sglang.collectives import (
    ALL_GATHER, ALL_GATHER_V, ALL_REDUCE, ALL_TO_ALL, ALL_TO_ALL_V, BROADCAST, CATALOG, COPY, PACKED,
    PACKED_V, REDUCE, REDUCE_SCATTER, REDUCE_SCATTER_V, SCATTERED, SCATTERED_V, TRANSPOSED, TRANSPOSED_V,
    CollectiveSpec, Layout, LayoutKind, ReduceOp,
)
from purlin_sglang.errors import PurlinPlanError

SNAC = pathlib.Path(purlin_sglang.__file__).parent / "snac"

EXPECTED = {
    "all_reduce": ("packed", "packed", "reduce(sum)"),
    "all_gather": ("packed", "scattered", "copy"),
    "reduce_scatter": ("scattered", "packed", "reduce(sum)"),
    "all_to_all": ("scattered", "transposed", "copy"),
    "all_gather_v": ("packedV", "scatteredV", "copy"),
    "reduce_scatter_v": ("scatteredV", "packedV", "reduce(sum)"),
    "all_to_all_v": ("scatteredV", "transposedV", "copy"),
    "broadcast": ("packed@root", "packed", "copy"),
}


def test_the_eight_entries():
    assert set(CATALOG) == set(EXPECTED)
    for name, (i, o, c) in EXPECTED.items():
        spec = CATALOG[name]
        assert spec.name == name
        assert (spec.input.name, spec.output.name, spec.consume.name) == (i, o, c), spec
        assert str(spec) == f"{name}: {i} -> {o}, {c}"


def test_catalog_constants_are_the_catalog_entries():
    for spec in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, ALL_GATHER_V, REDUCE_SCATTER_V,
                 ALL_TO_ALL_V, BROADCAST):
        assert CATALOG[spec.name] is spec


def test_layout_properties():
    assert not PACKED.sliced and SCATTERED.sliced and TRANSPOSED.sliced
    assert PACKED_V.variable and SCATTERED_V.variable and TRANSPOSED_V.variable and not PACKED.variable
    assert PACKED.root() == Layout(LayoutKind.PACKED, False, True) and PACKED.root().rooted and not PACKED.rooted
    assert SCATTERED_V.root().name == "scatteredV@root"
    assert BROADCAST.rooted and not ALL_REDUCE.rooted
    assert ALL_GATHER_V.variable and not ALL_GATHER.variable
    assert REDUCE.reduce is ReduceOp.SUM and COPY.is_copy and not REDUCE.is_copy
    assert REDUCE.with_op("max").name == "reduce(max)" and COPY.with_op("max") is COPY


def test_planner_has_no_code_for_broadcast():
    files = sorted(SNAC.rglob("*.py"))  # the algorithms (snac/algorithms/) included
    assert len(files) >= 10, files  # planner.py, lower.py, plan.py, policy.py, registry.py and the algorithms
    for f in files:
        assert "broadcast" not in f.read_text().lower(), f"{f.name} mentions broadcast"


def _code_strings_and_names(tree):
    """Identifiers, attribute names and string constants that are not docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


def test_planner_code_knows_no_collective_by_name():
    names = set(CATALOG) | {n.upper() for n in CATALOG}
    for f in sorted(SNAC.rglob("*.py")):
        found = {tok for tok in _code_strings_and_names(ast.parse(f.read_text()))
                 if any(n in tok for n in names)}
        assert not found, f"{f.name} refers to collectives by name: {found}"


@pytest.mark.parametrize("inp,out,consume,why", [
    (PACKED, SCATTERED, REDUCE, "nothing to reduce"),  # reduce into a sliced output
    (SCATTERED, TRANSPOSED, REDUCE, "nothing to reduce"),
    (PACKED, PACKED, COPY, "every rank would copy into the same packed output"),  # copy into packed, unrooted
    (SCATTERED, PACKED, COPY, "every rank would copy into the same packed output"),
    (PACKED.root(), PACKED.root(), COPY, "a rooted input and a rooted output move nothing"),
    (PACKED.root(), PACKED.root(), REDUCE, "a rooted input and a rooted output move nothing"),
    (PACKED_V, SCATTERED, COPY, "both be V forms or both fixed"),  # fixed / V mix
    (SCATTERED, PACKED_V, REDUCE, "both be V forms or both fixed"),
    (SCATTERED, SCATTERED, COPY, "the input must be packed"),  # scattered output from a sliced input
    (TRANSPOSED, SCATTERED, COPY, "the input must be packed"),
    (SCATTERED_V, SCATTERED_V, COPY, "the input must be packed"),
    (PACKED, TRANSPOSED, COPY, "the input must be sliced"),
    (PACKED.root(), SCATTERED, COPY, "use a packed output"),
])
def test_invalid_namings_are_rejected(inp, out, consume, why):
    with pytest.raises(PurlinPlanError, match=why) as info:
        CollectiveSpec("bogus", inp, out, consume)
    assert "spec 'bogus'" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", ["", "all reduce", "a-b", "x;y"])
def test_spec_names_must_be_identifiers(name):
    with pytest.raises(PurlinPlanError, match="non-empty identifier"):
        CollectiveSpec(name, PACKED, SCATTERED, COPY)


def test_user_namings_that_are_valid():
    # the rooted namings used by the engine tests, and a few more: all accepted
    for spec in (CollectiveSpec("gather", PACKED, SCATTERED.root(), COPY),
                 CollectiveSpec("reduce", PACKED, PACKED.root(), REDUCE),
                 CollectiveSpec("scatter", SCATTERED.root(), PACKED, COPY),
                 CollectiveSpec("gather_v", PACKED_V, SCATTERED_V.root(), COPY),
                 CollectiveSpec("transpose_to_root", SCATTERED, TRANSPOSED.root(), COPY)):
        assert spec.rooted
    assert not CollectiveSpec("all_reduce2", PACKED, PACKED, REDUCE).rooted
