"""The API glue of moe_dispatch / moe_combine: the argument checks, then the call on the engine's MoE
part (:class:`~.engine.MoEEngine`). The checks run before anything is shared, so a bad call raises
PurlinValueError (naming the argument) and leaves the communicator usable. An eager dispatch
rejected on one rank is announced to its peers in the call's header exchange (``MoEEngine.reject``,
:mod:`.exchange`), so they raise too instead of waiting for it; a rejected combine ends the peers'
combine (``MoEEngine.reject_combine``)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PurlinValueError
from .dispatch import MoEDispatch

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
FP8 = torch.float8_e4m3fn


def _tensor(op: str, what: str, t: Any, device: torch.device, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise PurlinValueError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise PurlinValueError(f"{op}: {what} is on {t.device}, but the communicator runs on {device}")
    if t.dim() != dim:
        raise PurlinValueError(f"{op}: {what} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.layout != torch.strided or not t.is_contiguous():
        raise PurlinValueError(f"{op}: {what} must be a contiguous dense tensor; call .contiguous() first")


def check_dispatch(x: Any, ids: Any, ws: Any, num_experts: Any, capacity: Any, dtype: Any, world: int,
                   device: torch.device, check_values: bool, max_tokens: Any = None) -> str:
    """Validate; return the payload quantisation ("none" or "fp8"). ``check_values``: also read the
    ids on the host (range check; a device sync on CUDA, so not under graph capture)."""
    op = "moe_dispatch"
    _tensor(op, "x", x, device, 2)
    if x.dtype not in X_DTYPES:
        raise PurlinValueError(f"{op}: x has dtype {x.dtype}; use float32, bfloat16 or float16")
    _tensor(op, "topk_ids", ids, device, 2)
    if ids.dtype not in ID_DTYPES:
        raise PurlinValueError(f"{op}: topk_ids has dtype {ids.dtype}; use int32 or int64")
    if ids.shape[0] != x.shape[0]:
        raise PurlinValueError(f"{op}: topk_ids has {ids.shape[0]} rows but x has {x.shape[0]} tokens")
    if ids.shape[1] < 1:
        raise PurlinValueError(f"{op}: topk_ids must have at least one column (top-k), got shape {tuple(ids.shape)}")
    _tensor(op, "topk_weights", ws, device, 2)
    if not ws.dtype.is_floating_point or ws.dtype == FP8:
        raise PurlinValueError(f"{op}: topk_weights has dtype {ws.dtype}; use a float dtype")
    if tuple(ws.shape) != tuple(ids.shape):
        raise PurlinValueError(f"{op}: topk_weights has shape {tuple(ws.shape)}, topk_ids {tuple(ids.shape)}; "
                               "they must match")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise PurlinValueError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    if num_experts % world:
        raise PurlinValueError(f"{op}: num_experts={num_experts} is not divisible by the world size {world} "
                               "(experts are split contiguously over the ranks)")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise PurlinValueError(f"{op}: capacity must be None or a positive int, got {capacity!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < x.shape[0]):
        raise PurlinValueError(f"{op}: max_tokens must be None or an int >= this rank's {x.shape[0]} tokens (the most "
                               f"tokens any rank dispatches in this call), got {max_tokens!r}")
    if dtype is not None and dtype not in (FP8, x.dtype):
        raise PurlinValueError(f"{op}: dtype must be None, x's dtype or torch.float8_e4m3fn, got {dtype}")
    if check_values and ids.numel():
        check_id_range(int(ids.min()), int(ids.max()), num_experts)
    return "fp8" if dtype == FP8 and x.dtype != FP8 else "none"


def checked_dispatch(moe: Any, x: Any, ids: Any, ws: Any, num_experts: Any, capacity: Any, dtype: Any, world: int,
                     device: torch.device, max_tokens: Any = None) -> MoEDispatch:
    """Validate a moe_dispatch call, then run it on the MoE engine ``moe``. A bad argument raises
    PurlinValueError; in eager mode ``moe.reject`` first tells the peers (every rank raises, the
    communicator stays usable). Under graph capture the error is this rank's alone."""
    on_gpu = device.type == "cuda"
    capturing = on_gpu and torch.cuda.is_current_stream_capturing()
    try:  # the GPU engine checks the ids' range itself (no host read)
        quant = check_dispatch(x, ids, ws, num_experts, capacity, dtype, world, device, check_values=not on_gpu,
                               max_tokens=max_tokens)
    except PurlinValueError as e:
        if not capturing:
            moe.reject(e)  # raises
        raise
    return moe.dispatch(x, ids, ws, num_experts, capacity, quant, capturing, max_tokens=max_tokens)


def check_combine(expert_out: Any, d: Any, device: torch.device, owner: int) -> None:
    op = "moe_combine"
    if not isinstance(d, MoEDispatch):
        raise PurlinValueError(f"{op}: d must be the MoEDispatch that moe_dispatch returned, got {type(d).__name__}")
    if d._owner != owner:
        raise PurlinValueError(f"{op}: d was made by another communicator")
    _tensor(op, "expert_out", expert_out, device, 2)
    if expert_out.dtype not in X_DTYPES:
        raise PurlinValueError(f"{op}: expert_out has dtype {expert_out.dtype}; use bfloat16, float16 or float32")
    if tuple(expert_out.shape) != (d.rows, d.hidden):
        raise PurlinValueError(f"{op}: expert_out has shape {tuple(expert_out.shape)}; expected "
                               f"{(d.rows, d.hidden)} (d.x's rows and hidden size)")


def checked_combine(moe: Any, expert_out: Any, d: Any, device: torch.device, owner: int) -> torch.Tensor:
    """Validate a moe_combine call, then run it on the MoE engine ``moe``. A bad argument raises
    PurlinValueError after ``moe.reject_combine`` ended the peers' combine without a timeout."""
    try:
        check_combine(expert_out, d, device, owner)
    except PurlinValueError as e:
        moe.reject_combine(e)  # raises e
        raise
    return moe.combine(expert_out, d)


def check_id_range(lo: int, hi: int, num_experts: int) -> None:
    """Raise PurlinValueError unless every id (min ``lo``, max ``hi``) is in [-1, num_experts)."""
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise PurlinValueError(f"moe_dispatch: topk_ids holds {bad}, outside [-1, {num_experts}) "
                               f"(num_experts={num_experts}; -1 means no expert)")
