"""The MoE wing: expert-parallel dispatch and combine, every layer of it in one package.

``Communicator.moe_dispatch`` / ``moe_combine`` (purlin_sglang/api.py) are the API; the rest is here:

* :mod:`.validate`: the API glue: argument checks, then the call on the engine's MoE part.
* :mod:`.dispatch`: :class:`MoEDispatch`, what a dispatch returns and its combine takes.
* :mod:`.namings`: the two namings (``MOE_DISPATCH``, ``MOE_COMBINE``) in the collectives'
  vocabulary; :mod:`.plan`: their SNAC plans, plain data.
* :mod:`.engine`: the engine contract: :class:`~.engine.MoEEngine`, what an engine's MoE part
  provides, and :class:`~.engine.MoEContext`, what the Communicator hands it.
* :mod:`.exchange`: the count exchange every engine's eager dispatch starts with;
  :mod:`.limits`: the limits a config puts on calls, each decided once.
* :mod:`.cpu`, :mod:`.cuda`: the CPU and CUDA engines' MoE parts; :mod:`.region`: the CUDA
  part's MoE region (its layout, the loopback world's one allocation).
* :mod:`.routing`: the routing prologue; :mod:`.reference`: the plain torch reference every test
  (and the SGLang side) compares against.

The wing sits above the layers it uses (collectives, config, memory, native) and none of them
imports it; the engine registry names each engine's MoE part by import path. The SGLang side of MoE
(the dispatcher and its hook) is in :mod:`purlin_sglang.sglang`. Importing does no device work.
"""

from .dispatch import MoEDispatch
from .namings import MOE_COMBINE, MOE_DISPATCH

__all__ = ["MoEDispatch", "MOE_DISPATCH", "MOE_COMBINE"]
