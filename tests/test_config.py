"""EplbConfig and its SGLang-compatible flags: defaults, parsing, and every invalid combination."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from eplb.config import (
    CONTINUOUS_BUFFER_SIZE,
    CONTINUOUS_INTERVAL,
    CONTINUOUS_MAX_MOVED_EXPERTS,
    MAX_WINDOW_PASSES,
    ConfigError,
    EplbConfig,
    add_cli_args,
    even_nodes,
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


@pytest.mark.parametrize(("layers", "budget"), [(58, 160), (6, 17), (4, 11), (32, 88), (94, 259), (1, 3)])
def test_the_continuous_default_budget_scales_with_the_models_layers(layers: int, budget: int) -> None:
    cfg = EplbConfig(eplb_rebalance_mode="continuous")
    assert cfg.for_layers(layers).max_moved_experts == budget  # 160 copies per 58 layers, rounded
    assert cfg.for_layers(layers).for_layers(layers) == cfg.for_layers(layers)
    given = EplbConfig(eplb_rebalance_mode="continuous", eplb_max_moved_experts=5).for_layers(layers)
    assert given.max_moved_experts == 5 and EplbConfig().for_layers(layers).max_moved_experts is None
    assert (
        parse_config(["--eplb-rebalance-mode", "continuous", "--num-layers", str(layers)]).max_moved_experts
        == budget
    )
    with pytest.raises(
        ValueError, match=f"the flags are for {layers} MoE layers, the model has {layers + 1}"
    ):
        cfg.for_layers(layers).for_layers(layers + 1)
    with pytest.raises(ConfigError, match="--num-layers"):
        EplbConfig(num_layers=0)


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
        # per_token keeps ids, not counts: refused with EPLB on when parsed, not when the manager starts.
        (
            ["--enable-eplb", "--ep-size", "8", "--expert-distribution-recorder-mode", "per_token"],
            "--expert-distribution-recorder-mode",
        ),
        # Both size the window allocated up front: bounded.
        (["--eplb-rebalance-num-iterations", str(10**8)], "--eplb-rebalance-num-iterations"),
        (
            ["--eplb-rebalance-mode", "continuous", "--eplb-rebalance-num-iterations", str(10**8)],
            "--eplb-rebalance-num-iterations",
        ),
        (
            [
                "--eplb-rebalance-mode",
                "continuous",
                "--expert-distribution-recorder-buffer-size",
                str(MAX_WINDOW_PASSES + 1),
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


def test_window_bound_is_inclusive_and_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_config(
        [
            "--eplb-rebalance-mode",
            "continuous",
            "--eplb-rebalance-num-iterations",
            str(MAX_WINDOW_PASSES),
            "--expert-distribution-recorder-buffer-size",
            str(MAX_WINDOW_PASSES),
        ]
    )
    assert cfg.rebalance_interval == cfg.recorder_buffer_size == MAX_WINDOW_PASSES == 10**6
    assert parse_config(["--expert-distribution-recorder-mode", "per_token"]).recorder_mode == "per_token"
    with pytest.raises(SystemExit):
        parse_config(["--help"], prog="server")
    help_text = " ".join(capsys.readouterr().out.split())
    assert help_text.count(f"at most {MAX_WINDOW_PASSES:,}") == 2


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--ep-size", "8", "--nnodes", "3"], "--nnodes"),
        (["--enable-eplb", "--ep-size", "8", "--expert-distribution-recorder-mode", "per_token"], "--expert"),
        # (A value out of its flag's range is refused by the flag's parse: tests/test_cli_inputs.py.)
        (
            ["--enable-eplb", "--ep-size", "8", "--eplb-rebalance-num-iterations", "10",
             "--expert-distribution-recorder-buffer-size", "20"],
            "--expert-distribution-recorder-buffer-size",
        ),
    ],
)  # fmt: skip
def test_add_cli_args_alone_checks_when_parsed(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # An engine that adds the flags to its own parser and only calls parse_args().
    parser = argparse.ArgumentParser(prog="server")
    parser.add_argument("--model", default="m")
    add_cli_args(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2
    assert f"server: error: {flag}" in capsys.readouterr().err
    # Subparsers too (as the eplb command nests them), and a valid combination still parses.
    top = argparse.ArgumentParser(prog="tool")
    add_cli_args(top.add_subparsers(dest="command").add_parser("serve"))
    with pytest.raises(SystemExit) as exc:
        top.parse_args(["serve", *argv])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
    args = top.parse_args(["serve", "--ep-size", "8", "--nnodes", "2"])
    assert (args.ep_size, args.nnodes) == (8, 2)
    assert EplbConfig.from_namespace(parser.parse_args(["--ep-size", "8", "--nnodes", "4"])).nnodes == 4


def test_add_cli_args_unchecked_leaves_validation_to_the_caller() -> None:
    parser = add_cli_args(argparse.ArgumentParser(prog="demo"), check=False)
    args = parser.parse_args(["--ep-size", "8", "--nnodes", "3"])  # the caller adjusts, then checks
    with pytest.raises(ConfigError, match="--nnodes"):
        EplbConfig.from_namespace(args)


def test_even_nodes_folds_uneven_layouts_to_one_node() -> None:
    """Against the rule written out: a node count that divides the GPUs stands, any other is one
    node; GPUs per node that divide the GPUs give that many nodes, any other one node."""
    for gpus in range(0, 25):
        for nodes in range(-2, 27):
            want = nodes if nodes >= 1 and gpus % nodes == 0 else 1
            assert even_nodes(gpus, nodes) == want, (gpus, nodes)
        for per_node in range(1, 27):
            want = gpus // per_node if gpus >= per_node and gpus % per_node == 0 else 1
            assert even_nodes(gpus, gpus_per_node=per_node) == want, (gpus, per_node)
    assert even_nodes(8) == 1  # no node count given: one node


def test_the_engine_adapters_state_the_node_rule_only_through_even_nodes() -> None:
    """No module but eplb.config writes "nodes that do not divide the GPUs count as one" again."""
    import re
    from pathlib import Path

    import eplb

    rule = re.compile(r"%\s*\w*nodes?\w*\s*==\s*0\s+else\s+1|%\s*\w*per_node\w*\s*==\s*0\s+else")
    root = Path(eplb.__file__).parent
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "config.py" or path.parent != root
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if rule.search(line)
    ]
    assert not found
    for module in ("integrations/engine_env.py", "integrations/engine_plan.py", "integrations/sglang.py"):
        assert "even_nodes(" in (root / module).read_text(), module
    assert (root / "integrations/vllm.py").read_text().count("even_nodes(") == 2
