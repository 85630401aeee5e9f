"""EplbConfig and its SGLang-compatible flags: defaults, parsing, and every invalid combination."""

from __future__ import annotations

import dataclasses

import pytest

from eplb.config import ConfigError, EplbConfig, parse_config


def test_defaults_follow_sglang() -> None:
    cfg = parse_config(["--enable-eplb", "--ep-size", "8"])
    assert cfg.enable_eplb and cfg.recorder_mode == "stat"
    assert cfg.eplb_rebalance_num_iterations == 1000
    assert cfg.recorder_buffer_size == 1000
    assert cfg.dispatch_algorithm == "static"
    assert cfg.eplb_algorithm == "auto"
    assert cfg.eplb_min_rebalancing_utilization_threshold == 1.0
    assert parse_config([]).recorder_mode is None


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
    assert isinstance(ConfigError("x"), ValueError)
