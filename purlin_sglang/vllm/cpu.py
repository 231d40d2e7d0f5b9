"""PurlinCpuCommunicator: vLLM's ``CpuCommunicator`` with purlin's routes in front (:mod:`.communicator`),
for vLLM groups on the CPU platform. Imports vLLM."""

from __future__ import annotations

from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from .communicator import PurlinRoutes


class PurlinCpuCommunicator(PurlinRoutes, CpuCommunicator):
    """A ``CpuCommunicator`` whose collectives purlin serves where its routing table admits them."""
