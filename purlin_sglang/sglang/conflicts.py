"""SGLang's all-reduce paths that would serve a collective before purlin is asked: switched off.

With ``--comm-backend purlin``, :func:`switch_off` runs in every process that builds a
GroupCoordinator (each scheduler / TP worker), from the ``GroupCoordinator.__init__`` hook,
so before the first group of the process is built (the world group). That is after SGLang's
``bootstrap._set_all_reduce_flags()`` has set the ``parallel_state`` flags from the published
server args and before ``init_model_parallel_group`` reads them, the model reads
``exec.comm.flashinfer_allreduce_fusion_backend`` or ``_tag_groups_for_flashinfer_allreduce_only``
runs. For each path it sets both places SGLang 0.5.23 reads:

- the resolved config leaf in the published runtime context (``get_context().override``,
  SGLang's own way to change a resolved value in a running process; the record ServerArgs is
  read-only after resolution), and
- the ``parallel_state`` flag, through the setter ``_set_all_reduce_flags`` itself calls.

Then it reads both back and raises :class:`~purlin_sglang.errors.PurlinPluginError` naming the target and
``sglang==0.5.23`` if either did not take. Each path switched off is logged once per process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import PurlinPluginError
from .settings import SUPPORTED_SGLANG, installed_version

logger = logging.getLogger(__name__)

_PS = "sglang.srt.distributed.parallel_state"
_SA = "sglang.srt.server_args.ServerArgs"
SOURCE = "purlin_sglang (--comm-backend purlin)"


@dataclass(frozen=True)
class ConflictingPath:
    name: str     # for the log line
    leaf: str     # the ServerArgs field, a leaf of the published exec.comm namespace
    off: Any      # the leaf's value that means "off"
    setter: str   # the parallel_state function bootstrap._set_all_reduce_flags calls
    flag: str     # the parallel_state global that setter writes
    why: str


PATHS: tuple[ConflictingPath, ...] = (
    ConflictingPath("custom all-reduce", "disable_custom_all_reduce", True, "set_custom_all_reduce",
                    "_ENABLE_CUSTOM_ALL_REDUCE", "GroupCoordinator asks it before purlin"),
    ConflictingPath("mscclpp all-reduce", "enable_mscclpp", False, "set_mscclpp", "_ENABLE_MSCCLPP",
                    "GroupCoordinator asks it before purlin"),
    ConflictingPath("torch symmetric-memory all-reduce", "enable_torch_symm_mem", False,
                    "set_torch_symm_mem_all_reduce", "_ENABLE_TORCH_SYMM_MEM_ALL_REDUCE",
                    "GroupCoordinator asks it before purlin"),
    ConflictingPath("FlashInfer all-reduce fusion", "flashinfer_allreduce_fusion_backend", None,
                    "set_flashinfer_allreduce_only", "_ENABLE_FLASHINFER_ALLREDUCE_ONLY",
                    "its fused all-reduce + RMSNorm kernels bypass GroupCoordinator"),
)
TARGETS: tuple[str, ...] = tuple(
    t for p in PATHS for t in (f"{_PS}.{p.setter}", f"{_PS}.{p.flag}", f"{_SA}.{p.leaf}"))

_announced: set[str] = set()


def missing_targets() -> list[str]:
    """The targets (with the reason) that this SGLang lacks; [] if all exist. Imports parallel_state."""
    import importlib

    missing = []
    try:
        ps = importlib.import_module(_PS)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return [f"{_PS} (cannot import: {type(e).__name__}: {e})"]
    try:
        from sglang.srt.server_args import ServerArgs

        fields = set(getattr(ServerArgs, "__struct_fields__", ()))
    except Exception as e:  # noqa: BLE001
        return [f"{_SA} (cannot import: {type(e).__name__}: {e})"]
    for p in PATHS:
        if not callable(getattr(ps, p.setter, None)):
            missing.append(f"{_PS}.{p.setter} (not found)")
        if not hasattr(ps, p.flag):
            missing.append(f"{_PS}.{p.flag} (not found)")
        if p.leaf not in fields:
            missing.append(f"{_SA}.{p.leaf} (not a ServerArgs field)")
    return missing


def _published_comm() -> Optional[Any]:
    """The published ``exec.comm`` config namespace of this process, or None before publication."""
    from sglang.srt.runtime_context import get_exec

    try:
        return get_exec().comm
    except ValueError:  # "config namespace 'exec' not published": no server args here (tests, tools)
        return None


def switch_off(cause: str = "--comm-backend purlin") -> list[str]:
    """Switch every path of :data:`PATHS` off in this process, verify, log; return the names switched now.

    Idempotent and cheap; a path that is already off is left alone and not logged.
    """
    missing = missing_targets()
    if missing:
        raise PurlinPluginError(
            f"--comm-backend purlin: cannot switch off SGLang's competing all-reduce paths: {'; '.join(missing)}. "
            f"This plugin supports sglang=={SUPPORTED_SGLANG} (installed: {installed_version()})")
    import sglang.srt.distributed.parallel_state as ps

    comm = _published_comm()
    absent = [p.leaf for p in PATHS if comm is not None and p.leaf not in comm]
    if absent:
        raise PurlinPluginError(
            f"--comm-backend purlin: the published exec.comm config has no {absent}; this plugin supports "
            f"sglang=={SUPPORTED_SGLANG} (installed: {installed_version()})")
    leaves, switched = {}, []
    for p in PATHS:
        on = bool(getattr(ps, p.flag))
        if comm is not None and getattr(comm, p.leaf) != p.off:
            leaves[p.leaf], on = p.off, True
        if getattr(ps, p.flag):
            getattr(ps, p.setter)(False)
        if on:
            switched.append(p)
    if leaves:
        from sglang.srt.runtime_context import get_context

        get_context().override(SOURCE, **leaves)
    comm = _published_comm()
    bad = [f"{_PS}.{p.flag} is {getattr(ps, p.flag)!r} after {p.setter}(False)" for p in PATHS if getattr(ps, p.flag)]
    if comm is not None:
        bad += [f"exec.comm.{p.leaf} is {getattr(comm, p.leaf)!r}, not {p.off!r}, after get_context().override"
                for p in PATHS if getattr(comm, p.leaf) != p.off]
    if bad:
        raise PurlinPluginError(
            f"--comm-backend purlin: switching off SGLang's competing all-reduce paths did not take: {'; '.join(bad)}. "
            f"This plugin supports sglang=={SUPPORTED_SGLANG} (installed: {installed_version()}); "
            "run with --comm-backend nccl")
    for p in switched:
        if p.name not in _announced:
            _announced.add(p.name)
            logger.info("purlin_sglang: %s switched off (%s; %s)", p.name, cause, p.why)
    if comm is not None and getattr(comm, "enable_symm_mem", False) and "symm_mem" not in _announced:
        _announced.add("symm_mem")
        logger.warning("purlin_sglang: --enable-symm-mem is on: GroupCoordinator.all_reduce sends every GPU "
                       "all-reduce to pynccl's symmetric-memory path before purlin is asked, so purlin serves no "
                       "all-reduce; drop --enable-symm-mem to route all-reduce through purlin")
    return [p.name for p in switched]
