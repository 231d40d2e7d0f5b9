"""The ``ipc`` provider: one cudaMalloc per rank, mapped into every peer with CUDA IPC.

Each rank allocates its workspace (``cudaMalloc``, zeroed), exports it with
``cudaIpcGetMemHandle``, and the 64-byte handles travel over the group's CPU (gloo)
process group (``all_gather_object``). Each rank opens its peers' handles with
``cudaIpcOpenMemHandle(cudaIpcMemLazyEnablePeerAccess)`` and uses its own pointer for
itself. Peer access is enabled explicitly where a peer's GPU differs from ours, and
skipped where it is the same GPU (several ranks on one GPU, as in the one-GPU tests).

Why legacy CUDA IPC and not the virtual-memory route (``cuMemCreate`` +
``cuMemExportToShareableHandle`` with POSIX file descriptors): legacy IPC handles are
plain bytes, so they travel over the gloo group we already have, and they work between
two processes on ONE GPU, which is what we can test. A POSIX file descriptor is only
meaningful inside the process that owns it: it has to be passed over a Unix-domain
socket (SCM_RIGHTS) or pulled with ``pidfd_getfd`` (Linux 5.6+, and ptrace rights over
the peer, which containers often deny), i.e. a second rendezvous channel beside gloo.
VMM buys control of the granularity and physical placement, multicast objects (NVLS:
off in this project) and fabric handles for multi-node NVLink; none is needed for a
single node's staging buffers today. The VMM route would slot in behind this class.

Contracts: :meth:`IpcWorkspace.create` is collective over ``group`` (every rank calls
it with the same ``layout_nbytes``); it blocks the host (allocation, a device
synchronize after zeroing, two all-gathers); it is not safe under CUDA graph capture.
A rank that fails anywhere in set-up tells the others through a status all-gather, so
every rank raises (naming the failed ranks and why) instead of waiting in a collective.
:meth:`IpcWorkspace.close` is local (no collective, no barrier): the caller makes sure
no peer still reads this rank's memory before it closes.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Optional

from ..errors import PurlinError, PurlinUnavailableError, PurlinValueError
from .device import WorkspaceLifetime
from .procs import exited, own_identity, watchable
from .setup_phase import agree, as_status, check_create_args, check_same_nbytes, setup_group

IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
_PIP = "pip install cuda-python"


def load_cudart():
    """cuda-python's runtime module, imported on first use (tests replace this function)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as e:
        try:  # cuda-python < 12.6 spelled it cuda.cudart
            from cuda import cudart  # type: ignore[no-redef]
        except ImportError:
            raise PurlinUnavailableError(
                f"memory='ipc' needs cuda-python (cuda.bindings.runtime is not importable: {e}); {_PIP}"
            ) from e
    return cudart


def error_text(cudart, err) -> str:
    try:
        _, name = cudart.cudaGetErrorName(err)
        _, text = cudart.cudaGetErrorString(err)
        return f"{name.decode()} ({text.decode()})"
    except Exception:  # a broken runtime: still say which code
        return f"CUDA error {int(err)}"


_NO_GPU = {35, 100}  # cudaErrorInsufficientDriver, cudaErrorNoDevice


def _check(cudart, call: str, result) -> Any:
    """Unpack a cuda-python result tuple ``(err, *values)``; raise if ``err`` is not cudaSuccess."""
    err, values = result[0], result[1:]
    if int(err) != 0:
        hint = ("; GPU memory providers need an NVIDIA GPU and driver (check nvidia-smi and "
                "CUDA_VISIBLE_DEVICES), or use memory='host' with the CPU engine") if int(err) in _NO_GPU else ""
        raise PurlinUnavailableError(f"{call}: {error_text(cudart, err)}{hint}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@contextlib.contextmanager
def _on_device(cudart, device_index: int):
    """Make ``device_index`` current for the block, then restore the caller's device."""
    prev = _check(cudart, "cudaGetDevice", cudart.cudaGetDevice())
    if prev != device_index:
        _check(cudart, f"cudaSetDevice({device_index})", cudart.cudaSetDevice(device_index))
    try:
        yield
    finally:
        if prev != device_index:
            cudart.cudaSetDevice(prev)


def _handle_bytes(handle) -> bytes:
    # cudaIpcMemHandle_t is 64 opaque bytes; getPtr() is its address (every cuda-python version has it).
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def _handle_from_bytes(cudart, raw: bytes):
    handle = cudart.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    return handle


class IpcWorkspace(WorkspaceLifetime):
    """This rank's workspace (a cudaMalloc) and every rank's pointer as mapped in this process.

    Implements :class:`~purlin_sglang.memory.device.DeviceWorkspace`. ``layout`` is whatever
    layout object the caller passed (the engines compute offsets through it); the provider
    only allocates ``nbytes``, exchanges and maps.
    """

    provider = "ipc"

    def __init__(self, *, cudart, rank: int, world: int, device_index: int, nbytes: int, own_ptr: int,
                 peer_ptrs: dict[int, int], layout: Any = None):
        super().__init__(rank=rank, world=world, device_index=device_index, nbytes=nbytes, layout=layout)
        self._cudart = cudart
        self._own_ptr = own_ptr
        self._peer_ptrs = dict(peer_ptrs)  # rank -> pointer opened with cudaIpcOpenMemHandle
        self.peers: dict[int, tuple[int, int]] = {}  # rank -> (pid, start) of the peers this process can watch

    def lost_peers(self) -> dict[int, int]:
        """The peers (rank -> pid) whose processes have exited since the set-up, among those this process
        can watch (:mod:`.procs`: same host, same pid namespace). Reads /proc only; safe from any thread."""
        return {r: pid for r, (pid, start) in self.peers.items() if exited(pid, start)}

    # -- set-up ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, layout_nbytes: int, group: Any, device_index: int, rank: int, world: int, *,
               layout: Any = None) -> "IpcWorkspace":
        """Allocate ``layout_nbytes`` zeroed bytes on GPU ``device_index`` and map every rank's.

        Collective over ``group`` (a CPU/gloo group; None: the default group): every rank
        calls it, with the same ``layout_nbytes``. Blocks the host; not for CUDA graph capture.
        Raises on EVERY rank if any rank fails: :class:`PurlinValueError` for bad or
        disagreeing arguments, :class:`PurlinUnavailableError` (naming the CUDA call and its
        error string) when cuda-python, the GPU or IPC is not usable. Whatever it raises (also
        an exchange that fails because a peer died, or an interrupt), it has first closed the
        peers' handles it opened and freed the memory it allocated.
        """
        op = "IpcWorkspace.create"
        group, gworld = setup_group(op, group)
        cudart, own_ptr, ws = None, None, None
        try:
            # Phase 1: check, allocate, zero, export.
            try:
                check_create_args(op, group, layout_nbytes, device_index, rank, world)
                cudart = load_cudart()
                with _on_device(cudart, device_index):
                    own_ptr = int(_check(cudart, f"cudaMalloc({layout_nbytes})", cudart.cudaMalloc(layout_nbytes)))
                    _check(cudart, "cudaMemset", cudart.cudaMemset(own_ptr, 0, layout_nbytes))
                    _check(cudart, "cudaDeviceSynchronize", cudart.cudaDeviceSynchronize())
                    handle = _check(cudart, "cudaIpcGetMemHandle", cudart.cudaIpcGetMemHandle(own_ptr))
                    bus = _check(cudart, "cudaDeviceGetPCIBusId", cudart.cudaDeviceGetPCIBusId(32, device_index))
                mine = ("ok", {"handle": _handle_bytes(handle), "bus_id": _bus_text(bus), "nbytes": layout_nbytes,
                               **own_identity(), "device_index": device_index})
            except Exception as e:  # noqa: BLE001 - every failure is reported to every rank
                mine = as_status(e)
            infos = agree(op, group, gworld, mine)
            check_same_nbytes(op, infos)
            pids = [i["pid"] for i in infos]
            if len(set(pids)) != len(pids):
                raise PurlinValueError(f"{op}: several ranks live in one process (pids {pids}); CUDA IPC maps "
                                       "memory between processes: use memory='loopback' for ranks in one process")

            # Phase 2: enable peer access where the GPUs differ, open every peer's handle.
            ws = cls(cudart=cudart, rank=rank, world=world, device_index=device_index, nbytes=layout_nbytes,
                     own_ptr=own_ptr, peer_ptrs={}, layout=layout)
            ws.peers = watchable({r: i for r, i in enumerate(infos) if r != rank})
            try:
                own_bus = infos[rank]["bus_id"]
                with _on_device(cudart, device_index):
                    for r, info in enumerate(infos):
                        if r == rank:
                            continue
                        if info["bus_id"] != own_bus:
                            _enable_peer(cudart, device_index, info["bus_id"], r)
                        h = _handle_from_bytes(cudart, info["handle"])
                        ptr = _check(cudart, f"cudaIpcOpenMemHandle(rank {r})",
                                     cudart.cudaIpcOpenMemHandle(h, cudart.cudaIpcMemLazyEnablePeerAccess))
                        ws._peer_ptrs[r] = int(ptr)
                mine = ("ok", None)
            except Exception as e:  # noqa: BLE001
                mine = as_status(e)
            agree(op, group, gworld, mine)
        except BaseException:  # a failed rank, a dead peer's exchange, an interrupt: release, then raise it
            if ws is not None:
                with contextlib.suppress(Exception):
                    ws.close()  # the peers' handles opened so far, then this rank's memory
            else:
                _free_quietly(cudart, own_ptr, device_index)
            raise
        return ws

    # -- DeviceWorkspace ------------------------------------------------------------------------
    def _mapped_ptrs(self) -> list[int]:
        return [self._own_ptr if r == self.rank else self._peer_ptrs[r] for r in range(self.world)]

    def close(self) -> None:
        """Unmap the peers (cudaIpcCloseMemHandle) and free this rank's memory (cudaFree).

        Local: no collective, no barrier; safe to call twice. Make sure no peer still reads this
        rank's memory first. Tries every step, then raises :class:`PurlinUnavailableError` naming
        the calls that failed, if any.
        """
        if self._closed:
            return
        self._closed = True
        cudart, errors = self._cudart, []
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(_on_device(cudart, self.device_index))
            except PurlinError as e:  # still try to release: the calls below say what fails
                errors.append(str(e))
            for r, ptr in sorted(self._peer_ptrs.items()):
                _collect(errors, cudart, f"cudaIpcCloseMemHandle(rank {r})", cudart.cudaIpcCloseMemHandle(ptr))
            self._peer_ptrs.clear()
            if self._own_ptr:
                _collect(errors, cudart, "cudaFree", cudart.cudaFree(self._own_ptr))
                self._own_ptr = 0
        if errors:
            raise PurlinUnavailableError(f"IpcWorkspace.close (rank {self.rank}): " + "; ".join(errors))


_CUDART_UNLOADING = 4  # cudaErrorCudartUnloading: the process is exiting, the driver frees everything


def _collect(errors: list, cudart, call: str, result) -> None:
    err = int(result[0])
    if err not in (0, _CUDART_UNLOADING):
        errors.append(f"{call}: {error_text(cudart, result[0])}")


def _bus_text(bus) -> str:
    raw = bytes(bus) if not isinstance(bus, str) else bus.encode()
    return raw.split(b"\0", 1)[0].decode().strip().lower()


def _enable_peer(cudart, device_index: int, bus_id: str, peer_rank: int) -> None:
    """Enable access from the current device to the GPU with PCI bus id ``bus_id``."""
    peer_dev = _check(cudart, f"cudaDeviceGetByPCIBusId({bus_id}) for rank {peer_rank}",
                      cudart.cudaDeviceGetByPCIBusId(bus_id.encode()))
    can = _check(cudart, "cudaDeviceCanAccessPeer", cudart.cudaDeviceCanAccessPeer(device_index, peer_dev))
    if not can:
        raise PurlinUnavailableError(
            f"cudaDeviceCanAccessPeer: GPU {device_index} cannot access rank {peer_rank}'s GPU {peer_dev} "
            f"({bus_id}); the ipc provider needs NVLink or PCIe P2P between every pair of GPUs"
        )
    result = cudart.cudaDeviceEnablePeerAccess(peer_dev, 0)
    if int(result[0]) == int(cudart.cudaError_t.cudaErrorPeerAccessAlreadyEnabled):
        cudart.cudaGetLastError()  # not an error for us; do not leave it for the next caller
        return
    _check(cudart, f"cudaDeviceEnablePeerAccess({peer_dev})", result)


def _free_quietly(cudart, ptr: Optional[int], device_index: int) -> None:
    if cudart is None or not ptr:
        return
    with contextlib.suppress(Exception):
        with _on_device(cudart, device_index):
            cudart.cudaFree(ptr)


__all__ = ["IpcWorkspace", "IPC_HANDLE_BYTES"]
