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


def test_solve_writes_and_prints_every_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from eplb.placement.io import load_placement

    out = tmp_path / "plan"
    args = ["solve", "--preset", "tiny", "--steps", "60", "--ep-size", "4", "--nnodes", "2"]
    assert (
        main([*args, "--ep-num-redundant-experts", "4", "--trtllm-layer-offset", "3", "--out", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    placement, _ = load_placement(out / "placement.safetensors")
    balancer = yaml.safe_load((out / "trtllm_load_balancer.yaml").read_text())
    assert balancer["num_slots"] == placement.num_physical == 20 and balancer["layer_updates_per_iter"] == 0
    assert balancer["initial_global_assignments"] == {
        3 + i: row for i, row in enumerate(placement.phy2log_LP.tolist())
    }
    options = yaml.safe_load((out / "trtllm_extra_llm_api_options.yaml").read_text())
    assert options["moe_config"]["load_balancer"] == str((out / "trtllm_load_balancer.yaml").resolve())
    lines = dict(line.strip().split(": ", 1) for line in printed.splitlines() if ": " in line)
    json_path = out / "init_expert_location.json"
    # SGLang: eplb's solver through the plugin, or EPLB off; never --enable-eplb with SGLang's planner.
    assert lines["sglang_flags"].startswith("--enable-eplb --eplb-algorithm scipy ")
    assert f"--init-expert-location {json_path}" in lines["sglang_flags"]
    assert "--enable-eplb" not in lines["sglang_flags_static"]
    assert "--ep-num-redundant-experts 4" in lines["sglang_flags_static"]
    assert lines["vllm_flags"].startswith("EPLB_VLLM_POLICY=1 vllm serve")
    assert "--ep_size 4" in lines["trtllm_flags"]
    assert main([*args, "--ep-num-redundant-experts", "4", "--eplb-algorithm", "deepseek", "--out", str(out),
                 "--json", "-"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["sglang_flags"].startswith("--enable-eplb --eplb-algorithm eplb:deepseek ")


def test_dashboards_exports_the_data_files(tmp_path: Path) -> None:
    assert main(["dashboards", "--out", str(tmp_path / "d"), "--json", str(tmp_path / "d.json")]) == 0
    files = json.loads((tmp_path / "d.json").read_text())["files"]
    assert "eplb-expert-load.json" in files and "prometheus.yml" in files
    assert all(not f.endswith(".py") for f in files)
    dashboard = json.loads((tmp_path / "d" / "eplb-expert-load.json").read_text())
    assert dashboard["uid"] == "eplb-expert-load"
