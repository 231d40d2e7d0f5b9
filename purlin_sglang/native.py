"""The one door to the native library ``purlin_sglang._native`` (built at install time).

Nothing happens at import: the library is located and loaded on the first call of
:func:`load` (or a function that needs it) and cached for the process. The native ABI is plain
``extern "C"`` (``native/include/purlin/native.h``), bound here with ctypes; the library links
no libtorch and carries its own static CUDA runtime, sharing the driver's primary context (and
so the current device and the streams) with torch.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import threading
from collections.abc import Sequence
from typing import Any, Optional

from purlin_sglang.errors import PurlinCudaError, PurlinUnavailableError, PurlinValueError

ABI_VERSION = 6
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


SNAC_MAX_RANKS = 64  # PURLIN_SNAC_MAX_RANKS
_ll = ctypes.c_longlong


class SnacParams(ctypes.Structure):
    """native.h's PurlinSnacParams (keep the field order in step with the header)."""

    _fields_ = [
        ("ops", ctypes.c_void_p), ("n_ops", _ll), ("n_updates", _ll),
        ("input", ctypes.c_void_p), ("output", ctypes.c_void_p),
        ("bases", ctypes.c_void_p * SNAC_MAX_RANKS),
        ("rank", _ll), ("world", _ll), ("dtype", _ll), ("blocks", _ll), ("max_items", _ll),
        ("notify_off", _ll), ("ack_off", _ll), ("sent_off", _ll), ("expect_off", _ll), ("acked_off", _ll),
        ("arrive_off", _ll), ("arrive_slots", _ll), ("exit_off", _ll), ("error_off", _ll), ("staging_off", _ll),
        ("timeout_ns", _ll), ("host_error", ctypes.c_void_p), ("tag", _ll),
        ("epoch_off", _ll), ("window_off", _ll), ("window_bytes", _ll), ("packets", _ll),
    ]


MOE_MAX_RANKS = 64  # PURLIN_MOE_MAX_RANKS
_vp = ctypes.c_void_p


class MoeParams(ctypes.Structure):
    """native.h's PurlinMoeParams (keep the field order in step with the header)."""

    _fields_ = [("bases", ctypes.c_void_p * MOE_MAX_RANKS)] + [(n, _ll) for n in (
        "rank", "world", "blocks", "local", "topk", "tokens", "max_tokens", "capacity", "payload_bytes",
        "hdr_bytes", "slot_bytes", "ret_bytes", "count_off", "count_bytes", "done_off", "recv_off",
        "recv_parity_bytes", "ret_off", "ret_parity_bytes", "state_off", "timeout_ns")] + [(n, _vp) for n in (
        "host_error", "x", "scales", "dst", "le", "j", "send_pos", "counts", "tokens_to", "bad_ids", "out_x",
        "out_scales", "out_expert", "out_src", "out_slot", "out_counts", "expert_out", "row_src", "row_slot",
        "weights", "y")] + [("dtype", _ll)]


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
        lib.purlin_copy_atom.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.purlin_copy_atom.restype = ctypes.c_int
        lib.purlin_copy_atom_ex.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int,
        ]
        lib.purlin_copy_atom_ex.restype = ctypes.c_int
        lib.purlin_copy_atom_bulk.argtypes = lib.purlin_copy_atom_ex.argtypes
        lib.purlin_copy_atom_bulk.restype = ctypes.c_int
        lib.purlin_reduce_atom.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
        ]
        lib.purlin_reduce_atom.restype = ctypes.c_int
        lib.purlin_snac_execute.argtypes = [ctypes.POINTER(SnacParams), ctypes.c_void_p]
        lib.purlin_snac_execute.restype = ctypes.c_int
        lib.purlin_snac_occupancy.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib.purlin_snac_occupancy.restype = ctypes.c_int
        for name in ("purlin_moe_dispatch", "purlin_moe_combine"):
            getattr(lib, name).argtypes = [ctypes.POINTER(MoeParams), ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_int
        lib.purlin_moe_occupancy.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib.purlin_moe_occupancy.restype = ctypes.c_int
        self.moe_dispatch = lib.purlin_moe_dispatch  # (byref(MoeParams), stream) -> cudaError_t
        self.moe_combine = lib.purlin_moe_combine
        self._lib = lib
        self.snac_execute = lib.purlin_snac_execute  # (byref(SnacParams), stream) -> cudaError_t; hot path

    def snac_occupancy(self, dtype_code: int) -> tuple[int, int]:
        """(resident interpreter blocks per SM, SM count) of the current device."""
        per_sm, sms = ctypes.c_int(0), ctypes.c_int(0)
        self.check("snac_occupancy", int(self._lib.purlin_snac_occupancy(dtype_code, ctypes.byref(per_sm),
                                                                         ctypes.byref(sms))))
        return int(per_sm.value), int(sms.value)

    def moe_occupancy(self) -> tuple[int, int]:
        """(resident MoE-kernel blocks per SM, SM count) of the current device; loads both kernels."""
        per_sm, sms = ctypes.c_int(0), ctypes.c_int(0)
        self.check("moe_occupancy", int(self._lib.purlin_moe_occupancy(ctypes.byref(per_sm), ctypes.byref(sms))))
        return int(per_sm.value), int(sms.value)

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

    def copy_atom(self, dst_ptr: int, src_ptr: int, nbytes: int, stream: int, max_blocks: int = 0) -> None:
        """Enqueue dst[0:nbytes] = src[0:nbytes] on ``stream``; see :func:`copy_atom`."""
        if max_blocks:
            code = self._lib.purlin_copy_atom_ex(dst_ptr, src_ptr, nbytes, stream or None, max_blocks)
        else:
            code = self._lib.purlin_copy_atom(dst_ptr, src_ptr, nbytes, stream or None)
        self.check("copy_atom", int(code))

    def copy_atom_bulk(self, dst_ptr: int, src_ptr: int, nbytes: int, stream: int, max_blocks: int = 0) -> None:
        """The Hopper bulk-copy (TMA) variant of :meth:`copy_atom`, for pointers that agree modulo 16.

        Raises :class:`PurlinCudaError` (cudaErrorNotSupported) on a GPU older than sm_90, a build
        without sm_90 code, or a pair that differs in its misalignment. Measured against the plain
        atom per size in docs/RESULTS.md."""
        self.check("copy_atom_bulk", int(self._lib.purlin_copy_atom_bulk(dst_ptr, src_ptr, nbytes, stream or None,
                                                                         max_blocks)))

    def reduce_atom(
        self, dst_ptr: int, src_ptrs: Sequence[int], nbytes: int, dtype: Any, op: Any, stream: int,
        max_blocks: int = 0,
    ) -> None:
        """Enqueue dst = op(srcs...) over ``nbytes`` on ``stream``; see :func:`reduce_atom`."""
        srcs, dtype_code, op_code = _check_reduce(dst_ptr, src_ptrs, nbytes, dtype, op, stream, max_blocks)
        self._reduce(dst_ptr, srcs, nbytes, dtype_code, op_code, stream, max_blocks)

    def _reduce(self, dst_ptr: int, srcs: list, nbytes: int, dtype_code: int, op_code: int, stream: int,
                max_blocks: int) -> None:
        """The native call on checked arguments and codes."""
        arr = (ctypes.c_void_p * len(srcs))(*srcs)
        code = self._lib.purlin_reduce_atom(
            dst_ptr, arr, len(srcs), nbytes, dtype_code, op_code, stream or None, max_blocks
        )
        self.check("reduce_atom", int(code))


_lock = threading.Lock()
_LIB: Optional[NativeLibrary] = None


def load() -> NativeLibrary:
    """The native library, loaded once per process; it needs a CUDA build and a visible GPU.

    Raises :class:`PurlinUnavailableError` saying what is missing: the module is not built, it was
    built without CUDA (and why), its ABI is stale, or no CUDA GPU is visible.
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
        if lib.abi_version() != ABI_VERSION:
            raise PurlinUnavailableError(
                f"native: {info['path']} has ABI {lib.abi_version()}, this package needs {ABI_VERSION} "
                f"(a stale build); {_REINSTALL}"
            )
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


# The codes of native.h's enum purlin_dtype / enum purlin_reduce_op.
_REDUCE_DTYPE_NAMES = {"bfloat16": 1, "float16": 2, "float32": 3, "float64": 4, "int32": 5, "int64": 6}
_REDUCE_OPS = {"sum": 1, "max": 2, "min": 3}
REDUCE_MAX_SOURCES = 8


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


def reduce_atom(
    dst_ptr: int, src_ptrs: Sequence[int], nbytes: int, dtype: Any, op: Any, stream: int, max_blocks: int = 0
) -> None:
    """Enqueue ``dst = op(src_ptrs[0], ..., src_ptrs[k-1])`` over ``nbytes`` on ``stream``.

    ``dtype`` is a torch dtype (bfloat16, float16, float32, float64, int32, int64), ``op`` is
    "sum", "max" or "min" (or a :class:`~purlin_sglang.collectives.ReduceOp`), 1 <= k <= 8.
    Bitwise the CPU engine's reduction: sources combined in order, 16-bit floats accumulated in
    float32 and rounded to nearest even once; max/min propagate NaN like torch.maximum/minimum
    (NaN payloads and the sign of a zero from max/min of +0 and -0 are unspecified). Pointers are
    device addresses (local, or a peer's memory mapped over NVLink) aligned to the element size;
    ``dst`` may equal one source (in place) but must not otherwise overlap one. ``max_blocks``
    bounds the thread blocks (0: fill the device). Does not block the host; safe under CUDA graph
    capture. Raises :class:`PurlinValueError` for bad arguments (before any CUDA call),
    :class:`PurlinUnavailableError` when the native library cannot run, and
    :class:`PurlinCudaError` when the launch fails.
    """
    srcs, dtype_code, op_code = _check_reduce(dst_ptr, src_ptrs, nbytes, dtype, op, stream, max_blocks)
    load()._reduce(dst_ptr, srcs, nbytes, dtype_code, op_code, stream, max_blocks)


def copy_atom(dst_ptr: int, src_ptr: int, nbytes: int, stream: int) -> None:
    """Enqueue a device copy of ``nbytes`` from ``src_ptr`` to ``dst_ptr`` on ``stream``.

    Pointers are device addresses (local, or a peer's memory mapped over NVLink), any alignment;
    the ranges must not overlap. ``stream`` is a cudaStream_t as an int (0: the legacy default
    stream), e.g. ``torch.cuda.current_stream().cuda_stream``. Does not block the host; safe under
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
    load().copy_atom(dst_ptr, src_ptr, nbytes, stream)


__all__ = [
    "ABI_VERSION", "MoeParams", "NativeLibrary", "PurlinCudaError", "REDUCE_MAX_SOURCES", "SNAC_MAX_RANKS", "SnacParams",
    "build_info", "copy_atom", "load", "reduce_atom", "reduce_dtype_code",
]
