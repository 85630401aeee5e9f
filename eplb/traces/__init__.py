"""Load traces: the ``Trace`` type, this project's format, and readers for SGLang and OpenEvolve files.

Every reader treats its file as untrusted (eplb.traces.checks): a bad file is a TraceFormatError
(a ValueError) naming the file, never a crash, an unpickled object or a huge allocation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eplb.fileio import map_input, read_input
from eplb.traces.checks import MAX_TRACE_FILE_BYTES, TraceFormatError
from eplb.traces.openevolve import parse_openevolve, read_openevolve, write_openevolve
from eplb.traces.sglang import parse_sglang_dump, read_sglang_dump, read_sglang_per_pass
from eplb.traces.trace import ProgressFn, Trace

FORMATS = ("auto", "eplb", "sglang", "openevolve")
HEAD_BYTES = 512
"""The first bytes of a file, by which :func:`detect_format` tells its format."""

__all__ = [
    "FORMATS",
    "ProgressFn",
    "Trace",
    "TraceFormatError",
    "load_trace",
    "read_openevolve",
    "read_sglang_dump",
    "read_sglang_per_pass",
    "write_openevolve",
]


def detect_format(data: bytes) -> str:
    """Guess a file's format from its first bytes: JSON, torch zip or pickle (SGLang), npz or safetensors."""
    head = data[:HEAD_BYTES]
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        return "openevolve"
    if head.startswith(b"PK\x03\x04"):
        # torch.save writes a zip whose entries live under "<name>/data.pkl"; np.savez writes "*.npy".
        return "eplb" if b".npy" in head else "sglang"
    if head[8:9] != b"{" and head.startswith(b"\x80"):
        # A bare pickle (torch.save's legacy format), not safetensors (u64 header size, then JSON).
        return "sglang"
    return "eplb"


def load_trace(
    paths: str | Path | Sequence[str | Path], fmt: str = "auto", *, progress: ProgressFn | None = None
) -> Trace:
    """Read a trace from one file, or from several SGLang per_pass files (one per rank).

    Every file is checked by eplb.fileio first: a regular file (symlinks followed) of at most
    ``MAX_TRACE_FILE_BYTES``, so a FIFO, a device or a folder is refused before it is opened. An
    eplb trace is mapped, not read (eplb.traces.trace); the other formats are parsed from the
    whole file in memory, once it is known to fit (eplb.fileio.read_input).
    ``progress(done, total)`` follows the slow readers (OpenEvolve JSON, per_pass records).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; choose from {FORMATS}")
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not path_list:
        raise ValueError("no trace file given")
    if len(path_list) > 1:
        if fmt not in ("auto", "sglang"):
            raise ValueError("several files are only accepted as SGLang per_pass dumps (one per rank)")
        return read_sglang_per_pass(path_list, progress=progress)
    path = path_list[0]
    if fmt == "auto":
        kind = detect_format(read_input(path, limit=MAX_TRACE_FILE_BYTES, what="trace file", head=HEAD_BYTES))
    else:
        kind = fmt
    if kind == "eplb":
        return Trace.from_bytes(map_input(path, limit=MAX_TRACE_FILE_BYTES, what="trace file"), str(path))
    # JSON and torch's unpickler parse bytes in memory.
    data = read_input(path, limit=MAX_TRACE_FILE_BYTES, what="trace file")
    if kind == "openevolve":
        return parse_openevolve(data, str(path), progress=progress)
    return parse_sglang_dump(data, str(path))
