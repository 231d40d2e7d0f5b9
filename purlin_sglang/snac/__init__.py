"""SNAC (Stage, Notify, And Consume): the one planner every engine executes.

Algorithms are registered units (snac/registry.py), one module each in snac/algorithms/ (imported
here, which registers the built-in ones); :func:`~.planner.select` chooses among them.
"""

from . import registry
from .lower import (
    Copy, Op, PacketCopy, PacketPut, PacketReduce, Reduce, Schedule, Signal, Sizes, Span, WaitDrainAll, WaitSignal,
    lower, part_range,
)
from .plan import (
    Ack, Beat, Buf, ConsumeStep, Drain, DrainAll, Hear, Item, Notify, Plan, Push, RankProgram, Ref, Stage, Step, Wait,
)
from .planner import (
    algorithms_of, choose_algorithm, consumers, has_hybrid_form, has_packet_form, make_plan, producers, select,
)
from .policy import ALIGN, TuningPolicy
from .registry import Algorithm
from . import algorithms  # noqa: E402, F401  (last: registers the built-in algorithms)

__all__ = [
    "Copy", "Op", "PacketCopy", "PacketPut", "PacketReduce", "Push", "Reduce", "Schedule", "Signal", "Sizes",
    "Span", "WaitDrainAll", "WaitSignal", "lower", "part_range", "Ack", "Beat", "Buf", "ConsumeStep", "Drain",
    "DrainAll", "Hear", "Item", "Notify", "Plan", "RankProgram", "Ref", "Stage", "Step", "Wait", "algorithms_of",
    "choose_algorithm", "consumers", "has_hybrid_form", "has_packet_form", "make_plan", "producers", "select",
    "ALIGN", "TuningPolicy", "Algorithm", "registry", "algorithms",
]
