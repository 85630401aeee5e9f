"""Helpers shared by subcommands: progress bars, optional extras, JSON output, signals (their
shared flags, ``--seed``, ``--disable-tqdm``, ``--json`` among them, are eplb.commands.flags').

Every file a command writes goes through eplb.fileio (atomic, regular files only); commands that
write several files stage them in one ``OutputSet`` so a failure leaves none of them. A command
that must clean up when stopped runs under :func:`run_until_signalled`: SIGTERM then unwinds it as
Ctrl-C does, and it ends with one line and exit status 143 (Ctrl-C: 130).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from eplb.fileio import OutputSet, check_output_path, write_text

T = TypeVar("T")

INTERRUPTED_EXIT = 130
"""Exit status after Ctrl-C (SIGINT): 128 + 2, as a shell reports it."""
TERMINATED_EXIT = 143
"""Exit status after SIGTERM: 128 + 15."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so ``finally`` blocks
    and ``with`` exits (staged outputs discarded, rank processes ended) run before the command
    ends; SIGTERM's default action ends the process at once, leaving all of that undone."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` in the main thread (only the main
    thread may set a handler; elsewhere nothing changes). The previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_until_signalled(command: str, body: Callable[[], int], *, hard_exit: bool = False) -> int:
    """``body()``, with SIGTERM unwinding it (:func:`sigterm_raises`): then one line on stderr and
    :data:`TERMINATED_EXIT`. Ctrl-C's KeyboardInterrupt goes on to eplb.cli (one line, 130).

    ``hard_exit``: after either signal, print the line and end the process with ``os._exit``
    (130 or 143) instead of returning: for a command whose threads may still be inside native
    code (a rank's collective) that interpreter shutdown could abort in C++.
    """
    try:
        with sigterm_raises():
            return body()
    except Terminated:
        code, word = TERMINATED_EXIT, "terminated"
    except KeyboardInterrupt:
        if not hard_exit:
            raise
        code, word = INTERRUPTED_EXIT, "interrupted"
    print(f"eplb {command}: {word}", file=sys.stderr, flush=True)
    if hard_exit:
        # What interpreter shutdown would release and os._exit skips: multiprocessing's named
        # semaphores (its resource tracker would warn of each leaked one, on our stderr).
        mp_util = sys.modules.get("multiprocessing.util")
        with suppress(Exception):
            mp_util._run_finalizers(0)  # type: ignore[union-attr]
        sys.stdout.flush()
        os._exit(code)
    return code


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (``eplb demo: error: ...``) and exit
    status 2, as every other error in what the user gave; argparse's own error prints the whole
    usage first, twenty lines for a subcommand with many flags. Subparsers take this class too.
    A value's error names the flag as every other check does: ``--steps: expected ...``."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split()).removeprefix("argument ")
        print(f"{self.prog}: error: {text}", file=sys.stderr)
        sys.exit(2)


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
