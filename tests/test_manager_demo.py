"""``eplb demo`` end to end on 2 CPU ranks: it rebalances, prints balancedness, writes JSON, takes a sink."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from eplb.cli import main
from eplb.commands.demo import (
    DEMO_PERIODIC_INTERVAL,
    DemoConfig,
    add_arguments,
    config_from_namespace,
    run_demo,
)
from eplb.config import CONTINUOUS_INTERVAL, CONTINUOUS_MAX_MOVED_EXPERTS, EplbConfig


@pytest.mark.parametrize(
    "mode",
    [
        ["--eplb-rebalance-mode", "periodic"],
        [],  # the demo's own default: continuous
        ["--eplb-transfer-gbps", "0.01"],  # continuous, each swap paced over the following passes
    ],
)
def test_demo_cli_rebalances_and_reports(
    mode: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo.json"
    argv = [
        "demo",
        "--nproc",
        "2",
        "--steps",
        "70",
        "--eplb-rebalance-num-iterations",
        "30",
        *mode,
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "rebalance applied" in printed and "window balancedness" in printed
    assert (
        "periodic" if mode[1:2] == ["periodic"] else "continuous"
    ) + " rebalancing every 30 passes" in printed
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and result["passes"] == 70
    applied = [r for r in result["rebalances"] if r["outcome"] == "applied"]
    assert applied and all(r["balancedness_after"] >= r["balancedness_before"] for r in applied)
    assert len(result["phy2log"]) == 4  # the tiny preset's layers


def test_run_demo_reports_to_a_sink_and_stops_on_time() -> None:
    events: list[str] = []

    class Sink:
        def on_forward_pass(self, **kw: Any) -> None:
            events.append("pass")

        def on_window(self, **kw: Any) -> None:
            events.append("window")

        def on_rebalance(self, **kw: Any) -> None:
            events.append("rebalance")

        def on_topology(self, **kw: Any) -> None:
            events.append("topology")

    lines: list[str] = []
    config = DemoConfig(
        nproc=2,
        steps=10_000,
        duration_s=3.0,
        eplb=EplbConfig(
            enable_eplb=True, ep_size=2, ep_num_redundant_experts=2, eplb_rebalance_num_iterations=4
        ),
    )
    result = run_demo(config, sink=Sink(), out=lines.append)
    assert 0 < result["passes"] < 10_000
    assert events[0] == "topology" and events.count("pass") == result["passes"]
    assert "window" in events and lines[0].startswith("eplb demo: 2 ranks")


def test_demo_defaults_to_continuous_and_keeps_periodic_reachable() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    own = config_from_namespace(parser.parse_args(["--nproc", "2"])).eplb
    assert own.continuous and own.rebalance_interval == CONTINUOUS_INTERVAL
    assert own.max_moved_experts == CONTINUOUS_MAX_MOVED_EXPERTS
    sglang = config_from_namespace(
        parser.parse_args(["--nproc", "2", "--eplb-rebalance-mode", "periodic"])
    ).eplb
    assert not sglang.continuous and sglang.max_moved_experts is None
    assert sglang.rebalance_interval == DEMO_PERIODIC_INTERVAL  # demo-sized, as before
    with pytest.raises(SystemExit):  # pacing needs continuous mode
        config_from_namespace(
            parser.parse_args(
                ["--nproc", "2", "--eplb-rebalance-mode", "periodic", "--eplb-transfer-gbps", "1"]
            )
        )


def test_demo_rejects_bad_layouts() -> None:
    with pytest.raises(ValueError, match="do not divide"):
        run_demo(DemoConfig(nproc=3, eplb=EplbConfig(ep_num_redundant_experts=0)))
