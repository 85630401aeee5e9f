"""Load traces: the ``Trace`` type, this project's format, and readers for SGLang and OpenEvolve files.

Every reader treats its file as untrusted (eplb.traces.checks): a bad file is a TraceFormatError
(a ValueError) naming the file, never a crash, an unpickled object or a huge allocation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eplb.traces.checks import TraceFormatError
from eplb.traces.openevolve import read_openevolve, write_openevolve
from eplb.traces.sglang import read_sglang_dump, read_sglang_per_pass
from eplb.traces.trace import ProgressFn, Trace

FORMATS = ("auto", "eplb", "sglang", "openevolve")

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


def detect_format(path: Path) -> str:
    """Guess a file's format from its first bytes: JSON, torch zip or pickle (SGLang), npz or safetensors."""
    with path.open("rb") as f:
        head = f.read(512)
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

    ``progress(done, total)`` follows the slow readers (OpenEvolve JSON, per_pass records).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; choose from {FORMATS}")
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not path_list:
        raise ValueError("no trace file given")
    for p in path_list:
        if not p.exists():
            raise FileNotFoundError(f"trace file not found: {p}")
        if not p.is_file():
            raise ValueError(f"{p} is not a regular file")
    kind = detect_format(path_list[0]) if fmt == "auto" else fmt
    if len(path_list) > 1:
        if kind != "sglang":
            raise ValueError("several files are only accepted as SGLang per_pass dumps (one per rank)")
        return read_sglang_per_pass(path_list, progress=progress)
    path = path_list[0]
    if kind == "openevolve":
        return read_openevolve(path, progress=progress)
    if kind == "sglang":
        return read_sglang_dump(path)
    return Trace.load(path)
