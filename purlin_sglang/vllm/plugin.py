"""purlin's ``vllm.general_plugins`` entry point (pyproject.toml): :func:`register`.

vLLM calls it once in every process (API server, engine core, each worker) before any group
exists (docs/VLLM.md, "Plugins"). It makes the current platform's ``get_device_communicator_cls``
answer purlin's class where vLLM's answer is its stock CPU or CUDA communicator:
:class:`~.cpu.PurlinCpuCommunicator` / :class:`~.cuda.PurlinCudaCommunicator`, which behave exactly
as vLLM's own unless the run's ``additional_config`` has the key ``purlin`` (:mod:`.settings`).
Another platform's own communicator is left alone. It never stops vLLM: with another vLLM version
it logs why and changes nothing (``VLLM_PLUGINS`` can leave it out altogether).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

STOCK = {
    "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator":
        "purlin_sglang.vllm.cpu.PurlinCpuCommunicator",
    "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator":
        "purlin_sglang.vllm.cuda.PurlinCudaCommunicator",
}
_MARK = "_purlin_communicator"


def register() -> bool:
    """Install purlin's communicator classes on vLLM's current platform (idempotent). True if installed."""
    from ..errors import PurlinPluginError
    from .settings import check_vllm

    try:
        check_vllm()
    except PurlinPluginError as e:
        logger.warning("purlin_sglang: %s; purlin's vLLM communicator is not installed", e)
        return False
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if getattr(cls, _MARK, False):
        return True
    original = cls.get_device_communicator_cls

    def get_device_communicator_cls(klass) -> str:
        name = original()
        return STOCK.get(name, name)

    cls.get_device_communicator_cls = classmethod(get_device_communicator_cls)
    setattr(cls, _MARK, True)
    return True
