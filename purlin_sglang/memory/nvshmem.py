"""The ``nvshmem`` provider: each rank's workspace is one block of NVSHMEM's symmetric heap.

NVSHMEM is initialised over the group's processes with the unique-id bootstrap: the group's
rank 0 makes an id (``nvshmemx_get_uniqueid``), it travels over the group's CPU (gloo) process
group, and every rank initialises as PE ``rank`` of ``world``
(``nvshmemx_set_attr_uniqueid_args``, then init with ``NVSHMEMX_INIT_WITH_UNIQUEID``). The
workspace is ``nvshmem_malloc(layout_nbytes)``, zeroed; the peers' pointers are
``nvshmem_ptr(block, pe)``. NVSHMEM's host API is reached through ``libpurlin_nvshmem.so``
(native/nvshmem/), a small library built next to the native module only where CUDA is on and
the nvidia-nvshmem-cu13 (or -cu12) wheel was installed at build time; elsewhere
:meth:`NvshmemWorkspace.create` raises :class:`PurlinUnavailableError` saying so on every rank,
and :func:`nvshmem_status` says why.

NVSHMEM is process-global, so this module keeps one NVSHMEM session per process:

* The first :meth:`create` initialises NVSHMEM over its group's processes, bound to its GPU.
  Later :meth:`create` calls over a group of the SAME processes (any rank order) reuse it.
  A process holds ONE nvshmem group at a time: a :meth:`create` over other processes, or on
  another GPU, raises. :func:`shutdown` (collective) finalizes NVSHMEM; NVSHMEM cannot be
  initialised again in that process afterwards.
* ``nvshmem_malloc`` / ``nvshmem_free`` are collective in NVSHMEM (every PE, same order), but
  :meth:`NvshmemWorkspace.close` is local, like the other providers': it retires the block, and
  blocks retired on EVERY rank are freed at the start of the next :meth:`create` or
  :func:`shutdown` over the group (both collective anyway), oldest first. Until then the heap
  keeps them (at most one stale workspace per communicator that was closed).

Environment: just before NVSHMEM is initialised (inside the first :meth:`create`, never at
import), ``NVSHMEM_DISABLE_NVLS=1`` is set in this process's environment: this project never
uses NVLink multicast. NVSHMEM's unique-id bootstrap loads its plugin
``nvshmem_bootstrap_uid.so.3`` by name; the wheel's ``libnvshmem_host.so.3`` finds it in its own
directory (its RPATH is ``$ORIGIN``), and this module also preloads it from there by absolute
path unless ``NVSHMEM_BOOTSTRAP_UID_PLUGIN`` is set. Every other ``NVSHMEM_*`` variable is the
user's (e.g. ``NVSHMEM_DEBUG=WARN``).

Contracts: :meth:`create` is collective over ``group`` (every rank calls it with the same
``layout_nbytes``), blocks the host (status all-gathers, NVSHMEM init, a collective malloc, a
device synchronize after zeroing) and is not safe under CUDA graph capture. A rank that fails a
check tells the others through a status all-gather before any collective NVSHMEM call, so every
rank raises. A failure INSIDE NVSHMEM's own collectives (init, malloc) can leave the peers
waiting in NVSHMEM, which has no timeout we can set; a session that failed half-way refuses
further use ("restart the processes"). :meth:`close` is local, never blocks, safe to call twice.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import socket
import threading
from typing import Any, Optional

from ..errors import PurlinError, PurlinUnavailableError, PurlinValueError
from .device import WorkspaceLifetime
from .setup_phase import (
    _Fail, agree, as_status, check_create_args, check_same_nbytes, gather_status, raise_failures, setup_group,
)

SHIM_ABI_VERSION = 1  # PURLIN_NVSHMEM_ABI_VERSION in native/nvshmem/purlin_nvshmem.cu
_HOST_LIB = "libnvshmem_host.so.3"
_UID_PLUGIN = "nvshmem_bootstrap_uid.so.3"
_REINSTALL = ("pip install nvidia-nvshmem-cu13 (nvidia-nvshmem-cu12 for CUDA 12) and reinstall purlin_sglang with "
              "`pip install --no-build-isolation .` so that its build sees the wheel")
_NO_GPU = ("; GPU memory providers need an NVIDIA GPU and driver (check nvidia-smi and CUDA_VISIBLE_DEVICES), "
           "or use memory='host' with the CPU engine")


# -- what this installation has -------------------------------------------------------------------
def _native_build_info() -> dict:
    """The native module's build info (tests replace this function)."""
    from .. import native

    return native.build_info()


def _wheel_dirs() -> list[str]:
    """The installed nvidia-nvshmem wheel's ``nvidia/nvshmem`` directories (a namespace package)."""
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return []
    dirs = list(spec.submodule_search_locations or []) if spec else []
    return [d for d in dirs if os.path.isfile(os.path.join(d, "lib", _HOST_LIB))]


def nvshmem_status() -> dict:
    """Whether the nvshmem provider can run here, and what it was built with. Never raises; loads nothing.

    Keys: ``built`` (libpurlin_nvshmem.so was built), ``reason`` (None, or why ``memory='nvshmem'``
    is unavailable, with the fix), ``version`` (the NVSHMEM headers it was built against),
    ``wheel`` (the wheel seen at build time), ``build_dir`` (that wheel's nvidia/nvshmem
    directory), ``library`` (the shim's path) and ``runtime_dir`` (the wheel's directory found
    now, or None). A GPU is not checked here.
    """
    info = _native_build_info()
    out: dict[str, Any] = {"built": False, "reason": None, "version": None, "wheel": None, "build_dir": None,
                           "library": None, "runtime_dir": None}
    if not info.get("built"):
        out["reason"] = f"memory='nvshmem': the native library is not built: {info.get('reason')}"
        return out
    nv = info.get("nvshmem")
    if not isinstance(nv, dict):
        out["reason"] = ("memory='nvshmem': the native module predates the nvshmem provider (its build info has "
                         "no 'nvshmem' entry); reinstall purlin_sglang")
        return out
    if not nv.get("built"):
        out["reason"] = (f"memory='nvshmem': this build of purlin_sglang has no NVSHMEM support: "
                         f"{nv.get('reason') or 'unknown reason'}; {_REINSTALL}")
        return out
    lib = os.path.join(os.path.dirname(info.get("path") or ""), nv.get("library") or "libpurlin_nvshmem.so")
    dirs = _wheel_dirs()
    out.update(built=True, version=nv.get("version"), wheel=nv.get("wheel"), build_dir=nv.get("dir"), library=lib,
               runtime_dir=dirs[0] if dirs else None)
    if not os.path.isfile(lib):
        out["reason"] = f"memory='nvshmem': {lib} is missing from the installation; reinstall purlin_sglang"
    elif not dirs and not os.path.isfile(os.path.join(nv.get("dir") or "", "lib", _HOST_LIB)):
        out["reason"] = (f"memory='nvshmem': purlin_sglang was built against NVSHMEM {nv.get('version')} "
                         f"({nv.get('wheel') or nv.get('dir')}), but no nvidia-nvshmem wheel is installed now; "
                         f"{_REINSTALL}")
    return out


# -- the shim --------------------------------------------------------------------------------------
class _Shim:
    """Typed ctypes bindings over libpurlin_nvshmem.so; every method raises on a non-zero status."""

    def __init__(self, path: str, host_lib_dir: str):
        self.path = path
        self.host_lib_dir = host_lib_dir
        lib = ctypes.CDLL(path)
        c_int, c_size, c_void = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
        p_int, p_size, p_void = ctypes.POINTER(c_int), ctypes.POINTER(c_size), ctypes.POINTER(c_void)
        for name, args in {
            "abi_version": [], "build_info": [], "last_error": [], "uniqueid_bytes": [],
            "runtime_version": [p_int, p_int, p_int], "init_status": [p_int], "device_count": [p_int],
            "mem_info": [c_int, p_size, p_size], "get_uniqueid": [c_void, c_int],
            "init": [ctypes.c_char_p, c_int, c_int, c_int, c_int], "pe": [p_int, p_int],
            "malloc": [c_int, c_size, p_void], "ptr": [c_void, c_int, p_void], "free": [c_int, c_void],
            "finalize": [c_int],
        }.items():
            fn = getattr(lib, f"purlin_nvshmem_{name}")
            fn.argtypes = args
            fn.restype = ctypes.c_char_p if name in ("build_info", "last_error") else c_int
        self._lib = lib
        if lib.purlin_nvshmem_abi_version() != SHIM_ABI_VERSION:
            raise PurlinUnavailableError(f"memory='nvshmem': {path} has ABI {lib.purlin_nvshmem_abi_version()}, this "
                                         f"package needs {SHIM_ABI_VERSION} (a stale build); reinstall purlin_sglang")
        self.uid_bytes = int(lib.purlin_nvshmem_uniqueid_bytes())
        self.headers_version = json.loads(lib.purlin_nvshmem_build_info()).get("nvshmem")

    def _check(self, call: str, code: int, no_gpu_hint: bool = False) -> None:
        if code != 0:
            text = (self._lib.purlin_nvshmem_last_error() or b"").decode(errors="replace") or f"status {code}"
            hint = _NO_GPU if no_gpu_hint and ("NoDevice" in text or "InsufficientDriver" in text) else ""
            raise PurlinUnavailableError(f"{text if text.startswith(call) else f'{call}: {text}'}{hint}")

    def runtime_version(self) -> str:
        v = [ctypes.c_int(0) for _ in range(3)]
        self._check("nvshmem runtime_version", self._lib.purlin_nvshmem_runtime_version(*map(ctypes.byref, v)))
        return ".".join(str(x.value) for x in v)

    def init_status(self) -> int:
        s = ctypes.c_int(0)
        self._check("nvshmemx_init_status", self._lib.purlin_nvshmem_init_status(ctypes.byref(s)))
        return int(s.value)

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        self._check("cudaGetDeviceCount", self._lib.purlin_nvshmem_device_count(ctypes.byref(n)), no_gpu_hint=True)
        return int(n.value)

    def mem_info(self, device: int) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._check("cudaMemGetInfo", self._lib.purlin_nvshmem_mem_info(device, ctypes.byref(free),
                                                                        ctypes.byref(total)))
        return int(free.value), int(total.value)

    def get_uniqueid(self) -> bytes:
        buf = ctypes.create_string_buffer(self.uid_bytes)
        self._check("nvshmemx_get_uniqueid", self._lib.purlin_nvshmem_get_uniqueid(buf, self.uid_bytes))
        return buf.raw

    def init(self, uid: bytes, pe: int, npes: int, device: int) -> None:
        self._check("nvshmem init", self._lib.purlin_nvshmem_init(uid, len(uid), pe, npes, device))

    def malloc(self, device: int, nbytes: int) -> tuple[int, Optional[PurlinError]]:
        """(pointer or 0, the error or None): a block can exist even when zeroing it failed."""
        out = ctypes.c_void_p(0)
        code = self._lib.purlin_nvshmem_malloc(device, nbytes, ctypes.byref(out))
        try:
            self._check("nvshmem_malloc", code)
            return int(out.value or 0), None
        except PurlinError as e:
            return int(out.value or 0), e

    def ptr(self, block: int, pe: int) -> int:
        out = ctypes.c_void_p(0)
        self._check(f"nvshmem_ptr(PE {pe})", self._lib.purlin_nvshmem_ptr(block, pe, ctypes.byref(out)))
        return int(out.value)

    def free(self, device: int, block: int) -> None:
        self._check("nvshmem_free", self._lib.purlin_nvshmem_free(device, block))

    def finalize(self, device: int) -> None:
        self._check("nvshmem_finalize", self._lib.purlin_nvshmem_finalize(device))


def _mapped(name: str) -> Optional[str]:
    """The path of a library file named ``name`` already mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path) == name:
                    return path
    except OSError:
        pass
    return None


_SHIM: Optional[_Shim] = None


def _load_shim() -> _Shim:
    """libpurlin_nvshmem.so, loaded once per process; _Fail("unavailable") saying what is missing
    (tests replace this function)."""
    global _SHIM
    if _SHIM is not None:
        return _SHIM
    st = nvshmem_status()
    if st["reason"]:
        raise _Fail("unavailable", st["reason"])
    # The host library the shim links by SONAME: the one already in the process (torch's CUDA
    # build loads it from the same wheel), else the wheel's, preloaded by absolute path so that a
    # moved environment still works (the shim's RPATH is the build-time directory).
    host = _mapped(_HOST_LIB)
    if host is None:
        lib_dir = os.path.join(st["runtime_dir"] or st["build_dir"], "lib")
        host = os.path.join(lib_dir, _HOST_LIB)
        try:
            ctypes.CDLL(host)
        except OSError as e:
            raise _Fail("unavailable", f"memory='nvshmem': cannot load {host} ({e}); {_REINSTALL}") from e
    lib_dir = os.path.dirname(host)
    if "NVSHMEM_BOOTSTRAP_UID_PLUGIN" not in os.environ and _mapped(_UID_PLUGIN) is None:
        plugin = os.path.join(lib_dir, _UID_PLUGIN)
        try:  # NVSHMEM's dlopen of the plugin's SONAME then finds this one
            ctypes.CDLL(plugin)
        except OSError as e:
            raise _Fail("unavailable", f"memory='nvshmem': cannot load NVSHMEM's unique-id bootstrap plugin {plugin} "
                                       f"({e}); {_REINSTALL}") from e
    try:
        _SHIM = _Shim(st["library"], lib_dir)
    except OSError as e:
        raise _Fail("unavailable", f"memory='nvshmem': cannot load {st['library']} with ctypes ({e}); "
                                   f"{_REINSTALL}") from e
    return _SHIM


# -- the process's NVSHMEM session ----------------------------------------------------------------
class _Session:
    """NVSHMEM as initialised in this process: its PEs, its GPU and the blocks this module holds."""

    def __init__(self, peers: tuple, device_index: int):
        self.peers = peers  # (hostname, pid) of PE 0, 1, ...
        self.device_index = device_index
        self.next_id = 0  # block ids: mallocs are collective, so every rank numbers blocks alike
        self.live: dict[int, int] = {}  # block id -> pointer, an open workspace's
        self.retired: dict[int, int] = {}  # closed here, not freed yet (nvshmem_free is collective)


_lock = threading.RLock()
_SESSION: Optional[_Session] = None
_FINALIZED = False  # shutdown() finalized NVSHMEM in this process
_BROKEN = ""  # why no further collective NVSHMEM call can be matched on every rank ("" if none)


def _identity() -> tuple:
    return (socket.gethostname(), os.getpid())


def _agree_on_session(op: str, infos: list) -> Optional[tuple]:
    """The PEs of the session every rank holds (None: nobody holds one); raises where they differ."""
    sessions = [None if i["peers"] is None else tuple(i["peers"]) for i in infos]
    if all(s is None for s in sessions):
        return None
    idents = [tuple(i["ident"]) for i in infos]
    first = next(s for s in sessions if s is not None)
    if any(s != first for s in sessions) or set(first) != set(idents) or len(first) != len(idents):
        have = [r for r, s in enumerate(sessions) if s is not None]
        raise PurlinUnavailableError(
            f"{op}: NVSHMEM is process-global and rank(s) {have} of this group already hold a session over other "
            f"processes ({len(first)} PEs); one process holds one nvshmem group at a time: create every nvshmem "
            "workspace over the same processes, or use memory='ipc'")
    return first


def _free_retired(shim: Any, session: _Session, infos: list) -> None:
    """nvshmem_free every block retired on every rank, oldest first (the same calls on every rank)."""
    common = set(infos[0]["retired"]).intersection(*(set(i["retired"]) for i in infos[1:]))
    for block_id in sorted(common):
        shim.free(session.device_index, session.retired.pop(block_id))


class NvshmemWorkspace(WorkspaceLifetime):
    """This rank's workspace (a block of NVSHMEM's symmetric heap) and every rank's pointer to it.

    Implements :class:`~purlin_sglang.memory.device.DeviceWorkspace`; ``layout`` is whatever
    layout object the caller passed. See the module docstring for the one-session-per-process
    rule and when the memory of a closed workspace is given back (``hbm_bytes`` is 0 once
    closed; the heap frees the block at the next set-up).
    """

    provider = "nvshmem"

    def __init__(self, *, rank: int, world: int, device_index: int, nbytes: int, ptrs: list[int], session: Any,
                 block_id: int, layout: Any = None):
        super().__init__(rank=rank, world=world, device_index=device_index, nbytes=nbytes, layout=layout)
        self._ptrs = list(ptrs)
        self._session = session
        self._block_id = block_id

    @classmethod
    def create(cls, layout_nbytes: int, group: Any, device_index: int, rank: int, world: int, *,
               layout: Any = None) -> "NvshmemWorkspace":
        """Allocate ``layout_nbytes`` zeroed bytes of NVSHMEM's symmetric heap on GPU ``device_index``.

        Collective over ``group`` (a CPU/gloo group; None: the default group): every rank calls
        it, with the same ``layout_nbytes``. The first call in a process initialises NVSHMEM over
        the group's processes. Blocks the host; not for CUDA graph capture. Raises on EVERY rank
        if any rank fails a check: :class:`PurlinValueError` for bad or disagreeing arguments,
        :class:`PurlinUnavailableError` when NVSHMEM is not built in (naming the wheel), there is
        no GPU, or NVSHMEM refuses (naming the call).
        """
        global _SESSION, _BROKEN
        op = "NvshmemWorkspace.create"
        group, gworld = setup_group(op, group)
        with _lock:
            # Phase 1: local checks; nothing collective in NVSHMEM yet.
            shim = None
            try:
                check_create_args(op, group, layout_nbytes, device_index, rank, world)
                shim = _load_shim()
                session = _SESSION
                if _BROKEN:
                    raise _Fail("unavailable", f"{op}: {_BROKEN}")
                if session is None and _FINALIZED:
                    raise _Fail("unavailable", f"{op}: NVSHMEM was finalized in this process (memory.nvshmem.shutdown) "
                                               "and cannot be initialised again; start new processes")
                count = shim.device_count()
                if device_index >= count:
                    raise _Fail("unavailable", f"{op}: device_index={device_index} but {count} GPU(s) are visible")
                if session is not None and session.device_index != device_index:
                    raise _Fail("value", f"{op}: NVSHMEM in this process is bound to GPU {session.device_index} (its "
                                         f"first workspace's), not {device_index}; one process uses one GPU here")
                if session is None and shim.init_status() != 0:
                    raise _Fail("unavailable", f"{op}: NVSHMEM is already initialised in this process by another "
                                               "user of libnvshmem_host.so.3 (torch's NVSHMEM symmetric memory?); "
                                               "use memory='ipc' or memory='torch' there")
                free, _ = shim.mem_info(device_index)
                if free < layout_nbytes:
                    raise _Fail("unavailable", f"{op}: GPU {device_index} has {free} bytes free, the workspace needs "
                                               f"{layout_nbytes}")
                mine = ("ok", {"nbytes": layout_nbytes, "ident": _identity(),
                               "peers": None if session is None else session.peers,
                               "retired": [] if session is None else sorted(session.retired)})
            except Exception as e:  # noqa: BLE001 - every failure is reported to every rank
                mine = as_status(e)
            infos = agree(op, group, gworld, mine)
            check_same_nbytes(op, infos)
            idents = [tuple(i["ident"]) for i in infos]
            if len(set(idents)) != len(idents):
                raise PurlinValueError(f"{op}: several ranks live in one process ({idents}); NVSHMEM has one PE per "
                                       "process: use memory='loopback' for ranks in one process")
            peers = _agree_on_session(op, infos)

            # Phase 2 (first use in these processes): rank 0's unique id, then init everywhere.
            if peers is None:
                _SESSION = _init_session(op, shim, group, gworld, rank, device_index, tuple(idents))
                peers = _SESSION.peers
            session = _SESSION
            pe_of = {ident: pe for pe, ident in enumerate(peers)}

            # Phase 3: free what every rank retired, allocate (collective), map every peer.
            block_id, ptr, ptrs, allocated = session.next_id, 0, [], False
            session.next_id += 1
            try:
                _free_retired(shim, session, infos)
                ptr, err = shim.malloc(device_index, layout_nbytes)
                allocated = bool(ptr)
                if ptr:
                    session.live[block_id] = ptr
                if err is not None:
                    raise err
                ptrs = [ptr if r == rank else shim.ptr(ptr, pe_of[idents[r]]) for r in range(world)]
                mine = ("ok", True)
            except Exception as e:  # noqa: BLE001
                mine = (*as_status(e), allocated)
            statuses = None
            try:
                statuses = gather_status(group, gworld, mine)
                raise_failures(op, statuses)
            except BaseException as e:
                if statuses is not None and all(s[-1] for s in statuses):  # the block exists everywhere:
                    session.retired[block_id] = session.live.pop(block_id)  # freed with the next set-up
                else:  # its collective free cannot be matched on every rank any more
                    session.live.pop(block_id, None)
                    _BROKEN = (f"an nvshmem_malloc failed on some rank of this group earlier ({op}); the symmetric "
                               "heap is no longer the same on every PE" if statuses is not None else
                               f"the exchange after an nvshmem_malloc failed earlier ({op}: {as_status(e)[2]}); "
                               "whether every PE holds the block is unknown") + ": restart the processes"
                raise
            return cls(rank=rank, world=world, device_index=device_index, nbytes=layout_nbytes, ptrs=ptrs,
                       session=session, block_id=block_id, layout=layout)

    # -- DeviceWorkspace ------------------------------------------------------------------------
    def close(self) -> None:
        """Retire this rank's block: it is freed (collectively) at the next create() or shutdown() over
        the group once every rank has closed it. Local: no collective, no barrier; safe to call twice.
        Make sure no peer still reads this rank's memory first."""
        if self._closed:
            return
        self._closed = True
        self._ptrs = []
        with _lock:
            s = self._session
            if self._block_id in s.live:
                s.retired[self._block_id] = s.live.pop(self._block_id)


def _init_session(op: str, shim: Any, group: Any, gworld: int, rank: int, device_index: int,
                  peers: tuple) -> _Session:
    """Rank 0 makes the unique id, it travels in a status all-gather, every rank initialises NVSHMEM."""
    global _BROKEN
    try:
        mine = ("ok", shim.get_uniqueid() if rank == 0 else None)
    except Exception as e:  # noqa: BLE001
        mine = as_status(e)
    uid = agree(op, group, gworld, mine)[0]
    try:
        os.environ["NVSHMEM_DISABLE_NVLS"] = "1"  # never NVLink multicast (read by NVSHMEM at init)
        shim.init(uid, rank, gworld, device_index)
        mine = ("ok", None)
    except Exception as e:  # noqa: BLE001
        mine = as_status(e)
    try:
        agree(op, group, gworld, mine)
    except BaseException as e:  # NVSHMEM is half set up (here or on a peer): nothing collective can follow
        _BROKEN = (f"NVSHMEM failed to initialise on some rank of this group earlier ({as_status(e)[2]}); it "
                   "cannot be initialised again in this process: restart the processes")
        raise
    return _Session(peers, device_index)


def shutdown(group: Any = None) -> bool:
    """Free every retired block and, when no rank holds an open nvshmem workspace, finalize NVSHMEM.

    Collective over ``group`` (the processes NVSHMEM was initialised over; None: the default
    group); a no-op where no rank has an NVSHMEM session. Returns True when NVSHMEM was
    finalized (it cannot be initialised again in these processes), False when an open workspace
    kept it. Call it before the processes exit for a clean NVSHMEM teardown; exiting without it
    leaves the clean-up to the driver.
    """
    global _SESSION, _FINALIZED
    op = "nvshmem.shutdown"
    group, gworld = setup_group(op, group)
    with _lock:
        s = _SESSION
        mine = ("ok", {"ident": _identity(), "peers": None if s is None else s.peers,
                       "retired": [] if s is None else sorted(s.retired), "live": 0 if s is None else len(s.live),
                       "broken": _BROKEN})
        infos = agree(op, group, gworld, mine)  # every status is "ok": an exchange of states
        broken = [(r, i["broken"]) for r, i in enumerate(infos) if i["broken"]]
        if broken:
            raise PurlinUnavailableError(f"{op}: rank {broken[0][0]}: {broken[0][1]}")
        if _agree_on_session(op, infos) is None:
            return False
        finalize = all(i["live"] == 0 for i in infos)
        try:
            _free_retired(_load_shim(), s, infos)
            if finalize:
                _load_shim().finalize(s.device_index)
                _SESSION, _FINALIZED = None, True
            mine = ("ok", None)
        except Exception as e:  # noqa: BLE001
            mine = as_status(e)
        agree(op, group, gworld, mine)
        return finalize


__all__ = ["NvshmemWorkspace", "nvshmem_status", "shutdown"]
