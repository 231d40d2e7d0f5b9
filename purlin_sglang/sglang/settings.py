"""The plugin's setting: which backend this process uses, and its ``--purlin-config``.

The choice travels on SGLang's ServerArgs (an underscore attribute survives pickling to the
workers); :func:`active_settings` reads it in a worker, :func:`activate` overrides it for tests
and tools. The config file is parsed once per process (:func:`load_plugin_config`, cached by
path, modification time and size), not once per GroupCoordinator. Imports nothing of SGLang at
module import time, and nothing else of the plugin.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import PurlinPluginError

SUPPORTED_SGLANG = "0.5.23"
BACKENDS = ("nccl", "purlin")

_ATTR_BACKEND = "_purlin_comm_backend"
_ATTR_CONFIG = "_purlin_config_path"
_ATTR_NCCL_FREE = "_purlin_nccl_free"
_ATTR_MOE = "_purlin_moe_a2a"
_process_settings: Optional["CommSettings"] = None
_configs: dict[str, tuple[tuple, Any]] = {}  # path -> ((mtime_ns, size), PluginConfig)
_configs_lock = threading.Lock()


def installed_version() -> str:
    """The installed SGLang's version ("unknown" when it is not installed)."""
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


def load_plugin_config(path: Optional[str]):
    """The :class:`~purlin_sglang.routed.PluginConfig` in ``path`` (None: the defaults), parsed once per process.

    Cached by the absolute path and the file's modification time and size, so an edited file is
    read again; a file that cannot be read or parsed raises PurlinConfigError every time."""
    from ..routed import PluginConfig

    if path is None:
        return PluginConfig()
    path = os.path.abspath(path)
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        return PluginConfig.from_yaml(path, flag="--purlin-config")  # raises the message that names the problem
    with _configs_lock:
        hit = _configs.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
    cfg = PluginConfig.from_yaml(path, flag="--purlin-config")
    with _configs_lock:
        _configs[path] = (stamp, cfg)
    return cfg


@dataclass(frozen=True)
class CommSettings:
    backend: str = "nccl"
    config_path: Optional[str] = None
    nccl_free: bool = False  # --purlin-nccl-free (single_gpu.py)
    moe_a2a: bool = False  # --moe-a2a-backend purlin: purlin's MoE dispatcher, whatever moe.dispatcher says

    def load_config(self):
        """The plugin config of ``config_path`` (parsed once per process: :func:`load_plugin_config`)."""
        return load_plugin_config(self.config_path)


def record(server_args: Any, backend: str, config_path: Optional[str], nccl_free: bool, moe_a2a: bool = False) -> None:
    """Carry the setting on ``server_args`` (pickled to the workers with it)."""
    setattr(server_args, _ATTR_BACKEND, backend)
    setattr(server_args, _ATTR_CONFIG, config_path)
    setattr(server_args, _ATTR_NCCL_FREE, bool(nccl_free))
    setattr(server_args, _ATTR_MOE, bool(moe_a2a))


def settings_of(server_args: Any) -> CommSettings:
    return CommSettings(getattr(server_args, _ATTR_BACKEND, "nccl"), getattr(server_args, _ATTR_CONFIG, None),
                        bool(getattr(server_args, _ATTR_NCCL_FREE, False)), bool(getattr(server_args, _ATTR_MOE, False)))


def active_settings() -> CommSettings:
    """This process's setting: :func:`activate`'s, else the published ServerArgs', else nccl."""
    if _process_settings is not None:
        return _process_settings
    try:
        from sglang.srt.runtime_context import get_server_args

        return settings_of(get_server_args())
    except Exception:  # not published (not a worker) or no SGLang: nothing to route
        return CommSettings()


@contextlib.contextmanager
def activate(backend: str, config_path: Optional[str] = None, nccl_free: bool = False, moe_a2a: bool = False):
    """Use ``backend`` for GroupCoordinators built in this process inside the context (tests, tools)."""
    global _process_settings
    if backend not in BACKENDS:
        raise PurlinPluginError(f"activate: {backend!r} is not one of {list(BACKENDS)}")
    prev, _process_settings = _process_settings, CommSettings(backend, config_path, nccl_free, moe_a2a)
    try:
        yield _process_settings
    finally:
        _process_settings = prev
