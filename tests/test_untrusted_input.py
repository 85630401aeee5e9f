"""Hostile and broken input: size bombs under a memory cap, no silent coercion, one-line CLI errors,
no partial output files.

Every bomb here would allocate more than the capped subprocess can (a control allocation shows the
cap bites); each must be refused with a clear error in well under a second.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb.cli import main
from eplb.fileio import OutputPathError, OutputSet, write_text
from eplb.placement.io import save_placement
from eplb.placement.model import Placement
from eplb.traces import Trace, TraceFormatError, load_trace, write_openevolve
from eplb.traces import trace as trace_module

CAP = 1 << 30
"""Address space the bomb subprocess may add to what its imports mapped: 1 GiB."""
BOMB_BYTES = 3 << 29
"""What each bomb declares: 1.5 GiB, more than the cap leaves."""
ROOT = Path(__file__).resolve().parents[1]


# ---- building bombs --------------------------------------------------------------------------
def _deflated_zeros(prefix: bytes, zeros: int) -> tuple[bytes, int, int]:
    """Raw deflate of ``prefix`` + ``zeros`` zero bytes, its CRC-32 and size, built fast from one
    repeated full-flush block (each block is self-contained, so repeats decode to repeats)."""
    chunk = 1 << 24
    assert zeros % chunk == 0
    head = zlib.compressobj(9, zlib.DEFLATED, -15)
    parts = [head.compress(prefix) + head.flush(zlib.Z_FULL_FLUSH)]
    body = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = body.compress(bytes(chunk)) + body.flush(zlib.Z_FULL_FLUSH)
    parts += [block] * (zeros // chunk)
    parts.append(zlib.compressobj(9, zlib.DEFLATED, -15).flush())
    crc, zero = zlib.crc32(prefix), bytes(chunk)
    for _ in range(zeros // chunk):
        crc = zlib.crc32(zero, crc)
    return b"".join(parts), crc, len(prefix) + zeros


def _write_zip(path: Path, members: list[tuple[str, bytes, int, int, int]]) -> Path:
    """A zip of (name, payload, method, crc, uncompressed size) members, payloads as given."""
    out, central = bytearray(), bytearray()
    for name, payload, method, crc, size in members:
        encoded, offset = name.encode(), len(out)
        out += struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), size, len(encoded), 0
        )
        out += encoded + payload
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(payload), size, len(encoded), 0, 0, 0, 0, 0, offset,
        )  # fmt: skip
        central += encoded
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(out), 0)
    path.write_bytes(bytes(out + central + end))
    return path


def _stored(name: str, data: bytes) -> tuple[str, bytes, int, int, int]:
    return name, data, zipfile.ZIP_STORED, zlib.crc32(data), len(data)


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _npz_bomb(path: Path, *, lie: bool) -> Path:
    """An eplb npz trace whose counts declare BOMB_BYTES: deflated zeros, or (``lie``) 64 bytes."""
    T = BOMB_BYTES // (64 * 256 * 4)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<i4", "fortran_order": False, "shape": (T, 64, 256)}
    )
    if lie:
        counts = _stored("counts.npy", header.getvalue() + bytes(64))
    else:
        counts = ("counts.npy", *_deflated_zeros(header.getvalue(), BOMB_BYTES))
        counts = (counts[0], counts[1], zipfile.ZIP_DEFLATED, counts[2], counts[3])
    small = {
        "format": np.array("eplb-trace"),
        "version": np.array("1"),
        "meta": np.array("{}"),
        "is_prefill": np.zeros(T, np.uint8),
        "num_tokens": np.zeros(T, np.int64),
    }
    return _write_zip(path, [counts, *(_stored(f"{k}.npy", _npy(v)) for k, v in small.items())])


def _npz_deflated(path: Path, key: str, descr: str, shape: tuple[int, ...]) -> Path:
    """An eplb npz trace whose member ``key`` is deflated zeros of ``descr`` and ``shape`` (a
    multiple of 16 MiB, within the zip-bomb check's free expansion: a few kB of file), its other
    members as eplb writes them (counts [F, 2, 4] zeros, F from a counts ``shape`` or 4)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": shape})
    payload, crc, size = _deflated_zeros(header.getvalue(), math.prod(shape) * np.dtype(descr).itemsize)
    F = shape[0] if key == "counts" else 4
    members = {
        "format": np.array("eplb-trace"),
        "version": np.array("1"),
        "meta": np.array("{}"),
        "counts": np.zeros((F, 2, 4), np.int32),
        "is_prefill": np.zeros(F, np.uint8),
        "num_tokens": np.zeros(F, np.int64),
    }
    del members[key]
    deflated = (f"{key}.npy", payload, zipfile.ZIP_DEFLATED, crc, size)
    return _write_zip(path, [deflated, *(_stored(f"{k}.npy", _npy(v)) for k, v in members.items())])


def _torch_bomb(path: Path) -> Path:
    """A torch.save dump whose logical_count storage is a deflated record of BOMB_BYTES zeros."""
    seed_numel, numel = 70001, BOMB_BYTES // 4
    buf = io.BytesIO()
    torch.save({"rank": 0, "logical_count": torch.zeros(seed_numel, dtype=torch.int32)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    members = []
    for name in src.namelist():
        data = src.read(name)
        if name.endswith("data.pkl"):
            data = data.replace(b"J" + struct.pack("<i", seed_numel), b"J" + struct.pack("<i", numel))
            members.append(_stored(name, data))
        elif name.endswith("data/0"):
            payload, crc, size = _deflated_zeros(b"", BOMB_BYTES)
            members.append((name, payload, zipfile.ZIP_DEFLATED, crc, size))
        else:
            members.append(_stored(name, data))
    return _write_zip(path, members)


def _per_pass(path: Path, p2l: list[list[int]], records: list[dict[str, object]]) -> Path:
    torch.save({"records": records, "last_physical_to_logical_map": torch.tensor(p2l)}, path)
    return path


def _record(counts: object, pass_id: object = 0, rank: object = 0) -> dict[str, object]:
    return {"forward_pass_id": pass_id, "rank": rank, "global_physical_count": counts}


_BOMB_SCRIPT = """
import json, resource, sys, time
import numpy as np
import safetensors.numpy
import torch
from eplb.placement.model import Placement
from eplb.traces import load_trace

# The cap counts from what the interpreter already maps (a CUDA build of torch maps several GiB of
# libraries), so it bounds what reading the files may allocate, on any torch build.
with open("/proc/self/status") as status:
    mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + {cap}, mapped + {cap}))

def control():
    np.ones({bomb}, dtype=np.uint8)

out = {{}}
for arg in ["control", *sys.argv[1:]]:
    start = time.perf_counter()
    try:
        if arg == "control":
            control()
        elif arg.endswith(".json"):
            Placement.from_sglang(arg, 1)
        else:
            load_trace(arg)
        outcome = "accepted"
    except MemoryError:
        outcome = "MemoryError"
    except ValueError as exc:
        outcome = f"{{type(exc).__name__}}: {{exc}}"
    out[arg] = [outcome, time.perf_counter() - start]
print(json.dumps(out))
"""


def test_size_bombs_are_refused_under_a_memory_cap_in_seconds(tmp_path: Path) -> None:
    shared = torch.arange(4 * 4096, dtype=torch.int32).reshape(4, 4096) % 7
    bombs = {
        # One id of 2**26 (or 2**31 - 1) in a 4-slot map: E would be 67 million (or 2 billion).
        _per_pass(tmp_path / "big_id.pt", [[0, 1, 2, 2**26]], [_record(torch.ones(1, 4, dtype=torch.int32))]): "ids outside",
        _per_pass(tmp_path / "max_id.pt", [[0, 2**31 - 1]], [_record(torch.ones(1, 2, dtype=torch.int32))]): "ids outside",
        # A 40-byte placement JSON naming expert 3e8.
        tmp_path / "loc.json": "slots per layer",
        _npz_bomb(tmp_path / "zipbomb.npz", lie=False): "zip bomb",
        _npz_bomb(tmp_path / "lying.npz", lie=True): "declares shape",
        _torch_bomb(tmp_path / "zipbomb.pt"): "compressed",
        # A stride-0 tensor: 8 bytes of storage claiming BOMB_BYTES.
        tmp_path / "expanded.pt": "declare",
        # 30,000 records sharing one 64 KiB tensor.
        _per_pass(tmp_path / "shared.pt", (torch.arange(4 * 4096).reshape(4, 4096) % 4096).tolist(), [_record(shared, i) for i in range(30_000)]): "declare",
        tmp_path / "lying.safetensors": "not a readable",
    }  # fmt: skip
    (tmp_path / "loc.json").write_text('{"physical_to_logical_map":[[300000000]]}')
    expanded = torch.zeros(1, dtype=torch.int32).expand(BOMB_BYTES // (4 * 64 * 256), 64, 256)
    torch.save({"rank": 0, "logical_count": expanded}, tmp_path / "expanded.pt")
    header = json.dumps(
        {"counts": {"dtype": "I32", "shape": [BOMB_BYTES // 4, 1, 1], "data_offsets": [0, BOMB_BYTES]}}
    )
    (tmp_path / "lying.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(64))
    assert all(p.stat().st_size < 4 << 20 for p in bombs)
    done = subprocess.run(
        [sys.executable, "-c", _BOMB_SCRIPT.format(cap=CAP, bomb=BOMB_BYTES), *map(str, bombs)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results.pop("control")[0] == "MemoryError"  # the cap bites: a bomb that allocated would fail
    for path, needle in bombs.items():
        outcome, seconds = results[str(path)]
        expected = "ValueError" if path.suffix == ".json" else "TraceFormatError"
        assert outcome.startswith(expected) and needle in outcome, (path.name, outcome)
        assert seconds < 5, (path.name, seconds)


META_BOMB = 48 << 20
"""What the npz bombs below inflate to: within the zip-bomb check's free expansion (64 MiB)."""


def test_npz_members_are_bounded_by_their_npy_headers_before_any_is_inflated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An npz trace's members are sized from their npy headers (eplb.traces.checks.npy_header)
    and refused past MAX_NPZ_HEADER_BYTES each (format, version, metadata) or MAX_NPZ_ARRAY_BYTES
    together (the arrays) before np.load inflates any: a few kB of deflated zeros claim 48 MiB
    here, and every limit's refusal is one line with exit 2."""
    meta = _npz_deflated(tmp_path / "meta.npz", "meta", f"<U{META_BOMB // 4}", ())
    counts = _npz_deflated(tmp_path / "counts.npz", "counts", "<i4", (META_BOMB // (64 * 256 * 4), 64, 256))
    assert meta.stat().st_size < 64 << 10 and counts.stat().st_size < 64 << 10

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("np.load was called before the members' sizes were checked")

    monkeypatch.setattr(trace_module, "MAX_NPZ_ARRAY_BYTES", META_BOMB - 1)
    with monkeypatch.context() as patched:
        patched.setattr(np, "load", no_load)
        for path, needle in (
            (meta, f"header member 'meta' would inflate to {META_BOMB} bytes; refusing more than 1048576"),
            (counts, f"the arrays would inflate to {META_BOMB + 768 * 9} bytes; refusing more than"),
        ):
            start = time.perf_counter()
            with pytest.raises(TraceFormatError, match=re.escape(needle)):
                load_trace(path)
            assert time.perf_counter() - start < 1.0
            assert needle in _one_line_error(capsys, ["trace", "info", str(path)])
    # The limit is what refused: a trace of 48 MiB inflates when the limit allows it, and an npz
    # trace reads back as its safetensors form does.
    monkeypatch.setattr(trace_module, "MAX_NPZ_ARRAY_BYTES", META_BOMB * 2)
    assert load_trace(counts).counts_FLE.shape == (768, 64, 256)
    rng = np.random.default_rng(3)
    trace = Trace.from_counts(
        rng.integers(0, 99, (50, 3, 8)), is_prefill=np.arange(50) % 4 == 0, meta={"k": 2}
    )
    npz, st = load_trace(trace.save(tmp_path / "t.npz")), load_trace(trace.save(tmp_path / "t.safetensors"))
    assert npz.equals(trace) and npz.equals(st) and npz.counts_FLE.dtype == st.counts_FLE.dtype


def test_sane_limits_on_dimensions(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    wide = {"counts": np.zeros((1, 1, 1 << 17), np.int32), "is_prefill": np.zeros(1, np.uint8)}
    wide["num_tokens"] = np.zeros(1, np.int64)
    save_file(wide, str(tmp_path / "wide.safetensors"), metadata={"format": "eplb-trace", "version": "1"})
    with pytest.raises(TraceFormatError, match="131072 experts per layer"):
        load_trace(tmp_path / "wide.safetensors")
    with pytest.raises(ValueError, match="experts per layer"):
        Trace.from_counts(np.zeros((2, 3, 0)))
    with pytest.raises(ValueError, match="layers"):
        Trace.from_counts(np.zeros((2, 0, 4)))


# ---- silent coercion -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ("[[0.7, 2]]", "fractional"),
        ('[["1", 2]]', "str values"),
        ("[[true, 2]]", "bool values"),
        ("[[null, 2]]", "NoneType values"),
        ("[[]]", "0 experts"),
        ("[]", r"must be \[L\]\[E\]"),
        ("[[1, 2], [3]]", "not a numeric"),
    ],
)
def test_openevolve_values_are_refused_not_coerced(tmp_path: Path, table: str, needle: str) -> None:
    path = tmp_path / "load.json"
    path.write_text(f'{{"load_history": [{{"logical_expert_load": {table}}}]}}')
    with pytest.raises(TraceFormatError, match=needle):
        load_trace(path)


def test_openevolve_whole_floats_and_other_keys_are_read(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    path.write_text(
        '{"model": {"name": "x"}, "load_history": [{"logical_expert_load": [[1.0, 2], [0, 3]], "t": 1}]}'
    )
    assert load_trace(path).counts_FLE.tolist() == [[[1, 2], [0, 3]]]
    path.write_text('{"load_history": [{"logical_expert_load": [[1]]}], "load_history": []}')
    with pytest.raises(TraceFormatError, match="twice"):
        load_trace(path)


@pytest.mark.parametrize(
    ("counts", "needle"),
    [
        (torch.tensor([[0.7, 1.0, 1.0, 1.0]]), "fractional"),
        (torch.tensor([[True, False, True, True]]), "booleans"),
        (torch.tensor([[1, -1, 1, 1]]), r"\[0, 2\*\*31\)"),
        (torch.tensor([[float("nan"), 1, 1, 1]]), "NaN"),
        ([[1, 1, 1, 1]], "must be a tensor"),
        (torch.ones(1, 4, dtype=torch.bfloat16), "cannot be read"),
    ],
)
def test_per_pass_counts_are_refused_not_coerced(tmp_path: Path, counts: object, needle: str) -> None:
    path = _per_pass(tmp_path / "d.pt", [[0, 1, 2, 0]], [_record(counts)])
    with pytest.raises(TraceFormatError, match=needle):
        load_trace(path)


def test_stat_dump_with_no_experts_and_own_format_with_bad_flags_are_refused(tmp_path: Path) -> None:
    torch.save({"rank": 0, "logical_count": torch.zeros(3, 2, 0, dtype=torch.int32)}, tmp_path / "e0.pt")
    with pytest.raises(TraceFormatError, match="0 experts"):
        load_trace(tmp_path / "e0.pt")
    trace = Trace.from_counts(np.ones((2, 1, 2), np.int32))
    path = trace.save(tmp_path / "t.npz")
    data = dict(np.load(path))
    data["is_prefill"] = np.array([7, 1], np.uint8)
    np.savez(path, **data)
    with pytest.raises(TraceFormatError, match="0 or 1"):
        load_trace(path)


# ---- one line on stderr, exit 2 ---------------------------------------------------------------
def _workload_argv(out: Path) -> list[str]:
    return ["workload", "--preset", "tiny", "--steps", "5", "--disable-tqdm", "--out", str(out)]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"eplb {argv[0]}: error: ") and "Traceback" not in err, err
    return err


def test_hostile_inputs_end_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"load_history": [' + "[" * 100_000 + "]" * 100_000 + "]}")
    assert "nested too deeply" in _one_line_error(capsys, ["trace", "info", str(deep)])
    digits = tmp_path / "digits.json"
    digits.write_text('{"load_history": [{"logical_expert_load": [[' + "9" * 400 + "]]}]}")
    assert "too large" in _one_line_error(capsys, ["trace", "info", str(digits)])
    ones = torch.ones(1, 4, dtype=torch.int32)
    cases = {
        "rank": _record(ones, rank=torch.zeros(3)),
        "forward_pass_id": _record(ones, pass_id=torch.arange(2)),
        "digits": _record(ones, pass_id=10**400),
        "bool": _record(ones, pass_id=True),
    }
    for name, rec in cases.items():
        path = _per_pass(tmp_path / f"{name}.pt", [[0, 1, 2, 0]], [rec])
        err = _one_line_error(capsys, ["trace", "info", str(path)])
        assert "rank" in err or "forward_pass_id" in err
    (tmp_path / "legacy.pt").write_bytes(b"\x80\x02}q\x00.")
    assert "not a torch.save zip" in _one_line_error(capsys, ["trace", "info", str(tmp_path / "legacy.pt")])


def test_bad_output_paths_end_in_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = Trace.from_counts(np.ones((3, 2, 4), np.int32)).save(tmp_path / "src.safetensors")
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("keep")
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "file", tmp_path / "link")
    convert = ["trace", "convert", str(src), "--out"]
    assert "is a folder" in _one_line_error(capsys, [*convert, str(tmp_path / "folder")])
    assert "is not a folder" in _one_line_error(capsys, [*convert, str(tmp_path / "file" / "x.npz")])
    assert "not a regular file" in _one_line_error(capsys, [*convert, str(tmp_path / "fifo")])
    assert "symlink" in _one_line_error(capsys, [*convert, str(tmp_path / "link")])
    json_dir = ["--json", str(tmp_path / "folder")]
    assert "is a folder" in _one_line_error(capsys, [*convert, str(tmp_path / "out.npz"), *json_dir])
    workload = _workload_argv(tmp_path / "w.npz")
    assert "is a folder" in _one_line_error(capsys, [*workload, *json_dir])
    assert os.path.islink(tmp_path / "link") and stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert (tmp_path / "file").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file", "folder", "link", "src.safetensors"]
    assert list((tmp_path / "folder").iterdir()) == []
    # A missing folder is created for the CLI; the library refuses it.
    assert main([*convert, str(tmp_path / "new" / "sub" / "t.npz")]) == 0
    with pytest.raises(OutputPathError, match="does not exist"):
        load_trace(src).save(tmp_path / "missing" / "t.npz")


def test_long_commands_refuse_bad_outputs_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """simulate, sweep (both kinds) and demo check --json and --plots before they run anything."""
    import eplb.commands.demo
    import eplb.simulate
    import eplb.simulate.sweep
    import eplb.simulate.tradeoff

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the run started before its outputs were checked")

    for target, name in [
        (eplb.simulate, "simulate"),
        (eplb.simulate.sweep, "sweep"),
        (eplb.simulate.tradeoff, "tradeoff"),
        (eplb.commands.demo, "run_demo"),
    ]:
        monkeypatch.setattr(target, name, never)
    (tmp_path / "file").write_text("keep")
    under_file = str(tmp_path / "file" / "out.json")
    tiny = ["--preset", "tiny", "--steps", "40", "--disable-tqdm"]
    commands = [
        ["simulate", *tiny],
        ["sweep", *tiny, "--intervals", "10"],
        ["sweep", "--tradeoff", *tiny],
        ["demo", "--nproc", "1", "--steps", "5"],
    ]
    for argv in commands:
        assert "is not a folder" in _one_line_error(capsys, [*argv, "--json", under_file])
    for argv in commands[0], commands[2]:
        assert "is not a folder" in _one_line_error(capsys, [*argv, "--plots", str(tmp_path / "file")])
    assert (tmp_path / "file").read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == [
        "file"
    ]


def test_ctrl_c_ends_in_one_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(np.lib.format, "write_array", _fail_midway(KeyboardInterrupt(), path_arg=False))
    argv = _workload_argv(tmp_path / "t.npz")
    assert main([*argv, "--json", str(tmp_path / "t.json")]) == 130
    assert capsys.readouterr().err == "eplb workload: interrupted\n"
    assert list(tmp_path.iterdir()) == []


# ---- partial outputs -------------------------------------------------------------------------
def _fail_midway(exc: BaseException, *, path_arg: bool):  # type: ignore[no-untyped-def]
    """A stand-in writer that writes part of its output, then raises ``exc``: ``write_array(fp, ...)``
    or (``path_arg``) ``save_file(tensors, path, ...)``."""

    def write(first: object, second: object = None, *args: object, **kwargs: object) -> None:
        if path_arg:
            Path(str(second)).write_bytes(b"x" * 1000)
        else:
            first.write(b"x" * 1000)  # type: ignore[attr-defined]
        raise exc

    return write


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
@pytest.mark.parametrize("what", ["npz", "safetensors", "openevolve", "placement"])
def test_failed_or_interrupted_writes_leave_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, exc: BaseException
) -> None:
    import safetensors.numpy

    trace = Trace.from_counts(np.arange(24, dtype=np.int32).reshape(3, 2, 4))
    placement = Placement.trivial(2, 4, 2, 2)
    old = tmp_path / f"out.{what}"
    old.write_bytes(b"previous content")
    if what == "npz":
        monkeypatch.setattr(np.lib.format, "write_array", _fail_midway(exc, path_arg=False))
        target, write = tmp_path / "t.npz", lambda p: trace.save(p)
    elif what == "openevolve":
        calls = iter(range(10))
        real = json.dumps
        monkeypatch.setattr(json, "dumps", lambda *a, **k: real(*a, **k) if next(calls) < 2 else _raise(exc))
        target, write = tmp_path / "t.json", lambda p: write_openevolve(trace, p)
    else:
        monkeypatch.setattr(safetensors.numpy, "save_file", _fail_midway(exc, path_arg=True))
        if what == "safetensors":
            target, write = tmp_path / "t.safetensors", lambda p: trace.save(p)
        else:
            target, write = tmp_path / "p.safetensors", lambda p: save_placement(p, placement)
    for path in (target, old):
        with pytest.raises(type(exc)):
            write(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]
    assert old.read_bytes() == b"previous content"


def _raise(exc: BaseException) -> str:
    raise exc


def test_output_set_commits_all_or_nothing_and_keeps_permissions(tmp_path: Path) -> None:
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    kept.chmod(0o600)
    with pytest.raises(RuntimeError), OutputSet() as outputs:
        write_text(kept, "new", outputs=outputs)
        write_text(tmp_path / "a.json", "a", outputs=outputs)
        raise RuntimeError("the second step failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"] and kept.read_text() == "old"
    with OutputSet() as outputs:
        write_text(kept, "new", outputs=outputs)
        write_text(tmp_path / "a.json", "a", outputs=outputs)
        assert not (tmp_path / "a.json").exists()  # staged, not yet there
    assert kept.read_text() == "new" and stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    with pytest.raises(OutputPathError, match="twice"), OutputSet() as outputs:
        write_text(kept, "1", outputs=outputs)
        write_text(kept, "2", outputs=outputs)
    assert kept.read_text() == "new"
