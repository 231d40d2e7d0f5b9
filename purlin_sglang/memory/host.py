"""Host shared memory: the provider of the CPU reference engine.

Two forms share one layout: ``HostWorkspace.private`` (one process, virtual ranks
in threads) and ``HostWorkspace.shared`` (separate processes on one host, a file
under /dev/shm mapped by every rank and unlinked as soon as all have mapped it,
so nothing leaks if a process dies).

Ordering: signal words are 8-byte aligned int64 stores by one writer; staging
data is written before the signal that publishes it. This relies on the host's
total store order (x86-64); other hosts are not supported by the process form.
"""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np
import torch

from ..errors import PurlinUnavailableError
from .layout import MAGIC, VERSION, WorkspaceLayout

SHM_DIR = "/dev/shm"


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
    def create_shared(cls, layout: WorkspaceLayout) -> tuple["HostWorkspace", str]:
        if not os.path.isdir(SHM_DIR):
            raise PurlinUnavailableError(f"memory='host' across processes needs {SHM_DIR}, which is missing")
        path = os.path.join(SHM_DIR, f"purlin-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, layout.total_bytes)
            mm = mmap.mmap(fd, layout.total_bytes)
        finally:
            os.close(fd)
        ws = cls(layout, mm, mapping=mm)
        ws.init_header()
        return ws, path

    @classmethod
    def open_shared(cls, layout: WorkspaceLayout, path: str) -> "HostWorkspace":
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise PurlinUnavailableError(f"cannot open the host workspace {path}: {e}") from e
        try:
            mm = mmap.mmap(fd, layout.total_bytes)
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


def unlink_shared(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


