"""The native ABI checked at load, and the device index on the launch path; no GPU needed.

The library exports its layout (purlin_native_layout: struct sizes, field offsets, constants);
native.load() compares it with the Python side before anything else. The engines pass their
communicator's CUDA device to every launch and occupancy query.
"""

from __future__ import annotations

import contextlib
import ctypes
import types

import numpy as np
import pytest
import torch

from purlin_sglang import abi, native
from purlin_sglang.engines import cuda as cuda_mod
from purlin_sglang.engines import cuda_ops as co
from purlin_sglang.errors import PurlinBrokenError, PurlinTimeoutError, PurlinUnavailableError, PurlinValueError
from purlin_sglang.memory.layout import REJECT_WORDS, RESYNC_WORDS, DeviceLayout
from purlin_sglang.moe.cuda import CudaMoE
from purlin_sglang.moe.region import MoELayout

CUDA_ERROR_INVALID_VALUE = 1
built = native.build_info()
needs_build = pytest.mark.skipif(not built.get("built"), reason=f"native module not built: {built.get('reason')}")


@pytest.fixture
def fresh(monkeypatch):
    """load() starts from nothing (and the cached library comes back after the test)."""
    monkeypatch.setattr(native, "_LIB", None)


# -- the layout check ------------------------------------------------------------------------------
@needs_build
def test_the_library_and_python_agree():
    lib_layout = native.native_layout()
    assert native.layout_problems(lib_layout) == []
    native.check_layout()
    assert lib_layout["PURLIN_NATIVE_ABI_VERSION"] == native.ABI_VERSION


@needs_build
def test_every_ctypes_field_and_every_table_is_in_the_export():
    lib_layout = native.native_layout()
    for cname, cls in (("PurlinSnacParams", native.SnacParams), ("PurlinMoeParams", native.MoeParams)):
        assert lib_layout[f"sizeof({cname})"] == ctypes.sizeof(cls)
        for name, _ in cls._fields_:
            assert lib_layout[f"offsetof({cname}, {name})"] == getattr(cls, name).offset, name
    for name, code in native.DTYPE_CODES.items():  # one dtype table for Python and C++
        assert lib_layout[f"PURLIN_DTYPE_{name.upper()}"] == code
    for name, code in co.OPCODES.items():
        assert lib_layout[f"snac.op.{name}"] == code
    assert lib_layout["snac.error.tag"] == native.SNAC_ERROR_FIELDS.index("tag") == 8
    assert lib_layout["PURLIN_SNAC_ERROR_WORDS"] == cuda_mod.HOST_ERROR_WORDS


class _StaleSnacParams(ctypes.Structure):
    """SnacParams as an ABI 6 Python side had it: no device field."""

    _fields_ = [f for f in native.SnacParams._fields_ if f[0] != "device"]


@needs_build
def test_a_struct_mismatch_names_the_field_and_both_values(monkeypatch, fresh):
    monkeypatch.setattr(abi, "SnacParams", _StaleSnacParams)  # the one Python mirror of the ABI
    with pytest.raises(PurlinUnavailableError) as info:
        native.load()  # the layout is checked before the CUDA build and the GPU are
    msg = str(info.value)
    lib_layout = native.native_layout()
    assert f"offsetof(PurlinSnacParams, device): the library has {lib_layout['offsetof(PurlinSnacParams, device)']}, " \
           "Python has no such field" in msg
    assert (f"sizeof(PurlinSnacParams): the library has {lib_layout['sizeof(PurlinSnacParams)']}, "
            f"Python has {ctypes.sizeof(_StaleSnacParams)}") in msg
    assert "PurlinMoeParams" not in msg  # the unchanged struct is not reported
    assert "pip install" in msg  # says how to fix it


@needs_build
def test_a_constant_mismatch_names_it_and_both_values(monkeypatch, fresh):
    monkeypatch.setattr(abi, "OPCODES", dict(abi.OPCODES, PACKET_COPY=10))  # where the check reads it
    monkeypatch.setattr(abi, "DTYPE_CODES", dict(abi.DTYPE_CODES, float16=3))
    monkeypatch.setattr(abi, "SNAC_ERROR_FIELDS", abi.SNAC_ERROR_FIELDS[:8])  # an 8-word record
    with pytest.raises(PurlinUnavailableError) as info:
        native.load()
    msg = str(info.value)
    assert "snac.op.PACKET_COPY: the library has 9, Python has 10" in msg
    assert "PURLIN_DTYPE_FLOAT16: the library has 2, Python has 3" in msg
    assert "snac.error.tag: the library has 8, Python has no such field" in msg


# The record-format constants the kernels decode with (native/snac/ops.cuh: opcode_of, sub_of, ref_rank, ...),
# the kernel kinds and the descriptor word: each is exported and compared at load.
ENCODING_CONSTANTS = {
    "SUB_SHIFT": "snac.word0.sub_shift", "NSRC_SHIFT": "snac.word0.nsrc_shift",
    "FLAGS_SHIFT": "snac.word0.flags_shift", "OPCODE_MASK": "snac.word0.opcode_mask",
    "SUB_MASK": "snac.word0.sub_mask", "NSRC_MASK": "snac.word0.nsrc_mask", "REF_BUF_SHIFT": "snac.ref.buf_shift",
    "REF_RANK_SHIFT": "snac.ref.rank_shift", "REF_RANK_BITS": "snac.ref.rank_bits",
    "REF_OFFSET_BITS": "snac.ref.offset_bits", "KERNEL_STAGED": "snac.kernel.STAGED",
    "KERNEL_PACKET": "snac.kernel.PACKET", "DESC_SEQ_SHIFT": "snac.desc.seq_shift",
}


@needs_build
def test_the_library_exports_every_constant_the_kernels_decode_with():
    lib_layout = native.native_layout()
    for name, key in ENCODING_CONSTANTS.items():
        assert lib_layout[key] == getattr(abi, name), key


@needs_build
@pytest.mark.parametrize("name", sorted(ENCODING_CONSTANTS))
def test_a_changed_encoding_constant_is_refused_by_name(monkeypatch, name):
    key, value = ENCODING_CONSTANTS[name], getattr(abi, name)
    monkeypatch.setattr(abi, name, value + 1)
    with pytest.raises(PurlinUnavailableError) as info:
        native.check_layout()
    assert f"{key}: the library has {value}, Python has {value + 1}" in str(info.value)
    assert "pip install" in str(info.value)


def test_layout_problems_reports_missing_and_extra_names():
    mine = {"a": 1, "b": 2, "c": 3}
    got = native.layout_problems({"a": 1, "b": 5, "d": 4, "moe.state_words": 7}, mine)
    assert got == ["b: the library has 5, Python has 2",
                   "c: Python has 3, the library has no such field or constant",
                   "d: the library has 4, Python has no such field or constant"]
    too_many = native.layout_problems({"moe.state_words": 17}, {})
    assert too_many and too_many[0].startswith("moe.state_words: the library has 17 words")


@needs_build
def test_a_stale_abi_version_keeps_the_rebuild_message(monkeypatch, fresh):
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION - 1)
    with pytest.raises(PurlinUnavailableError, match=r"has ABI \d+, this package needs \d+ \(a stale build\); "
                                                     r"reinstall with `pip install \.`"):
        native.load()


# -- the native set-device path, without a GPU -----------------------------------------------------
@needs_build
@pytest.mark.skipif(not built.get("cuda"), reason="the CUDA entry points need a CUDA build")
def test_native_checks_params_before_touching_a_device():
    lib = native._open_checked(built["path"])
    lib.purlin_native_last_device.restype = ctypes.c_int
    before = lib.purlin_native_last_device()
    p = native.SnacParams()
    p.world, p.blocks, p.arrive_slots, p.timeout_ns, p.bases[0] = 1, 1, 1, 1, 4096
    p.device = -2  # not a device
    assert lib.purlin_snac_execute(ctypes.byref(p), None) == CUDA_ERROR_INVALID_VALUE
    p.device = -1
    for kind in (-1, abi.KERNEL_PACKET + 1):  # not a kernel kind of purlin/encoding.h
        p.packets = kind
        assert lib.purlin_snac_execute(ctypes.byref(p), None) == CUDA_ERROR_INVALID_VALUE
    m = native.MoeParams()
    m.device = 99
    assert lib.purlin_moe_dispatch(ctypes.byref(m), None) == CUDA_ERROR_INVALID_VALUE
    assert lib.purlin_native_last_device() == before  # nothing made current
    if torch.cuda.is_available():
        return
    assert before == -1  # no launch has run in this process
    # A device the runtime cannot make current: the call fails with a CUDA error, nothing is launched.
    code = lib.purlin_copy_atom(ctypes.c_void_p(16), ctypes.c_void_p(32), ctypes.c_size_t(16), None, 0, 3)
    assert code not in (0, CUDA_ERROR_INVALID_VALUE)
    assert lib.purlin_native_last_device() == -1


# -- the Python side passes the communicator's device ----------------------------------------------
class _RecordingLib:
    """The NativeLibrary calls the engines make, recording the device of each."""

    def __init__(self, per_sm: int = 1, sms: int = 132):
        self.per_sm, self.sms, self.devices = per_sm, sms, []

    def snac_occupancy(self, device=-1):
        self.devices.append(("snac_occupancy", device))
        return self.per_sm, self.sms

    def moe_occupancy(self, device=-1):
        self.devices.append(("moe_occupancy", device))
        return self.per_sm, self.sms

    def copy_atom(self, dst, src, nbytes, stream, max_blocks=0, device=-1):
        self.devices.append(("copy_atom", device))
        ctypes.memmove(dst, src, nbytes)

    def snac_execute(self, pref, stream):
        p = ctypes.cast(pref, ctypes.POINTER(native.SnacParams)).contents
        self.devices.append(("snac_execute", p.device))
        self.descs = getattr(self, "descs", []) + [(p.desc_off, p.desc_seq, p.desc_fp, p.desc_info)]
        return 0

    def error_string(self, code):
        return f"fake error {code}"


def _cuda_engine_on_cpu(monkeypatch, device_index: int, lib: _RecordingLib,
                        call_check: bool = False) -> cuda_mod.CudaEngine:
    """CudaEngine.__init__ itself, with its device parts on the CPU (no GPU here)."""
    monkeypatch.setattr(native, "load", lambda: lib)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    cpu_arena = cuda_mod._Arena

    def arena(device, words):
        a = cpu_arena(torch.device("cpu"), words)
        a.device = device  # the engine's CUDA device: what a table upload passes to the library
        return a

    monkeypatch.setattr(cuda_mod, "_Arena", arena)
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
    world = 2
    ws = types.SimpleNamespace(device_index=device_index, layout=DeviceLayout(world, 1 << 16),
                               base_ptrs=[4096 * (r + 1) for r in range(world)])
    return cuda_mod.CudaEngine(ws, 1, world, 5.0, ranks_on_gpu=world, call_check=call_check)


def test_cuda_engine_passes_its_device_to_occupancy_uploads_and_launches(monkeypatch):
    lib = _RecordingLib()
    e = _cuda_engine_on_cpu(monkeypatch, 3, lib)
    assert e._params.device == 3 and ("snac_occupancy", 3) in lib.devices
    e._arena.put(np.arange(24, dtype=np.int64), lib, 0)
    assert lib.devices[-1] == ("copy_atom", 3)
    assert lib.snac_execute(e._pref, 0) == 0 and lib.devices[-1] == ("snac_execute", 3)


def test_grid_blocks_refuses_ranks_that_cannot_be_coresident():
    lib = _RecordingLib(per_sm=1, sms=4)
    assert cuda_mod.grid_blocks(lib, 4, 4, device=2) == 1 and lib.devices == [("snac_occupancy", 2)]
    with pytest.raises(PurlinUnavailableError, match="cannot all be resident"):
        cuda_mod.grid_blocks(lib, 5, 5, device=2)
    with pytest.raises(PurlinUnavailableError, match="cannot all be resident"):
        cuda_mod.grid_blocks(_RecordingLib(per_sm=0), 1, 1)  # a kernel that cannot run at all


def test_cuda_moe_passes_its_device():
    lib = _RecordingLib()
    m = CudaMoE.__new__(CudaMoE)
    m.lib, m.device, m.world, m.rank, m.blocks = lib, torch.device("cuda", 5), 2, 0, 4
    m.ctx = types.SimpleNamespace(config=types.SimpleNamespace(timeout_s=1.0))
    m.region = types.SimpleNamespace(base_ptrs=[4096, 8192])
    m._host_error = torch.zeros(native.MOE_ERROR_WORDS, dtype=torch.int64)
    m._trace = None
    for one_device in (True, False):  # virtual ranks: every region on this GPU, signals at GPU scope
        m.one_device = one_device
        p = m._params(MoELayout(2, 8, 2, 64, 64))
        assert p.device == 5 and m.device_index == 5 and p.one_device == int(one_device)
        assert p.trace is None  # moe.trace off: the kernels stamp nothing
    m._trace = torch.zeros(2 * native.MOE_TRACE_WORDS, dtype=torch.int64)
    assert m._params(MoELayout(2, 8, 2, 64, 64)).trace == m._trace.data_ptr()


class _AtomLib:
    """The two ctypes entry points of the public atoms, recording the device argument."""

    def __init__(self):
        self.devices = []

    def purlin_copy_atom(self, dst, src, nbytes, stream, max_blocks, device):
        self.devices.append(device)
        return 0

    def purlin_reduce_atom(self, dst, srcs, nsrc, nbytes, dtype, op, stream, max_blocks, device):
        self.devices.append(device)
        return 0


def test_public_atoms_pass_a_device(monkeypatch):
    lib = object.__new__(native.NativeLibrary)  # no .so, no CUDA
    lib._lib = _AtomLib()
    monkeypatch.setattr(native, "load", lambda: lib)
    native.copy_atom(16, 32, 16, 0, device=2)
    native.reduce_atom(16, [32], 16, torch.float32, "sum", 0, device=3)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    native.copy_atom(16, 32, 16, 0)  # torch has no CUDA context: the library's current device
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    native.copy_atom(16, 32, 16, 0)  # torch's current device
    native.reduce_atom(16, [32], 16, torch.float32, "sum", 0)
    assert lib._lib.devices == [2, 3, -1, 1, 1]
    with pytest.raises(PurlinValueError, match="device"):
        native.copy_atom(16, 32, 16, 0, device=-1)


# -- a bad record surfaces as an error -------------------------------------------------------------
_FIELD = {n: i for i, n in enumerate(native.SNAC_ERROR_FIELDS)}  # error record word of each field


def _engine_with_empty_record() -> cuda_mod.CudaEngine:
    """A CudaEngine (no GPU: only what reading its error record needs) whose record is all zero."""
    e = cuda_mod.CudaEngine.__new__(cuda_mod.CudaEngine)
    e.timeout_s, e._names, e.broken = 5.0, ["all_reduce"], None
    e._err = np.zeros(native.SNAC_ERROR_WORDS, dtype=np.int64)
    return e


def _engine_with_record(code: int, kind: int, w0: int, target: int) -> cuda_mod.CudaEngine:
    e, f = _engine_with_empty_record(), _FIELD
    e._err[[f["code"], f["op"], f["kind"], f["peer"], f["rank"], f["target"], f["seen"], f["tag"]]] = [
        code, 3, kind, -1, 1, target, w0, 0]
    return e


def test_a_bad_record_is_a_broken_error_not_a_timeout():
    w0 = co.REDUCE | (1 << co.SUB_SHIFT) | (2 << co.NSRC_SHIFT)
    e = _engine_with_record(native.SNAC_ERROR_CODES["BAD_RECORD"], co.REDUCE, w0, 0)
    with pytest.raises(PurlinBrokenError, match=r"all_reduce: rank 1's kernel met op #3 \(opcode 2, word 0 0x20102\) "
                                                r"that it cannot run \(dtype code 0"):
        e.check()
    assert "cannot run" in e.broken
    e = _engine_with_record(native.SNAC_ERROR_CODES["TIMEOUT"], co.NOTIFY, 5, 7)
    with pytest.raises(PurlinTimeoutError):
        e.check()


def test_the_recorded_error_is_read_without_raising_or_breaking():
    assert _engine_with_empty_record().recorded_error() is None
    e = _engine_with_record(native.SNAC_ERROR_CODES["TIMEOUT"], co.NOTIFY, 5, 7)
    seen = e.recorded_error()  # what a watchdog thread reads: the same error check() raises, nothing changed
    assert isinstance(seen, PurlinTimeoutError) and e.broken is None and e._err[0]
    with pytest.raises(PurlinTimeoutError) as raised:
        e.check()
    assert str(raised.value) == str(seen) and e.broken == str(seen)


# -- device call descriptors (config device_call_check) ---------------------------------------------------------
def _schedule(spec, world: int, rank: int, nbytes: int, root=None):
    from purlin_sglang.snac import Sizes, lower, make_plan

    plan = make_plan(spec, world, rank, root=root, nbytes=nbytes, staging_bytes=1 << 16, algorithm="oneshot")
    return lower(plan, Sizes((nbytes,), (nbytes,) * (world if spec.output.sliced else 1)))


@pytest.mark.parametrize("call_check", [False, True])
def test_cuda_engine_publishes_call_descriptors_only_when_asked(monkeypatch, call_check):
    from purlin_sglang.collectives.catalog import ALL_GATHER, ALL_REDUCE
    from purlin_sglang.engines.base import CallContext, call_info, fold32

    lib = _RecordingLib()
    monkeypatch.setattr(cuda_mod, "_current_raw_stream", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(synchronize=lambda: 0))
    e = _cuda_engine_on_cpu(monkeypatch, 0, lib, call_check=call_check)
    layout = DeviceLayout(2, 1 << 16)
    assert e._params.desc_off == (layout.desc_off if call_check else -1)
    rng = np.random.default_rng()
    calls = []
    for seq in range(1, 6):
        spec, dtype = (ALL_REDUCE, torch.bfloat16) if rng.integers(2) else (ALL_GATHER, torch.float32)
        n = int(rng.integers(1, 64)) * 4
        x = torch.empty(n // dtype.itemsize, dtype=dtype)
        y = torch.empty(n * (2 if spec is ALL_GATHER else 1) // dtype.itemsize, dtype=dtype)
        sched = _schedule(spec, 2, 1, n)
        fp, info = int(rng.integers(1, 1 << 62)), call_info(spec.name, dtype, n, sched.plan)
        e.execute(sched, CallContext(spec.name, seq, fp, dtype, x, y, info))
        calls.append((seq, fold32(fp), info))
    got = lib.descs
    assert [g[0] for g in got] == [layout.desc_off if call_check else -1] * 5
    if call_check:
        assert [g[1:] for g in got] == calls


def test_device_descriptors_and_rejections_live_in_the_signal_area_and_do_not_overlap():
    for world in (1, 2, 3, 8, 64):
        lay = DeviceLayout(world, 1 << 20)
        end_of_epochs = lay.epoch_off + 16 * 8
        assert lay.desc_off >= end_of_epochs and lay.desc_off % 128 == 0
        slots = {lay.desc(p, s) for p in range(world) for s in range(native.SNAC_DESC_RING)}
        assert len(slots) == world * native.SNAC_DESC_RING
        assert min(slots) == lay.desc_off
        assert max(slots) + native.SNAC_DESC_WORDS * 8 <= lay.reject_off and lay.reject_off % 128 == 0
        assert lay.desc(world - 1, 7) == lay.desc(world - 1, 3)  # slot = seq % ring
        entries = [lay.reject(p) for p in range(world)]  # each producer's rejection message
        assert entries[0] == lay.reject_off and all(b - a == REJECT_WORDS * 8 for a, b in zip(entries, entries[1:]))
        assert entries[-1] + REJECT_WORDS * 8 <= lay.resync_off and lay.resync_off % 128 == 0
        rounds = [lay.resync(p) for p in range(world)]  # each producer's reset words
        assert rounds[0] == lay.resync_off and all(b - a == RESYNC_WORDS * 8 for a, b in zip(rounds, rounds[1:]))
        assert rounds[-1] + RESYNC_WORDS * 8 == lay.signal_bytes <= lay.staging_off
        # a reset clears everything the kernels keep, up to the rejections, and the packet windows; never
        # the reset words themselves nor the staged payload
        assert lay.reset_spans() == [(0, lay.reject_off), (lay.window_off, lay.rank_bytes - lay.window_off)]
        assert lay.window(0, 0) == lay.window_off and lay.window(1, world - 1) + lay.window_bytes == lay.rank_bytes


def _engine_with_mismatch(mine_seq: int, mine_fp: int, theirs_fp: int, my_info: int, peer_info: int | None):
    e, f = _engine_with_empty_record(), _FIELD

    def word(payload):
        v = (mine_seq << 32) | (payload & 0xFFFFFFFF)
        return v - (1 << 64) if v >= 1 << 63 else v

    e._err[f["op"]], e._err[f["kind"]], e._err[f["peer"]], e._err[f["rank"]] = 4, co.NOTIFY, 0, 1
    e._err[f["target"]], e._err[f["seen"]], e._err[f["my_info"]] = word(mine_fp), word(theirs_fp), my_info
    if peer_info is not None:
        e._err[f["peer_info_lo"]], e._err[f["peer_info_hi"]] = word(peer_info), word(peer_info >> 32)
    e._err[f["code"]] = native.SNAC_ERROR_CODES["MISMATCH"]
    return e


def test_a_device_mismatch_record_is_a_mismatch_error_naming_both_calls():
    from purlin_sglang.collectives.catalog import ALL_GATHER, ALL_REDUCE
    from purlin_sglang.engines.base import call_info
    from purlin_sglang.errors import PurlinMismatchError

    mine = call_info("all_reduce", torch.bfloat16, 8192, _schedule(ALL_REDUCE, 2, 1, 8192).plan)
    theirs = call_info("all_gather", torch.float32, 4096, _schedule(ALL_GATHER, 2, 0, 4096).plan)
    e = _engine_with_mismatch(7, 0x1234, 0xBEEF, mine, theirs)
    with pytest.raises(PurlinMismatchError) as info:
        e.check()
    msg = str(info.value)
    assert info.value.rank == 1 and info.value.peer == 0
    assert msg.startswith("all_reduce: rank 1 and rank 0 entered call #7 with different collectives"), msg
    assert ("rank 1 called all_reduce(dtype=bfloat16, 8192 bytes in), rank 0 called all_gather(dtype=float32, "
            "4096 bytes in)") in msg, msg
    assert "communicator is now broken" in msg and e.broken == msg
    # the peer's description words were already overwritten: its fingerprint is named instead
    e = _engine_with_mismatch(9, 0x1234, 0xBEEF, mine, None)
    with pytest.raises(PurlinMismatchError, match=r"call #9 .*rank 0 called another call \(fingerprint 0x0000beef"):
        e.check()
