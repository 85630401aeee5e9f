"""Simulator engine: hand-computed balancedness and time, past-only planning, solver forecasts, formats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from eplb.placement.balance import expert_gpu_share, gpu_load
from eplb.placement.dispatch_map import static_dispatch_map
from eplb.placement.model import Placement
from eplb.policy import Proposal
from eplb.simulate import (
    CostModel,
    PastView,
    RunSpec,
    SimulationConfig,
    parse_runs,
    rebalance_steps,
    simulate,
)
from eplb.traces import Trace, load_trace, write_openevolve
from tests.helpers.placements import random_phy2log
from tests.helpers.simulation import server


def _random_trace(seed: int, T: int = 24, L: int = 3, E: int = 8, prefill: np.ndarray | None = None) -> Trace:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, size=(T, L, E)) * (rng.random((T, L, E)) < 0.8)  # some zero experts
    return Trace.from_counts(counts.astype(np.int32), is_prefill=prefill)


def _hand_step(
    counts_LE: np.ndarray, placement: Placement, share_of_slot: np.ndarray, cost: CostModel
) -> tuple[float, float]:
    """(balancedness, µs) of one step by loops: slot by slot, GPU by GPU, layer by layer."""
    bal, us = [], 0.0
    for layer in range(placement.num_layers):
        tokens = np.zeros(placement.num_gpus)
        active = np.zeros(placement.num_gpus)
        for slot, expert in enumerate(placement.phy2log_LP[layer]):
            got = counts_LE[layer, expert] * share_of_slot[layer, slot]
            gpu = slot // placement.slots_per_gpu
            tokens[gpu] += got
            active[gpu] += got > 0
        bal.append(1.0 if tokens.max() == 0 else tokens.mean() / tokens.max())
        us += max(
            cost.base_us + max(cost.per_expert_us * a, cost.per_token_us * t)
            for a, t in zip(active, tokens, strict=True)
        )
    return float(np.mean(bal)), us


@pytest.mark.parametrize("dispatch", ["dynamic", "static"])
@pytest.mark.parametrize("redundant", [0, 4])
def test_identity_placement_matches_hand_computation(dispatch: str, redundant: int) -> None:
    trace = _random_trace(seed=redundant)
    cost = CostModel(base_us=7.0, per_expert_us=3.0, per_token_us=0.5)
    flags = server(
        ep_size=4,
        nnodes=2,
        ep_num_redundant_experts=redundant,
        eplb_rebalance_num_iterations=5,
        ep_dispatch_algorithm=dispatch,
    )
    config = SimulationConfig(eplb=flags, cost=cost)
    result = simulate(trace, [RunSpec("none", dispatch)], config)
    run = result.runs[0]
    pl = Placement.trivial(3, 8, num_gpus=4, num_redundant=redundant, num_nodes=2)
    if dispatch == "dynamic":
        share = 1.0 / pl.logcnt_LE[np.arange(3)[:, None], pl.phy2log_LP]
    else:  # each rank sends 1/G of an expert's tokens to the slot its static map names
        share = np.zeros(pl.phy2log_LP.shape)
        for rank in range(4):
            smap = static_dispatch_map(pl, rank)
            for layer in range(3):
                for expert in range(8):
                    share[layer, smap[layer, expert]] += 1 / 4
    for t in range(trace.num_steps):
        bal, us = _hand_step(trace.counts_FLE[t], pl, share, cost)
        assert run.balancedness_F[t] == pytest.approx(bal, rel=1e-6)
        assert run.moe_us_F[t] == pytest.approx(us, rel=1e-6)
    assert not run.events and result.scored_from == 5
    summary = result.summaries()[0]
    assert summary["speedup_vs_none"] == 1.0
    assert summary["balancedness_mean"] == pytest.approx(run.balancedness_F[5:].mean())


def test_expert_gpu_share_reproduces_gpu_load() -> None:
    rng = np.random.default_rng(3)
    pl = Placement.from_phy2log(random_phy2log(rng, 4, 10, 16), num_gpus=4, num_nodes=2)
    load_FLE = rng.integers(0, 100, size=(6, 4, 10)).astype(np.float64)
    weights = rng.random(pl.log2phy_LER.shape) * (pl.log2phy_LER >= 0)
    weights /= weights.sum(axis=2, keepdims=True)
    for w in (None, weights):
        share_LEG = expert_gpu_share(pl, w)
        np.testing.assert_allclose(share_LEG.sum(axis=2), 1.0)
        via_matmul = np.einsum("tle,leg->tlg", load_FLE, share_LEG)
        np.testing.assert_allclose(via_matmul, gpu_load(load_FLE, pl, w))


class _Recorder:
    """Keeps what it was given; proposes a fixed placement."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.calls: list[tuple[int, np.ndarray]] = []

    def __call__(self, window_WLE: np.ndarray, current: Placement, past: PastView | None = None) -> Proposal:
        assert past is not None
        self.calls.append((past.now, window_WLE.copy()))
        return Proposal(self.placement)


class _Peeker:
    """Reads the steps its own plan will serve: forbidden."""

    def __call__(self, window_WLE: np.ndarray, current: Placement, past: PastView | None = None) -> Proposal:
        assert past is not None
        future = past.counts(np.arange(past.now, past.now + 3))
        return Proposal(current, predicted_balancedness=float(future.sum()))


def test_planner_gets_the_last_window_of_recorded_steps_before_the_rebalance() -> None:
    prefill = np.array([True, False, True, True, False, True, True, True, False, True, True, True] * 2)
    trace = _random_trace(seed=1, prefill=prefill)
    flags = server(
        ep_size=2,
        nnodes=1,
        eplb_rebalance_num_iterations=3,
        expert_distribution_recorder_buffer_size=2,
        eplb_record_prefill_only=True,
    )
    config = SimulationConfig(eplb=flags)
    target = Placement.from_phy2log(np.array([np.roll(np.arange(8), 1)] * 3, dtype=np.int32), num_gpus=2)
    planner = _Recorder(target)
    result = simulate(trace, [RunSpec("fixed", "dynamic")], config, planners={"fixed:dynamic": planner})
    recorded = np.flatnonzero(prefill)
    # Rebalance after every 3rd recorded step, serving from the next step.
    expected_now = [
        int(recorded[i]) + 1 for i in range(2, len(recorded), 3) if recorded[i] + 1 < len(prefill)
    ]
    assert [now for now, _ in planner.calls] == expected_now == rebalance_steps(trace, config).tolist()
    for now, window in planner.calls:
        steps = recorded[recorded < now][-2:]
        np.testing.assert_array_equal(window, trace.counts_FLE[steps])
    # The placement serves from the rebalance step on, never before it.
    run = result.runs[0]
    first = expected_now[0]
    want = gpu_load(trace.counts_FLE[first:], target)
    np.testing.assert_allclose(run.balancedness_F[first:], (want.mean(-1) / want.max(-1)).mean(-1), rtol=1e-6)
    assert run.events[0].applied and run.events[0].changed_slots == 24


def test_future_peeking_planner_is_caught() -> None:
    trace = _random_trace(seed=2)
    config = SimulationConfig(eplb=server(ep_size=2, nnodes=1, eplb_rebalance_num_iterations=4))
    with pytest.raises(
        AssertionError, match="the placement used at step t must be computed from steps before t"
    ):
        simulate(trace, [RunSpec("peek", "dynamic")], config, planners={"peek:dynamic": _Peeker()})


@pytest.mark.parametrize("algorithm", ["deepseek", "deepseek_hierarchical", "scipy"])
@pytest.mark.parametrize("dispatch", ["dynamic", "weighted"])
def test_when_the_future_equals_the_past_the_solver_forecast_is_exact(algorithm: str, dispatch: str) -> None:
    rng = np.random.default_rng(11)
    step_LE = (rng.lognormal(0, 1.0, size=(4, 16)) * 100).astype(np.int32)
    trace = Trace.from_counts(np.broadcast_to(step_LE, (40, 4, 16)).copy())
    flags = server(ep_size=4, nnodes=2, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=10)
    config = SimulationConfig(eplb=flags, num_groups=4)
    result = simulate(trace, parse_runs([f"{algorithm}:{dispatch}"], "static"), config)
    run = result.runs[0]
    applied = [e for e in run.events if e.applied]
    assert applied and applied[0].step == 10
    assert applied[0].predicted_balancedness is not None
    assert applied[0].predicted_balancedness > run.balancedness_F[0]
    # Every step runs on the last applied plan, and scores exactly what that plan predicted.
    for event, next_event in zip(applied, [*applied[1:], None], strict=True):
        stop = trace.num_steps if next_event is None else next_event.step
        np.testing.assert_allclose(
            run.balancedness_F[event.step : stop], event.predicted_balancedness, rtol=1e-6
        )


WALL_CLOCK_KEYS = {
    "solve_seconds_total",
    "solve_seconds_mean",
    "solve_seconds_max",
    "eval_seconds",
    "apply_seconds",
}


def test_every_input_format_gives_the_same_result(tmp_path: Path) -> None:
    trace = _random_trace(seed=5, T=30, L=2, E=8)
    trace.save(tmp_path / "t.safetensors")
    trace.save(tmp_path / "t.npz")
    write_openevolve(trace, tmp_path / "t.json")
    torch.save({"rank": 0, "logical_count": torch.from_numpy(trace.counts_FLE)}, tmp_path / "stat.pt")
    # per_pass: physical counts of two ranks under a map with a duplicated expert, summed back.
    p2l = np.array([[*range(8), 0, 3]] * 2)
    for rank in range(2):
        records = []
        for t in range(trace.num_steps):
            phys = np.zeros((2, 10), dtype=np.int64)
            logical = (
                trace.counts_FLE[t] // 2 if rank == 0 else trace.counts_FLE[t] - trace.counts_FLE[t] // 2
            )
            phys[:, :8] = logical
            phys[:, 0], phys[:, 8] = logical[:, 0] - logical[:, 0] // 3, logical[:, 0] // 3
            records.append(
                {"forward_pass_id": 100 + t, "rank": rank, "global_physical_count": torch.from_numpy(phys)}
            )
        torch.save(
            {"records": records, "last_physical_to_logical_map": torch.from_numpy(p2l)},
            tmp_path / f"r{rank}.pt",
        )
    sources = [
        load_trace(tmp_path / "t.safetensors"),
        load_trace(tmp_path / "t.npz"),
        load_trace(tmp_path / "t.json"),
        load_trace(tmp_path / "stat.pt"),
        load_trace([tmp_path / "r0.pt", tmp_path / "r1.pt"]),
    ]
    flags = server(ep_size=2, nnodes=1, ep_num_redundant_experts=2, eplb_rebalance_num_iterations=6)
    config = SimulationConfig(eplb=flags, num_groups=2)
    runs = parse_runs(["none", "deepseek", "deepseek:dynamic"], "static")
    results = [simulate(src, runs, config) for src in sources]
    reference = results[0].summaries()
    for res in results[1:]:
        got = res.summaries()
        for a, b in zip(reference, got, strict=True):
            for key in a:
                if key not in WALL_CLOCK_KEYS:
                    assert a[key] == b[key], key
        for ra, rb in zip(results[0].runs, res.runs, strict=True):
            np.testing.assert_array_equal(ra.balancedness_F, rb.balancedness_F)
            assert [e.step for e in ra.events] == [e.step for e in rb.events]
    assert any("time order" in n for n in results[3].notes)


def test_transfer_cost_counts_the_busiest_receiving_gpu() -> None:
    from eplb.placement.diff import diff_placements

    # 4 GPUs on 2 nodes, 2 slots each: GPU0 [0 1] GPU1 [2 3] | GPU2 [4 5] GPU3 [6 7] becomes
    # GPU0 [1 2] GPU1 [0 4] | GPU2 [3 5] GPU3 [6 7]. GPU0 pulls 2 and GPU1 pulls 0 within node 0,
    # GPU1 pulls 4 and GPU2 pulls 3 across nodes.
    old = Placement.from_phy2log(np.array([[0, 1, 2, 3, 4, 5, 6, 7]]), num_gpus=4, num_nodes=2)
    new = Placement.from_phy2log(np.array([[1, 2, 0, 4, 3, 5, 6, 7]]), num_gpus=4, num_nodes=2)
    diff = diff_placements(old, new, bytes_per_expert=10**9)
    cost = CostModel(nvlink_gbps=100.0, internode_gbps=10.0)
    per_gpu = []
    for g in range(4):
        arrivals = np.flatnonzero(diff.arrivals_LGE[0, g])
        cross = np.flatnonzero(diff.cross_node_arrivals_LGE[0, g])
        per_gpu.append((len(arrivals) - len(cross)) / 100.0 + len(cross) / 10.0)
    # GPU 1 gets expert 0 from GPU 0 (intra-node) and expert 4 from node 1: 0.01 + 0.1 s.
    assert per_gpu[1] == pytest.approx(0.11)
    assert cost.transfer_seconds(diff) == pytest.approx(max(per_gpu))


def test_threshold_skips_and_fake_dispatch_ignores_the_placement() -> None:
    trace = _random_trace(seed=8, T=40)
    flags = server(
        ep_size=4,
        nnodes=1,
        ep_num_redundant_experts=4,
        eplb_rebalance_num_iterations=10,
        eplb_min_rebalancing_utilization_threshold=0.0,
    )
    config = SimulationConfig(eplb=flags)
    result = simulate(trace, parse_runs(["deepseek", "none:fake", "deepseek:fake"], "static"), config)
    assert all(not e.applied and "threshold" in e.reason for e in result.run("deepseek:static").events)
    fake_none, fake_ds = result.run("none:fake"), result.run("deepseek:fake")
    np.testing.assert_array_equal(fake_none.balancedness_F, fake_ds.balancedness_F)
    assert fake_none.balancedness_F.mean() > result.baseline.balancedness_F.mean()


def test_empty_steps_and_one_expert_taking_everything() -> None:
    counts = np.zeros((12, 2, 8), dtype=np.int32)
    counts[1::2, :, 5] = 500  # odd steps: expert 5 takes every token; even steps: no load at all
    trace = Trace.from_counts(counts)
    flags = server(ep_size=4, nnodes=2, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=4)
    config = SimulationConfig(eplb=flags, num_groups=4)
    result = simulate(trace, parse_runs(["none:dynamic", "deepseek:dynamic"], "static"), config)
    none, ds = result.run("none:dynamic"), result.run("deepseek:dynamic")
    np.testing.assert_array_equal(none.balancedness_F[0::2], 1.0)  # no load is perfectly balanced
    # Trivial layout: slots 8-11 repeat experts 0-3, so expert 5 has one replica, on GPU 2 of 4.
    np.testing.assert_allclose(none.balancedness_F[1::2], 0.25)
    # The planner gives the hot expert more replicas on more GPUs, so balance improves after step 4.
    assert ds.events[0].applied and ds.balancedness_F[5] > 0.25
    assert np.isfinite(ds.moe_us_F).all() and (ds.moe_us_F[0::2] == 2 * config.cost.base_us).all()


def test_solver_options_reach_the_solver() -> None:
    trace = _random_trace(seed=4, T=40)
    flags = server(ep_size=4, nnodes=1, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=10)
    # min_gain binds a priced policy's plans (scipy; DeepSeek's are applied unpriced, as SGLang does).
    config = SimulationConfig(eplb=flags, solver_options={"min_gain": 2.0})
    events = simulate(trace, parse_runs(["scipy"], "static"), config).runs[0].events
    assert len(events) == 3 and all(not e.applied and "min_gain" in e.reason for e in events)
    unknown = SimulationConfig(eplb=flags, solver_options={"static_dispatch": True})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['static_dispatch'\]"):
        simulate(trace, parse_runs(["scipy"], "static"), unknown)


def test_bad_configurations_are_value_errors() -> None:
    trace = _random_trace(seed=0)
    with pytest.raises(ValueError, match="divide evenly"):
        simulate(trace, [RunSpec("none", "static")], SimulationConfig(eplb=server(ep_size=3, nnodes=1)))
    with pytest.raises(ValueError, match="recorder-buffer-size"):
        server(ep_size=4, eplb_rebalance_num_iterations=10, expert_distribution_recorder_buffer_size=20)
    with pytest.raises(ValueError, match="unknown algorithm"):
        parse_runs(["greedy"], "static")
    with pytest.raises(ValueError, match="twice"):
        parse_runs(["deepseek", "deepseek:static"], "static")
    with pytest.raises(ValueError, match="cost model"):
        CostModel(per_token_us=float("nan"))
