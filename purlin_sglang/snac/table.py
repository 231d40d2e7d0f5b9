"""The tuning table: measured crossovers between algorithms (``purlin-sglang tune`` writes it).

Format 1 (JSON)::

    {"format": 1, "device": "NVIDIA H200" | "cpu", "engine": "cuda" | "cpu", "date": ..., "command": ...,
     "purlin_sglang": "<version>", "placement": "one_gpu" | "gpu_per_rank" | "any" (optional, "any"),
     "entries": {"<world>": {"<collective>": [[max_bytes, "algorithm"], ...]}},
     "measurements": [...]}

Each list holds size bands sorted by ``max_bytes``: a call whose input on one rank is ``nbytes``
bytes takes the first band with ``nbytes <= max_bytes`` (larger calls: the last band;
``snac.planner.band``). The input bytes of a fixed-size collective are the same on every rank,
so every rank reads the same band. ``measurements`` (the raw rows) is kept for the record and not read here.

Tables also ship in the package (``purlin_sglang/tables/``): with ``tuning.table`` unset, a
communicator uses the first shipped table that applies to it (device, engine, placement, world),
else the built-in thresholds; ``tuning.table: thresholds`` turns the shipped tables off.

``placement`` says where the ranks were when it was measured: ``one_gpu`` (every rank of the world on
one GPU: loopback virtual ranks, what ``purlin-sglang tune --device cuda`` measures today),
``gpu_per_rank`` (one GPU per rank, peers over NVLink) or ``any``. Crossovers measured with every
rank in one GPU's HBM do not carry over to NVLink (a one-shot that reads every peer's whole input
is cheap in HBM, not over links), so a table applies only to communicators placed the same way: a
virtual world for ``one_gpu``, a process group for ``gpu_per_rank`` (processes that share one GPU
count as ``gpu_per_rank``: the communicator cannot tell).

:func:`load_table` reads a table once per process (cached by path and modification time) and raises
:class:`~purlin_sglang.errors.PurlinConfigError` naming the key (``tuning.table``) and the field
that is wrong. :func:`bands_for` answers what one communicator uses: the bands of its world, or
None with the reason (no table, another device, no entry for the world).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from ..collectives import CATALOG
from ..errors import PurlinConfigError
from .planner import algorithms_of

FORMAT = 1
PLACEMENTS = ("one_gpu", "gpu_per_rank", "any")
KEY = "tuning.table"
THRESHOLDS = "thresholds"  # tuning.table value: the built-in thresholds only, no shipped table
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tables")


def shipped_tables() -> list[str]:
    """The tables that ship in the package (purlin_sglang/tables/*.json), sorted by name."""
    try:
        names = sorted(n for n in os.listdir(SHIPPED_DIR) if n.endswith(".json"))
    except OSError:
        return []
    return [os.path.join(SHIPPED_DIR, n) for n in names]


@dataclass(frozen=True)
class TuningTable:
    """A validated table: ``entries[world][collective]`` = ((max_bytes, algorithm), ...), sorted."""

    path: str
    device: str
    engine: str
    entries: dict[int, dict[str, tuple[tuple[int, str], ...]]]
    placement: str = "any"

    @property
    def worlds(self) -> tuple[int, ...]:
        return tuple(sorted(self.entries))

    @property
    def collectives(self) -> tuple[str, ...]:
        return tuple(sorted({c for per in self.entries.values() for c in per}))


@dataclass(frozen=True)
class TableInUse:
    """What one communicator's planner uses: ``bands`` per collective (None: the built-in thresholds)
    and ``reason``, one line saying which and why."""

    path: str | None
    bands: dict[str, tuple[tuple[int, str], ...]] | None
    reason: str


_CACHE: dict[tuple[str, int], TuningTable] = {}
_LOCK = threading.Lock()


def load_table(path: str) -> TuningTable:
    """The table at ``path``, read and validated once per (path, modification time)."""
    where = f"{KEY} {path}"
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as e:
        raise PurlinConfigError(f"{where}: cannot read: {e.strerror or e}") from None
    with _LOCK:
        table = _CACHE.get((path, mtime))
        if table is None:
            try:
                with open(path) as f:
                    data = json.load(f)
            except OSError as e:
                raise PurlinConfigError(f"{where}: cannot read: {e.strerror or e}") from None
            except ValueError as e:
                raise PurlinConfigError(f"{where}: not valid JSON: {e}") from None
            table = parse_table(data, path)
            _CACHE[(path, mtime)] = table
        return table


def parse_table(data: Any, path: str = "<table>") -> TuningTable:
    """Validate a decoded table; every error names the field (``PurlinConfigError``)."""
    where = f"{KEY} {path}"

    def bad(field: str, why: str) -> PurlinConfigError:
        return PurlinConfigError(f"{where}: field '{field}' {why}; regenerate it with 'purlin-sglang tune'")

    if not isinstance(data, dict):
        raise PurlinConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise bad("format", f"must be {FORMAT}, got {data.get('format')!r}")
    for field in ("device", "engine"):
        if not isinstance(data.get(field), str) or not data[field]:
            raise bad(field, f"must be a non-empty string, got {data.get(field)!r}")
    if data["engine"] not in ("cuda", "cpu"):
        raise bad("engine", f"must be 'cuda' or 'cpu', got {data['engine']!r}")
    placement = data.get("placement", "any")
    if placement not in PLACEMENTS:
        raise bad("placement", f"must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    raw = data.get("entries")
    if not isinstance(raw, dict):
        raise bad("entries", f"must be an object of world sizes, got {type(raw).__name__}")
    entries: dict[int, dict[str, tuple[tuple[int, str], ...]]] = {}
    for w, per in raw.items():
        if not (isinstance(w, str) and w.isdigit() and int(w) >= 1):
            raise bad(f"entries.{w}", "must be keyed by a world size >= 1")
        if not isinstance(per, dict):
            raise bad(f"entries.{w}", f"must be an object of collectives, got {type(per).__name__}")
        entries[int(w)] = {}
        for name, bands in per.items():
            field = f"entries.{w}.{name}"
            if name not in CATALOG:
                raise bad(field, f"names no catalog collective (known: {', '.join(CATALOG)})")
            allowed = algorithms_of(CATALOG[name], packets=True)
            if not isinstance(bands, list) or not bands:
                raise bad(field, "must be a non-empty list of [max_bytes, algorithm]")
            out: list[tuple[int, str]] = []
            for i, b in enumerate(bands):
                ok = isinstance(b, list) and len(b) == 2 and type(b[0]) is int and b[0] >= 0 and isinstance(b[1], str)
                if not ok:
                    raise bad(f"{field}[{i}]", f"must be [max_bytes (int >= 0), algorithm], got {b!r}")
                if b[1] not in allowed:
                    raise bad(f"{field}[{i}]", f"algorithm {b[1]!r} is not one {name} has ({', '.join(allowed)})")
                if out and b[0] <= out[-1][0]:
                    raise bad(f"{field}[{i}]", f"max_bytes {b[0]} is not above the band before ({out[-1][0]})")
                out.append((b[0], b[1]))
            entries[int(w)][name] = tuple(out)
    return TuningTable(path, data["device"], data["engine"], entries, placement)


_BUILTIN = "built-in thresholds (tuning.packet_max_bytes, tuning.oneshot_max_bytes)"


def bands_for(path: str | None, device_name: str, engine: str, world: int, placement: str = "any") -> TableInUse:
    """What a communicator of ``world`` ranks on ``device_name`` (``engine``), placed as ``placement``
    (``one_gpu`` or ``gpu_per_rank``), uses: from the table at ``path``; with ``path`` None (the
    default), from the first shipped table that applies (:func:`shipped_tables`), else the built-in
    thresholds; with ``path`` ``"thresholds"``, the built-in thresholds."""
    if path == THRESHOLDS:
        return TableInUse(None, None, f"{_BUILTIN}: tuning.table is '{THRESHOLDS}'")
    if path is None:
        for shipped in shipped_tables():
            used = _bands_of(shipped, device_name, engine, world, placement)
            if used.bands is not None:
                return TableInUse(used.path, used.bands, "shipped " + used.reason)
        return TableInUse(None, None, f"{_BUILTIN}: no shipped table for {device_name} ({engine} engine, "
                                      f"{placement}, world {world})")
    return _bands_of(path, device_name, engine, world, placement)


def _bands_of(path: str, device_name: str, engine: str, world: int, placement: str) -> TableInUse:
    table = load_table(path)
    if (table.device, table.engine) != (device_name, engine):
        return TableInUse(path, None, f"table {path} is for {table.device} ({table.engine} engine), not "
                                      f"{device_name} ({engine} engine): not applied, built-in thresholds")
    if table.placement != "any" and placement != "any" and table.placement != placement and world > 1:
        return TableInUse(path, None, f"table {path} was measured with placement {table.placement}, this "
                                      f"communicator is {placement}: not applied, built-in thresholds")
    per = table.entries.get(world)
    if not per:
        return TableInUse(path, None, f"table {path} has no entry for world {world} "
                                      f"(it has {list(table.worlds)}): built-in thresholds")
    return TableInUse(path, per, f"table {path} ({table.device}, world {world}: {', '.join(sorted(per))})")
