"""purlin's vLLM adapter: vLLM's device communicator classes with purlin's routed communicator
(:mod:`purlin_sglang.routed`) in front of them, and purlin's MoE exchange under vLLM's FusedMoE.

:class:`~.communicator.PurlinRoutes`: the overrides of ``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_gatherv`` and ``reduce_scatterv`` that serve a call through purlin and
hand every other call to vLLM's own implementation (counted, with the reason); its CPU and CUDA
forms (:mod:`.cpu`, :mod:`.cuda`: subclasses of vLLM's ``CpuCommunicator`` / ``CudaCommunicator``).
:mod:`.moe`: a modular prepare/finalize over purlin's ``moe_dispatch`` / ``moe_combine`` for
TP-only expert parallelism. :mod:`.hooks`: the four places purlin touches vLLM, each verified;
:func:`.plugin.register`, the ``vllm.general_plugins`` entry point, applies them. Switched on per
run by vLLM's ``additional_config`` (key ``purlin``; :mod:`.settings`). Tested on CPU against vLLM
0.33.0's own groups and FusedMoE kernel on gloo ranks; the CUDA form has not run on a GPU
(docs/VLLM.md). Nothing here imports vLLM at module import time but the class modules (``cpu``,
``cuda``, ``moe``) and the hooks, when applied.
"""
