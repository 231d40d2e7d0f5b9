"""purlin's vLLM adapter (in progress): vLLM's device communicator classes with purlin's routed
communicator (:mod:`purlin_sglang.routed`) in front of them.

What exists: :class:`~.communicator.PurlinRoutes`, the overrides of ``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_gatherv`` and ``reduce_scatterv`` that serve a call through purlin and
hand every other call to vLLM's own implementation (counted, with the reason), and its CPU form
:class:`~.cpu.PurlinCpuCommunicator` (a ``CpuCommunicator``), tested against vLLM 0.33.0's own
``GroupCoordinator`` on gloo ranks. Switched on per run by vLLM's ``additional_config`` (key
``purlin``; :mod:`.settings`). Planned: the platform plugin that installs the CUDA form through
``get_device_communicator_cls``, the MoE exchange under FusedMoE, and a GPU run (docs/VLLM.md).
Nothing here imports vLLM at module import time but the class modules (``cpu``, ``cuda``).
"""
