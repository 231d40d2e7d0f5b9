"""native.reduce_atom's argument checks and codes; no GPU needed (nothing reaches CUDA)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from purlin_sglang import native
from purlin_sglang.collectives import ReduceOp
from purlin_sglang.errors import PurlinValueError

HEADER = Path(__file__).resolve().parents[1] / "native" / "include" / "purlin" / "native.h"
P = 1 << 20  # a plausible, 16-byte aligned device address: never dereferenced here


class _FakeLib:
    """Stands in for the ctypes library: records purlin_reduce_atom calls."""

    def __init__(self):
        self.calls = []

    def purlin_reduce_atom(self, dst, srcs, nsrc, nbytes, dtype, op, stream, max_blocks, device):
        self.calls.append((dst, [srcs[i] for i in range(nsrc)], nsrc, nbytes, dtype, op, stream, max_blocks))
        self.device = device
        return 0


@pytest.fixture
def fake(monkeypatch):
    lib = object.__new__(native.NativeLibrary)  # no .so, no CUDA
    lib._lib = _FakeLib()
    monkeypatch.setattr(native, "load", lambda: lib)
    return lib._lib


@pytest.fixture
def no_load(monkeypatch):
    def fail():
        raise AssertionError("reduce_atom reached the native library with bad arguments")

    monkeypatch.setattr(native, "load", fail)


def _header_enum(name: str) -> dict:
    body = re.search(r"enum " + name + r" \{(.*?)\};", HEADER.read_text(), re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"(PURLIN_\w+) = (\d+)", body)}


def test_codes_match_the_header():
    dtypes = _header_enum("purlin_dtype")
    assert {k.removeprefix("PURLIN_DTYPE_").lower(): v for k, v in dtypes.items()} == native._REDUCE_DTYPE_NAMES
    ops = _header_enum("purlin_reduce_op")
    assert {k.removeprefix("PURLIN_REDUCE_").lower(): v for k, v in ops.items()} == native._REDUCE_OPS
    assert f"#define PURLIN_REDUCE_MAX_SOURCES {native.REDUCE_MAX_SOURCES}" in HEADER.read_text()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool, torch.complex64, "float32", None])
def test_unsupported_dtype_raises_before_any_cuda_call(no_load, dtype):
    with pytest.raises(PurlinValueError, match="reduce_atom: unsupported dtype"):
        native.reduce_atom(P, [P, P], 64, dtype, "sum", 0)


@pytest.mark.parametrize("op", ["prod", "avg", "", 1, None, "sum "])
def test_unsupported_op_raises(no_load, op):
    with pytest.raises(PurlinValueError, match="reduce_atom: unsupported op"):
        native.reduce_atom(P, [P], 64, torch.float32, op, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"src_ptrs": []}, "1 to 8 sources"),
        ({"src_ptrs": [P] * 9}, "1 to 8 sources"),
        ({"src_ptrs": P}, "sequence of ints"),
        ({"src_ptrs": [P, 1.5]}, r"src_ptrs\[1\] must be an int"),
        ({"nbytes": 6}, "not a multiple"),  # float32: 4-byte elements
        ({"nbytes": -4}, "nbytes must be >= 0"),
        ({"nbytes": True}, "nbytes must be an int"),
        ({"dst_ptr": P + 2}, "dst_ptr=.* aligned"),
        ({"dst_ptr": 0}, "dst_ptr=.* non-null"),
        ({"src_ptrs": [P, P + 1]}, r"src_ptrs\[1\]=.* aligned"),
        ({"max_blocks": -1}, "max_blocks must be >= 0"),
        ({"stream": -1}, "stream must be >= 0"),
    ],
)
def test_bad_arguments_raise(no_load, kwargs, match):
    args = {"dst_ptr": P, "src_ptrs": [P, P], "nbytes": 64, "dtype": torch.float32, "op": "sum", "stream": 0}
    args.update(kwargs)
    with pytest.raises(PurlinValueError, match=match):
        native.reduce_atom(**args)


def test_valid_call_passes_the_codes(fake):
    native.reduce_atom(P + 16, (P, P + 32, P + 64), 96, torch.bfloat16, "max", 0, max_blocks=7)
    native.reduce_atom(P, [P + 8], 24, torch.int64, ReduceOp.MIN, 1234)
    native.reduce_atom(0, [0], 0, torch.float16, "SUM", 0)  # nothing to do: null pointers are fine
    assert fake.calls == [
        (P + 16, [P, P + 32, P + 64], 3, 96, 1, 2, None, 7),
        (P, [P + 8], 1, 24, 6, 3, 1234, 0),
        (0, [None], 1, 0, 2, 1, None, 0),  # ctypes reads a null c_void_p back as None
    ]
