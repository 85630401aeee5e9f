"""Load traces: the ``Trace`` type, this project's format, and readers for SGLang and OpenEvolve files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eplb.traces.openevolve import read_openevolve, write_openevolve
from eplb.traces.sglang import read_sglang_dump, read_sglang_per_pass
from eplb.traces.trace import Trace, TraceFormatError

FORMATS = ("auto", "eplb", "sglang", "openevolve")

__all__ = [
    "FORMATS",
    "Trace",
    "TraceFormatError",
    "load_trace",
    "read_openevolve",
    "read_sglang_dump",
    "read_sglang_per_pass",
    "write_openevolve",
]


def detect_format(path: Path) -> str:
    """Guess a file's format from its first bytes: JSON, torch zip (SGLang), npz zip or safetensors."""
    with path.open("rb") as f:
        head = f.read(512)
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        return "openevolve"
    if head.startswith(b"PK\x03\x04"):
        # torch.save writes a zip whose entries live under "<name>/data.pkl"; np.savez writes "*.npy".
        return "eplb" if b".npy" in head else "sglang"
    return "eplb"


def load_trace(paths: str | Path | Sequence[str | Path], fmt: str = "auto") -> Trace:
    """Read a trace from one file, or from several SGLang per_pass files (one per rank)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; choose from {FORMATS}")
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not path_list:
        raise ValueError("no trace file given")
    for p in path_list:
        if not p.is_file():
            raise FileNotFoundError(f"trace file not found: {p}")
    kind = detect_format(path_list[0]) if fmt == "auto" else fmt
    if len(path_list) > 1:
        if kind != "sglang":
            raise ValueError("several files are only accepted as SGLang per_pass dumps (one per rank)")
        return read_sglang_per_pass(path_list)
    path = path_list[0]
    if kind == "openevolve":
        return read_openevolve(path)
    if kind == "sglang":
        return read_sglang_dump(path)
    return Trace.load(path)
