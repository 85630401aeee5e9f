"""OpenEvolve / ADRS EPLB traces: ``{"load_history": [{"logical_expert_load": [L][E]}, ...]}``.

Shape legend: F steps, L layers, E logical experts.

One entry per step. Their evaluation plans on window i and scores on window i+1; so does ours.
The reader decodes one entry at a time, so memory stays close to the file's size and progress
can be reported; every count must be a JSON number with a whole value (``"1"``, ``true`` and
``0.7`` are refused, not coerced), and nesting too deep for the decoder is a format error. The
writer streams entries into an atomic file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from eplb.fileio import OutputSet, atomic_path, json_error_text, read_input
from eplb.traces.checks import MAX_TRACE_FILE_BYTES, TraceFormatError, check_dims, count_array
from eplb.traces.trace import ProgressFn, Trace

_SPACE = re.compile(r"[ \t\n\r]*")


def read_openevolve(path: str | Path, *, progress: ProgressFn | None = None) -> Trace:
    """Read an OpenEvolve ``expert-load.json`` (``progress`` in characters decoded)."""
    data = read_input(path, limit=MAX_TRACE_FILE_BYTES, what="trace file")
    return parse_openevolve(data, str(path), progress=progress)


def parse_openevolve(data: bytes, path: str, *, progress: ProgressFn | None = None) -> Trace:
    """An OpenEvolve trace from a file's bytes (``path`` names it in errors)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: not valid JSON ({exc})") from None
    rows: list[np.ndarray] = []
    try:
        for i, (entry, end) in enumerate(_history_entries(text, path)):
            rows.append(_entry_counts(entry, f"{path}: load_history[{i}]", rows[0].shape if rows else None))
            if progress is not None:
                progress(end, len(text))
    except TraceFormatError:
        raise
    except ValueError as exc:  # JSONDecodeError, or an integer past Python's digit limit
        raise TraceFormatError(f"{path}: not valid JSON ({json_error_text(exc)})") from None
    except RecursionError:
        raise TraceFormatError(f"{path}: JSON nested too deeply to be a load trace") from None
    if not rows:
        raise TraceFormatError(f"{path}: load_history is empty")
    if progress is not None:
        progress(len(text), len(text))
    try:
        return Trace.from_counts(np.stack(rows), meta={"source": "openevolve"})
    except ValueError as exc:
        raise TraceFormatError(f"{path}: {exc}") from None


def write_openevolve(
    trace: Trace, path: str | Path, *, outputs: OutputSet | None = None, progress: ProgressFn | None = None
) -> Path:
    """Write a trace as OpenEvolve JSON (counts only; per-step metadata is not part of that format).

    The file is atomic; with ``outputs`` it is staged there and appears when that set commits.
    """
    path = Path(path)
    with atomic_path(path, outputs=outputs) as tmp, tmp.open("w") as f:
        f.write('{"load_history":[')
        for t, step_LE in enumerate(trace.counts_FLE):
            f.write(',{"logical_expert_load":' if t else '{"logical_expert_load":')
            f.write(json.dumps(step_LE.tolist(), separators=(",", ":")))
            f.write("}")
            if progress is not None:
                progress(t + 1, trace.num_steps)
        f.write("]}")
    return path


def _entry_counts(entry: Any, where: str, shape: tuple[int, ...] | None) -> np.ndarray:
    """int32 [L, E] counts of one ``load_history`` entry, type-checked value by value."""
    if not isinstance(entry, dict) or "logical_expert_load" not in entry:
        raise TraceFormatError(f"{where} has no 'logical_expert_load'")
    table = entry["logical_expert_load"]
    if not isinstance(table, list) or not all(isinstance(row, list) for row in table):
        raise TraceFormatError(f"{where}: logical_expert_load must be an [L][E] list of lists")
    kinds: set[type] = set()
    for row in table:
        kinds.update(map(type, row))
    foreign = kinds - {int, float}
    if foreign:
        names = ", ".join(sorted(k.__name__ for k in foreign))
        raise TraceFormatError(f"{where}: holds {names} values; counts must be JSON numbers")
    try:
        arr = np.array(table, dtype=np.float64 if float in kinds else np.int64)
    except OverflowError:
        raise TraceFormatError(f"{where}: holds a number too large for a count") from None
    except ValueError as exc:
        raise TraceFormatError(f"{where} is not a numeric [L][E] table ({exc})") from None
    if arr.ndim != 2:
        raise TraceFormatError(f"{where}: logical_expert_load must be [L][E], got shape {list(arr.shape)}")
    check_dims(arr.shape[0], arr.shape[1], where)
    if shape is not None and arr.shape != shape:
        raise TraceFormatError(
            f"{where}: shape {list(arr.shape)} differs from the first entry's {list(shape)}"
        )
    return count_array(arr, where)


def _history_entries(text: str, where: str) -> Iterator[tuple[Any, int]]:
    """Each entry of the top-level object's ``load_history`` list, and the offset after it.

    Values are decoded one at a time; the object's other keys are decoded and dropped. Raises
    JSONDecodeError for text that ``json.loads`` would refuse.
    """
    decoder = json.JSONDecoder()

    def skip(pos: int) -> int:
        match = _SPACE.match(text, pos)
        assert match is not None  # the pattern matches the empty string
        return match.end()

    def expect(pos: int, chars: str, what: str) -> str:
        if pos >= len(text) or text[pos] not in chars:
            raise json.JSONDecodeError(f"Expecting {what}", text, pos)
        return text[pos]

    pos = skip(0)
    expect(pos, "{", "an object")
    pos = skip(pos + 1)
    found = False
    if text.startswith("}", pos):
        pos += 1
    else:
        while True:
            expect(pos, '"', "property name enclosed in double quotes")
            key, pos = decoder.raw_decode(text, pos)
            pos = skip(pos)
            expect(pos, ":", "':' delimiter")
            pos = skip(pos + 1)
            if key == "load_history":
                if found:
                    raise TraceFormatError(f"{where}: 'load_history' appears twice")
                found = True
                if not text.startswith("[", pos):
                    raise TraceFormatError(f"{where}: 'load_history' is not a list")
                pos = skip(pos + 1)
                if text.startswith("]", pos):
                    pos += 1
                else:
                    while True:
                        entry, pos = decoder.raw_decode(text, pos)
                        yield entry, pos
                        pos = skip(pos)
                        if expect(pos, ",]", "',' delimiter") == "]":
                            pos += 1
                            break
                        pos = skip(pos + 1)
            else:
                _, pos = decoder.raw_decode(text, pos)
            pos = skip(pos)
            if expect(pos, ",}", "',' delimiter") == "}":
                pos += 1
                break
            pos = skip(pos + 1)
    if skip(pos) != len(text):
        raise json.JSONDecodeError("Extra data", text, skip(pos))
    if not found:
        raise TraceFormatError(f"{where}: no 'load_history' list")
