"""Continuous mode: the move budget reaches the planner, a rebalance every interval from a longer
window, swaps paced beside the passes, and every rank switching maps on the same pass.

The paced run is 2 real ranks over Gloo; its schedule is checked against a closed form (chunk i goes
on the first pass whose earned credit covers the bytes of chunks 0..i, each pass earning the cap
times the longest rank's duration) with costs counted slot by slot from the two placements.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from eplb.config import CONTINUOUS_MAX_MOVED_EXPERTS, EplbConfig
from eplb.manager.manager import EplbManager
from eplb.moe.model import MoEModel, logical_weights
from eplb.moe.reference import reference_forward
from eplb.moe.spawn import RankContext, run_ranks
from eplb.placement.model import Placement
from eplb.solver.types import SolveOptions
from tests.helpers.manager import CFG, CPU, FakePlan, make, other_placement, run_passes, until_idle
from tests.helpers.placements import random_phy2log

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("config", "extra"),
    [
        # The default budget scales with the model's layers (eplb.config.continuous_move_budget).
        (EplbConfig(eplb_rebalance_mode="continuous"), {"max_moved_experts": -1}),
        (EplbConfig(eplb_rebalance_mode="continuous", eplb_max_moved_experts=7), {"max_moved_experts": 7}),
        (EplbConfig(eplb_rebalance_mode="continuous", eplb_max_moved_experts=0), {"max_moved_experts": 0}),
        (EplbConfig(eplb_max_moved_experts=5), {"max_moved_experts": 5}),
        (EplbConfig(), {}),  # periodic: the planner SGLang's flags always made
    ],
)
def test_the_move_budget_reaches_the_planner(
    config: EplbConfig, extra: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import eplb.solver.planner as planner_module

    made: list[dict[str, Any]] = []

    class Recording:
        def __init__(self, **kw: Any) -> None:
            made.append(kw)

    monkeypatch.setattr(planner_module, "SolverPlanner", Recording)
    model, placement, _ = make()
    if extra.get("max_moved_experts") == -1:
        extra = {"max_moved_experts": round(CONTINUOUS_MAX_MOVED_EXPERTS * placement.num_layers / 58)}
    EplbManager(config, model, placement, device=CPU, num_groups=2).close()
    bytes_per_expert = sum(t[0].numel() * t.element_size() for t in model.slot_tensors(0).values())
    # Every other option keeps its default.
    want = SolveOptions(
        algorithm="auto",
        bytes_per_expert=bytes_per_expert,
        # The server's dispatch (static unless a flag says otherwise): plans scored with its shares.
        dispatch=config.dispatch_algorithm,
        **extra,  # type: ignore[arg-type]
    )
    assert config.dispatch_algorithm == "static"
    assert made == [{"options": want, "num_groups": 2}]


def test_continuous_mode_rebalances_every_interval_from_a_longer_window() -> None:
    model, placement, _ = make()
    targets = [other_placement(placement, 5), other_placement(placement, 6)]
    windows: list[int] = []

    def planner(load_WLE: np.ndarray, current: Placement) -> FakePlan:
        windows.append(load_WLE.shape[0])
        return FakePlan(targets[len(windows) % 2])

    config = EplbConfig(
        eplb_rebalance_mode="continuous",
        eplb_rebalance_num_iterations=4,
        expert_distribution_recorder_buffer_size=10,
    )
    manager = EplbManager(config, model, placement, device=CPU, planner=planner)
    model.recorder = manager.recorder
    for step in range(30):
        run_passes(manager, model, 1, seed=step)
        time.sleep(0.01)  # the background solve finishes within the pass after its trigger
    state = manager.state()
    assert [at for at, _ in state.windows] == [4, 8, 12, 16, 20, 24, 28]
    assert windows == [4, 8, 10, 10, 10, 10, 10]  # the window reaches back over earlier rebalances
    assert [r.outcome for r in state.history] == ["applied"] * 7
    assert [r.at_pass for r in state.history] == [5, 9, 13, 17, 21, 25, 29]
    assert manager.placement.same_slots(targets[1])
    manager.close()


class _BudgetedPlanner:
    """A planner with a move budget to drop (as SolverPlanner has): records which one planned,
    ``full`` (unfitted, budget dropped), ``fresh`` (unfitted, budget kept) or ``budgeted``."""

    def __init__(
        self, calls: list[str], targets: list[Placement], kind: str = "budgeted", skip_first: bool = False
    ) -> None:
        self.calls, self.targets, self.kind, self.skip_first = calls, targets, kind, skip_first

    def for_unfitted_placement(self, *, drop_budget: bool = True) -> _BudgetedPlanner:
        kind = "full" if drop_budget else "fresh"
        return _BudgetedPlanner(self.calls, self.targets, kind=kind, skip_first=self.skip_first)

    def __call__(self, load_WLE: np.ndarray, current: Placement, history: object = None) -> FakePlan:
        self.calls.append(self.kind)
        apply = not (self.skip_first and len(self.calls) == 1)
        return FakePlan(self.targets[len(self.calls) % 2], apply=apply)


def _first_three_plans(fields: dict[str, Any], skip_first: bool = False) -> list[str]:
    """Which planner (budgeted or full) made each of the first three plans of a manager."""
    model, placement, _ = make()
    targets = [other_placement(placement, 5), other_placement(placement, 6)]
    calls: list[str] = []
    config = EplbConfig(**{"eplb_rebalance_mode": "continuous", "eplb_rebalance_num_iterations": 4, **fields})
    planner = _BudgetedPlanner(calls, targets, skip_first=skip_first)
    manager = EplbManager(config, model, placement, device=CPU, planner=planner)
    _run_until_plans(manager, model, calls, 3)
    manager.close()
    return calls


def _run_until_plans(manager: EplbManager, model: MoEModel, plans: list[Any], n: int) -> None:
    """Run single passes (each to the manager's idle) until ``plans`` holds ``n`` entries."""
    model.recorder = manager.recorder
    for step in range(40):
        run_passes(manager, model, 1, seed=step)
        until_idle(manager, model)
        if len(plans) == n:
            break


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({}, ["full", "budgeted", "budgeted"]),  # the first plan since start-up moves unbudgeted
        # Without the initial full plan, the first plan from the unfitted placement is still a
        # fresh one (eplb.policy.decision.Decider.planner), within the budget.
        ({"eplb_initial_full_plan": False}, ["fresh", "budgeted", "budgeted"]),
        # A budget of 0 moves nothing, ever: no unbudgeted first plan either.
        ({"eplb_max_moved_experts": 0}, ["fresh", "budgeted", "budgeted"]),
        ({"eplb_rebalance_mode": "periodic", "eplb_max_moved_experts": 5}, ["fresh", "budgeted", "budgeted"]),
    ],
)
def test_the_first_plan_since_start_up_moves_without_the_budget(
    fields: dict[str, Any], want: list[str]
) -> None:
    assert _first_three_plans(fields) == want


def test_a_skipped_first_plan_leaves_the_next_one_unbudgeted() -> None:
    assert _first_three_plans({}, skip_first=True) == ["full", "full", "budgeted"]


def test_a_start_up_placement_from_a_file_is_already_fitted() -> None:
    assert not EplbConfig(
        eplb_rebalance_mode="continuous", init_expert_location="placement.json"
    ).initial_full_plan
    assert EplbConfig(eplb_rebalance_mode="continuous").initial_full_plan


def test_paced_chunks_of_local_copies_wait_for_no_credit() -> None:
    model, placement, w = make()  # one GPU: every copy is local, so no chunk costs link bytes
    target = other_placement(placement, 7)
    config = EplbConfig(
        eplb_rebalance_mode="continuous", eplb_rebalance_num_iterations=2, eplb_transfer_gbps=1e-12
    )
    manager = EplbManager(config, model, placement, device=CPU, planner=lambda load, cur: FakePlan(target))
    model.recorder = manager.recorder
    run_passes(manager, model, 2)
    until_idle(manager, model)
    (record,) = manager.state().history
    assert record.outcome == "applied" and manager.placement.same_slots(target)
    x = torch.randn(7, CFG.hidden)
    torch.testing.assert_close(model(x), reference_forward(CFG, w, x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pass_seconds"):
        manager.on_forward_pass_end(pass_seconds=-1.0)
    manager.close()


# ---- two ranks, paced ----------------------------------------------------------------------------
PACED_STEPS = 24
PACED_GBPS = 7e-6  # 7000 bytes per second of pass: a 6144-byte expert every pass or so
PACED_SECONDS_RK = np.array(
    [
        [1.0 if k % 2 == 0 else 0.25 for k in range(PACED_STEPS)],
        [0.5 if k % 2 == 0 else 0.75 for k in range(PACED_STEPS)],
    ]
)
"""Each rank's pass durations: rank 0 is the slower on even passes, rank 1 on odd ones."""


def paced_placements() -> tuple[Placement, Placement]:
    old = Placement.trivial(CFG.num_layers, CFG.num_experts, 2, num_redundant=2)
    p2l = random_phy2log(np.random.default_rng(1), old.num_layers, old.num_logical, old.num_physical)
    return old, Placement.from_phy2log(p2l, 2, max_replicas=old.max_replicas)


def paced_run(ctx: RankContext) -> dict[str, Any]:
    w = logical_weights(CFG)
    placement, target = paced_placements()
    model = MoEModel(CFG, placement, rank=ctx.rank, device=ctx.device, weights=w, remap_backend="torch")
    pointers = [t.data_ptr() for layer in range(CFG.num_layers) for t in model.slot_tensors(layer).values()]
    switches: list[tuple[int, list[int]]] = []  # (pass, layers whose maps changed)
    step = 0
    set_placement = model.set_placement

    def spy(new: Placement, weights: np.ndarray | None = None) -> None:
        changed = np.flatnonzero((new.phy2log_LP != model.placement.phy2log_LP).any(axis=1)).tolist()
        if changed:
            switches.append((step, changed))
        set_placement(new, weights)

    model.set_placement = spy  # type: ignore[method-assign]
    config = EplbConfig(
        enable_eplb=True,
        ep_size=2,
        eplb_rebalance_mode="continuous",
        eplb_rebalance_num_iterations=4,
        eplb_transfer_gbps=PACED_GBPS,
    )
    manager = EplbManager(
        config, model, placement, device=ctx.device, planner=lambda load, cur: FakePlan(target)
    )
    model.recorder = manager.recorder
    g = torch.Generator().manual_seed(ctx.rank)
    phases = []
    for step in range(PACED_STEPS):
        manager.on_forward_pass_begin(is_prefill=False, num_tokens=6)
        model(torch.randn(6, CFG.hidden, generator=g))
        manager.on_forward_pass_end(pass_seconds=float(PACED_SECONDS_RK[ctx.rank, step]))
        phases.append(manager.state().phase)
        time.sleep(0.005)
    x = torch.randn(5, CFG.hidden, generator=g)
    err = float((model(x) - reference_forward(CFG, w, x)).abs().max())
    state = manager.state()
    manager.close()
    return {
        "switches": switches,
        "phases": phases,
        "outcomes": [r.outcome for r in state.history],
        "phy2log": state.placement.phy2log_LP.tolist(),
        "same_storage": pointers
        == [t.data_ptr() for layer in range(CFG.num_layers) for t in model.slot_tensors(layer).values()],
        "err": err,
    }


def arrival_bytes(old: Placement, new: Placement, layer: int, bytes_per_expert: int) -> int:
    """The most bytes one GPU receives for ``layer``: experts it holds under new but not old."""
    S = old.num_physical // old.num_gpus
    worst = 0
    for g in range(old.num_gpus):
        before = set(old.phy2log_LP[layer, g * S : (g + 1) * S].tolist())
        after = set(new.phy2log_LP[layer, g * S : (g + 1) * S].tolist())
        worst = max(worst, len(after - before))
    return worst * bytes_per_expert


def test_pacing_spreads_a_swap_and_every_rank_switches_on_the_same_pass() -> None:
    r0, r1 = run_ranks(paced_run, 2, timeout_s=120)
    assert r0["switches"] == r1["switches"] and r0["phases"] == r1["phases"]
    assert r0["phy2log"] == r1["phy2log"]
    old, target = paced_placements()
    assert r0["phy2log"] == target.phy2log_LP.tolist()
    assert r0["outcomes"][0] == "applied" and set(r0["outcomes"]) == {"applied"}

    # Reference schedule: one layer per chunk, in layer order; credit from the adoption pass on.
    bytes_per_expert = (2 * CFG.intermediate * CFG.hidden + CFG.hidden * CFG.intermediate) * 4
    costs = [arrival_bytes(old, target, layer, bytes_per_expert) for layer in range(CFG.num_layers)]
    assert all(c > 0 for c in costs)
    adopted = r0["phases"].index("applying")
    earned = np.cumsum(PACED_GBPS * 1e9 * PACED_SECONDS_RK.max(axis=0)[adopted:])
    expected = [
        (adopted + int(np.argmax(earned >= need)), [layer]) for layer, need in enumerate(np.cumsum(costs))
    ]
    assert r0["switches"] == expected
    passes = {at for at, _ in expected}
    assert len(passes) == len(costs) and max(passes) - adopted + 1 >= 5  # spread over several passes
    for at, _ in r0["switches"]:  # never ahead of the cap
        sent = sum(c for (when, _), c in zip(r0["switches"], costs, strict=True) if when <= at)
        assert sent <= earned[at - adopted]
    assert r0["same_storage"] and r1["same_storage"]  # captured CUDA graphs stay valid
    assert r0["err"] < 1e-5 and r1["err"] < 1e-5


# ---- two ranks, the real solver under a budget ---------------------------------------------------
def budget_run(ctx: RankContext, budget: int, initial_full_plan: bool = False) -> dict[str, Any]:
    placement = Placement.trivial(CFG.num_layers, CFG.num_experts, 2, num_redundant=2)
    model = MoEModel(CFG, placement, rank=ctx.rank, device=ctx.device, remap_backend="torch")
    config = EplbConfig(
        enable_eplb=True,
        ep_size=2,
        eplb_rebalance_mode="continuous",
        eplb_rebalance_num_iterations=5,
        expert_distribution_recorder_buffer_size=15,
        eplb_max_moved_experts=budget,
        eplb_initial_full_plan=initial_full_plan,
    )
    manager = EplbManager(config, model, placement, device=ctx.device)
    model.recorder = manager.recorder
    bias = torch.zeros(CFG.num_layers, CFG.num_experts)
    bias[:, 2:4] = 4.0  # experts 2 and 3 (only rank 0 holds them) take most tokens
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(40):
        manager.on_forward_pass_begin(is_prefill=True, num_tokens=8)
        model(torch.randn(8, CFG.hidden, generator=g), bias)
        manager.on_forward_pass_end()
        time.sleep(0.002)
    state = manager.state()
    manager.close()
    return {
        "history": [(r.at_pass, r.outcome, r.experts_moved) for r in state.history],
        "phy2log": state.placement.phy2log_LP.tolist(),
    }


@pytest.mark.parametrize("budget", [0, 1])
def test_real_solver_keeps_every_rebalance_within_the_budget(budget: int) -> None:
    """With --no-eplb-initial-full-plan every plan keeps the budget (the first one included)."""
    r0, r1 = run_ranks(budget_run, 2, args=(budget,), timeout_s=120)
    assert r0 == r1
    assert len(r0["history"]) >= 3 and "failed" not in {outcome for _, outcome, _ in r0["history"]}
    assert all(moved <= budget for *_, moved in r0["history"])
    start = Placement.trivial(CFG.num_layers, CFG.num_experts, 2, num_redundant=2)
    if budget == 0:
        assert Placement.from_phy2log(np.asarray(r0["phy2log"]), 2).same_slots(start)
    else:
        assert any(moved == 1 for *_, moved in r0["history"])  # the skew is worth a move


def test_with_the_initial_full_plan_only_the_first_plan_may_exceed_the_budget() -> None:
    """--eplb-initial-full-plan (the default): the documented exception is the first plan alone."""
    r0, r1 = run_ranks(budget_run, 2, args=(1, True), timeout_s=120)
    assert r0 == r1
    history = r0["history"]
    assert len(history) >= 3 and "failed" not in {outcome for _, outcome, _ in history}
    assert history[0][1] == "applied" and history[0][2] > 1  # the first plan took more than the budget
    assert all(moved <= 1 for *_, moved in history[1:])  # and only the first


class _AllowancePlanner:
    """A planner taking continuous mode's budgets (as SolverPlanner does): records each plan's."""

    def __init__(self, budgets: list[tuple[int, int | None]], targets: list[Placement]) -> None:
        self.budgets, self.targets = budgets, targets
        self.pending: tuple[int, int | None] | None = None

    def with_move_budget(self, budget: int, shift_budget: int | None) -> _AllowancePlanner:
        self.pending = (budget, shift_budget)
        return self

    def __call__(self, load_WLE: np.ndarray, current: Placement, history: object = None) -> FakePlan:
        assert self.pending is not None, "continuous mode passes its budgets to every plan"
        self.budgets.append(self.pending)
        self.pending = None
        return FakePlan(self.targets[len(self.budgets) % 2])


def test_the_move_allowance_gives_every_plan_its_budgets() -> None:
    """One GPU: every copy is local, so no plan spends against the rate and every plan gets the
    full budget and burst (the repayment is checked on MoveAllowance itself and in the simulator)."""
    model, placement, _ = make()
    targets = [other_placement(placement, 5), other_placement(placement, 6)]
    budgets: list[tuple[int, int | None]] = []
    config = EplbConfig(
        eplb_rebalance_mode="continuous",
        eplb_rebalance_num_iterations=4,
        eplb_max_moved_experts=2,
        eplb_shift_burst=3,
        eplb_initial_full_plan=False,
    )
    manager = EplbManager(config, model, placement, device=CPU, planner=_AllowancePlanner(budgets, targets))
    _run_until_plans(manager, model, budgets, 3)
    history = manager.state().history
    manager.close()
    assert [r.outcome for r in history] == ["applied"] * 3
    assert budgets == [(2, 6)] * 3
    with pytest.raises(ValueError, match="--eplb-shift-burst"):
        EplbConfig(eplb_rebalance_mode="continuous", eplb_shift_burst=0)
