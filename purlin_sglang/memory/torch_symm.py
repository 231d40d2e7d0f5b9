"""The ``torch`` provider: PyTorch's symmetric memory (``torch.distributed._symmetric_memory``).

Each rank allocates its workspace with ``_symmetric_memory.empty`` (a uint8 tensor of
``layout_nbytes``), zeroes it, and ``_symmetric_memory.rendezvous(tensor, group)`` maps
every rank's allocation into every process; ``buffer_ptrs`` are the pointers. PyTorch
owns the memory (its CUDA backend exports virtual-memory handles between processes);
:meth:`TorchSymmWorkspace.close` drops this provider's references so PyTorch can free it.

Where the installed torch lacks the module or one of ``empty`` / ``rendezvous``, or has
no CUDA, :meth:`create` raises :class:`PurlinUnavailableError` naming what is missing.
PyTorch's CUDA backend refuses several ranks on one GPU at rendezvous ("detected
allocations from overlapping devices") unless ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``
is set when the processes start (this module never sets it: it is PyTorch's global, read
in C++); the refusal surfaces as the same error, quoting PyTorch and saying so. Seen on an
H200 with torch 2.11: refused by default; with that variable set, two processes on one GPU
map each other's buffers and pass the same data and flag tests as the ipc provider.

Contracts: :meth:`create` is collective over ``group`` (every rank calls it with the same
``layout_nbytes``), blocks the host, and is not for CUDA graph capture. A rank that fails
before the rendezvous tells the others through a status all-gather (the rendezvous itself
is collective, so nobody enters it unless all can); a failure inside the rendezvous is
agreed on by a second status all-gather. :meth:`close` is local and safe to call twice.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .device import WorkspaceLifetime
from .setup_phase import _Fail, agree, as_status, check_create_args, check_same_nbytes, setup_group

_MODULE = "torch.distributed._symmetric_memory"


def _load_symm_mem():
    """The torch symmetric-memory module, or _Fail("unavailable") naming the missing API."""
    import torch

    try:
        symm_mem = importlib.import_module(_MODULE)
    except Exception as e:  # ImportError, or a build without distributed
        raise _Fail("unavailable", f"memory='torch' needs {_MODULE}, which torch {torch.__version__} does not "
                                   f"have ({type(e).__name__}: {e}); use memory='ipc' or a newer torch")
    missing = [name for name in ("empty", "rendezvous") if not callable(getattr(symm_mem, name, None))]
    if missing:
        raise _Fail("unavailable", f"memory='torch' needs {', '.join(f'{_MODULE}.{m}' for m in missing)}, which "
                                   f"torch {torch.__version__} does not have; use memory='ipc' or a newer torch")
    return symm_mem


class TorchSymmWorkspace(WorkspaceLifetime):
    """This rank's workspace as a torch symmetric-memory tensor, with every rank's pointer.

    Implements :class:`~purlin_sglang.memory.device.DeviceWorkspace`; ``layout`` is whatever
    layout object the caller passed. ``hbm_bytes`` counts this rank's buffer (PyTorch adds its
    own signal pad).
    """

    provider = "torch"

    def __init__(self, *, rank: int, world: int, device_index: int, nbytes: int, tensor: Any, handle: Any,
                 layout: Any = None):
        super().__init__(rank=rank, world=world, device_index=device_index, nbytes=nbytes, layout=layout)
        self._tensor = tensor
        self._handle = handle
        self._ptrs = [int(p) for p in handle.buffer_ptrs]

    @classmethod
    def create(cls, layout_nbytes: int, group: Any, device_index: int, rank: int, world: int, *,
               layout: Any = None) -> "TorchSymmWorkspace":
        """Allocate ``layout_nbytes`` zeroed bytes with torch symmetric memory and rendezvous.

        Collective over ``group`` (None: the default group). Raises on EVERY rank if any rank
        fails: :class:`PurlinValueError` for bad or disagreeing arguments,
        :class:`PurlinUnavailableError` (naming the missing API or quoting PyTorch) otherwise.
        Whatever it raises (also an exchange that fails because a peer died, or an interrupt), the
        error's traceback holds no reference to the tensor or its rendezvous handle, so PyTorch
        frees and unmaps them without waiting for the error to be dropped.
        """
        op = "TorchSymmWorkspace.create"
        group, gworld = setup_group(op, group)
        import torch

        tensor = handle = None
        try:
            try:
                check_create_args(op, group, layout_nbytes, device_index, rank, world)
                symm_mem = _load_symm_mem()
                if not torch.cuda.is_available():
                    raise _Fail("unavailable", f"{op}: memory='torch' needs a CUDA GPU (torch.cuda.is_available() is "
                                               "False); use memory='host' with the CPU engine")
                if device_index >= torch.cuda.device_count():
                    raise _Fail("unavailable", f"{op}: device_index={device_index} but torch sees "
                                               f"{torch.cuda.device_count()} GPU(s)")
                device = torch.device("cuda", device_index)
                tensor = symm_mem.empty(layout_nbytes, dtype=torch.uint8, device=device)
                tensor.zero_()
                torch.cuda.synchronize(device)
                mine = ("ok", {"nbytes": layout_nbytes})
            except Exception as e:  # noqa: BLE001 - reported to every rank
                mine = as_status(e)
            check_same_nbytes(op, agree(op, group, gworld, mine))

            try:
                _enable_for_group(symm_mem, group)
                try:
                    handle = symm_mem.rendezvous(tensor, group.group_name)
                except Exception as e:  # noqa: BLE001 - quote PyTorch exactly
                    text = _first_lines(e)
                    hint = ("; several ranks share one GPU: use memory='ipc' there, or start the processes with "
                            "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (PyTorch then sets up no multicast)"
                            if "overlapping devices" in text else "")
                    raise _Fail("unavailable", f"{_MODULE}.rendezvous: {type(e).__name__}: {text}{hint}")
                ptrs = list(getattr(handle, "buffer_ptrs", None) or [])
                if len(ptrs) != gworld:
                    raise _Fail("unavailable", f"{_MODULE}.rendezvous returned {len(ptrs)} buffer pointers for a "
                                               f"group of {gworld}")
                mine = ("ok", None)
            except Exception as e:  # noqa: BLE001
                mine = as_status(e)
            agree(op, group, gworld, mine)
        except BaseException:  # a failed rank, a dead peer's exchange, an interrupt: hold nothing, then raise it
            tensor = handle = None  # the error's traceback keeps this frame: it must not keep the memory
            raise
        return cls(rank=rank, world=world, device_index=device_index, nbytes=layout_nbytes, tensor=tensor,
                   handle=handle, layout=layout)

    @property
    def tensor(self):
        """This rank's workspace as a uint8 tensor (PyTorch's symmetric allocation)."""
        self._check_open("tensor")
        return self._tensor

    def close(self) -> None:
        """Drop the references to the tensor and its rendezvous handle (PyTorch frees the memory once
        nothing else holds them). Local, no barrier; safe to call twice."""
        self._closed = True
        self._handle = None
        self._tensor = None
        self._ptrs = []


def _enable_for_group(symm_mem, group) -> None:
    """Older torch needs enable_symm_mem_for_group before a rendezvous; newer torch marks it deprecated
    (and registers groups itself), so it is called only where it is not deprecated."""
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None or getattr(enable, "__deprecated__", None) is not None:
        return
    enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if enabled is not None and enabled(group.group_name):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable(group.group_name)


def _first_lines(e: BaseException, n: int = 3) -> str:
    """PyTorch's C++ errors carry a long stack; its first lines say what went wrong."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return " | ".join(lines[:n]) if lines else repr(e)


__all__ = ["TorchSymmWorkspace"]
