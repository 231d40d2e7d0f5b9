"""The places where purlin touches vLLM 0.33.0: a short table of AROUND hooks, each verified.

vLLM has no hook registry, so each hook replaces one attribute with a wrapper that calls
``hook(original, *args, **kwargs)``; the wrapper carries the hook (``__purlin_hook__``) and the
original (``__wrapped__``), so :func:`state` can tell whether it is in effect and :func:`apply` is
harmless twice. The table (:data:`HOOKS`):

========================= ================================================ ===========================
name                      target                                           applied
========================= ================================================ ===========================
``communicator_class``    current platform ``get_device_communicator_cls`` :func:`.plugin.register`
``platform_config``       current platform ``check_and_update_config``     :func:`.plugin.register`
``graph_capture``         ``GroupCoordinator.graph_capture``               :func:`.plugin.register`
``moe_kernel``            ``FusedMoEKernel.__init__``                      when purlin's MoE is on
========================= ================================================ ===========================

``moe_kernel`` is applied by the first purlin communicator a process builds with ``moe.dispatcher:
purlin`` (:mod:`.communicator`; every process that builds MoE layers builds its groups first),
not at plugin load: importing vLLM's MoE layer costs seconds, which the API server and ``vllm
serve --help`` need not pay. Every hook calls straight through unless the run's
``additional_config`` switches purlin on. Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import pkgutil
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import PurlinPluginError

logger = logging.getLogger(__name__)

STOCK = {
    "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator":
        "purlin_sglang.vllm.cpu.PurlinCpuCommunicator",
    "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator":
        "purlin_sglang.vllm.cuda.PurlinCudaCommunicator",
}
CAPTURES: Counter = Counter()  # group unique_name -> times purlin's capture context was entered for it


# -- the hooks ---------------------------------------------------------------------------------------
def communicator_class(original: Callable[[], str]) -> str:
    """AROUND ``get_device_communicator_cls``: purlin's class where vLLM answers its stock CPU or CUDA
    communicator and the current vLLM config (the one its groups are built under) switches purlin on;
    any other answer, and every answer with purlin off, unchanged: without the key vLLM builds its own
    class (elastic EP asserts that the class is exactly ``CudaCommunicator``)."""
    name = original()
    ours = STOCK.get(name)
    if ours is None:
        return name
    from vllm.config import get_current_vllm_config_or_none

    from .settings import plugin_config

    return ours if plugin_config(get_current_vllm_config_or_none()) is not None else name


def platform_config(original: Callable[[Any], None], vllm_config: Any) -> None:
    """AROUND ``check_and_update_config``: the platform's own checks first, then, when the run's
    ``additional_config`` switches purlin on: the purlin settings are validated (PurlinConfigError
    naming the key), the hooks are verified (PurlinPluginError), and the fused all-reduce + RMSNorm
    compile pass is turned off (``compilation_config.pass_config.fuse_allreduce_rms``: it would take
    matched all-reduces away from the communicator). Runs where the config is built, so a mistake
    stops ``vllm serve`` before any worker starts."""
    original(vllm_config)
    from .settings import check_moe, plugin_config

    config = plugin_config(vllm_config)
    if config is None:
        return
    verify(START_UP)
    check_moe(config)
    passes = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
    if passes is not None and getattr(passes, "fuse_allreduce_rms", False):
        passes.fuse_allreduce_rms = False
        logger.info("purlin_sglang: the fused all-reduce + RMSNorm pass is off (purlin serves the all-reduce)")


@contextlib.contextmanager
def graph_capture(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any):
    """AROUND ``GroupCoordinator.graph_capture``: vLLM's context (outer), then purlin's capture context
    (inner) for this group's purlin communicator and, for the TP group, also for the EP group's MoE
    communicator (vLLM's ``graph_capture(device)`` enters tp, pp and dp, never ep). Inside, vLLM's
    warm-up runs are served eagerly and remembered; see RoutedCommunicator for what is then served
    while capturing. With purlin off nothing is entered."""
    with original(self, *args, **kwargs) as ctx:
        with contextlib.ExitStack() as stack:
            for name, target in capture_targets(self):
                stack.enter_context(target.capture())
                CAPTURES[name] += 1
            yield ctx


_refusal = ""  # why purlin's start-up hooks are not in effect in this process (refuse_when_on)


def refuse(original: Callable[[Any], None], vllm_config: Any) -> None:
    """AROUND ``check_and_update_config`` where the start-up hooks could not be put in place (another
    vLLM version, a hook that cannot be applied; :func:`refuse_when_on`): the platform's own checks,
    then, when the run's ``additional_config`` switches purlin on, PurlinPluginError saying why purlin
    cannot serve it, so that such a run stops instead of running without purlin. vLLM is unchanged
    otherwise."""
    original(vllm_config)
    from .settings import KEY, requested

    if requested(vllm_config):
        raise PurlinPluginError(f"additional_config.{KEY} is set, but purlin's vLLM plugin is not in effect in "
                                f"this process: {_refusal}")


def moe_kernel(original: Callable[..., None], self: Any, prepare_finalize: Any, fused_experts: Any,
               *args: Any, **kwargs: Any) -> None:
    """AROUND ``FusedMoEKernel.__init__``: purlin's prepare/finalize in place of vLLM's
    ``MoEPrepareAndFinalizeNoDPEPModular`` where purlin's MoE is on and the layer qualifies
    (:func:`.moe.maybe_replace`); every other kernel is built unchanged."""
    from .moe import maybe_replace

    return original(self, maybe_replace(prepare_finalize, fused_experts), fused_experts, *args, **kwargs)


def capture_targets(group: Any) -> list[tuple[str, Any]]:
    """(name, object with ``capture()``) that :func:`graph_capture` enters for ``group``."""
    out = []
    comm = getattr(group, "device_communicator", None)
    routed = getattr(comm, "purlin", None)
    if routed is not None and not routed.disabled:
        out.append((group.unique_name, routed))
    if group.unique_name.split(":")[0] == "tp":
        from vllm.distributed import parallel_state

        ep = getattr(parallel_state, "_EP", None)
        moe = getattr(getattr(ep, "device_communicator", None), "purlin_moe_capture", None)
        target = moe() if moe is not None else None
        if target is not None and all(target is not t for _, t in out):
            out.append((ep.unique_name, target))
    return out


# -- the table ---------------------------------------------------------------------------------------
def _platform() -> type:
    from vllm.platforms import current_platform

    return type(current_platform)


def _group_coordinator() -> type:
    from vllm.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator


def _fused_moe_kernel() -> type:
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel

    return FusedMoEKernel


@dataclass(frozen=True)
class Hook:
    """One AROUND hook: ``owner()`` gives the class (importing vLLM), ``attr`` its method."""

    name: str
    owner: Callable[[], type]
    attr: str
    fn: Callable[..., Any]


HOOKS = {h.name: h for h in (
    Hook("communicator_class", _platform, "get_device_communicator_cls", communicator_class),
    Hook("platform_config", _platform, "check_and_update_config", platform_config),
    Hook("graph_capture", _group_coordinator, "graph_capture", graph_capture),
    Hook("moe_kernel", _fused_moe_kernel, "__init__", moe_kernel),
)}
START_UP = ("communicator_class", "platform_config", "graph_capture")
REFUSE = Hook("refuse", _platform, "check_and_update_config", refuse)  # not in HOOKS: only where those fail
MOE = ("moe_kernel",)


def apply(names: tuple[str, ...]) -> None:
    """Apply the named hooks (idempotent). Raises what resolving an owner raises (ImportError ...)."""
    for name in names:
        _apply(HOOKS[name])


def refuse_when_on(why: str) -> None:
    """Make a run that switches purlin on fail at its config check with ``why`` (:func:`refuse`), where
    the start-up hooks are not in effect. Raises what resolving the platform raises."""
    global _refusal
    _refusal = why
    _apply(REFUSE)


def _apply(hook: Hook) -> None:
    owner = hook.owner()
    if _applied(owner, hook):
        return
    raw = inspect.getattr_static(owner, hook.attr)
    if isinstance(raw, classmethod):
        func = raw.__func__

        @functools.wraps(func)
        def wrapper(cls, *args, __func=func, __fn=hook.fn, **kwargs):
            return __fn(__func.__get__(cls, cls), *args, **kwargs)

        wrapper.__purlin_hook__ = hook.fn
        setattr(owner, hook.attr, classmethod(wrapper))
    else:
        @functools.wraps(raw)
        def wrapper(*args, __orig=raw, __fn=hook.fn, **kwargs):
            return __fn(__orig, *args, **kwargs)

        wrapper.__purlin_hook__ = hook.fn
        setattr(owner, hook.attr, wrapper)


def _applied(owner: type, hook: Hook) -> bool:
    cur = getattr(inspect.getattr_static(owner, hook.attr, None), "__func__", None) or \
        inspect.getattr_static(owner, hook.attr, None)
    for _ in range(32):
        if cur is None:
            return False
        if getattr(cur, "__purlin_hook__", None) is hook.fn:
            return True
        cur = getattr(cur, "__wrapped__", None)
    return False


def state(name: str) -> str:
    """"" when the hook ``name`` is in effect now, else why not."""
    hook = HOOKS[name]
    try:
        owner = hook.owner()
    except Exception as e:  # noqa: BLE001 - reported, not raised: the caller decides
        return f"cannot import its owner: {type(e).__name__}: {e}"
    if inspect.getattr_static(owner, hook.attr, None) is None:
        return f"{owner.__name__} has no attribute {hook.attr!r}"
    return "" if _applied(owner, hook) else "not applied"


def missing(names: Optional[tuple[str, ...]] = None) -> list[str]:
    """``"name (target: why)"`` for each named hook (default: all) not in effect; [] when all are."""
    out = []
    for name in names if names is not None else tuple(HOOKS):
        why = state(name)
        if why:
            out.append(f"{name} ({HOOKS[name].attr}: {why})")
    return out


def verify(names: tuple[str, ...]) -> None:
    """Raise PurlinPluginError naming every hook of ``names`` that is not in effect."""
    gone = missing(names)
    if gone:
        from .settings import SUPPORTED_VLLM

        raise PurlinPluginError(f"purlin's vLLM plugin: hooks not in effect: {'; '.join(gone)}; it supports "
                                f"vllm=={SUPPORTED_VLLM} and is loaded as a vllm.general_plugins entry point "
                                "(check VLLM_PLUGINS), or leave additional_config.purlin unset")


def ensure(names: tuple[str, ...]) -> None:
    """Apply, then verify, the named hooks: PurlinPluginError (naming the cause) if one cannot be."""
    try:
        apply(names)
    except Exception as e:  # noqa: BLE001 - turned into the plugin's error, with the cause
        raise PurlinPluginError(f"purlin's vLLM plugin: cannot apply the hooks {', '.join(names)}: "
                                f"{type(e).__name__}: {e}") from e
    verify(names)
