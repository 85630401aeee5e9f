"""``SimulationConfig`` holds the server's ``EplbConfig``: the CLI and the API build the same one,
a server's parsed flags drive the schedule as the server runs it, and the numbers are those the
simulator gave before the config held it.

Shape legend: W window, L layers, E logical experts, P physical slots.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from typing import Any

import numpy as np
import pytest

from eplb.cli import main
from eplb.config import EplbConfig, parse_config
from eplb.placement.model import Placement
from eplb.policy import Proposal
from eplb.simulate import CostModel, PastView, RunSpec, SimulationConfig, parse_runs, simulate
from eplb.traces import Trace
from eplb.workloads import WorkloadConfig, generate
from tests.helpers.simulation import server

WALL_CLOCK_KEYS = {
    "solve_seconds",
    "solve_seconds_total",
    "solve_seconds_mean",
    "solve_seconds_max",
    "eval_seconds",
    "apply_seconds",
}
TINY = ["--preset", "tiny", "--steps", "240", "--seed", "0", "--disable-tqdm"]


def _tiny() -> Trace:
    return generate(WorkloadConfig(preset="tiny", num_steps=240, seed=0))


def _without_wall_clock(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_wall_clock(v) for k, v in value.items() if k not in WALL_CLOCK_KEYS}
    if isinstance(value, list):
        return [_without_wall_clock(v) for v in value]
    return value


# Each case: the flags of ``eplb simulate`` and the same server as an EplbConfig, with the runs.
CASES = {
    "continuous": (
        ["--ep-size", "4", "--nnodes", "2", "--ep-num-redundant-experts", "4",
         "--eplb-rebalance-mode", "continuous", "--eplb-rebalance-num-iterations", "20",
         "--expert-distribution-recorder-buffer-size", "60", "--eplb-max-moved-experts", "3",
         "--eplb-transfer-gbps", "50", "--eplb-shift-burst", "2", "--cost-interference", "0.05"],
        dict(ep_size=4, nnodes=2, ep_num_redundant_experts=4, eplb_rebalance_mode="continuous",
             eplb_rebalance_num_iterations=20, expert_distribution_recorder_buffer_size=60,
             eplb_max_moved_experts=3, eplb_transfer_gbps=50.0, eplb_shift_burst=2),
        ["none", "scipy"],
    ),
    "periodic": (
        ["--ep-size", "4", "--nnodes", "1", "--ep-num-redundant-experts", "4",
         "--eplb-rebalance-num-iterations", "20", "--expert-distribution-recorder-buffer-size", "10",
         "--eplb-record-prefill-only", "--eplb-min-rebalancing-utilization-threshold", "0.8",
         "--ep-dispatch-algorithm", "dynamic", "--cost-interference", "0.05"],
        dict(ep_size=4, nnodes=1, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=20,
             expert_distribution_recorder_buffer_size=10, eplb_record_prefill_only=True,
             eplb_min_rebalancing_utilization_threshold=0.8, ep_dispatch_algorithm="dynamic"),
        ["deepseek", "deepseek:static"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cli_and_the_api_build_the_same_config_and_results(case: str) -> None:
    flags, fields, algorithms = CASES[case]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["simulate", *TINY, *flags, "--algorithms", *algorithms, "--json", "-"]) == 0
    by_cli = json.loads(out.getvalue())
    trace = _tiny()
    config = SimulationConfig.for_trace(
        trace,
        eplb=server(**fields),
        cost=CostModel(interference=0.05),
    )
    dispatch = config.eplb.dispatch_algorithm
    by_api = json.loads(json.dumps(simulate(trace, parse_runs(algorithms, dispatch), config).to_dict()))
    # The CLI also tells EplbConfig the trace's expert count (to check the slots at parse time).
    assert by_cli["config"]["eplb"].pop("num_experts") == trace.num_experts
    assert by_api["config"]["eplb"].pop("num_experts") is None
    assert _without_wall_clock(by_cli) == _without_wall_clock(by_api)
    resolved = by_api["config"]
    assert (resolved["interval"], resolved["window_size"], resolved["move_budget"]) == (
        config.eplb.rebalance_interval,
        config.eplb.recorder_buffer_size,
        config.eplb.for_layers(trace.num_layers).max_moved_experts,
    )


class _Windows:
    """Keeps the step and window length of every call; proposes nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, window_WLE: np.ndarray, current: Placement, past: PastView | None = None) -> Proposal:
        assert past is not None
        self.calls.append((past.now, window_WLE.shape[0]))
        return Proposal(current, apply=False, reason="keeps")


@pytest.mark.parametrize(
    "argv",
    [
        "--eplb-rebalance-num-iterations 30",
        "--eplb-rebalance-mode continuous",
        "--eplb-rebalance-mode continuous --eplb-rebalance-num-iterations 15 "
        "--expert-distribution-recorder-buffer-size 40",
        "--eplb-rebalance-num-iterations 20 --expert-distribution-recorder-buffer-size 5 "
        "--eplb-record-prefill-only",
    ],
)
def test_a_servers_parsed_flags_drive_the_schedule_as_the_server_runs_it(argv: str) -> None:
    """The config a server parses is the simulation's: it plans after every interval-th recorded
    pass, from the last window of recorded passes (counted here pass by pass)."""
    flags = parse_config(
        ["--enable-eplb", "--ep-size", "4", "--ep-num-redundant-experts", "4", *argv.split()]
    )
    trace = _tiny()
    planner = _Windows()
    result = simulate(
        trace, [RunSpec("w", "static")], SimulationConfig(eplb=flags), planners={"w:static": planner}
    )
    recorded, expected = 0, []
    for t in range(trace.num_steps - 1):
        if flags.eplb_record_prefill_only and not trace.is_prefill_F[t]:
            continue
        recorded += 1
        if recorded % flags.rebalance_interval == 0:
            expected.append((t + 1, min(recorded, flags.recorder_buffer_size)))
    assert expected and planner.calls == expected
    assert result.config["interval"] == flags.rebalance_interval
    assert result.config["window_size"] == flags.recorder_buffer_size
    assert result.config["move_budget"] == flags.for_layers(trace.num_layers).max_moved_experts
    assert result.config["default_dispatch"] == flags.dispatch_algorithm == "static"


def test_a_simulation_needs_the_flags_of_a_server_that_rebalances() -> None:
    with pytest.raises(ValueError, match="enable_eplb=True"):
        SimulationConfig(eplb=EplbConfig(ep_size=4))
    # One rank has nothing to balance: EplbConfig says so, naming the flag.
    with pytest.raises(ValueError, match="--ep-size must be > 1"):
        server(ep_size=1)
    with pytest.raises(ValueError, match="--score-from"):
        SimulationConfig(eplb=server(ep_size=4), score_from=-1)
    with pytest.raises(ValueError, match="--num-experts"):
        simulate(
            _tiny(), [RunSpec("none", "static")], SimulationConfig(eplb=server(ep_size=4, num_experts=8))
        )


class _SnakeByLoad:
    """A deterministic planner that needs no solver: experts by window load, hottest first, dealt
    over the GPUs in snake order; the hottest get the redundant slots, in the reverse order."""

    def __call__(self, window_WLE: np.ndarray, current: Placement, past: PastView | None = None) -> Proposal:
        load_LE = window_WLE.sum(axis=0, dtype=np.int64)
        L, E = load_LE.shape
        P, G = current.num_physical, current.num_gpus
        S = P // G
        phy2log_LP = np.empty((L, P), dtype=np.int32)
        for layer in range(L):
            order_E = np.argsort(-load_LE[layer], kind="stable")
            for i, expert in enumerate(np.concatenate([order_E, order_E[: P - E][::-1]])):
                rnd, pos = divmod(i, G)
                gpu = pos if rnd % 2 == 0 else G - 1 - pos
                phy2log_LP[layer, gpu * S + rnd] = expert
        return Proposal(Placement.from_phy2log(phy2log_LP, num_gpus=G, num_nodes=current.num_nodes))


def _golden_config(**flags: Any) -> SimulationConfig:
    # Dispatch kernels uncharged, as the simulator then was (they add to total_seconds alone).
    return SimulationConfig(
        eplb=server(ep_size=4, nnodes=2, ep_num_redundant_experts=4, eplb_dispatch_cost="none", **flags),
        num_groups=4,
        bytes_per_expert=400_000_000,
        cost=CostModel(interference=0.05),
    )


# Computed by the simulator before SimulationConfig held an EplbConfig (commit bbebb46, where the
# flags were SimulationConfig's own fields: interval=40; interval=20, window=60, continuous,
# transfer_gbps=50; interval=20, window=10, record_prefill_only, utilization_threshold=0.75,
# default_dispatch="dynamic").
GOLDEN = {
    "periodic": (
        dict(eplb_rebalance_num_iterations=40),
        {
            "mine:static": (0.8974674823267083, 0.9072547872179935, 0.6102624303666127,
                            0.15331645569620253, 0.0, 39600000000, 5, 0, 0.0),
            "none:static": (0.6441992321151134, 0.6441208677444269, 0.6084169064941406,
                            0.0, 0.0, 0, 0, 0, 0.0),
        },
    ),
    "continuous": (
        dict(eplb_rebalance_num_iterations=20, expert_distribution_recorder_buffer_size=60,
             eplb_rebalance_mode="continuous", eplb_transfer_gbps=50.0),
        {
            "mine:static": (0.8762007815504266, 0.889605443223863, 0.5844768940545945,
                            0.06310251072692871, 0.010328451870146254, 38400000000, 11, 0,
                            8.909090909090908),
            "none:static": (0.6461436925881419, 0.6460906856085747, 0.6626049915161133,
                            0.0, 0.0, 0, 0, 0, 0.0),
        },
    ),
    "prefill_threshold": (
        dict(eplb_rebalance_num_iterations=20, expert_distribution_recorder_buffer_size=10,
             eplb_record_prefill_only=True, eplb_min_rebalancing_utilization_threshold=0.75,
             ep_dispatch_algorithm="dynamic"),
        {
            "mine:static": (0.8987158421605416, 0.9086148072292115, 0.49851905569573896,
                            0.08379746835443039, 0.0, 19600000000, 1, 3, 0.0),
            "none:dynamic": (0.6424035229580097, 0.6421451064260201, 0.5532770244140625,
                             0.0, 0.0, 0, 0, 0, 0.0),
        },
    ),
}  # fmt: skip
GOLDEN_KEYS = (
    "balancedness_mean",
    "balancedness_prefill_mean",
    "total_seconds",
    "stall_seconds",
    "interference_seconds",
    "bytes_moved",
    "rebalances_applied",
    "rebalances_skipped",
    "switch_delay_steps_mean",
)


GOLDEN_VERSIONS = {"numpy": "2.4", "scipy": "1.17"}
"""The releases the golden numbers were computed with (the CI's): another numpy sums float32 in
another order, which moves the gate's decisions (seen on the H200 machine's numpy)."""


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_the_numbers_are_those_before_the_config_held_the_servers_flags(case: str) -> None:
    import scipy

    have = {"numpy": np.__version__, "scipy": scipy.__version__}
    if any(not have[k].startswith(v + ".") for k, v in GOLDEN_VERSIONS.items()):
        pytest.skip(
            f"golden numbers are for numpy {GOLDEN_VERSIONS['numpy']}, scipy {GOLDEN_VERSIONS['scipy']}; have {have}"
        )
    flags, want = GOLDEN[case]
    config = _golden_config(**flags)
    baseline = f"none:{config.eplb.dispatch_algorithm}"
    result = simulate(
        _tiny(), [RunSpec("mine", "static"), RunSpec.parse(baseline, "static")], config,
        planners={"mine:static": _SnakeByLoad()},
    )  # fmt: skip
    got = {s["name"]: tuple(s[k] for k in GOLDEN_KEYS) for s in result.summaries()}
    assert got.keys() == want.keys()
    for name, values in want.items():
        assert got[name] == pytest.approx(values, rel=1e-9, abs=1e-15), name
