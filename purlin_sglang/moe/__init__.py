"""MoE expert-parallel dispatch and combine: the result type, the routing prologue, the reference.

``Communicator.moe_dispatch`` / ``moe_combine`` are the API (purlin_sglang/api.py); the namings are
in :mod:`purlin_sglang.moe.namings`, the plans in :mod:`purlin_sglang.moe.plan`.
:mod:`purlin_sglang.moe.reference` is the plain torch reference every test (and the SGLang side)
compares against. Importing does no device work.
"""

from .dispatch import MoEDispatch

__all__ = ["MoEDispatch"]
