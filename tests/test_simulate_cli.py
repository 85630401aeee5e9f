"""``eplb simulate``, ``eplb sweep`` and ``eplb solve`` on the tiny preset; placement files round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.placement.io import load_placement, save_placement
from eplb.placement.model import Placement
from eplb.simulate.sweep import redundant_candidates
from eplb.traces import load_trace

TINY = ["--preset", "tiny", "--ep-size", "4", "--nnodes", "2", "--disable-tqdm"]


def test_simulate_writes_table_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "simulate",
        *TINY,
        "--steps",
        "240",
        "--ep-num-redundant-experts",
        "4",
        "--eplb-rebalance-num-iterations",
        "40",
        "--algorithms",
        "none",
        "deepseek",
        "deepseek_hierarchical:dynamic",
        "--json",
        str(tmp_path / "r.json"),
        "--plots",
        str(tmp_path / "plots"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "deepseek:static" in out and "speed-up" in out
    result = json.loads((tmp_path / "r.json").read_text())
    names = [r["name"] for r in result["runs"]]
    assert names == ["none:static", "deepseek:static", "deepseek_hierarchical:dynamic"]
    by_name = {r["name"]: r for r in result["runs"]}
    assert by_name["none:static"]["speedup_vs_none"] == 1.0
    # Rebalancing the tiny preset's skewed load must help, and the modeled speed-up follows.
    assert (
        by_name["deepseek:static"]["balancedness_prefill_mean"]
        > by_name["none:static"]["balancedness_prefill_mean"]
    )
    assert by_name["deepseek:static"]["speedup_vs_none"] > 1.0
    assert len(result["rebalances"]["deepseek:static"]) == 240 // 40 - 1
    assert len(result["timeline"]["none:static"]["balancedness"]) == 240
    for png in ("balancedness.png", "load_heatmap.png", "balance_vs_migration.png"):
        data = (tmp_path / "plots" / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000


def test_simulate_reads_a_trace_and_prefill_only_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "workload",
                "--preset",
                "tiny",
                "--steps",
                "200",
                "--ep-size",
                "4",
                "--out",
                str(tmp_path / "t.npz"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    args = [
        "simulate",
        "--trace",
        str(tmp_path / "t.npz"),
        "--ep-size",
        "4",
        "--nnodes",
        "1",
        "--disable-tqdm",
    ]
    args += [
        "--algorithms",
        "none",
        "deepseek",
        "--eplb-rebalance-num-iterations",
        "20",
        "--eplb-record-prefill-only",
    ]
    assert main([*args, "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["record_prefill_only"] is True
    # Only prefill steps count: a rebalance follows every 20th prefill step.
    recorded = np.flatnonzero(load_trace(tmp_path / "t.npz").is_prefill_F)
    expected = [int(recorded[i]) + 1 for i in range(19, len(recorded), 20) if recorded[i] + 1 < 200]
    assert len(expected) >= 2
    assert [e["step"] for e in result["rebalances"]["deepseek:static"]] == expected
    assert all(e["window_steps"] == 20 for e in result["rebalances"]["deepseek:static"])


def test_simulate_continuous_mode_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "simulate", *TINY, "--steps", "240", "--ep-num-redundant-experts", "4",
        "--eplb-rebalance-mode", "continuous", "--eplb-rebalance-num-iterations", "20",
        "--expert-distribution-recorder-buffer-size", "60", "--eplb-max-moved-experts", "3",
        "--eplb-transfer-gbps", "50", "--cost-interference", "0.05",
        "--algorithms", "none", "scipy", "--json", str(tmp_path / "r.json"),
    ]  # fmt: skip
    assert main(args) == 0
    assert "interf. s" in capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    config = result["config"]
    assert (config["rebalance_mode"], config["interval"], config["window_size"]) == ("continuous", 20, 60)
    assert config["move_budget"] == 3 and config["transfer_gbps"] == 50.0
    assert config["cost"]["interference"] == 0.05
    events = result["rebalances"]["scipy:static"]
    assert len(events) == 240 // 20 - 1
    # The window reaches back past the last rebalance, up to 60 passes.
    assert [e["window_steps"] for e in events] == [min(e["step"], 60) for e in events]
    # --eplb-initial-full-plan (the default): the first applied plan alone may exceed the budget.
    first = next(i for i, e in enumerate(events) if e["applied"])
    assert all(e["experts_moved_across_gpus"] <= 3 for e in events[first + 1 :])
    assert main([*args, "--no-eplb-initial-full-plan"]) == 0
    capsys.readouterr()
    strict = json.loads((tmp_path / "r.json").read_text())
    assert strict["config"]["initial_full_plan"] is False
    assert all(e["experts_moved_across_gpus"] <= 3 for e in strict["rebalances"]["scipy:static"])
    sent = [e for e in events if e["applied"] and e["transfer_seconds"] > 0]
    assert sent and all(e["switch_step"] > e["step"] for e in sent)  # sent beside the passes first
    run = next(r for r in result["runs"] if r["name"] == "scipy:static")
    assert run["interference_seconds"] == pytest.approx(sum(e["interference_seconds"] for e in sent))
    assert run["interference_seconds"] > 0 and run["stall_seconds"] == 0.0


def test_continuous_mode_takes_the_servers_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from eplb.config import (
        CONTINUOUS_BUFFER_SIZE,
        CONTINUOUS_INTERVAL,
        CONTINUOUS_MAX_MOVED_EXPERTS,
        PERIODIC_INTERVAL,
    )

    base = ["simulate", *TINY, "--steps", "60", "--ep-num-redundant-experts", "4", "--algorithms", "none"]
    assert main([*base, "--eplb-rebalance-mode", "continuous", "--json", "-"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["interval"] == CONTINUOUS_INTERVAL
    assert config["window_size"] == max(CONTINUOUS_BUFFER_SIZE, CONTINUOUS_INTERVAL)
    # 160 copies per 58 layers, on the tiny preset's 4 layers.
    assert config["eplb"]["num_layers"] == 4
    assert config["move_budget"] == round(CONTINUOUS_MAX_MOVED_EXPERTS * 4 / 58) == 11
    assert main([*base, "--eplb-rebalance-mode", "periodic", "--json", "-"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["interval"], config["window_size"], config["move_budget"]) == (
        PERIODIC_INTERVAL,
        PERIODIC_INTERVAL,
        None,
    )  # the server's


def test_sweep_tradeoff_compares_periodic_and_continuous(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "sweep", "--tradeoff", *TINY, "--steps", "300", "--ep-num-redundant-experts", "4",
        "--algorithm", "scipy", "--periodic-intervals", "100", "25", "--budgets", "2", "8",
        "--eplb-rebalance-num-iterations", "20", "--eplb-transfer-gbps", "100",
        "--plots", str(tmp_path), "--json", str(tmp_path / "t.json"),
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "deepseek periodic 100" in out and "scipy continuous 20 budget 8" in out
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [(r["mode"], r["interval"], r["budget"]) for r in rows] == [
        ("periodic", 100, None),
        ("periodic", 25, None),
        ("continuous", 20, 2),
        ("continuous", 20, 8),
    ]
    # Every point is scored on the same steps: from the slowest schedule's first rebalance.
    assert all(r["scored_from"] == 100 for r in rows)
    for r in rows:
        assert r["bytes_moved_per_1000_passes"] == pytest.approx(r["bytes_moved"] * 1000 / 200)
    assert all(r["experts_moved_per_rebalance"] <= r["budget"] for r in rows[2:])
    assert rows[0]["experts_moved"] > 0 and rows[0]["stall_seconds"] > 0
    data = (tmp_path / "tradeoff.png").read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000


def test_score_from_scores_every_run_from_that_pass(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "simulate", *TINY, "--steps", "240", "--ep-num-redundant-experts", "4",
        "--eplb-rebalance-num-iterations", "40", "--algorithms", "none", "deepseek", "--score-from", "100",
    ]  # fmt: skip
    assert main([*args, "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["scored_from"] == result["config"]["score_from"] == 100
    run = next(r for r in result["runs"] if r["name"] == "deepseek:static")
    scored = [e for e in result["rebalances"]["deepseek:static"] if e["step"] >= 100]
    applied = [e for e in scored if e["applied"]]
    assert applied and run["rebalances_applied"] == len(applied)
    assert run["rebalances_skipped"] == len(scored) - len(applied)
    assert run["bytes_moved"] == sum(e["bytes_moved"] for e in applied)
    assert run["bytes_moved_per_1000_passes"] == pytest.approx(run["bytes_moved"] * 1000 / 140)
    timeline = result["timeline"]["deepseek:static"]["balancedness"]  # rounded to 5 digits
    assert run["balancedness_mean"] == pytest.approx(np.mean(timeline[100:]), abs=1e-5)


def test_sweep_tradeoff_scores_every_setting_from_score_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "sweep", "--tradeoff", *TINY, "--steps", "300", "--ep-num-redundant-experts", "4",
        "--algorithm", "deepseek", "--periodic-intervals", "100", "25", "--budgets", "8",
        "--eplb-rebalance-num-iterations", "20", "--score-from", "150", "--json", str(tmp_path / "t.json"),
    ]  # fmt: skip
    assert main(args) == 0
    assert "scored from step 150" in capsys.readouterr().out
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert len(rows) == 3 and all(r["scored_from"] == 150 for r in rows)
    for r in rows:
        assert r["bytes_moved_per_1000_passes"] == pytest.approx(r["bytes_moved"] * 1000 / 150)


@pytest.mark.parametrize(
    "command", [["simulate"], ["sweep", "--tradeoff", "--periodic-intervals", "20", "--budgets", "2"]]
)
@pytest.mark.parametrize("score_from", ["60", "75", "-1"])
def test_a_score_from_outside_the_trace_is_a_one_line_error(
    command: list[str], score_from: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*command, *TINY, "--steps", "60", "--ep-num-redundant-experts", "4", "--score-from", score_from]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"eplb {command[0]}: error: --score-from")
    assert "Traceback" not in captured.err


def test_sweep_finds_fewest_redundant_and_longest_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "sweep",
        *TINY,
        "--steps",
        "200",
        "--algorithm",
        "deepseek:dynamic",
        "--redundant",
        "0",
        "4",
        "--intervals",
        "25",
        "100",
        "--eplb-rebalance-num-iterations",
        "25",
    ]
    assert main([*args, "--target", "0.5", "--json", str(tmp_path / "easy.json")]) == 0
    easy = json.loads((tmp_path / "easy.json").read_text())
    assert easy["redundant"] == 0 and easy["interval"] == 100
    assert main([*args, "--target", "1.0", "--json", str(tmp_path / "hard.json")]) == 0
    hard = json.loads((tmp_path / "hard.json").read_text())
    assert hard["redundant"] is None and hard["interval"] is None
    assert {(p["num_redundant"], p["interval"]) for p in hard["points"]} == {(0, 25), (4, 25), (4, 100)}
    assert redundant_candidates(256, 32, 64) == [0, 32, 64] and redundant_candidates(10, 4, 10) == [2, 6, 10]


def test_solve_writes_own_and_sglang_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    args = ["solve", *TINY, "--steps", "120", "--ep-num-redundant-experts", "4", "--out", str(out)]
    assert main([*args, "--ep-dispatch-algorithm", "weighted", "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out)
    placement, weights = load_placement(out / "placement.safetensors")
    assert placement.num_physical == 20 and placement.num_gpus == 4 and placement.num_nodes == 2
    assert weights is not None and np.allclose(weights.sum(axis=2), 1.0, atol=1e-5)
    from_sglang = Placement.from_sglang(out / "init_expert_location.json", num_gpus=4, num_nodes=2)
    assert from_sglang.same_slots(placement)
    assert result["balancedness_on_window"] > result["balancedness_on_window_before"]
    # The solved placement can start a simulation (both file kinds), and beats the trivial one there.
    first_balancedness = {}
    for init in ("trivial", out / "placement.safetensors", out / "init_expert_location.json"):
        assert main(["simulate", *TINY, "--steps", "60", "--ep-num-redundant-experts", "4", "--algorithms",
                     "none:dynamic", "--init-expert-location", str(init), "--json", str(tmp_path / "s.json")]) == 0  # fmt: skip
        timeline = json.loads((tmp_path / "s.json").read_text())["timeline"]["none:dynamic"]["balancedness"]
        first_balancedness[str(init)] = np.mean(timeline[:20])
    solved = [v for k, v in first_balancedness.items() if k != "trivial"]
    assert solved[0] == solved[1] > first_balancedness["trivial"] + 0.1


def test_placement_file_round_trips_and_refuses_corrupt_files(tmp_path: Path) -> None:
    pl = Placement.trivial(2, 6, num_gpus=2, num_redundant=2, num_nodes=1)
    path = save_placement(tmp_path / "p.safetensors", pl, meta={"why": "test"})
    got, weights = load_placement(path)
    assert got == pl and weights is None
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}junk")
    with pytest.raises(ValueError, match="placement"):
        load_placement(tmp_path / "bad.safetensors")
    from safetensors.numpy import save_file

    bad = {"phy2log": pl.phy2log_LP, "log2phy": pl.log2phy_LER, "logcnt": pl.logcnt_LE + 1}
    save_file(bad, str(tmp_path / "inconsistent.safetensors"), metadata={"format": "eplb-placement", "version": "1",
                                                                          "num_gpus": "2", "num_nodes": "1"})  # fmt: skip
    with pytest.raises(ValueError, match="inconsistent placement"):
        load_placement(tmp_path / "inconsistent.safetensors")
    with pytest.raises(FileNotFoundError):
        load_placement(tmp_path / "missing.safetensors")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ep-num-redundant-experts", "1"], "--ep-num-redundant-experts"),
        (
            ["--eplb-rebalance-num-iterations", "10", "--expert-distribution-recorder-buffer-size", "20"],
            "buffer-size",
        ),
        (["--algorithms", "magic"], "unknown algorithm"),
        (["--algorithms", "deepseek", "--solver-option", "bogus=1"], "bogus"),
        (["--algorithms", "deepseek", "--solver-option", "prediction"], "KEY=VALUE"),
        (["--nnodes", "3"], "--nnodes"),
        (["--eplb-transfer-gbps", "10"], "--eplb-transfer-gbps"),
        (
            ["--eplb-rebalance-mode", "continuous", "--eplb-max-moved-experts", "-1"],
            "--eplb-max-moved-experts",
        ),
        (["--eplb-rebalance-mode", "continuous", "--cost-interference", "-1"], "interference"),
        (["--trace", "/nonexistent/trace.safetensors"], "not found"),
        (["--ep-size", "1"], "--ep-size must be > 1"),
    ],
)
def test_bad_simulate_flags_are_one_line_errors(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--preset", "tiny", "--steps", "20", "--ep-size", "4", "--nnodes", "1",
                 "--disable-tqdm", *extra]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("eplb simulate: error:") and message in err and "Traceback" not in err
