"""Host shared memory: the provider of the CPU reference engine.

Two forms share one layout: ``HostWorkspace.private`` (one process, virtual ranks
in threads) and ``HostWorkspace.shared`` (separate processes on one host, a file
under /dev/shm mapped by every rank and unlinked as soon as all have mapped it).

The shared file is allocated for real (``posix_fallocate``) after a free-space check, so a
small /dev/shm (a container's 64 MiB default) is a clear error at construction instead of a
SIGBUS at the first large call. Its name (:func:`shared_path`) is told to every rank before the
file exists, so any surviving rank can unlink it (memory/bootstrap.py); a file left only when no
rank survived to do so is removed by the next construction on the host (:func:`remove_stale`).

Ordering: signal words are 8-byte aligned int64 stores by one writer; staging
data is written before the signal that publishes it. This relies on the host's
total store order (x86-64); other hosts are not supported by the process form.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import uuid

import numpy as np
import torch

from ..errors import PurlinUnavailableError
from .layout import MAGIC, VERSION, WorkspaceLayout

SHM_DIR = "/dev/shm"
_STALE = re.compile(r"^purlin-(\d+)-[0-9a-f]{12}$")  # purlin-<creator pid>-<random>


def shm_free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def shm_space_error(need: int, free: int, directory: str) -> PurlinUnavailableError:
    """The error for a shared-memory file system too small for the workspace (names the fix)."""
    return PurlinUnavailableError(
        f"Communicator: the host workspace needs {_mib(need)} ({need} bytes) in {directory}, but only "
        f"{_mib(free)} is free; fix: give the container a larger {directory} (docker run --shm-size=..., "
        f"e.g. --shm-size={max(1, -(-need // (1 << 30)) + 1)}g), lower staging_bytes (the workspace is about "
        "world x staging_bytes), or set shm_dir to a larger tmpfs")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def shared_path(directory: str) -> str:
    """A fresh path for a workspace file in ``directory``, ``purlin-<this pid>-<random>``: unique per
    communicator, and the pid tells :func:`remove_stale` whether its creator is alive. Creates nothing."""
    return os.path.join(directory, f"purlin-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def remove_stale(directory: str) -> list[str]:
    """Remove workspace files in ``directory`` whose creating process no longer exists.

    A file lives only between its creation and the moment every rank has mapped it, and any rank
    that survives a failure in between unlinks it; one left behind means no rank of its group
    survived to do so (every rank killed during ``Communicator(...)``, or the creator killed after
    its peers had given up on it). Only this user's files named by this module are touched, and
    only when their creator's pid is not alive (in this pid namespace). Returns the removed names."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = _STALE.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    return removed


class HostWorkspace:
    """Signal words (a numpy int64 view) and per-rank staging (torch uint8 views) over one buffer."""

    def __init__(self, layout: WorkspaceLayout, buffer, *, mapping: mmap.mmap | None = None):
        self.layout = layout
        self._mapping = mapping
        self._buffer = buffer
        self.words = np.frombuffer(buffer, dtype=np.int64, count=layout.signal_words)
        raw = torch.frombuffer(buffer, dtype=torch.uint8) if layout.total_bytes else torch.empty(0, dtype=torch.uint8)
        self.staging = [
            raw[layout.staging_offset(r): layout.staging_offset(r) + layout.staging_bytes]
            for r in range(layout.world)
        ]

    def staging_region(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s staging region (memory/heap.py: the heap is its tail)."""
        return self.staging[rank]

    def init_header(self) -> None:
        self.words[:4] = (MAGIC, VERSION, self.layout.world, self.layout.staging_bytes)

    def check_header(self) -> None:
        got = tuple(int(v) for v in self.words[:4])
        want = (MAGIC, VERSION, self.layout.world, self.layout.staging_bytes)
        if got != want:
            raise PurlinUnavailableError(
                f"host workspace header {got} does not match {want}: ranks disagree on world size or staging_bytes"
            )

    @classmethod
    def private(cls, layout: WorkspaceLayout) -> "HostWorkspace":
        # An anonymous mapping: pages are zero-filled lazily, so unused staging costs nothing.
        mm = mmap.mmap(-1, max(layout.total_bytes, 1))
        ws = cls(layout, mm, mapping=mm)
        ws.init_header()
        return ws

    @classmethod
    def create_shared(cls, layout: WorkspaceLayout, path: str) -> "HostWorkspace":
        """Create, allocate and map the shared file at ``path`` (rank 0; :func:`shared_path`). Every
        failure is a PurlinUnavailableError and leaves no file behind."""
        directory = os.path.dirname(path) or "."
        if not os.path.isdir(directory):
            raise PurlinUnavailableError(f"memory='host' across processes needs {directory}, which is missing")
        remove_stale(directory)
        need = layout.total_bytes
        free = shm_free_bytes(directory)
        if free < need:
            raise shm_space_error(need, free, directory)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            raise PurlinUnavailableError(f"Communicator: cannot create the host workspace {path}: {e}") from e
        try:
            try:
                _allocate(fd, need)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG):
                    raise shm_space_error(need, shm_free_bytes(directory), directory) from e
                raise
            mm = mmap.mmap(fd, need)
        except PurlinUnavailableError:
            unlink_shared(path)
            raise
        except (OSError, ValueError) as e:
            unlink_shared(path)
            raise PurlinUnavailableError(
                f"Communicator: cannot map the {_mib(need)} host workspace {path}: {e} (a virtual-memory limit, "
                "ulimit -v, or a full file system); lower staging_bytes or raise the limit") from e
        finally:
            os.close(fd)
        ws = cls(layout, mm, mapping=mm)
        ws.init_header()
        return ws

    @classmethod
    def open_shared(cls, layout: WorkspaceLayout, path: str) -> "HostWorkspace":
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise PurlinUnavailableError(f"cannot open the host workspace {path}: {e}") from e
        try:
            mm = mmap.mmap(fd, layout.total_bytes)
        except (OSError, ValueError) as e:
            raise PurlinUnavailableError(
                f"cannot map the {_mib(layout.total_bytes)} host workspace {path}: {e} (a virtual-memory limit, "
                "ulimit -v?); lower staging_bytes or raise the limit") from e
        finally:
            os.close(fd)
        ws = cls(layout, mm, mapping=mm)
        ws.check_header()
        return ws

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def close(self) -> None:
        self.words = None
        self.staging = []
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # a tensor view is still alive; the mapping goes with it
            self._mapping = None
        self._buffer = None


def _allocate(fd: int, nbytes: int) -> None:
    """Give the file ``nbytes`` of real pages (a sparse file would fail later, with SIGBUS)."""
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # a file system without fallocate: checked for space above


def unlink_shared(path: str) -> None:
    """Unlink a workspace file; idempotent (every rank of a group may unlink the same path)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


