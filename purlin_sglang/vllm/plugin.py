"""purlin's ``vllm.general_plugins`` entry point (pyproject.toml): :func:`register`.

vLLM calls it once in every process (API server, engine core, each worker) before any group
exists (docs/VLLM.md, "Plugins"). It applies the start-up hooks of :mod:`.hooks`: the current
platform's ``get_device_communicator_cls`` answers purlin's class where vLLM's answer is its stock
CPU or CUDA communicator (:class:`~.cpu.PurlinCpuCommunicator` / :class:`~.cuda.PurlinCudaCommunicator`,
which behave exactly as vLLM's own unless the run's ``additional_config`` has the key ``purlin``,
:mod:`.settings`); the platform's ``check_and_update_config`` validates purlin's settings and turns
the fused all-reduce + RMSNorm pass off when purlin is on; ``GroupCoordinator.graph_capture`` enters
purlin's capture context. The MoE hook is applied later, where purlin's MoE is switched on
(:mod:`.hooks`). Another platform's own communicator is left alone. It never stops vLLM: with
another vLLM version, or a hook that cannot be applied, it logs why (a run that then switches
purlin on fails at its config check, naming the hook); ``VLLM_PLUGINS`` can leave it out altogether.
"""

from __future__ import annotations

import logging

from . import hooks
from .hooks import STOCK  # noqa: F401 - the stock classes and purlin's, by qualified name

logger = logging.getLogger(__name__)


def register() -> bool:
    """Apply and verify the start-up hooks (idempotent). True if all are in effect."""
    from ..errors import PurlinPluginError
    from .settings import check_vllm

    try:
        check_vllm()
    except PurlinPluginError as e:
        logger.warning("purlin_sglang: %s; purlin's vLLM communicator is not installed", e)
        return False
    try:
        hooks.apply(hooks.START_UP)
    except Exception as e:  # noqa: BLE001 - a general plugin's exception would stop vLLM
        logger.warning("purlin_sglang: cannot apply purlin's vLLM hooks (%s: %s); purlin stays off",
                       type(e).__name__, e)
        return False
    gone = hooks.missing(hooks.START_UP)
    if gone:
        logger.warning("purlin_sglang: purlin's vLLM hooks not in effect: %s", "; ".join(gone))
        return False
    return True
