"""SNAC (Stage, Notify, And Consume): the one planner every engine executes."""

from .lower import (
    Copy, Op, PacketCopy, PacketPut, PacketReduce, Reduce, Schedule, Signal, Sizes, Span, WaitDrainAll, WaitSignal,
    lower, part_range,
)
from .plan import (
    Ack, Beat, Buf, ConsumeStep, Drain, DrainAll, Hear, Item, Notify, Plan, Push, RankProgram, Ref, Stage, Step, Wait,
)
from .planner import (
    algorithms_of, choose_algorithm, consumers, has_hybrid_form, has_packet_form, make_plan, producers,
)
from .policy import ALIGN, TuningPolicy

__all__ = [
    "Copy", "Op", "PacketCopy", "PacketPut", "PacketReduce", "Push", "Reduce", "Schedule", "Signal", "Sizes",
    "Span", "WaitDrainAll", "WaitSignal", "lower", "part_range", "Ack", "Beat", "Buf", "ConsumeStep", "Drain",
    "DrainAll", "Hear", "Item", "Notify", "Plan", "RankProgram", "Ref", "Stage", "Step", "Wait", "algorithms_of",
    "choose_algorithm", "consumers", "has_hybrid_form", "has_packet_form", "make_plan", "producers", "ALIGN",
    "TuningPolicy",
]
