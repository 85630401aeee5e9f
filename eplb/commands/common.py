"""Options and helpers shared by subcommands: seeds, progress bars, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def add_seed(parser: argparse.ArgumentParser, default: int = 0) -> None:
    parser.add_argument("--seed", type=int, default=default, help="random seed (default: %(default)s)")


def add_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def add_json_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        dest="json_out",
        type=Path,
        default=None,
        help="also write the results as JSON to this file ('-' for stdout)",
    )


def progress(items: Iterable[T], *, disable: bool, desc: str, total: int | None = None) -> Iterator[T]:
    """A tqdm bar on stderr, or the plain iterable when disabled or tqdm is missing."""
    if disable:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, dynamic_ncols=True)


def write_json(result: Any, target: Path | None) -> None:
    if target is None:
        return
    text = json.dumps(result, indent=2, sort_keys=True, default=_jsonable)
    if str(target) == "-":
        print(text)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def emit(result: dict[str, Any], keys: Iterable[str], target: Path | None) -> None:
    """Print ``keys`` of ``result`` as an aligned table (unless JSON goes to stdout), then the JSON."""
    if target is None or str(target) != "-":
        shown = [k for k in keys if k in result]
        width = max((len(k) for k in shown), default=0)
        for key in shown:
            print(f"{key:>{width}}: {result[key]}")
    write_json(result, target)
