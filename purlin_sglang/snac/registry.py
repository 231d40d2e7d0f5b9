"""The algorithm registry: every algorithm the planner can derive is one registered :class:`Algorithm`.

An algorithm is a unit of its own (one module in ``snac/algorithms/``): which collectives it applies
to (by their naming, never by name), how it builds one rank's :class:`~purlin_sglang.snac.plan.Plan`,
how it lowers that plan with one rank's sizes, which kernel kind the CUDA engine runs its tables in,
and the rules by which the selector (:func:`purlin_sglang.snac.planner.select`) takes it. Nothing
outside an algorithm's module and the selector asks which algorithm a plan is: the call path, the
lowering, the engines and the tuning table read the entry's fields.

Adding an algorithm is one module that builds its entry, and :func:`register`. This module imports
nothing of the planner (the planner, the lowering and the policy read it), so it holds data only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import PurlinValueError


@dataclass(frozen=True)
class Selection:
    """What the selector knows of one call: the naming (``spec``), this rank's input bytes (``nbytes``,
    None when the size is resolved later), the group's largest push (``push``, None where unknown), the
    tuning policy and whether the engine runs the packet protocol (``packets``)."""

    spec: Any
    nbytes: Optional[int]
    push: Optional[int]
    policy: Any
    packets: bool


def _always(_sel: Selection) -> bool:
    return True


@dataclass(frozen=True)
class Algorithm:
    """One registered algorithm (a typed registry entry).

    * ``name``: the name plans carry (``Plan.algorithm``) and ``tuning.algorithm`` / tables use.
    * ``has_form(spec)``: the collectives it applies to (the naming's layouts and consume op).
    * ``form``: what a refusal of another collective says it has no form of, with why (a phrase).
    * ``plan(request)``: one rank's plan (:class:`Request`); ``lower(plan, resolver, sizes)``: that
      rank's schedule (snac/lower.py).
    * ``kernel``: the kernel kind the CUDA engine runs its tables in (``abi.KERNEL_*``); None for an
      algorithm whose schedules run as their parts (``Schedule.parts``), each of its own kind.
    * ``packets``: it needs an engine with the packet protocol.
    * ``priority``: selection order, highest first; ``fallback``: the answer when no other is taken
      (exactly one entry).
    * ``auto(selection)``: under ``tuning.algorithm: auto``, whether the selector takes it (None: never);
      ``forced_by``: the ``tuning.algorithm`` values that ask for it; ``fits(selection)``: whether the
      call's sizes can run it at all (a tuning table's band is taken only then).
    * ``tunable``: a tuning table may name it (``purlin-sglang tune`` times it).
    * ``heap_form_of``: the algorithm it replaces where every rank's input lies in the symmetric heap
      at the same offset (it reads the peers' inputs in place), or None.
    * ``agreed_sizes``: every rank knows every size of its calls, so a V form's sizes enter the call's
      fingerprint (ranks that disagree on them get a mismatch error).
    """

    name: str
    has_form: Callable[[Any], bool]
    form: str
    plan: Callable[["Request"], Any]
    lower: Callable[[Any, Any, Any], Any]
    kernel: Optional[int]
    packets: bool = False
    priority: int = 0
    fallback: bool = False
    auto: Optional[Callable[[Selection], bool]] = None
    forced_by: tuple[str, ...] = ()
    fits: Callable[[Selection], bool] = _always
    tunable: bool = False
    heap_form_of: Optional[str] = None
    agreed_sizes: bool = False

    def runs(self, sel: Selection) -> bool:
        """Whether the call of ``sel`` may take this algorithm: its naming has the form, and the engine
        has the packet protocol where the algorithm needs it."""
        return self.has_form(sel.spec) and (sel.packets or not self.packets)


@dataclass(frozen=True)
class Request:
    """What ``make_plan`` hands an algorithm's ``plan``: the entry (its name goes into the plan), the
    naming, the group size, this rank, the root (None for unrooted namings), the staging bytes per rank,
    the tuning policy and, for plans that read the symmetric heap, where every rank's input lies in it."""

    algorithm: Algorithm
    spec: Any
    world: int
    rank: int
    root: Optional[int]
    staging_bytes: int
    policy: Any
    input_at: int = -1


_LOCK = threading.Lock()
_ENTRIES: dict[str, Algorithm] = {}  # registration order: the order algorithms are listed in


def register(entry: Algorithm) -> Algorithm:
    """Add ``entry``; returns it. Raises PurlinValueError for a name that is taken, or a second fallback."""
    if not isinstance(entry, Algorithm):
        raise PurlinValueError(f"register: expected an Algorithm, got {type(entry).__name__}")
    with _LOCK:
        if entry.name in _ENTRIES:
            raise PurlinValueError(f"register: algorithm {entry.name!r} is already registered; pick another name "
                                   "or unregister it first")
        if entry.fallback and any(e.fallback for e in _ENTRIES.values()):
            raise PurlinValueError(f"register: algorithm {entry.name!r} is a fallback, and {fallback().name!r} "
                                   "already is one; a registry has exactly one")
        _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove the algorithm registered as ``name`` (tests that register their own)."""
    with _LOCK:
        if _ENTRIES.pop(name, None) is None:
            raise PurlinValueError(f"unregister: no algorithm {name!r} is registered")


def find(name: str) -> Optional[Algorithm]:
    """The algorithm registered as ``name``, or None."""
    return _ENTRIES.get(name)


def get(name: str) -> Algorithm:
    """The algorithm registered as ``name``; PurlinValueError naming the registered ones otherwise."""
    entry = _ENTRIES.get(name)
    if entry is None:
        raise PurlinValueError(unknown(name))
    return entry


def unknown(name: Any) -> str:
    """The message for an algorithm name nothing is registered as (without the op it starts with)."""
    return f"algorithm must be {_quoted(names())}, got {name!r}"


def registered() -> tuple[Algorithm, ...]:
    """Every algorithm, in registration order."""
    return tuple(_ENTRIES.values())


def names() -> tuple[str, ...]:
    return tuple(_ENTRIES)


def by_priority() -> tuple[Algorithm, ...]:
    """Every algorithm, highest priority first (registration order among equals)."""
    return tuple(sorted(_ENTRIES.values(), key=lambda e: -e.priority))


def fallback() -> Algorithm:
    """The algorithm the selector answers when no other is taken."""
    for entry in _ENTRIES.values():
        if entry.fallback:
            return entry
    raise PurlinValueError("algorithm registry: no fallback algorithm is registered")


def forced_names() -> tuple[str, ...]:
    """The values ``tuning.algorithm`` takes besides ``auto``: every name some algorithm is forced by."""
    out: list[str] = []
    for entry in _ENTRIES.values():
        out += [n for n in entry.forced_by if n not in out]
    return tuple(out)


def heap_form(entry: Algorithm) -> Optional[Algorithm]:
    """The algorithm that runs in place of ``entry`` where every rank's input lies in the symmetric heap."""
    for other in _ENTRIES.values():
        if other.heap_form_of == entry.name:
            return other
    return None


def _quoted(items: tuple[str, ...]) -> str:
    quoted = [repr(n) for n in items]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
