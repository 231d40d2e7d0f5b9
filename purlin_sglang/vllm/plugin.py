"""purlin's ``vllm.general_plugins`` entry point (pyproject.toml): :func:`register`.

vLLM calls it once in every process (API server, engine core, each worker) before any group
exists (docs/VLLM.md, "Plugins"). It applies the start-up hooks of :mod:`.hooks`: the current
platform's ``get_device_communicator_cls`` answers purlin's class where vLLM's answer is its stock
CPU or CUDA communicator and the run's ``additional_config`` has the key ``purlin`` (:mod:`.settings`;
:class:`~.cpu.PurlinCpuCommunicator` / :class:`~.cuda.PurlinCudaCommunicator`), vLLM's own class
otherwise; the platform's ``check_and_update_config`` validates purlin's settings and turns
the fused all-reduce + RMSNorm pass off when purlin is on; ``GroupCoordinator.graph_capture`` enters
purlin's capture context. The MoE hook is applied later, where purlin's MoE is switched on
(:mod:`.hooks`). Another platform's own communicator is left alone. It never stops vLLM: with
another vLLM version, or a hook that cannot be applied, it logs why and puts one check around the
platform's ``check_and_update_config`` (:func:`.hooks.refuse`), so that a run that switches purlin on
fails there, saying why, instead of running without purlin; ``VLLM_PLUGINS`` can leave it out
altogether.
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
        return _off(f"{e}; purlin's vLLM communicator is not installed")
    try:
        hooks.apply(hooks.START_UP)
    except Exception as e:  # noqa: BLE001 - a general plugin's exception would stop vLLM
        return _off(f"cannot apply purlin's vLLM hooks ({type(e).__name__}: {e}); purlin stays off")
    gone = hooks.missing(hooks.START_UP)
    if gone:
        return _off(f"purlin's vLLM hooks not in effect: {'; '.join(gone)}")
    return True


def _off(why: str) -> bool:
    """Log ``why``, and make a run that switches purlin on fail at its config check saying it (not run
    without purlin); False."""
    logger.warning("purlin_sglang: %s", why)
    try:
        hooks.refuse_when_on(why)
    except Exception as e:  # noqa: BLE001 - as above: never stop vLLM here
        logger.warning("purlin_sglang: cannot install the check that refuses additional_config.purlin either "
                       "(%s: %s): a run that sets it runs without purlin", type(e).__name__, e)
    return False
