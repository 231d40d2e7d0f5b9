"""CUDA graph capture and the rest of the process: what must not happen while a stream captures.

A capture is invalidated by a synchronising or otherwise unsafe CUDA call from the capturing thread,
whoever makes it. Two sources of such calls that the capturing code does not see are finalisers:
Python's cyclic collector can run at any allocation and free unrelated objects (an old CUDA graph,
an event, a communicator), and a finaliser that makes a CUDA call then breaks the capture. So
:func:`collection_paused` keeps the collector off while any capture context of this process is open
(``Communicator.capture`` enters it), and a communicator dropped during a capture is closed when the
capture ends (:func:`defer_close`), not inside it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any, Iterator

import torch

_lock = threading.Lock()
_depth = 0  # open capture contexts, every thread
_was_enabled = False  # the collector's state when the first of them opened
_deferred: list[Any] = []  # objects whose close() waits for the end of a capture


def capturing_here() -> bool:
    """Whether this thread's current CUDA stream is capturing (never initialises CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def defer_close(obj: Any) -> None:
    """``obj.close()`` once no capture context is open and this thread does not capture."""
    with _lock:
        _deferred.append(obj)


def close_deferred() -> None:
    """Close what :func:`defer_close` kept, unless a capture is still open (then the next end does it).
    A close that fails is dropped (as a finaliser's would be)."""
    if capturing_here():
        return
    with _lock:
        if _depth:
            return
        objs = _deferred[:]
        _deferred.clear()
    for obj in objs:
        with contextlib.suppress(Exception):
            obj.close()


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while any such context of the process is open; its earlier
    state back when the last one exits, then the deferred closes run."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
        close_deferred()
