"""PurlinCudaCommunicator: vLLM's ``CudaCommunicator`` with purlin's routes in front (:mod:`.communicator`),
for vLLM groups on CUDA. A subclass, so ``GroupCoordinator.graph_capture``'s type check holds. Not yet
run on a GPU (docs/VLLM.md). Imports vLLM."""

from __future__ import annotations

from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

from .communicator import PurlinRoutes


class PurlinCudaCommunicator(PurlinRoutes, CudaCommunicator):
    """A ``CudaCommunicator`` whose collectives purlin serves where its routing table admits them."""
