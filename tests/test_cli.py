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
    assert result["steps"] == 40 and result["imbalance_without_balancing"] > 1.0
    capsys.readouterr()
    assert main(["trace", "info", str(out), "--json", "-"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layers"] == 4 and info["experts"] == 16
    assert main(["trace", "convert", str(out), "--to", "openevolve", "--out", str(tmp_path / "o.json")]) == 0
    assert np.array_equal(load_trace(tmp_path / "o.json").counts_FLE, load_trace(out).counts_FLE)


def test_bad_input_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04junk")
    assert main(["trace", "info", str(tmp_path / "bad.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb trace: error:") and "Traceback" not in err
    assert main(["trace", "info", str(tmp_path / "nope.pt")]) == 2
    assert main(["workload", "--preset", "tiny", "--ep-size", "3", "--steps", "2"]) == 2


def test_workload_defaults_work_for_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    # The default EP size is 32, or the largest divisor below it for presets with fewer experts.
    for preset, ep_size in (("tiny", 16), ("mixtral-8x7b", 8)):
        assert main(["workload", "--preset", preset, "--steps", "4", "--disable-tqdm", "--json", "-"]) == 0
        assert json.loads(capsys.readouterr().out)["ep_size"] == ep_size


def test_progress_bars_on_stderr_unless_disabled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.npz"
    assert main(["workload", "--preset", "tiny", "--steps", "30", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "generate" in err and "30/30" in err and "write" in err
    assert main(["trace", "convert", str(out), "--to", "openevolve", "--out", str(tmp_path / "t.json")]) == 0
    err = capsys.readouterr().err
    assert "write" in err and "30/30" in err
    assert main(["trace", "info", str(tmp_path / "t.json"), "--disable-tqdm"]) == 0
    assert capsys.readouterr().err == ""


def test_plots_without_matplotlib_fail_first_and_name_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    argv = ["simulate", "--preset", "tiny", "--steps", "50", "--ep-size", "4", "--nnodes", "1"]
    argv += ["--plots", str(tmp_path / "plots"), "--json", str(tmp_path / "r.json"), "--disable-tqdm"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "eplb[plots]" in captured.err
    assert list(tmp_path.iterdir()) == []


def test_demo_json_to_stdout_is_only_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--nproc", "2", "--steps", "40", "--eplb-rebalance-num-iterations", "20", "--json", "-"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["passes"] == 40
    assert "window balancedness" in captured.err


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
