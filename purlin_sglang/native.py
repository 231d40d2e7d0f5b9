"""The one door to the native library ``purlin_sglang._native`` (built at install time).

Nothing happens at import: the library is located and loaded on the first call of
:func:`load` (or a function that needs it) and cached for the process. The native ABI is plain
``extern "C"`` (``native/include/purlin/native.h``), bound here with ctypes; the library links
no libtorch and carries its own static CUDA runtime, sharing the driver's primary contexts (and
so the streams) with torch, but keeping its own current device: every launch and device query
passes the CUDA device index, which the library makes current before it touches the device.

The ABI is written twice, in C++ and in :mod:`purlin_sglang.abi` (the parameter structs, the dtype
and reduce-op codes, the op-table encoding, the kernel kinds, the error records, the layout constants;
re-exported here). :func:`load` compares the two through ``purlin_native_layout()``
(:func:`check_layout`) and refuses a library that disagrees, naming each field or constant with both
values: a stale or foreign build is an error at load, never a hang or a wrong sum.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import sys
import threading
from collections.abc import Sequence
from typing import Any, Optional

from . import abi
from .abi import (  # noqa: F401  (re-exported: the engines and tests read the ABI through this module too)
    ABI_VERSION, DTYPE_CODES, MOE_ERROR_CODES, MOE_ERROR_WORDS, MOE_MAX_RANKS, MOE_REJECT_BIT, MOE_TRACE_PHASES,
    MOE_DECODE_META, MOE_TRACE_PHASES_DECODE, MOE_TRACE_PHASES_ONE_PASS,
    MOE_TRACE_WORDS, REDUCE_MAX_SOURCES,
    REDUCE_OP_CODES, SNAC_DESC_AFTER_NS, SNAC_DESC_RING, SNAC_DESC_WORDS, SNAC_ERROR_CODES, SNAC_ERROR_FIELDS, SNAC_ERROR_WORDS,
    SNAC_MAX_RANKS, MoeParams, SnacParams, python_layout,
)
from .errors import PurlinCudaError, PurlinUnavailableError, PurlinValueError

_MODULE = "purlin_sglang._native"
_REINSTALL = "reinstall with `pip install .` (or `pip install -e .`) from the repository root"


def _import_module() -> tuple[Optional[Any], str]:
    """(the extension module, "") or (None, why it could not be imported)."""
    try:
        return importlib.import_module(_MODULE), ""
    except ImportError as exc:
        return None, f"native module {_MODULE} is not built or not importable ({exc}); {_REINSTALL}"


def build_info() -> dict:
    """How the native module was built. Never raises.

    Keys: ``built`` (the module exists), ``cuda`` (CUDA atoms were compiled), ``archs`` (CUDA
    architectures, e.g. ``["90"]``), ``nvcc`` (compiler version or None), ``reason`` (None, or why
    CUDA is missing), ``abi`` and ``path`` when built.
    """
    mod, why = _import_module()
    if mod is None:
        return {"built": False, "cuda": False, "archs": [], "nvcc": None, "reason": why}
    try:
        info = json.loads(mod.build_info())
    except Exception as exc:  # a broken or foreign build must not break callers of build_info()
        return {
            "built": False, "cuda": False, "archs": [], "nvcc": None,
            "reason": f"native module {_MODULE} has unreadable build info ({exc}); {_REINSTALL}",
        }
    info["built"] = True
    info["path"] = getattr(mod, "__file__", None)
    return info


class _AbiEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_longlong)]


def layout_problems(lib_layout: dict[str, int], mine: Optional[dict[str, int]] = None) -> list[str]:
    """Each difference between the library's layout and this package's, one line each ([] if none)."""
    mine = abi.python_layout() if mine is None else mine
    lib_layout = dict(lib_layout)
    problems = []
    words = lib_layout.pop("moe.state_words", None)  # a bound, not a copy: the region's state area holds them
    if words is None or words * 8 > abi.MOE_STATE_BYTES:
        problems.append(f"moe.state_words: the library has {words} words, the MoE region's state area "
                        f"(abi.MOE_STATE_BYTES) is {abi.MOE_STATE_BYTES} bytes")
    for key in sorted(set(lib_layout) | set(mine)):
        lv, pv = lib_layout.get(key), mine.get(key)
        if lv == pv:
            continue
        if lv is None:
            problems.append(f"{key}: Python has {pv}, the library has no such field or constant")
        elif pv is None:
            problems.append(f"{key}: the library has {lv}, Python has no such field or constant")
        else:
            problems.append(f"{key}: the library has {lv}, Python has {pv}")
    return problems


def _open_checked(path: str) -> ctypes.CDLL:
    """The library at ``path`` opened with ctypes, its ABI version checked (any build, CUDA or not)."""
    try:
        lib = ctypes.CDLL(path)
        lib.purlin_native_abi_version.argtypes = []
        lib.purlin_native_abi_version.restype = ctypes.c_int
        version = int(lib.purlin_native_abi_version())
    except (OSError, AttributeError) as exc:
        raise PurlinUnavailableError(f"native: cannot load {path} with ctypes ({exc}); {_REINSTALL}") from exc
    if version != ABI_VERSION:
        raise PurlinUnavailableError(
            f"native: {path} has ABI {version}, this package needs {ABI_VERSION} (a stale build); {_REINSTALL}"
        )
    return lib


def native_layout(lib: Optional[ctypes.CDLL] = None) -> dict[str, int]:
    """The layout the native library was compiled with (``purlin_native_layout()``), as {name: value}.

    Works on host-only builds too (no GPU needed). Raises :class:`PurlinUnavailableError` when the
    module is not built or its ABI version is not this package's."""
    if lib is None:
        info = build_info()
        if not info.get("built"):
            raise PurlinUnavailableError(f"native: {info.get('reason')}")
        lib = _open_checked(info["path"])
    fn = lib.purlin_native_layout
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.POINTER(_AbiEntry)
    count = ctypes.c_int(0)
    entries = fn(ctypes.byref(count))
    return {entries[i].name.decode(): int(entries[i].value) for i in range(count.value)}


def check_layout(lib: Optional[ctypes.CDLL] = None, path: str = "") -> None:
    """Raise :class:`PurlinUnavailableError` naming every field or constant on which the native library
    and this package disagree, with both values. Needs no GPU; :func:`load` calls it."""
    problems = layout_problems(native_layout(lib))
    if problems:
        shown = "; ".join(problems[:12]) + (f"; and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise PurlinUnavailableError(
            f"native: {path or 'the native library'} does not match this package's Python side (ABI {ABI_VERSION}): "
            f"{shown}. The library and the package come from different sources; {_REINSTALL}"
        )


class NativeLibrary:
    """Typed ctypes bindings over the loaded native library. Obtain it with :func:`load`."""

    def __init__(self, path: str, info: dict):
        self.path = path
        self.info = info
        lib = ctypes.CDLL(path)
        lib.purlin_native_abi_version.argtypes = []
        lib.purlin_native_abi_version.restype = ctypes.c_int
        lib.purlin_native_build_info.argtypes = []
        lib.purlin_native_build_info.restype = ctypes.c_char_p
        lib.purlin_cuda_error_string.argtypes = [ctypes.c_int]
        lib.purlin_cuda_error_string.restype = ctypes.c_char_p
        lib.purlin_cuda_device_count.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.purlin_cuda_device_count.restype = ctypes.c_int
        lib.purlin_native_last_device.argtypes = []
        lib.purlin_native_last_device.restype = ctypes.c_int
        # (dst, src, bytes, stream, max_blocks, device)
        lib.purlin_copy_atom.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ]
        lib.purlin_copy_atom.restype = ctypes.c_int
        lib.purlin_copy_atom_bulk.argtypes = lib.purlin_copy_atom.argtypes
        lib.purlin_copy_atom_bulk.restype = ctypes.c_int
        lib.purlin_reduce_atom.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ]
        lib.purlin_reduce_atom.restype = ctypes.c_int
        lib.purlin_snac_execute.argtypes = [ctypes.POINTER(SnacParams), ctypes.c_void_p]
        lib.purlin_snac_execute.restype = ctypes.c_int
        occupancy = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]  # (device, per SM, SMs)
        lib.purlin_snac_occupancy.argtypes = occupancy
        lib.purlin_snac_occupancy.restype = ctypes.c_int
        for name in ("purlin_moe_dispatch", "purlin_moe_combine"):
            getattr(lib, name).argtypes = [ctypes.POINTER(MoeParams), ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_int
        lib.purlin_moe_occupancy.argtypes = occupancy
        lib.purlin_moe_occupancy.restype = ctypes.c_int
        self.moe_dispatch = lib.purlin_moe_dispatch  # (byref(MoeParams), stream) -> cudaError_t
        self.moe_combine = lib.purlin_moe_combine
        self._lib = lib
        self.snac_execute = lib.purlin_snac_execute  # (byref(SnacParams), stream) -> cudaError_t
        # The steady state of an eager call (engines/cuda.py _Launch): (address of a prepared SnacParams,
        # input, output, call number, stream) -> cudaError_t, a function of the extension module itself
        # (the same loaded library), called without ctypes' argument conversion (native/python/module.cpp).
        self.snac_launch = importlib.import_module(_MODULE).snac_launch

    def snac_occupancy(self, device: int = -1) -> tuple[int, int]:
        """(resident blocks per SM of the interpreter and packet kernels, the fewest over all of them; the
        SM count) of CUDA device ``device`` (-1: the library's current device), which it makes current."""
        per_sm, sms = ctypes.c_int(0), ctypes.c_int(0)
        self.check("snac_occupancy", int(self._lib.purlin_snac_occupancy(device, ctypes.byref(per_sm),
                                                                         ctypes.byref(sms))))
        return int(per_sm.value), int(sms.value)

    def moe_occupancy(self, device: int = -1) -> tuple[int, int]:
        """(resident MoE-kernel blocks per SM, SM count) of CUDA device ``device``; loads both kernels."""
        per_sm, sms = ctypes.c_int(0), ctypes.c_int(0)
        self.check("moe_occupancy", int(self._lib.purlin_moe_occupancy(device, ctypes.byref(per_sm),
                                                                       ctypes.byref(sms))))
        return int(per_sm.value), int(sms.value)

    def last_device(self) -> int:
        """The CUDA device the library's runtime was current on at its last launch or device query (-1: none)."""
        return int(self._lib.purlin_native_last_device())

    def abi_version(self) -> int:
        return int(self._lib.purlin_native_abi_version())

    def error_string(self, code: int) -> str:
        raw = self._lib.purlin_cuda_error_string(int(code))
        return raw.decode(errors="replace") if raw else f"unknown CUDA error {code}"

    def device_count(self) -> tuple[int, int]:
        """(cudaError_t of cudaGetDeviceCount, number of visible devices)."""
        count = ctypes.c_int(0)
        code = int(self._lib.purlin_cuda_device_count(ctypes.byref(count)))
        return code, int(count.value)

    def check(self, op: str, code: int) -> None:
        """Raise :class:`PurlinCudaError` naming ``op`` if ``code`` is not cudaSuccess."""
        if code != 0:
            raise PurlinCudaError(f"{op}: CUDA error {code}: {self.error_string(code)}", code=code)

    def copy_atom(self, dst_ptr: int, src_ptr: int, nbytes: int, stream: int, max_blocks: int = 0,
                  device: int = -1) -> None:
        """Enqueue dst[0:nbytes] = src[0:nbytes] on ``stream`` of CUDA device ``device`` (-1: the library's
        current device); see :func:`copy_atom`."""
        self.check("copy_atom", int(self._lib.purlin_copy_atom(dst_ptr, src_ptr, nbytes, stream or None, max_blocks,
                                                               device)))

    def copy_atom_bulk(self, dst_ptr: int, src_ptr: int, nbytes: int, stream: int, max_blocks: int = 0,
                       device: int = -1) -> None:
        """The Hopper bulk-copy (TMA) variant of :meth:`copy_atom`, for pointers that agree modulo 16.

        Raises :class:`PurlinCudaError` (cudaErrorNotSupported) on a GPU older than sm_90, a build
        without sm_90 code, or a pair that differs in its misalignment. Measured against the plain
        atom per size in docs/RESULTS.md."""
        self.check("copy_atom_bulk", int(self._lib.purlin_copy_atom_bulk(dst_ptr, src_ptr, nbytes, stream or None,
                                                                         max_blocks, device)))

    def reduce_atom(
        self, dst_ptr: int, src_ptrs: Sequence[int], nbytes: int, dtype: Any, op: Any, stream: int,
        max_blocks: int = 0, device: int = -1,
    ) -> None:
        """Enqueue dst = op(srcs...) over ``nbytes`` on ``stream`` of ``device``; see :func:`reduce_atom`."""
        srcs, dtype_code, op_code = _check_reduce(dst_ptr, src_ptrs, nbytes, dtype, op, stream, max_blocks)
        self._reduce(dst_ptr, srcs, nbytes, dtype_code, op_code, stream, max_blocks, device)

    def _reduce(self, dst_ptr: int, srcs: list, nbytes: int, dtype_code: int, op_code: int, stream: int,
                max_blocks: int, device: int = -1) -> None:
        """The native call on checked arguments and codes."""
        arr = (ctypes.c_void_p * len(srcs))(*srcs)
        code = self._lib.purlin_reduce_atom(
            dst_ptr, arr, len(srcs), nbytes, dtype_code, op_code, stream or None, max_blocks, device
        )
        self.check("reduce_atom", int(code))


_lock = threading.Lock()
_LIB: Optional[NativeLibrary] = None


def load() -> NativeLibrary:
    """The native library, loaded once per process; it needs a CUDA build and a visible GPU.

    Raises :class:`PurlinUnavailableError` saying what is missing: the module is not built, its ABI
    is stale, its layout differs from this package's (each field or constant named, both values:
    :func:`check_layout`), it was built without CUDA (and why), or no CUDA GPU is visible.
    """
    global _LIB
    if _LIB is not None:
        return _LIB
    with _lock:
        if _LIB is not None:
            return _LIB
        info = build_info()
        if not info.get("built"):
            raise PurlinUnavailableError(f"native: {info.get('reason')}")
        # The ABI version, then the layout: checked on every build (host-only too), before anything else.
        check_layout(_open_checked(info["path"]), info["path"])
        if not info.get("cuda"):
            raise PurlinUnavailableError(
                f"native: module {info.get('path')} was built without CUDA: {info.get('reason')}; to get the "
                f"CUDA atoms, put nvcc on PATH, leave PURLIN_DISABLE_CUDA unset and {_REINSTALL}"
            )
        try:
            lib = NativeLibrary(info["path"], info)
        except (OSError, AttributeError) as exc:
            raise PurlinUnavailableError(
                f"native: cannot load {info.get('path')} with ctypes ({exc}); {_REINSTALL}"
            ) from exc
        code, count = lib.device_count()
        if code != 0 or count == 0:
            why = lib.error_string(code) if code != 0 else "no devices"
            raise PurlinUnavailableError(
                f"native: no CUDA GPU visible (cudaGetDeviceCount: {why}, code {code}); the CUDA atoms "
                "need an NVIDIA GPU and driver (check CUDA_VISIBLE_DEVICES and nvidia-smi)"
            )
        _LIB = lib
        return lib


def _check_int(op: str, name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PurlinValueError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise PurlinValueError(f"{op}: {name} must be >= {minimum}, got {value}")
    return value


_REDUCE_DTYPE_NAMES = DTYPE_CODES  # the one table (above), under its older names
_REDUCE_OPS = REDUCE_OP_CODES


_REDUCE_DTYPE_CODES: Optional[dict] = None


def _reduce_dtype_codes() -> dict:
    """{torch dtype: code}, built on first use (this module does not import torch at import time)."""
    global _REDUCE_DTYPE_CODES
    if _REDUCE_DTYPE_CODES is None:
        import torch

        _REDUCE_DTYPE_CODES = {getattr(torch, name): code for name, code in _REDUCE_DTYPE_NAMES.items()}
    return _REDUCE_DTYPE_CODES


def reduce_dtype_code(dtype: Any) -> int:
    """native.h's purlin_dtype code of a torch dtype, 0 if the reduce path does not support it."""
    return _reduce_dtype_codes().get(dtype, 0)


def _check_reduce(
    dst_ptr: Any, src_ptrs: Any, nbytes: Any, dtype: Any, op: Any, stream: Any, max_blocks: Any
) -> tuple[list[int], int, int]:
    """Validate reduce_atom's arguments; (source pointers, dtype code, op code). Touches no device."""
    codes = _reduce_dtype_codes()
    if dtype not in codes:
        raise PurlinValueError(
            f"reduce_atom: unsupported dtype {dtype!r}; use one of "
            + ", ".join(f"torch.{n}" for n in _REDUCE_DTYPE_NAMES)
        )
    op_name = getattr(op, "value", op)  # collectives.ReduceOp is a str enum
    if not isinstance(op_name, str) or op_name.lower() not in _REDUCE_OPS:
        raise PurlinValueError(f"reduce_atom: unsupported op {op!r}; use one of {', '.join(_REDUCE_OPS)}")
    if isinstance(src_ptrs, (str, bytes)) or not isinstance(src_ptrs, Sequence):
        raise PurlinValueError(f"reduce_atom: src_ptrs must be a sequence of ints, got {type(src_ptrs).__name__}")
    if not 1 <= len(src_ptrs) <= REDUCE_MAX_SOURCES:
        raise PurlinValueError(
            f"reduce_atom: needs 1 to {REDUCE_MAX_SOURCES} sources, got {len(src_ptrs)}; "
            "reduce more in several calls, accumulating into dst"
        )
    srcs = list(src_ptrs)
    esize = dtype.itemsize
    # Fast path (a hot call): one pass of cheap tests; the slow pass below only names the culprit.
    ints_ok = all(type(v) is int and v >= 0 for v in (dst_ptr, nbytes, stream, max_blocks, *srcs))
    if ints_ok and nbytes % esize == 0 and (
        nbytes == 0 or all(v != 0 and v % esize == 0 for v in (dst_ptr, *srcs))
    ):
        return srcs, codes[dtype], _REDUCE_OPS[op_name.lower()]
    for i, v in enumerate(srcs):
        _check_int("reduce_atom", f"src_ptrs[{i}]", v)
    _check_int("reduce_atom", "dst_ptr", dst_ptr)
    _check_int("reduce_atom", "nbytes", nbytes)
    _check_int("reduce_atom", "stream", stream)
    _check_int("reduce_atom", "max_blocks", max_blocks)
    if nbytes % esize:
        raise PurlinValueError(
            f"reduce_atom: nbytes={nbytes} is not a multiple of the {dtype} element size {esize}"
        )
    for name, v in [("dst_ptr", dst_ptr)] + [(f"src_ptrs[{i}]", v) for i, v in enumerate(srcs)]:
        if v == 0 or v % esize:
            raise PurlinValueError(
                f"reduce_atom: {name}={v:#x} must be non-null and aligned to the {dtype} element size {esize}"
            )
    raise AssertionError("unreachable: the fast path rejected valid arguments")  # pragma: no cover
    return srcs, codes[dtype], _REDUCE_OPS[op_name.lower()]


def _device_arg(op: str, device: Optional[int]) -> int:
    """The device index to pass: ``device``, else torch's current CUDA device where torch has initialised
    CUDA in this process (the device of its current stream), else -1 (the library's current device)."""
    if device is not None:
        return _check_int(op, "device", device)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return -1


def reduce_atom(
    dst_ptr: int, src_ptrs: Sequence[int], nbytes: int, dtype: Any, op: Any, stream: int, max_blocks: int = 0,
    device: Optional[int] = None,
) -> None:
    """Enqueue ``dst = op(src_ptrs[0], ..., src_ptrs[k-1])`` over ``nbytes`` on ``stream``.

    ``dtype`` is a torch dtype (bfloat16, float16, float32, float64, int32, int64), ``op`` is
    "sum", "max" or "min" (or a :class:`~purlin_sglang.collectives.ReduceOp`), 1 <= k <= 8.
    Bitwise the CPU engine's reduction: sources combined in order, 16-bit floats accumulated in
    float32 and rounded to nearest even once; max/min propagate NaN like torch.maximum/minimum
    (NaN payloads and the sign of a zero from max/min of +0 and -0 are unspecified). Pointers are
    device addresses (local, or a peer's memory mapped over NVLink) aligned to the element size;
    ``dst`` may equal one source (in place) but must not otherwise overlap one. ``max_blocks``
    bounds the thread blocks (0: fill the device). ``device``: the CUDA device of the pointers and
    the stream (default: torch's current device), made current for the launch. Does not block the
    host; safe under CUDA graph capture. Raises :class:`PurlinValueError` for bad arguments (before any CUDA call),
    :class:`PurlinUnavailableError` when the native library cannot run, and
    :class:`PurlinCudaError` when the launch fails.
    """
    srcs, dtype_code, op_code = _check_reduce(dst_ptr, src_ptrs, nbytes, dtype, op, stream, max_blocks)
    dev = _device_arg("reduce_atom", device)
    load()._reduce(dst_ptr, srcs, nbytes, dtype_code, op_code, stream, max_blocks, dev)


def copy_atom(dst_ptr: int, src_ptr: int, nbytes: int, stream: int, device: Optional[int] = None) -> None:
    """Enqueue a device copy of ``nbytes`` from ``src_ptr`` to ``dst_ptr`` on ``stream``.

    Pointers are device addresses (local, or a peer's memory mapped over NVLink), any alignment;
    the ranges must not overlap. ``stream`` is a cudaStream_t as an int (0: the legacy default
    stream), e.g. ``torch.cuda.current_stream().cuda_stream``; ``device`` its CUDA device (default:
    torch's current device), made current for the launch. Does not block the host; safe under
    CUDA graph capture. Raises :class:`PurlinValueError` for bad arguments,
    :class:`PurlinUnavailableError` when the native library cannot run, and
    :class:`PurlinCudaError` (with the CUDA error string) when the launch fails.
    """
    _check_int("copy_atom", "nbytes", nbytes)
    _check_int("copy_atom", "dst_ptr", dst_ptr)
    _check_int("copy_atom", "src_ptr", src_ptr)
    _check_int("copy_atom", "stream", stream)
    if nbytes and (dst_ptr == 0 or src_ptr == 0):
        raise PurlinValueError("copy_atom: dst_ptr and src_ptr must be non-null when nbytes > 0")
    dev = _device_arg("copy_atom", device)
    load().copy_atom(dst_ptr, src_ptr, nbytes, stream, 0, dev)


__all__ = [
    "ABI_VERSION", "DTYPE_CODES", "MoeParams", "NativeLibrary", "PurlinCudaError", "REDUCE_MAX_SOURCES",
    "REDUCE_OP_CODES", "SNAC_MAX_RANKS", "SnacParams", "build_info", "check_layout", "copy_atom", "layout_problems",
    "load", "native_layout", "python_layout", "reduce_atom", "reduce_dtype_code",
]
