"""EplbConfig and its SGLang-compatible flags: defaults, parsing, and every invalid combination."""

from __future__ import annotations

import dataclasses

import pytest

from eplb.config import (
    CONTINUOUS_BUFFER_SIZE,
    CONTINUOUS_INTERVAL,
    CONTINUOUS_MAX_MOVED_EXPERTS,
    ConfigError,
    EplbConfig,
    parse_config,
)


def test_defaults_follow_sglang() -> None:
    cfg = parse_config(["--enable-eplb", "--ep-size", "8"])
    assert cfg.enable_eplb and cfg.recorder_mode == "stat"
    assert cfg.eplb_rebalance_mode == "periodic" and not cfg.continuous
    assert cfg.rebalance_interval == 1000
    assert cfg.recorder_buffer_size == 1000
    assert cfg.max_moved_experts is None and cfg.eplb_transfer_gbps is None
    assert cfg.dispatch_algorithm == "static"
    assert cfg.eplb_algorithm == "auto"
    assert cfg.eplb_min_rebalancing_utilization_threshold == 1.0
    assert parse_config([]).recorder_mode is None
    # SGLang's schedule stays reachable by name, whatever eplb's own commands default to.
    assert parse_config(["--enable-eplb", "--ep-size", "8", "--eplb-rebalance-mode", "periodic"]) == cfg


def test_continuous_mode_has_its_own_defaults() -> None:
    cfg = parse_config(["--enable-eplb", "--ep-size", "8", "--eplb-rebalance-mode", "continuous"])
    assert cfg.continuous and cfg.rebalance_interval == CONTINUOUS_INTERVAL
    assert cfg.max_moved_experts == CONTINUOUS_MAX_MOVED_EXPERTS and cfg.eplb_transfer_gbps is None
    assert cfg.recorder_buffer_size == max(CONTINUOUS_BUFFER_SIZE, CONTINUOUS_INTERVAL)
    longer = EplbConfig(eplb_rebalance_mode="continuous", eplb_rebalance_num_iterations=5000)
    assert longer.recorder_buffer_size == 5000  # the default window is never shorter than the interval


def test_continuous_flags_parse() -> None:
    cfg = parse_config(
        [
            "--enable-eplb",
            "--ep-size",
            "8",
            "--eplb-rebalance-mode",
            "continuous",
            "--eplb-rebalance-num-iterations",
            "20",
            "--expert-distribution-recorder-buffer-size",
            "500",
            "--eplb-max-moved-experts",
            "0",
            "--eplb-transfer-gbps",
            "40",
        ]
    )
    assert cfg == EplbConfig(
        enable_eplb=True,
        ep_size=8,
        eplb_rebalance_mode="continuous",
        eplb_rebalance_num_iterations=20,
        expert_distribution_recorder_buffer_size=500,  # a window longer than the interval
        eplb_max_moved_experts=0,
        eplb_transfer_gbps=40.0,
    )
    assert cfg.rebalance_interval == 20 and cfg.recorder_buffer_size == 500 and cfg.max_moved_experts == 0


def test_all_flags_parse() -> None:
    cfg = parse_config(
        [
            "--enable-eplb",
            "--expert-distribution-recorder-mode",
            "per_pass",
            "--expert-distribution-recorder-buffer-size",
            "100",
            "--eplb-rebalance-num-iterations",
            "200",
            "--eplb-rebalance-layers-per-chunk",
            "4",
            "--eplb-min-rebalancing-utilization-threshold",
            "0.9",
            "--eplb-record-prefill-only",
            "--ep-num-redundant-experts",
            "32",
            "--ep-dispatch-algorithm",
            "weighted",
            "--eplb-algorithm",
            "scipy",
            "--init-expert-location",
            "loc.json",
            "--ep-size",
            "32",
            "--nnodes",
            "4",
            "--num-experts",
            "256",
        ]
    )
    assert cfg == EplbConfig(
        enable_eplb=True,
        expert_distribution_recorder_mode="per_pass",
        expert_distribution_recorder_buffer_size=100,
        eplb_rebalance_num_iterations=200,
        eplb_rebalance_layers_per_chunk=4,
        eplb_min_rebalancing_utilization_threshold=0.9,
        eplb_record_prefill_only=True,
        ep_num_redundant_experts=32,
        ep_dispatch_algorithm="weighted",
        eplb_algorithm="scipy",
        init_expert_location="loc.json",
        ep_size=32,
        nnodes=4,
        num_experts=256,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ep_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (
            ["--enable-eplb", "--ep-size", "8", "--expert-distribution-recorder-buffer-size", "2000"],
            "--expert-distribution-recorder-buffer-size",
        ),
        (
            ["--enable-eplb", "--ep-size", "8", "--num-experts", "256", "--ep-num-redundant-experts", "4"],
            "--ep-num-redundant-experts",
        ),
        (["--enable-eplb"], "--enable-eplb"),
        (["--enable-eplb", "--ep-size", "1"], "--enable-eplb"),
        (["--eplb-algorithm", "magic"], "--eplb-algorithm"),
        (["--ep-dispatch-algorithm", "random"], "--ep-dispatch-algorithm"),
        (["--expert-distribution-recorder-mode", "all"], "--expert-distribution-recorder-mode"),
        (["--ep-num-redundant-experts", "-1"], "--ep-num-redundant-experts"),
        (["--eplb-rebalance-num-iterations", "0"], "--eplb-rebalance-num-iterations"),
        (
            ["--eplb-min-rebalancing-utilization-threshold", "1.5"],
            "--eplb-min-rebalancing-utilization-threshold",
        ),
        (["--ep-size", "6", "--nnodes", "4"], "--nnodes"),
        (["--eplb-rebalance-layers-per-chunk", "0"], "--eplb-rebalance-layers-per-chunk"),
        (["--ep-dispatch-algorithm", "weighted", "--ep-size", "4"], "--ep-dispatch-algorithm"),
        (["--eplb-rebalance-mode", "sometimes"], "--eplb-rebalance-mode"),
        (["--eplb-max-moved-experts", "-1"], "--eplb-max-moved-experts"),
        (["--eplb-rebalance-mode", "continuous", "--eplb-transfer-gbps", "0"], "--eplb-transfer-gbps"),
        (["--eplb-rebalance-mode", "continuous", "--eplb-transfer-gbps", "nan"], "--eplb-transfer-gbps"),
        (["--eplb-rebalance-mode", "continuous", "--eplb-transfer-gbps", "inf"], "--eplb-transfer-gbps"),
        (["--eplb-transfer-gbps", "10"], "--eplb-transfer-gbps"),  # periodic keeps SGLang's schedule
        (
            ["--eplb-rebalance-mode", "continuous", "--eplb-rebalance-num-iterations", "0"],
            "--eplb-rebalance-num-iterations",
        ),
        (
            [
                "--enable-eplb",
                "--ep-size",
                "8",
                "--eplb-rebalance-mode",
                "periodic",
                "--eplb-rebalance-num-iterations",
                "100",
                "--expert-distribution-recorder-buffer-size",
                "101",
            ],
            "--expert-distribution-recorder-buffer-size",
        ),
    ],
)
def test_invalid_combinations_fail_at_parse_time_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(argv, prog="server")
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_direct_construction_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="--ep-size"):
        EplbConfig(ep_size=0)
    with pytest.raises(ConfigError, match="--eplb-rebalance-mode"):
        EplbConfig(eplb_rebalance_mode="burst")
    with pytest.raises(ConfigError, match="--eplb-transfer-gbps: paces"):
        EplbConfig(eplb_transfer_gbps=1.0)
    assert isinstance(ConfigError("x"), ValueError)
