"""Symmetric memory providers: staging buffers and signal words for every rank."""

from .host import HostWorkspace
from .layout import WorkspaceLayout

PROVIDERS = ("auto", "ipc", "nvshmem", "torch", "loopback", "host")

__all__ = ["HostWorkspace", "WorkspaceLayout", "PROVIDERS"]
