"""purlin's vLLM adapter (in progress): vLLM's device communicator classes with purlin's routed
communicator (:mod:`purlin_sglang.routed`) in front of them.

What exists: :class:`~.communicator.PurlinRoutes`, the overrides of ``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_gatherv`` and ``reduce_scatterv`` that serve a call through purlin and
hand every other call to vLLM's own implementation (counted, with the reason); its CPU and CUDA
forms (:mod:`.cpu`, :mod:`.cuda`: subclasses of vLLM's ``CpuCommunicator`` / ``CudaCommunicator``);
and the ``vllm.general_plugins`` entry point (:func:`.plugin.register`) that makes vLLM build them.
Switched on per run by vLLM's ``additional_config`` (key ``purlin``; :mod:`.settings`). The CPU form
is tested against vLLM 0.33.0's own groups on gloo ranks; the CUDA form has not run on a GPU.
Planned: the graph-capture hook and the MoE exchange under FusedMoE (docs/VLLM.md).
Nothing here imports vLLM at module import time but the class modules (``cpu``, ``cuda``) and
:func:`.plugin.register`, when vLLM calls it.
"""
