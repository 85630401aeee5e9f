"""Every file input goes through one checked reader (eplb.fileio.read_input): FIFOs, devices,
folders and symlinks to them are refused before they are opened, sizes are bounded before and
while reading, and JSON errors name the file.

The command-line cases run ``eplb`` in real subprocesses: a FIFO with no writer would block a
reader that opened it, and /dev/zero would feed one until memory ran out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.fileio import InputFileError, read_input
from eplb.placement.io import load_placement, save_placement
from eplb.placement.model import Placement
from eplb.traces import Trace, TraceFormatError, load_trace, read_openevolve, read_sglang_per_pass

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny", "--steps", "20", "--ep-size", "4", "--nnodes", "1", "--disable-tqdm"]
ERROR_SECONDS = 2.0
"""The bound is one second; the subprocess's own start-up (Python, numpy) is inside it, so the
assertion allows twice that on a loaded machine. What matters is that nothing blocks or reads on."""


@pytest.fixture
def specials(tmp_path: Path) -> dict[str, Path]:
    """Paths that are not regular files: a FIFO with no writer, a device, a folder, symlinks."""
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/dev/zero", tmp_path / "zero.json")
    os.symlink(tmp_path / "fifo", tmp_path / "fifo.safetensors")
    os.symlink("/dev/zero", tmp_path / "zero.safetensors")
    (tmp_path / "folder").mkdir()
    return {
        "device": Path("/dev/zero"),
        "symlink to a device": tmp_path / "zero.json",
        "fifo": tmp_path / "fifo",
        "folder": tmp_path / "folder",
        "symlink to a fifo (.safetensors)": tmp_path / "fifo.safetensors",
        "symlink to a device (.safetensors)": tmp_path / "zero.safetensors",
    }


def _eplb(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "eplb", *argv], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    return done, time.monotonic() - start


@pytest.mark.parametrize("command", ["simulate", "solve"])
def test_init_expert_location_refuses_special_files_in_one_line_at_once(
    command: str, specials: dict[str, Path], tmp_path: Path
) -> None:
    extra = ["--out", str(tmp_path / "plan")] if command == "solve" else []
    for kind, path in specials.items():
        done, seconds = _eplb([command, *TINY, *extra, "--init-expert-location", str(path)], tmp_path)
        assert done.returncode == 2, (kind, done.stderr)
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"eplb {command}: error: "), (
            done.stderr
        )
        assert "not a regular file" in done.stderr and str(path) in done.stderr, done.stderr
        assert seconds < ERROR_SECONDS, (kind, seconds)
    assert not (tmp_path / "plan").exists()


@pytest.mark.timeout(60)
def test_every_reader_refuses_special_files_before_opening_them(specials: dict[str, Path]) -> None:
    """A reader that opened the FIFO would block here (the timeout ends the test)."""
    readers: dict[str, Callable[[Path], object]] = {
        "load_trace": load_trace,
        "Trace.load": Trace.load,
        "read_openevolve": read_openevolve,
        "per_pass": lambda p: read_sglang_per_pass([p, p]),
        "load_placement": load_placement,
        "from_sglang": lambda p: Placement.from_sglang(p, 4),
        "read_input": lambda p: read_input(p, limit=1 << 20),
    }
    for name, reader in readers.items():
        for kind, path in specials.items():
            start = time.monotonic()
            with pytest.raises(InputFileError, match="not a regular file") as caught:
                reader(path)
            assert str(path) in str(caught.value), (name, kind)
            assert time.monotonic() - start < 1.0, (name, kind)
    assert issubclass(InputFileError, ValueError)


def test_sizes_are_bounded_before_and_while_reading(tmp_path: Path) -> None:
    data = tmp_path / "eleven"
    data.write_bytes(b"x" * 11)
    assert read_input(data, limit=11) == b"x" * 11
    with pytest.raises(InputFileError, match="holds 11 bytes, more than the 10"):
        read_input(data, limit=10)
    # A file that says it is empty but is not (as /proc's are, or one growing after the stat) is
    # read only up to the bound plus one byte, then refused.
    status = Path("/proc/self/status")
    assert status.stat().st_size == 0 and len(read_input(status, limit=1 << 20)) > 100
    with pytest.raises(InputFileError, match="grew past the 100 bytes"):
        read_input(status, limit=100)
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_trace(tmp_path / "missing.safetensors")


def test_json_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    digits = "9" * 10**6
    location = tmp_path / "location.json"
    location.write_text('{"physical_to_logical_map": [[' + digits + "]]}")
    with pytest.raises(ValueError, match=r"location\.json: not valid JSON \(Exceeds the limit") as caught:
        Placement.from_sglang(location, 1)
    assert "set_int_max_str_digits" not in str(caught.value)  # advice that is not the user's fix
    capsys.readouterr()
    assert main(["simulate", *TINY, "--init-expert-location", str(location)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(location) in err and "Traceback" not in err
    # A placement the file holds but that does not fit also names it.
    (tmp_path / "bad.json").write_text('{"physical_to_logical_map": [[0, 3]]}')
    with pytest.raises(ValueError, match=r"bad\.json: phy2log names expert 3"):
        Placement.from_sglang(tmp_path / "bad.json", 1)
    history = tmp_path / "load.json"
    history.write_text('{"load_history": [{"logical_expert_load": [[' + digits + "]]}]}")
    with pytest.raises(TraceFormatError, match=r"load\.json: not valid JSON \(Exceeds the limit"):
        load_trace(history)


def test_regular_files_still_read_through_symlinks(tmp_path: Path) -> None:
    placement = Placement.trivial(2, 4, 2, 2)
    save_placement(tmp_path / "p.safetensors", placement)
    os.symlink(tmp_path / "p.safetensors", tmp_path / "link.safetensors")
    assert load_placement(tmp_path / "link.safetensors")[0] == placement
    placement.write_sglang_json(tmp_path / "p.json")
    assert Placement.from_sglang(tmp_path / "p.json", 2).same_slots(placement)
    trace = Trace.from_counts(np.arange(24, dtype=np.int32).reshape(3, 2, 4))
    for name in ("t.safetensors", "t.npz"):
        trace.save(tmp_path / name)
        os.symlink(tmp_path / name, tmp_path / f"link-{name}")
        assert load_trace(tmp_path / f"link-{name}").equals(trace)


def test_num_tokens_must_be_whole() -> None:
    counts = np.ones((2, 1, 2), dtype=np.int32)
    with pytest.raises(ValueError, match=r"num_tokens.*fractional"):
        Trace.from_counts(counts, num_tokens=[1.5, 2])
    with pytest.raises(ValueError, match="num_tokens"):
        Trace.from_counts(counts, num_tokens=[True, False])
    assert Trace.from_counts(counts, num_tokens=[3.0, 2]).num_tokens_F.tolist() == [3, 2]
