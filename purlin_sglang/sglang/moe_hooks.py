"""The MoE hook: ``create_moe_dispatcher`` (AROUND ``layers/moe/fused_moe_triton/layer.py``).

SGLang 0.5.23's ``FusedMoE.__init__`` asks the module-level ``create_moe_dispatcher(moe_runner_config,
quant_method)`` for its dispatcher (looked up at call time, so the hook reaches every layer). With
``--comm-backend purlin`` and either ``--moe-a2a-backend purlin`` or a ``--purlin-config`` whose
``moe.dispatcher`` is ``purlin`` with ``--moe-a2a-backend none``, it answers a :class:`~.moe_dispatcher.PurlinMoEDispatcher`; in every other
case SGLang's own choice, unchanged (a layer purlin cannot serve is logged once, with the reason).
Nothing here imports SGLang at module import time.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher"
_said: set[str] = set()
FALLBACKS: Counter = Counter()  # reason -> MoE layers that kept SGLang's dispatcher after purlin's was chosen


def _once(level: int, text: str) -> None:
    if text not in _said:
        _said.add(text)
        logger.log(level, text)


def purlin_moe_config():
    """This process's ``moe:`` section when purlin is chosen as the dispatcher, else None."""
    from .settings import active_settings
    from .moe_config import moe_settings_of

    settings = active_settings()
    if settings.backend != "purlin" or (settings.config_path is None and not settings.moe_a2a):
        return None
    cfg = moe_settings_of(settings.load_config())
    return cfg if cfg.dispatcher == "purlin" or settings.moe_a2a else None


def create_moe_dispatcher(original, moe_runner_config: Any, quant_method: Any = None, *args, **kwargs):
    """AROUND create_moe_dispatcher: purlin's dispatcher where chosen and possible, else SGLang's."""
    cfg = purlin_moe_config()
    if cfg is None:
        return original(moe_runner_config, quant_method, *args, **kwargs)
    from sglang.srt.layers.moe import get_moe_a2a_backend

    a2a = get_moe_a2a_backend()
    if not a2a.is_none():
        _once(logging.WARNING, f"purlin_sglang: moe.dispatcher purlin needs --moe-a2a-backend none (it is "
                               f"{a2a.value}); SGLang's {a2a.value} dispatcher is used")
        return original(moe_runner_config, quant_method, *args, **kwargs)
    from . import moe_dispatcher

    why = moe_dispatcher.why_not(moe_runner_config)
    if why is not None:
        _once(logging.INFO, f"purlin_sglang: MoE layers use SGLang's standard dispatcher: {why}")
        return original(moe_runner_config, quant_method, *args, **kwargs)
    try:
        return moe_dispatcher.PurlinMoEDispatcher(moe_runner_config, cfg)
    except moe_dispatcher.KeepSGLangDispatcher as e:
        FALLBACKS[str(e)] += 1
        _once(logging.WARNING, f"purlin_sglang: MoE layers use SGLang's standard dispatcher: {e}")
        return original(moe_runner_config, quant_method, *args, **kwargs)
