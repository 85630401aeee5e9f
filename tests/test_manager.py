"""The rebalance manager: pass counting, background solve, decisions, chunked swaps, rollback, metrics.

One-rank tests drive the control logic with planners passed in; a 2-rank Gloo run checks that every
rank takes the same steps on the same pass, with the real solver and a skewed router.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from eplb.config import EplbConfig
from eplb.manager.manager import EplbManager
from eplb.moe.model import MoEModel, logical_weights
from eplb.moe.reference import reference_forward
from eplb.moe.spawn import RankContext, run_ranks
from eplb.placement.model import Placement
from tests.helpers.manager import (
    CFG,
    CPU,
    FakePlan,
    RecordingSink,
    make,
    other_placement,
    run_passes,
    until_idle,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rebalance_applies_a_chunk_of_layers_per_pass() -> None:
    model, placement, w = make()
    target = other_placement(placement)
    sink = RecordingSink()
    config = EplbConfig(eplb_rebalance_num_iterations=5, eplb_rebalance_layers_per_chunk=1)
    manager = EplbManager(
        config, model, placement, device=CPU, sink=sink, planner=lambda load, cur: FakePlan(target)
    )
    model.recorder = manager.recorder
    run_passes(manager, model, 4)
    assert manager.state().phase == "idle" and manager.state().window_passes == 4
    run_passes(manager, model, 1)
    assert manager.state().phase == "solving"
    phases = []
    deadline = time.monotonic() + 10
    while manager.state().phase != "idle":
        assert time.monotonic() < deadline
        run_passes(manager, model, 1)
        phases.append((manager.state().phase, manager.state().layers_pending))
        time.sleep(0.005)
    # Three changed layers, one per pass: two passes still applying, then done.
    assert [p for p in phases if p[0] == "applying"] == [("applying", (1, 2)), ("applying", (2,))]
    assert manager.placement.same_slots(target) and model.placement.same_slots(target)
    (record,) = manager.state().history
    assert record.outcome == "applied" and record.predicted_balancedness == pytest.approx(0.99)
    assert record.balancedness_before <= 1.0 and record.experts_moved == 0  # one GPU: all copies local
    (event,) = sink.of("rebalance")
    assert event["outcome"] == "applied" and event["transfer_seconds"] > 0
    assert sink.of("topology")[0]["num_physical"] == placement.num_physical
    window = sink.of("window")[0]
    assert window["logical_load_LE"].sum() == 5 * 6 * CFG.top_k * CFG.num_layers  # 5 passes, 6 tokens, top-2
    x = torch.randn(7, CFG.hidden)
    torch.testing.assert_close(model(x), reference_forward(CFG, w, x), rtol=1e-5, atol=1e-5)
    manager.close()


def test_each_chunk_is_prepared_on_a_helper_thread_passes_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    import eplb.manager.schedule as schedule_module
    from eplb.hotswap.swap import PreparedSwap

    model, placement, w = make()
    target = other_placement(placement, 3)
    config = EplbConfig(eplb_rebalance_num_iterations=2, eplb_rebalance_layers_per_chunk=1)
    manager = EplbManager(config, model, placement, device=CPU, planner=lambda load, cur: FakePlan(target))
    model.recorder = manager.recorder
    prepared: list[tuple[tuple[int, ...], str, bool]] = []
    executed: list[tuple[tuple[int, ...], int, str]] = []
    ahead: list[list[int]] = []  # chunks being prepared when each applying pass ends
    prepare, execute = schedule_module.prepare_swap, PreparedSwap.execute

    def spy_prepare(*args: Any, **kw: Any) -> PreparedSwap:
        prepared.append((tuple(kw["layers"]), threading.current_thread().name, kw["check"]))
        return prepare(*args, **kw)

    def spy_execute(self: PreparedSwap, **kw: Any) -> Any:
        executed.append((self.layers, manager.state().passes, threading.current_thread().name))
        return execute(self, **kw)

    monkeypatch.setattr(schedule_module, "prepare_swap", spy_prepare)
    monkeypatch.setattr(PreparedSwap, "execute", spy_execute)
    run_passes(manager, model, 2)
    while manager.state().phase != "idle":
        run_passes(manager, model, 1)
        if manager._swapper.job is not None and manager.state().phase == "applying":
            ahead.append(sorted(manager._swapper.job.prepared))
    # Three changed layers, one per pass; each pass executes a swap prepared before it began.
    assert [(layers, p) for layers, p, _ in executed] == [((k,), executed[0][1] + k) for k in range(3)]
    assert ahead == [[1, 2], [2]]
    assert sorted(layers for layers, _, _ in prepared) == [(0,), (1,), (2,)]
    assert all(name.startswith("eplb-prepare") and not check for _, name, check in prepared)
    assert all(name == threading.current_thread().name for *_, name in executed)
    (record,) = manager.state().history
    assert record.outcome == "applied" and manager.placement.same_slots(target)
    x = torch.randn(7, CFG.hidden)
    torch.testing.assert_close(model(x), reference_forward(CFG, w, x), rtol=1e-5, atol=1e-5)
    manager.close()


def test_a_swap_that_cannot_be_prepared_fails_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    import eplb.manager.schedule as schedule_module

    model, placement, _ = make()
    before = [{k: v.clone() for k, v in d.items()} for d in model.slots_L]
    prepare = schedule_module.prepare_swap

    def failing_prepare(*args: Any, **kw: Any) -> Any:
        if list(kw["layers"]) == [1]:
            raise RuntimeError("no plan for layer 1")
        return prepare(*args, **kw)

    monkeypatch.setattr(schedule_module, "prepare_swap", failing_prepare)
    config = EplbConfig(eplb_rebalance_num_iterations=2, eplb_rebalance_layers_per_chunk=1)
    target = other_placement(placement, 4)
    manager = EplbManager(config, model, placement, device=CPU, planner=lambda load, cur: FakePlan(target))
    model.recorder = manager.recorder
    run_passes(manager, model, 2)
    until_idle(manager, model)
    (record,) = manager.state().history
    assert record.outcome == "failed" and "no plan for layer 1" in record.reason
    assert "layers [0] restored" in record.reason and manager.placement.same_slots(placement)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(model.slots_L, before, strict=True) for k in a)
    manager.close()


def test_serving_never_waits_for_the_solve() -> None:
    model, placement, _ = make()
    release = threading.Event()
    target = other_placement(placement, 1)

    def slow_planner(load: np.ndarray, current: Placement) -> FakePlan:
        release.wait(10)
        return FakePlan(target)

    manager = EplbManager(
        EplbConfig(eplb_rebalance_num_iterations=2), model, placement, device=CPU, planner=slow_planner
    )
    model.recorder = manager.recorder
    start = time.perf_counter()
    run_passes(manager, model, 10)  # the solve is blocked for all of these passes
    assert time.perf_counter() - start < 5 and manager.state().phase == "solving"
    release.set()
    until_idle(manager, model)
    assert manager.placement.same_slots(target)
    manager.close()


@pytest.mark.parametrize(
    "planner,outcome,reason",
    [
        (lambda load, cur: FakePlan(cur, apply=False, reason="gain too small"), "skipped", "gain too small"),
        (lambda load, cur: 1 / 0, "failed", "ZeroDivisionError"),
    ],
)
def test_skipped_and_failed_plans_keep_the_placement(planner: Any, outcome: str, reason: str) -> None:
    model, placement, _ = make()
    sink = RecordingSink()
    manager = EplbManager(
        EplbConfig(eplb_rebalance_num_iterations=3), model, placement, device=CPU, sink=sink, planner=planner
    )
    model.recorder = manager.recorder
    run_passes(manager, model, 3)
    until_idle(manager, model)
    (record,) = manager.state().history
    assert record.outcome == outcome and reason in record.reason
    assert sink.of("rebalance")[0]["outcome"] == outcome
    assert manager.placement is placement
    manager.close()


def test_threshold_skips_without_solving() -> None:
    model, placement, _ = make()
    calls = []
    config = EplbConfig(eplb_rebalance_num_iterations=3, eplb_min_rebalancing_utilization_threshold=0.0)
    manager = EplbManager(config, model, placement, device=CPU, planner=lambda load, cur: calls.append(1))
    model.recorder = manager.recorder
    run_passes(manager, model, 3)
    (record,) = manager.state().history
    assert record.outcome == "skipped" and "threshold" in record.reason and calls == []
    manager.close()


def test_failed_swap_rolls_back_every_applied_chunk() -> None:
    model, placement, _ = make()
    target = other_placement(placement, 2)
    before = [{k: v.clone() for k, v in d.items()} for d in model.slots_L]
    swaps = []

    def fault(stage: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if stage == "prepare" and chunk == 0:
            swaps.append(1)
            if len(swaps) == 2:  # the second layer chunk of the rebalance fails
                raise RuntimeError("injected")

    config = EplbConfig(eplb_rebalance_num_iterations=2, eplb_rebalance_layers_per_chunk=1)
    manager = EplbManager(
        config, model, placement, device=CPU, planner=lambda load, cur: FakePlan(target), swap_fault=fault
    )
    model.recorder = manager.recorder
    run_passes(manager, model, 2)
    until_idle(manager, model)
    (record,) = manager.state().history
    assert record.outcome == "failed" and "injected" in record.reason and "restored" in record.reason
    assert manager.placement.same_slots(placement) and model.placement.same_slots(placement)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(model.slots_L, before, strict=True) for k in a)
    manager.close()


def test_prefill_only_counts_only_prefill_passes() -> None:
    model, placement, _ = make()
    sink = RecordingSink()
    config = EplbConfig(eplb_rebalance_num_iterations=4, eplb_record_prefill_only=True)
    manager = EplbManager(
        config, model, placement, device=CPU, sink=sink, planner=lambda load, cur: FakePlan(cur, apply=False)
    )
    model.recorder = manager.recorder
    run_passes(manager, model, 5, prefill=False)
    assert manager.state().counted_passes == 0 and manager.state().window_passes == 0
    run_passes(manager, model, 3, prefill=True)
    assert manager.state().counted_passes == 3 and manager.state().passes == 8
    assert [e["recorded"] for e in sink.of("pass")] == [False] * 5 + [True] * 3
    assert [e["kind"] for e in sink.of("pass")][-1] == "prefill"
    manager.close()


def test_window_keeps_the_last_passes() -> None:
    model, placement, _ = make()
    config = EplbConfig(eplb_rebalance_num_iterations=100, expert_distribution_recorder_buffer_size=3)
    manager = EplbManager(config, model, placement, device=CPU, planner=lambda load, cur: FakePlan(cur))
    for i in range(5):
        manager.on_forward_pass_begin(is_prefill=False)
        manager.recorder.pass_counts_LP[0, 0] = i + 1  # slot 0 holds expert 0
        manager.on_forward_pass_end()
    window = manager.recorder.window_logical_counts()
    assert window[:, 0, 0].tolist() == [3, 4, 5] and int(manager.recorder.pass_counts_LP.sum()) == 0
    manager.close()


def test_token_mode_cannot_drive_rebalancing() -> None:
    model, placement, _ = make()
    config = EplbConfig(expert_distribution_recorder_mode="per_token")
    with pytest.raises(ValueError, match="stat or per_pass"):
        EplbManager(config, model, placement, device=CPU)


# ---- two ranks ---------------------------------------------------------------------------------
def two_rank_run(ctx: RankContext) -> dict[str, Any]:
    w = logical_weights(CFG)
    placement = Placement.trivial(CFG.num_layers, CFG.num_experts, 2, num_redundant=2)
    model = MoEModel(CFG, placement, rank=ctx.rank, device=ctx.device, weights=w, remap_backend="torch")
    sink = RecordingSink()
    config = EplbConfig(
        enable_eplb=True,
        ep_size=2,
        eplb_rebalance_num_iterations=6,
        eplb_rebalance_layers_per_chunk=2,
        eplb_record_prefill_only=True,
    )
    manager = EplbManager(config, model, placement, device=ctx.device, sink=sink)
    model.recorder = manager.recorder
    bias = torch.zeros(CFG.num_layers, CFG.num_experts)
    bias[:, 2:4] = 4.0  # experts 2 and 3 (only rank 0 holds them) take most tokens
    g = torch.Generator().manual_seed(ctx.rank)
    phases = []
    for step in range(40):
        # Only rank 0 ever has prefill, and only on even steps: rank 1 must count the same passes.
        manager.on_forward_pass_begin(is_prefill=ctx.rank == 0 and step % 2 == 0, num_tokens=8)
        model(torch.randn(8, CFG.hidden, generator=g), bias)
        manager.on_forward_pass_end()
        phases.append(manager.state().phase)
        time.sleep(0.002)
    x = torch.randn(5, CFG.hidden, generator=g)
    err = float((model(x, bias) - reference_forward(CFG, w, x, bias)).abs().max())
    state = manager.state()
    manager.close()
    return {
        "phases": phases,
        "counted": state.counted_passes,
        "history": [
            (r.at_pass, r.outcome, r.balancedness_before, r.balancedness_after) for r in state.history
        ],
        "phy2log": state.placement.phy2log_LP.tolist(),
        "err": err,
        "recorded": [e["recorded"] for e in sink.of("pass")],
    }


def test_two_ranks_adopt_the_same_plan_on_the_same_pass() -> None:
    r0, r1 = run_ranks(two_rank_run, 2, timeout_s=120)
    assert r0["phases"] == r1["phases"] and r0["counted"] == r1["counted"] == 20
    assert r0["recorded"] == r1["recorded"] == [step % 2 == 0 for step in range(40)]
    assert r0["history"] == r1["history"] and r0["phy2log"] == r1["phy2log"]
    applied = [h for h in r0["history"] if h[1] == "applied"]
    assert applied and applied[0][3] > applied[0][2]  # the skewed window balances better afterwards
    assert "applying" in r0["phases"]
    assert r0["err"] < 1e-5 and r1["err"] < 1e-5
