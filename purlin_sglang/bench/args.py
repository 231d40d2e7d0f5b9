"""Command-line argument types shared by the commands (demo, bench collectives, tune, bench moe)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

from ..errors import PurlinValueError
from .metrics import parse_size


def positive_int(text: str) -> int:
    """An int >= 1 (``--rows 0`` is refused by argparse, naming the option)."""
    return _number(text, int, 1, strict=False)


def nonneg_int(text: str) -> int:
    """An int >= 0."""
    return _number(text, int, 0, strict=False)


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds)."""
    return _number(text, float, 0, strict=True)


def factor_arg(text: str) -> float:
    """A sweep's step: a finite number > 1 (each size is the one before times this)."""
    return _number(text, float, 1, strict=True)


def _number(text: str, kind: type, low: float, *, strict: bool) -> Any:
    """``text`` as ``kind`` (int or float): finite, and above ``low`` (``strict``) or at least ``low``."""
    what = f"{'an integer' if kind is int else 'a number'} {'>' if strict else '>='} {low:g}"
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"need {what}, got {text!r}") from None
    if not (v > low if strict else v >= low) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"need {what}, got {text}")
    return v


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


def add_launch_ahead(p: argparse.ArgumentParser) -> None:
    """``--launch-ahead`` (bench collectives, bench moe, moe_parts; timing.time_graph_replays)."""
    p.add_argument("--launch-ahead", action="store_true",
                   help="graph mode: hold each rank's stream behind a GPU sleep while the host enqueues every timed "
                        "replay, so replays run back to back and host launch time between them is not timed "
                        "(virtual ranks: the rank threads share one CUDA context and can fall behind the GPU)")


def add_decode_tokens(p: argparse.ArgumentParser) -> None:
    """``--decode-tokens N`` (bench moe, moe_parts): the communicators' ``moe.decode_tokens``."""
    p.add_argument("--decode-tokens", type=int, default=None, metavar="N",
                   help="moe.decode_tokens: calls of at most N tokens a rank take the decode mode (packets, one "
                        "round an op); 0: off (default: the config's default)")


def start(args: argparse.Namespace, resolve: Callable[[argparse.Namespace], argparse.Namespace]
          ) -> tuple[argparse.Namespace, Path]:
    """A bench command's arguments checked by ``resolve`` and its output folder made: (the resolved
    arguments, the folder). A ValueError of ``resolve`` (an option it refuses) is raised as a
    PurlinValueError: the command line prints its message and exits 2."""
    try:
        args = resolve(args)
    except PurlinValueError:
        raise
    except ValueError as e:
        raise PurlinValueError(str(e)) from e
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return args, out_dir
