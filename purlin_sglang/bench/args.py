"""Command-line argument types shared by the bench commands (collectives, tune, moe)."""

from __future__ import annotations

import argparse

from .metrics import parse_size


def csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def sizes_arg(text: str) -> list[int]:
    try:
        return [parse_size(t) for t in csv_list(text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def worlds_arg(text: str) -> list[int]:
    try:
        vals = [int(t) for t in csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad world list {text!r}: use ints, e.g. 8 or 2,4,8") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"bad world list {text!r}: world sizes must be >= 1")
    return vals
