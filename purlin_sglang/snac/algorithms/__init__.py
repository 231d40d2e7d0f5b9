"""The built-in algorithms, one module each (MSCCL++ keeps one file per all-reduce strategy), registered
here in the order they are listed (snac/registry.py). A new algorithm is a new module that builds its
:class:`~purlin_sglang.snac.registry.Algorithm` entry, and its registration."""

from .. import registry
from . import direct, direct_twoshot, hybrid, oneshot, packet, twoshot

BUILTIN = (packet.ALGORITHM, hybrid.ALGORITHM, oneshot.ALGORITHM, twoshot.ALGORITHM, direct.ALGORITHM,
           direct_twoshot.ALGORITHM)

for _entry in BUILTIN:
    registry.register(_entry)

__all__ = ["BUILTIN", "direct", "direct_twoshot", "hybrid", "oneshot", "packet", "twoshot"]
