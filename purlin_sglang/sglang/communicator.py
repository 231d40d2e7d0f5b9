"""PurlinGroupCommunicator: the routed communicator (:mod:`purlin_sglang.routed`) as one SGLang
group's ``purlin_comm``, in SGLang's communicator convention (``disabled``, ``should_<op>``, ops
that return ``None`` to decline, ``destroy()``), with its deterministic mode taken from SGLang's
``--enable-deterministic-inference``."""

from __future__ import annotations

from typing import Any, Optional

from ..routed import PluginConfig, RoutedCommunicator
from .routing import deterministic_inference


class PurlinGroupCommunicator(RoutedCommunicator):
    """A :class:`~purlin_sglang.routed.RoutedCommunicator` for the SGLang group ``name``, built on its
    CPU (gloo) group; batch-invariant routing when SGLang runs with deterministic inference."""

    def __init__(self, group: Any, device: Any, config: Optional[PluginConfig] = None, *, name: str = ""):
        super().__init__(group, device, config, name=name, deterministic=deterministic_inference())
