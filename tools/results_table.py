"""A/B tables from benchmark records: every case's median per build, side by side, and new / base.

    python3 tools/results_table.py OUT/ab                               # what `tools/gpu.sh ab` left
    python3 tools/results_table.py docs/results/2026-12-05-h200-s10     # records kept under a prefix

A folder (the ``ab`` step of tools/gpu.sh writes one) holds graph.jsonl and eager.jsonl (rows that
name their build in ``label``) and one file per build and round: engine-LABEL-ROUND.json,
parts-LABEL-ROUND.json, collectives-LABEL-ROUND/results.json, moe-LABEL-ROUND/moe.json. Under a
prefix (docs/results) the records are PREFIX-graph-ab.jsonl, PREFIX-eager-ab.jsonl and
PREFIX-KIND[-LABEL].json with KIND cuda-engine, staged-parts, bench-collectives or bench-moe (no
LABEL: the build measured, "new"). A value is the median over rounds; "-" where a build has no record of the case; "(wrong)" where a result of it was
wrong. Standard library only. Exit status 1 when no record is found.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kind:
    """One kind of record: where it lies, which fields name a case, which field is its time."""

    name: str
    title: str
    key: tuple[str, ...]
    value: str
    folder: str  # in an ab folder: NAME.jsonl, or a glob of per-run files named NAME-LABEL-ROUND
    prefix: str  # under a docs/results prefix: PREFIX + this (+ "-LABEL" before ".json" for per-build files)


KINDS = (
    Kind("graph", "graph A/B: us per call, packet path", ("case", "check"), "us_per_call",
         "graph.jsonl", "-graph-ab.jsonl"),
    Kind("eager", "eager A/B: host us per call, 8 KiB all_reduce", ("world", "out"), "median_us",
         "eager.jsonl", "-eager-ab.jsonl"),
    Kind("engine", "engine bench: us per call", ("case", "world"), "us_per_call",
         "engine-*-*.json", "-cuda-engine.json"),
    Kind("parts", "staged one-shot parts: us per call", ("variant", "world"), "us_per_call",
         "parts-*-*.json", "-staged-parts.json"),
    Kind("collectives", "bench collectives: median us", ("impl", "collective", "mode", "world", "bytes"),
         "time_us_median", "collectives-*-*/results.json", "-bench-collectives.json"),
    Kind("moe", "bench moe: median us", ("impl", "op", "dtype", "mode", "world", "tokens"),
         "time_us_median", "moe-*-*/moe.json", "-bench-moe.json"),
)
ORDER = ("base", "new")  # these columns first, then any other label by name


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def _labelled(doc, label: str) -> list[dict]:
    rows = doc.get("rows") if isinstance(doc, dict) else None
    return [dict(r, label=label) for r in rows or [] if isinstance(r, dict)]


def rows_in_folder(folder: Path, kind: Kind) -> list[dict]:
    """The rows of ``kind`` in an ab folder, each with its build's ``label``."""
    if kind.folder.endswith(".jsonl"):
        return _jsonl(folder / kind.folder)
    rows = []
    for path in sorted(folder.glob(kind.folder)):
        run = path.parent.name if path.name in ("results.json", "moe.json") else path.stem  # NAME-LABEL-ROUND
        m = re.fullmatch(rf"{kind.name}-(.+)-(\d+)", run)
        if m:
            rows += _labelled(_json(path), m.group(1))
    return rows


def rows_under_prefix(prefix: Path, kind: Kind) -> list[dict]:
    """The rows of ``kind`` kept under a docs/results prefix, each with its build's ``label``."""
    if kind.prefix.endswith(".jsonl"):
        return _jsonl(Path(str(prefix) + kind.prefix))
    stem = prefix.name + kind.prefix.removesuffix(".json")
    rows = []
    for path in sorted(prefix.parent.glob(stem + "*.json")):
        rest = path.stem[len(stem):]
        if rest == "" or rest.startswith("-"):
            rows += _labelled(_json(path), rest[1:] or "new")
    return rows


def medians(rows: list[dict], kind: Kind) -> tuple[list[tuple], list[str], dict]:
    """(the cases in the order first seen, the labels in column order, (case, label) -> (median, wrong))."""
    values: dict[tuple, list[float]] = {}
    wrong: set[tuple] = set()
    cases: dict[tuple, None] = {}
    for r in rows:
        if not isinstance(r.get(kind.value), (int, float)) or "label" not in r:
            continue
        case = tuple(r.get(k) for k in kind.key)
        cases.setdefault(case)
        values.setdefault((case, r["label"]), []).append(float(r[kind.value]))
        if r.get("correct") is False:
            wrong.add((case, r["label"]))
    labels = {label for _, label in values}
    order = [x for x in ORDER if x in labels] + sorted(labels - set(ORDER))
    return list(cases), order, {k: (statistics.median(v), k in wrong) for k, v in values.items()}


def table(kind: Kind, rows: list[dict]) -> list[str]:
    """A markdown table of ``rows``: a line per case, a column per build, new / base where both are."""
    cases, labels, med = medians(rows, kind)
    if not cases:
        return []
    ratio = "base" in labels and "new" in labels
    head = list(kind.key) + labels + (["new/base"] if ratio else [])
    out = [f"## {kind.title} (median over rounds)", "", "| " + " | ".join(head) + " |",
           "|" + "---|" * len(head)]
    for case in cases:
        cells = [str(c) for c in case]
        for label in labels:
            got = med.get((case, label))
            cells.append("-" if got is None else f"{got[0]:.2f}" + (" (wrong)" if got[1] else ""))
        if ratio:
            b, n = med.get((case, "base")), med.get((case, "new"))
            cells.append(f"{n[0] / b[0]:.3f}" if b and n and b[0] > 0 else "-")
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path, help="an ab folder, or a docs/results prefix")
    a = ap.parse_args(argv)
    read = rows_in_folder if a.records.is_dir() else rows_under_prefix
    lines = [line for kind in KINDS for line in table(kind, read(a.records, kind))]
    if not lines:
        print(f"results_table: no records under {a.records} (an ab folder of tools/gpu.sh, or a "
              f"docs/results prefix such as docs/results/2026-12-05-h200-s10)", file=sys.stderr)
        return 1
    print("\n".join(lines).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
