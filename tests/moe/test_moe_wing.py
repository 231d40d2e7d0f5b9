"""The MoE wing keeps its shape: read from the source with ``ast``, no GPU needed.

* Every MoE module is in ``purlin_sglang/moe/``: the layers below it (collectives/, snac/, engines/,
  memory/) hold no MoE module or class and do not import the wing; the engine registry names each
  MoE part by import path.
* A MoE part sees the Communicator only through its MoEContext: the wing never names the
  communicator, never reads one of its private attributes, never imports the API.
* Both engines' parts implement the contract (moe/engine.py MoEEngine).
* The CUDA part decodes its error record through ``native.MOE_ERROR_CODES``: with the table's codes
  permuted, the same records still decode to the same errors.
* ``moe.max_tokens_per_rank`` is compared with a token count in moe/limits.py only, and no capacity
  is computed from it anywhere else.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import numpy as np
import pytest

import purlin_sglang
from purlin_sglang import engines, errors, native
from purlin_sglang.moe.engine import MoEEngine

ROOT = Path(purlin_sglang.__file__).parent
WING = ROOT / "moe"
BELOW = ("collectives", "snac", "engines", "memory")  # the layers the wing sits on
# What the wing may import of the package: the layers below it, and itself.
WING_IMPORTS = {"abi", "capture", "collectives", "config", "errors", "memory", "moe", "native"}
# Fields of MoEDispatch that hold a MoE part's own state of a call (the parts read them; not the Communicator's).
DISPATCH_PRIVATE = {"_engine", "_owner"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT.parent))


def _imported_parts(path: Path) -> set[str]:
    """The parts of the package (``x`` of ``purlin_sglang.x``) that ``path`` imports, deferred imports included."""
    here = path.relative_to(ROOT.parent).parts[:-1]  # the package a relative import of level 1 names
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - (node.level - 1)]) + (node.module.split(".") if node.module else [])
            else:
                base = (node.module or "").split(".")
            names = [base + [a.name] for a in node.names] if len(base) == 1 else [base]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        out.update(n[1] for n in names if n[0] == "purlin_sglang" and len(n) > 1)
    return out


def _communicator_private_names() -> set[str]:
    """Every private attribute and method of api.Communicator (``self._x``, ``def _x``)."""
    cls = next(n for n in ast.walk(_tree(ROOT / "api.py")) if isinstance(n, ast.ClassDef) and n.name == "Communicator")
    names = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == "self" and n.attr.startswith("_") and not n.attr.startswith("__")}
    names |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
              and not n.name.startswith("__")}
    return names


def communicator_findings(path: Path, private: set[str]) -> list[str]:
    """Where ``path`` names the communicator, reads a private attribute of the context, or names one of the
    Communicator's private attributes (as an attribute or as a getattr string)."""
    found = []
    for node in ast.walk(_tree(path)):
        where = f"{_rel(path)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Name) and node.id in ("comm", "communicator"):
            found.append(f"{where}: names the communicator ({node.id})")
        elif isinstance(node, ast.arg) and node.arg in ("comm", "communicator"):
            found.append(f"{where}: takes the communicator ({node.arg})")
        elif isinstance(node, ast.Attribute):
            base = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if node.attr in ("comm", "communicator"):
                found.append(f"{where}: holds the communicator (.{node.attr})")
            elif base == "ctx" and node.attr.startswith("_"):
                found.append(f"{where}: reads the context's private .{node.attr}")
            elif node.attr in private - DISPATCH_PRIVATE:
                found.append(f"{where}: reads the Communicator's private .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in private - DISPATCH_PRIVATE:
            found.append(f"{where}: names the Communicator's private {node.value!r}")
    return found


def test_the_wing_never_reaches_into_the_communicator():
    private = _communicator_private_names()
    assert {"_vworld", "_engine", "_moe"} <= private  # what the check is for
    found = [f for path in sorted(WING.glob("*.py")) for f in communicator_findings(path, private)]
    assert not found, "MoE code must see the Communicator only through its MoEContext:\n" + "\n".join(found)


def test_the_wing_imports_only_the_layers_below_it():
    found = [f"{_rel(p)} imports purlin_sglang.{part}" for p in sorted(WING.glob("*.py"))
             for part in sorted(_imported_parts(p) - WING_IMPORTS)]
    assert not found, "the MoE wing imports only " + ", ".join(sorted(WING_IMPORTS)) + ":\n" + "\n".join(found)


def misplaced_moe(root: Path) -> list[str]:
    """MoE modules and classes under the layers below the wing, and their imports of it."""
    found = []
    for layer in BELOW:
        for path in sorted((root / layer).rglob("*.py")):
            if "moe" in path.name.lower():
                found.append(f"{_rel(path)}: a MoE module outside purlin_sglang/moe/")
            for node in ast.walk(_tree(path)):
                if isinstance(node, ast.ClassDef) and "moe" in node.name.lower():
                    found.append(f"{_rel(path)}:{node.lineno}: class {node.name} belongs in purlin_sglang/moe/")
            if "moe" in _imported_parts(path):
                found.append(f"{_rel(path)}: imports the MoE wing (it sits above {layer}/)")
    return found


def test_every_moe_module_is_in_the_wing():
    found = misplaced_moe(ROOT)
    assert not found, "\n".join(found)


def test_the_registry_builds_each_engines_moe_part_from_the_wing():
    for info in engines.ENGINES:
        module, _, name = info.moe.partition(":")
        assert module.startswith("purlin_sglang.moe."), info
        cls = getattr(importlib.import_module(module), name)
        members = [m for m in vars(MoEEngine) if not m.startswith("_")] + list(MoEEngine.__annotations__)
        missing = [m for m in members if not hasattr(cls, m)]
        assert not missing, f"{info.moe} lacks {missing} of the MoE engine contract"
        assert list(inspect.signature(cls).parameters) == ["ctx"], f"{info.moe} is built with a MoEContext only"


# -- the error record, through the ABI table --------------------------------------------------------------
def _record(code: int, kind: int = 0) -> np.ndarray:
    from purlin_sglang.moe.cuda import RECORD_FIELDS

    words = np.zeros(native.MOE_ERROR_WORDS, dtype=np.int64)
    values = {"code": code, "kind": kind, "rank": 1, "peer": 0, "expert": 3, "count": 9, "cap": 4, "epoch": 7}
    for i, field in enumerate(RECORD_FIELDS):
        words[i] = values.get(field, 0)
    return words


EXPECTED = {"TIMEOUT": (errors.PurlinTimeoutError, True), "OVERFLOW": (errors.PurlinCapacityError, False),
            "BAD_IDS": (errors.PurlinValueError, False), "MISMATCH": (errors.PurlinMismatchError, True),
            "REJECTED": (errors.PurlinValueError, False)}


@pytest.mark.parametrize("shift", [0, 1, 3], ids=["as built", "permuted", "permuted again"])
def test_the_error_record_is_decoded_through_the_abi_table(monkeypatch, shift):
    from purlin_sglang.moe.cuda import KIND_COMBINE, recorded_error

    names = list(native.MOE_ERROR_CODES)
    assert set(names) == set(EXPECTED)
    values = [native.MOE_ERROR_CODES[n] for n in names]
    table = {n: values[(i + shift) % len(values)] for i, n in enumerate(names)}
    monkeypatch.setattr(native, "MOE_ERROR_CODES", table)
    assert recorded_error(_record(0), 5.0) is None
    for name, (cls, fatal) in EXPECTED.items():
        error, got_fatal = recorded_error(_record(table[name]), 5.0)
        assert type(error) is cls and got_fatal is fatal, (name, error)
    error, _ = recorded_error(_record(table["TIMEOUT"], kind=KIND_COMBINE), 5.0)
    assert "moe_combine" in str(error) and "done word" in str(error)
    error, _ = recorded_error(_record(table["OVERFLOW"]), 5.0)
    assert (error.rank, error.expert, error.count, error.capacity) == (0, 3, 9, 4)


# -- each limit decided once ------------------------------------------------------------------------------
LIMIT = "max_tokens_per_rank"


def _mentions_limit(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == LIMIT for n in ast.walk(node))


def limit_findings(root: Path) -> list[str]:
    """Comparisons with moe.max_tokens_per_rank, and capacities computed from it, outside moe/limits.py."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root) == Path("moe", "limits.py"):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Compare) and _mentions_limit(node):
                found.append(f"{_rel(path)}:{node.lineno}: compares with {LIMIT} (ask moe.limits.token_excess)")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _mentions_limit(node.value or ast.Pass()):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any("cap" in ast.unparse(t).lower() for t in targets):
                    found.append(f"{_rel(path)}:{node.lineno}: a capacity from {LIMIT} "
                                 "(ask moe.limits.default_capacity)")
    return found


def test_each_moe_limit_is_decided_in_moe_limits():
    found = limit_findings(ROOT)
    assert not found, "\n".join(found)
