"""The SGLang plugin: one entry point, a short named list of hooks, each verified.

SGLang (0.5.23) calls :func:`register` from ``sglang.srt.plugins.load_plugins()`` in the
launcher and in every scheduler process (entry-point group ``sglang.srt.plugins``, name
``purlin_sglang``), then applies every registered hook with ``HookRegistry.apply_hooks()``.
Both swallow exceptions (they are only logged), so the plugin checks that its hooks took
effect where it matters and fails loudly there: when ``--comm-backend purlin`` is parsed (in
the launcher) and when a GroupCoordinator is built with purlin on (in each worker). With the
default ``--comm-backend nccl`` every hook calls straight through: SGLang is unchanged. With
purlin, each worker also switches SGLang's competing all-reduce paths off (conflicts.py: custom
all-reduce, mscclpp, torch symm-mem, FlashInfer all-reduce fusion), verified by reading them back.

``register()`` only records hooks (dotted paths and functions); it imports nothing of SGLang
beyond the registry and is harmless to call twice. Importing this module needs no SGLang.
"""

from __future__ import annotations

import argparse
import logging
import os
import pkgutil
import inspect
from typing import Any, Callable, Iterable, Optional

from ..errors import PurlinPluginError
from . import conflicts, hooks, moe_hooks, single_gpu
from .settings import (  # noqa: F401 - CommSettings, activate, settings_of: the plugin's public names
    BACKENDS, SUPPORTED_SGLANG, CommSettings, activate, active_settings, installed_version, record, settings_of,
)

logger = logging.getLogger(__name__)

_SA = "sglang.srt.server_args.ServerArgs"
_PS = "sglang.srt.distributed.parallel_state"
_GC = f"{_PS}.GroupCoordinator"

_registered = False


# -- registration and verification ---------------------------------------------------------------
def register() -> bool:
    """Entry point (``sglang.srt.plugins``): record the hooks with SGLang's HookRegistry.

    Cheap and idempotent. Returns False (doing nothing) when SGLang is not importable.
    """
    global _registered
    if _registered:
        return True
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        return False
    for target, kind, fn in HOOKS:
        HookRegistry.register(target, fn, getattr(HookType, kind))
    _registered = True
    return True


def missing_hooks(targets: Optional[Iterable[str]] = None) -> list[str]:
    """The targets (with the reason) where our hook is not in effect now, or that this SGLang lacks
    (the flags and fields conflicts.py switches); [] if all are in effect."""
    wanted = None if targets is None else set(targets)
    missing = []
    for target, _kind, fn in HOOKS:
        if wanted is not None and target not in wanted:
            continue
        why = _hook_state(target, fn)
        if why:
            missing.append(f"{target} ({why})")
    if wanted is None or wanted & set(conflicts.TARGETS):
        missing += conflicts.missing_targets()
    return missing


def verify_hooks(targets: Optional[Iterable[str]] = None) -> None:
    """Raise :class:`PurlinPluginError` naming every target whose hook is not in effect."""
    missing = missing_hooks(targets)
    if missing:
        raise PurlinPluginError(
            f"purlin_sglang: SGLang hooks not in effect: {'; '.join(missing)}. This plugin supports "
            f"sglang=={SUPPORTED_SGLANG} (installed: {installed_version()}); install that version, "
            "or run with --comm-backend nccl"
        )


def _hook_state(target: str, fn: Callable) -> str:
    owner_path, attr = target.rsplit(".", 1)
    try:
        owner = pkgutil.resolve_name(owner_path)
    except (ImportError, AttributeError, ValueError) as e:
        return f"cannot resolve {owner_path}: {type(e).__name__}: {e}"
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if raw is None:
        return f"{owner_path} has no attribute {attr!r}"
    cur = getattr(raw, "__func__", raw)  # classmethod / staticmethod
    seen = 0
    while cur is not None and seen < 32:
        for cell in getattr(cur, "__closure__", None) or ():
            try:
                if cell.cell_contents is fn:
                    return ""
            except ValueError:  # an empty cell
                pass
        cur, seen = getattr(cur, "__wrapped__", None), seen + 1
    return "hook not applied"


# -- the setting ----------------------------------------------------------------------------------
def backend_arg(value: str) -> str:
    """argparse type of --comm-backend: choosing purlin checks the hooks first (a clear start-up error)."""
    if value == "purlin":
        missing = missing_hooks()
        if missing:
            raise argparse.ArgumentTypeError(
                f"purlin needs SGLang hooks that are not in effect: {'; '.join(missing)}; this plugin supports "
                f"sglang=={SUPPORTED_SGLANG} (installed: {installed_version()})"
            )
    return value


def set_comm_backend(server_args: Any, backend: str, config_path: Optional[str] = None,
                     nccl_free: bool = False, moe_a2a: bool = False) -> None:
    """Record the choice on a ServerArgs (also for Engine users who build ServerArgs in code).

    With ``purlin``, the hooks are verified and the config file is read now, so mistakes
    surface at start-up in the launcher rather than in a worker. ``nccl_free``
    (``--purlin-nccl-free``, either backend) verifies the hooks that mode needs. ``moe_a2a``
    (``--moe-a2a-backend purlin``) makes purlin the MoE dispatcher; it needs ``backend="purlin"`` and
    SGLang's own ``moe_a2a_backend`` left at ``"none"`` (the slot the dispatcher hook fills).
    """
    if backend not in BACKENDS:
        raise PurlinPluginError(f"--comm-backend: {backend!r} is not one of {list(BACKENDS)}")
    if moe_a2a and backend != "purlin":
        raise PurlinPluginError(
            f"{MOE_A2A_FLAG} purlin needs --comm-backend purlin (got {backend}): purlin's MoE dispatch and combine "
            "run on the purlin communicator of the expert-parallel group")
    if moe_a2a and getattr(server_args, "moe_a2a_backend", "none") not in ("none", None):
        raise PurlinPluginError(f"{MOE_A2A_FLAG} purlin: SGLang's moe_a2a_backend must stay 'none' (it is "
                                f"{server_args.moe_a2a_backend!r})")
    if config_path is not None:
        config_path = os.path.abspath(config_path)
    if backend == "purlin":
        verify_hooks()
        CommSettings(backend, config_path).load_config()
    elif config_path is not None:
        logger.warning("--purlin-config %s is ignored: --comm-backend is %s", config_path, backend)
    if nccl_free:
        missing = missing_hooks(NCCL_FREE_TARGETS)
        if missing:
            raise PurlinPluginError(
                f"{single_gpu.FLAG}: SGLang hooks not in effect: {'; '.join(missing)}. This plugin supports "
                f"sglang=={SUPPORTED_SGLANG} (installed: {installed_version()})")
    record(server_args, backend, config_path, nccl_free, moe_a2a)


# -- the start-up hooks: they verify the others ------------------------------------------------
MOE_A2A_FLAG = "--moe-a2a-backend"


def add_cli_args(result: Any, parser: argparse.ArgumentParser) -> None:
    """AFTER ServerArgs.add_cli_args: add --comm-backend and --purlin-config, and 'purlin' to the
    choices of --moe-a2a-backend (once per parser)."""
    a2a = parser._option_string_actions.get(MOE_A2A_FLAG)
    if a2a is not None and a2a.choices is not None and "purlin" not in a2a.choices:
        a2a.choices = [*a2a.choices, "purlin"]
        a2a.help = ((a2a.help or "").rstrip() + " 'purlin' (purlin_sglang): purlin's MoE dispatch and combine "
                    "(needs --comm-backend purlin; the moe: section of --purlin-config sets its limits).")
    if "--comm-backend" in parser._option_string_actions:
        return None
    group = parser.add_argument_group("purlin_sglang (communicator backend)")
    group.add_argument(
        "--comm-backend", type=backend_arg, choices=BACKENDS, default="nccl",
        help="Communicator for the parallel groups' collectives: 'nccl' (SGLang's own paths, unchanged) or "
             "'purlin' (purlin_sglang above the routing table's size thresholds, NCCL otherwise).",
    )
    group.add_argument(
        "--purlin-config", type=str, default=None, metavar="PATH",
        help="YAML file for --comm-backend purlin: PurlinConfig keys and an optional 'routing:' table "
             "(see configs/purlin.yaml).",
    )
    group.add_argument(
        "--purlin-nccl-free", action="store_true", default=False,
        help="Opt-in: run every tensor-parallel rank on the visible GPU(s) without NCCL (several ranks may share "
             "one GPU): ranks' GPU ids fold onto the visible GPUs, the device groups are gloo, pynccl and custom "
             "all-reduce are off; with --comm-backend purlin every device collective goes through purlin (use "
             "configs/purlin-nccl-free.yaml), with nccl SGLang's own collectives run on gloo (a reference).",
    )
    return None


def from_cli_args(original: Callable, cls: Any, args: argparse.Namespace) -> Any:
    """AROUND ServerArgs.from_cli_args: carry the choice on the record (an underscore attribute pickles).

    ``--moe-a2a-backend purlin`` is not a value SGLang knows: it is taken off the arguments (SGLang sees
    ``none``, whose dispatcher slot the create_moe_dispatcher hook fills) and recorded as the setting."""
    moe_a2a = getattr(args, "moe_a2a_backend", None) == "purlin"
    if moe_a2a:
        args.moe_a2a_backend = "none"
    result = original(cls, args)
    set_comm_backend(result, getattr(args, "comm_backend", "nccl"), getattr(args, "purlin_config", None),
                     bool(getattr(args, "purlin_nccl_free", False)), moe_a2a)  # refuses purlin's a2a without purlin
    return result


_OFF_WITH_PURLIN = ("use_custom_allreduce", "use_mscclpp", "use_torch_symm_mem_all_reduce")


def coordinator_init(original, self, *args, **kwargs):
    """AROUND GroupCoordinator.__init__: with purlin, switch SGLang's competing all-reduce paths off
    in this process (custom AR, mscclpp, torch symm-mem, FlashInfer fusion: see conflicts.py) and for
    this group, and attach ``self.purlin_comm`` (collective over the group's CPU group, on the group's
    device: the CUDA engine for CUDA groups). PyNccl stays: it is the fallback.

    With ``--purlin-nccl-free`` (either backend; single_gpu.py) pynccl is off too (NCCL refuses several
    ranks on one GPU): the fallback is then SGLang's torch.distributed path on the gloo device group."""
    settings = active_settings()
    if settings.backend != "purlin" and not settings.nccl_free:
        self.purlin_comm = None
        return original(self, *args, **kwargs)
    verify_hooks(NCCL_FREE_TARGETS if settings.backend != "purlin" else WORKER_TARGETS)
    conflicts.switch_off("--comm-backend purlin" if settings.backend == "purlin" else "--purlin-nccl-free")
    params = inspect.signature(original).parameters
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    off = _OFF_WITH_PURLIN + (("use_pynccl",) if settings.nccl_free else ())
    for name in off:
        if name in params:
            bound.arguments[name] = False
    self.purlin_comm = None
    original(*bound.args, **bound.kwargs)
    if settings.backend != "purlin":
        return
    group_name = self.unique_name.split(":")[0]
    config = settings.load_config()
    if self.world_size > 1 and config.routing.covers(group_name):
        from .communicator import PurlinGroupCommunicator

        try:
            self.purlin_comm = PurlinGroupCommunicator(self.cpu_group, self.device, config, name=self.unique_name)
        except Exception as e:
            raise PurlinPluginError(
                f"--comm-backend purlin: cannot build the purlin communicator for group {self.unique_name} "
                f"on {self.device}: {e}; run with --comm-backend nccl, or fix the cause"
            ) from e
        if not self.purlin_comm.disabled:  # (else the communicator logged why the group keeps SGLang's path)
            logger.info("purlin_sglang: group %s: %d ranks on %s through purlin (engine %s)", self.unique_name,
                        self.world_size, self.device, self.purlin_comm.engine)
    elif config.routing.covers(group_name):
        logger.info("purlin_sglang: group %s has one rank: no collective to route", self.unique_name)


# -- the hook table --------------------------------------------------------------------------------
# (target, hook type, hook). The only places where purlin touches SGLang.
HOOKS: list[tuple[str, str, Callable]] = [
    (f"{_SA}.add_cli_args", "AFTER", add_cli_args),
    (f"{_SA}.from_cli_args", "AROUND", from_cli_args),
    (f"{_GC}.__init__", "AROUND", coordinator_init),
    (f"{_GC}._resolve_outplace_all_reduce_method", "AROUND", hooks.resolve_outplace_all_reduce_method),
    (f"{_GC}._all_reduce_out_place", "AROUND", hooks.all_reduce_out_place),
    (f"{_GC}._all_reduce_in_place", "AROUND", hooks.all_reduce_in_place),
    (f"{_GC}._can_use_flashinfer_allreduce", "AROUND", hooks.can_use_flashinfer_allreduce),
    (f"{_GC}._all_gather_into_tensor", "AROUND", hooks.all_gather_into_tensor),
    (f"{_GC}._reduce_scatter_tensor", "AROUND", hooks.reduce_scatter_tensor),
    (f"{_GC}.all_gatherv", "AROUND", hooks.all_gatherv),
    (f"{_GC}.reduce_scatterv", "AROUND", hooks.reduce_scatterv),
    (f"{_GC}._all_to_all_single", "AROUND", hooks.all_to_all_single),
    (f"{_GC}.graph_capture", "AROUND", hooks.graph_capture),
    (f"{_GC}.destroy", "BEFORE", hooks.destroy),
    # --purlin-nccl-free (single_gpu.py): rank -> GPU mapping in the launcher, gloo instead of nccl.
    ("sglang.srt.utils.common.maybe_reindex_device_id", "AROUND", single_gpu.reindex_device_id),
    (f"{_PS}.get_default_distributed_backend", "AROUND", single_gpu.distributed_backend),
    # MoE dispatcher (moe_hooks.py): purlin's dispatch / combine with moe.dispatcher purlin.
    (moe_hooks.TARGET, "AROUND", moe_hooks.create_moe_dispatcher),
]
# Not hooks but switched with purlin on (conflicts.py): the flags and config fields of SGLang's
# competing all-reduce paths; checked to exist with the hooks.
WORKER_TARGETS = tuple(t for t, _, _ in HOOKS if t.startswith(_GC)) + conflicts.TARGETS
# What --purlin-nccl-free needs in effect (with either backend): checked when the flag is parsed.
NCCL_FREE_TARGETS = (f"{_GC}.__init__", f"{_GC}.all_gatherv", f"{_GC}.reduce_scatterv",
                     "sglang.srt.utils.common.maybe_reindex_device_id",
                     f"{_PS}.get_default_distributed_backend") + conflicts.TARGETS
