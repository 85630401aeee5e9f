"""Options and helpers shared by subcommands: seeds, progress bars, optional extras, JSON output.

Every file a command writes goes through eplb.fileio (atomic, regular files only); commands that
write several files stage them in one ``OutputSet`` so a failure leaves none of them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from eplb.fileio import OutputSet, check_output_path, write_text

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


def json_to_stdout(target: Path | None) -> bool:
    return target is not None and str(target) == "-"


def require_extra(module: str, extra: str, flag: str) -> None:
    """Refuse ``flag`` up front when its optional dependency is missing, naming the extra."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"{flag} needs {module}, which is not installed: pip install 'eplb[{extra}]'"
        ) from None


def check_outputs(*targets: Path | None) -> None:
    """Refuse unwritable output paths before any work is done ('-' and None are skipped)."""
    for target in targets:
        if target is not None and str(target) != "-":
            check_output_path(target, parents=True)


def check_output_folder(folder: Path | None) -> None:
    """Refuse an output folder (``--plots DIR``) that is a file or sits under one, before any work."""
    if folder is None:
        return
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    check_output_path(folder / "plot.png", parents=True)


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


@contextmanager
def progress_callback(*, disable: bool, desc: str, unit: str = "it") -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback drawing a tqdm bar on stderr (a no-op when disabled
    or tqdm is missing); the bar appears on the first call and closes with the block."""
    bar: Any = None
    try:
        from tqdm import tqdm
    except ImportError:
        disable = True

    def update(done: int, total: int) -> None:
        nonlocal bar
        if disable:
            return
        if bar is None:
            scale = unit == "B" or total >= 100_000  # 152M, not 152474805; small counts exact
            bar = tqdm(
                total=total, desc=desc, unit=unit, unit_scale=scale, file=sys.stderr, dynamic_ncols=True
            )
        bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


def write_json(result: Any, target: Path | None, *, outputs: OutputSet | None = None) -> None:
    """Print ``result`` as JSON ('-') or write it atomically (missing folders are created)."""
    if target is None:
        return
    text = json.dumps(result, indent=2, sort_keys=True, default=_jsonable)
    if str(target) == "-":
        print(text)
    else:
        write_text(target, text + "\n", outputs=outputs, parents=True)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def emit(
    result: dict[str, Any], keys: Iterable[str], target: Path | None, *, outputs: OutputSet | None = None
) -> None:
    """Print ``keys`` of ``result`` as an aligned table (unless JSON goes to stdout), then the JSON."""
    if not json_to_stdout(target):
        shown = [k for k in keys if k in result]
        width = max((len(k) for k in shown), default=0)
        for key in shown:
            print(f"{key:>{width}}: {result[key]}")
    write_json(result, target, outputs=outputs)
