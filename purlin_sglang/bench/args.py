"""Command-line argument types shared by the bench commands (collectives, tune, moe)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

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


def start(args: argparse.Namespace, resolve: Callable[[argparse.Namespace], argparse.Namespace]
          ) -> Optional[tuple[argparse.Namespace, Path]]:
    """A bench command's arguments checked by ``resolve`` and its output folder made: (the resolved
    arguments, the folder), or None after printing the argument error (the command then exits 2)."""
    try:
        args = resolve(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return args, out_dir
