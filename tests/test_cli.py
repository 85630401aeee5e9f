"""The eplb command: help, workload -> trace info -> convert, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.traces import load_trace


def test_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "workload" in out and "trace" in out


def test_console_script_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "eplb", "--version"], capture_output=True, text=True, check=True
    )
    assert done.stdout.startswith("eplb ")


def test_workload_then_trace_info_and_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.safetensors"
    assert (
        main(
            [
                "workload",
                "--preset",
                "tiny",
                "--steps",
                "40",
                "--ep-size",
                "4",
                "--seed",
                "5",
                "--out",
                str(out),
                "--json",
                str(tmp_path / "w.json"),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "w.json").read_text())
    assert result["steps"] == 40 and result["unbalanced_max_over_mean"] > 1.0
    capsys.readouterr()
    assert main(["trace", "info", str(out), "--json", "-"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layers"] == 4 and info["experts"] == 16
    assert main(["trace", "convert", str(out), "--to", "openevolve", "--out", str(tmp_path / "o.json")]) == 0
    assert np.array_equal(load_trace(tmp_path / "o.json").counts_TLE, load_trace(out).counts_TLE)


def test_bad_input_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04junk")
    assert main(["trace", "info", str(tmp_path / "bad.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb trace: error:") and "Traceback" not in err
    assert main(["trace", "info", str(tmp_path / "nope.pt")]) == 2
    assert main(["workload", "--preset", "tiny", "--ep-size", "3", "--steps", "2"]) == 2
