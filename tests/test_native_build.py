"""The native module's build and its Python door (purlin_sglang.native); no GPU needed."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from purlin_sglang import native
from purlin_sglang.errors import PurlinUnavailableError, PurlinValueError

REPO = Path(__file__).resolve().parents[1]


def test_build_info_is_a_dict_with_the_keys():
    info = native.build_info()
    assert isinstance(info, dict)
    for key in ("built", "cuda", "archs", "nvcc", "reason"):
        assert key in info, key
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["archs"], list)
    if not info["cuda"]:
        assert isinstance(info["reason"], str) and info["reason"]


def test_module_imports_and_matches_build_info():
    mod = importlib.import_module("purlin_sglang._native")
    assert mod.abi_version() == native.ABI_VERSION
    assert json.loads(mod.build_info())["cuda"] == native.build_info()["cuda"]
    assert native.build_info()["built"] is True


def test_module_file_loads_with_ctypes():
    mod = importlib.import_module("purlin_sglang._native")
    lib = ctypes.CDLL(mod.__file__)
    lib.purlin_native_abi_version.restype = ctypes.c_int
    assert lib.purlin_native_abi_version() == native.ABI_VERSION
    lib.purlin_native_build_info.restype = ctypes.c_char_p
    info = json.loads(lib.purlin_native_build_info())
    assert info["cuda"] == hasattr(lib, "purlin_copy_atom")


def test_cuda_build_has_the_requested_archs():
    info = native.build_info()
    if not info["cuda"]:
        pytest.skip(f"built without CUDA: {info['reason']}")
    requested = os.environ.get("PURLIN_CUDA_ARCHS") or "90"
    wanted = [a for a in requested.replace(",", ";").replace(" ", ";").split(";") if a]
    assert set(wanted) <= set(info["archs"]), (wanted, info["archs"])
    assert info["nvcc"] and info["reason"] is None


def test_load_works_or_says_what_is_missing():
    try:
        lib = native.load()
    except PurlinUnavailableError as exc:
        assert str(exc).strip()
        return
    assert native.load() is lib  # cached
    assert lib.abi_version() == native.ABI_VERSION


def test_snac_launch_writes_the_call_fields_then_launches():
    """The module's snac_launch (an eager call's steady state, engines/cuda.py CudaEngine.launch) writes
    input, output and the call number into the struct it is given and returns purlin_snac_execute's code
    for that struct: here cudaErrorInvalidValue (1), as the struct names no ranks, so the launch is
    refused before any device is touched (this runs with or without a GPU)."""
    info = native.build_info()
    mod = importlib.import_module("purlin_sglang._native")
    assert hasattr(mod, "snac_launch") == info["cuda"]
    if not info["cuda"]:
        pytest.skip(f"built without CUDA: {info['reason']}")
    p = native.SnacParams()  # world 0: refused by the launch's checks
    p.desc_fp = 0x1234
    assert mod.snac_launch(ctypes.addressof(p), 0x1000, 0x2000, 7, 0) == 1
    assert (p.input, p.output, p.desc_seq, p.desc_fp) == (0x1000, 0x2000, 7, 0x1234)
    assert mod.snac_launch(ctypes.addressof(p), 0, 0x3000, 1 << 40, 0x5EED) == 1
    assert (p.input, p.output, p.desc_seq) == (None, 0x3000, 1 << 40)  # ctypes shows a null pointer as None
    lib = ctypes.CDLL(mod.__file__)
    lib.purlin_snac_execute.argtypes = [ctypes.POINTER(native.SnacParams), ctypes.c_void_p]
    assert lib.purlin_snac_execute(ctypes.byref(p), None) == 1  # the same answer through ctypes
    with pytest.raises(TypeError, match="takes 5 arguments"):
        mod.snac_launch(ctypes.addressof(p), 1, 2)
    with pytest.raises(ValueError, match="null pointer"):
        mod.snac_launch(0, 1, 2, 3, 0)
    with pytest.raises(TypeError):
        mod.snac_launch(ctypes.addressof(p), "x", 2, 3, 0)
    assert p.output == 0x3000  # a refused argument writes nothing


def test_copy_atom_rejects_bad_arguments_before_loading():
    with pytest.raises(PurlinValueError):
        native.copy_atom(0, 0, -1, 0)
    with pytest.raises(PurlinValueError):
        native.copy_atom(0, 0, 16, 0)
    with pytest.raises(PurlinValueError):
        native.copy_atom(1.5, 16, 16, 0)  # type: ignore[arg-type]


def test_import_has_no_side_effects():
    code = (
        "import sys, purlin_sglang.native as n; "
        "assert n._LIB is None; "
        "assert 'purlin_sglang._native' not in sys.modules, 'native module loaded at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_build_info_without_the_module(monkeypatch):
    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(native.importlib, "import_module", missing)
    info = native.build_info()
    assert info["built"] is False and info["cuda"] is False and "not built" in info["reason"]
    monkeypatch.setattr(native, "_LIB", None)
    with pytest.raises(PurlinUnavailableError, match="not built"):
        native.load()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not on PATH")
def test_host_only_build_says_why(tmp_path):
    """PURLIN_DISABLE_CUDA=1: the host-only module builds, reports why CUDA is missing, and exports the
    layout native.load() checks."""
    build = tmp_path / "build"
    env = dict(os.environ, PURLIN_DISABLE_CUDA="1")
    cfg = subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
         "-DCMAKE_BUILD_TYPE=Release"],
        env=env, capture_output=True, text=True,
    )
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    assert "WITHOUT CUDA" in cfg.stderr
    bld = subprocess.run(["cmake", "--build", str(build)], env=env, capture_output=True, text=True)
    assert bld.returncode == 0, bld.stdout + bld.stderr
    (so,) = list(build.rglob("_native*.so"))
    lib = ctypes.CDLL(str(so))
    lib.purlin_native_build_info.restype = ctypes.c_char_p
    info = json.loads(lib.purlin_native_build_info())
    assert info["cuda"] is False and info["archs"] == [] and info["nvcc"] is None
    assert "PURLIN_DISABLE_CUDA" in info["reason"]
    assert not hasattr(lib, "purlin_copy_atom")
    # The same layout as the CUDA build, checked the same way (native.load() does this first).
    assert native.layout_problems(native.native_layout(native._open_checked(str(so)))) == []
