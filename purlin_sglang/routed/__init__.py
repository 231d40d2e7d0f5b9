"""The routed communicator: the framework-neutral layer between a serving framework's group
coordinator and a purlin :class:`~purlin_sglang.Communicator`.

:class:`RoutedCommunicator` decides per call whether purlin serves it (the routing table of
:mod:`.routing`, the tensors' eligibility, the CUDA-graph warm-up rule, the deterministic mode),
counts what it served and why it declined, and reports both. The SGLang adapter
(:mod:`purlin_sglang.sglang`) is built on it; a vLLM adapter is planned on the same layer. It
imports nothing of any framework.
"""

from .communicator import NOT_WARM, RoutedCommunicator
from .routing import OPS, REDUCE_OPS, OpRoute, PluginConfig, RoutingTable, for_deterministic_inference

__all__ = ["RoutedCommunicator", "NOT_WARM", "PluginConfig", "RoutingTable", "OpRoute", "OPS", "REDUCE_OPS",
           "for_deterministic_inference"]
