"""Every plan checked against the model's shapes before the manager acts on it (one rank; the
fault harness runs the same on real Gloo ranks): a plan of more slots, of fewer experts, of
another GPU count or with dispatch weights of other sizes, applied or not, fails its rebalance
with cause ``shape``, nothing moves, serving goes on, the failed-rebalance metric counts it, and
the next plan applies; a planner's own error stays the planner's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from eplb.config import EplbConfig
from eplb.manager.manager import EplbManager
from eplb.manager.plan_check import plan_problems
from eplb.metrics import names
from eplb.metrics.prometheus import PrometheusSink
from eplb.moe.reference import reference_forward
from eplb.placement.model import Placement
from tests.helpers.manager import CFG, CPU, FakePlan, make, other_placement, run_passes, until_idle

pytestmark = pytest.mark.usefixtures("one_thread")


def more_slots(cur: Placement) -> FakePlan:
    """One slot more than the model has."""
    redundant = cur.num_physical - cur.num_logical + 1
    return FakePlan(Placement.trivial(cur.num_layers, cur.num_logical, 1, num_redundant=redundant))


def an_expert_missing(cur: Placement) -> FakePlan:
    p2l = cur.phy2log_LP.copy()
    p2l[p2l == cur.num_logical - 1] = 0  # the last expert's slots go to expert 0: E - 1 experts
    return FakePlan(Placement.from_phy2log(p2l, 1))


def two_gpus(cur: Placement) -> FakePlan:
    return FakePlan(Placement.from_phy2log(cur.phy2log_LP, 2, max_replicas=cur.max_replicas))


def weights_of(*shape: int) -> Any:
    def plan(cur: Placement) -> FakePlan:
        return FakePlan(other_placement(cur, 1), dispatch_weights_LER=np.full(shape, 0.5, dtype=np.float32))

    return plan


L, E, P = CFG.num_layers, CFG.num_experts, CFG.num_experts + 4
R = P - E + 1
WRONG = {
    "more_slots": (more_slots, "13"),
    "an_expert_missing": (an_expert_missing, "7"),
    "two_gpus": (two_gpus, "2 GPUs"),
    "weights_more_replicas": (weights_of(L, E, R + 1), "dispatch weights"),
    "weights_more_experts": (weights_of(L, E + 1, R), "dispatch weights"),
    "weights_flat": (weights_of(L, E * R), "dispatch weights"),
}


@pytest.mark.parametrize("apply", [True, False], ids=["applied", "skipped"])
@pytest.mark.parametrize("kind", list(WRONG))
def test_a_plan_of_the_wrong_shape_fails_its_rebalance_and_the_next_applies(kind: str, apply: bool) -> None:
    wrong, named = WRONG[kind]
    model, placement, w = make()
    target = other_placement(placement, 3)
    plans = [0]

    def planner(load: np.ndarray, cur: Placement) -> FakePlan:
        plans[0] += 1
        if plans[0] == 1:
            plan = wrong(cur)
            plan.apply = apply
            return plan
        return FakePlan(target)

    sink = PrometheusSink()
    manager = EplbManager(
        EplbConfig(eplb_rebalance_num_iterations=3), model, placement, device=CPU, sink=sink, planner=planner
    )
    model.recorder = manager.recorder
    run_passes(manager, model, 3)  # nothing raises out of on_forward_pass_end
    until_idle(manager, model)
    (record,) = manager.state().history
    assert (record.outcome, record.cause) == ("failed", "shape"), record
    assert record.reason.startswith("shape: the plan does not fit the model") and named in record.reason, (
        record.reason
    )
    assert manager.placement is placement  # nothing moved, and serving goes on
    x = torch.randn(5, CFG.hidden, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(model(x), reference_forward(CFG, w, x), atol=1e-5)
    failed = [
        line
        for line in sink.render().decode().splitlines()
        if line.startswith(names.REBALANCES + "{")
        and 'outcome="failed"' in line
        and not line.endswith(" 0.0")
    ]
    assert len(failed) == 1 and 'cause="failed_shape"' in failed[0], failed
    run_passes(manager, model, 3)  # the next plan fits: applied
    until_idle(manager, model)
    assert [(r.outcome, r.cause) for r in manager.state().history] == [("failed", "shape"), ("applied", None)]
    assert manager.placement.same_slots(target)
    assert torch.allclose(model(x), reference_forward(CFG, w, x), atol=1e-5)
    manager.close()


def test_a_planners_own_error_stays_the_planners_even_in_the_diffs_words() -> None:
    model, placement, _ = make()

    def planner(load: np.ndarray, cur: Placement) -> FakePlan:
        raise ValueError("placements differ in shape: the planner's own words")

    manager = EplbManager(
        EplbConfig(eplb_rebalance_num_iterations=3), model, placement, device=CPU, planner=planner
    )
    model.recorder = manager.recorder
    run_passes(manager, model, 3)
    until_idle(manager, model)
    (record,) = manager.state().history
    assert (record.outcome, record.cause) == ("failed", None) and record.reason.startswith("planner failed")
    manager.close()


def test_plan_problems_name_every_size_that_differs() -> None:
    _, placement, _ = make()
    wrong = Placement.trivial(L + 1, E - 1, 2, num_redundant=P + 2 - (E - 1))
    problems = plan_problems(wrong, np.zeros((L, E, R + 1)), placement)
    assert problems == [
        f"phy2log [L, P] = [{L + 1}, {P + 2}], the model's [{L}, {P}]",
        f"E = {E - 1} logical experts, the model's {E}",
        "G = 2 GPUs, the model's 1",
        f"dispatch weights [L, E, R] = [{L}, {E}, {R + 1}], the model's [{L}, {E}, <= {R}]",
    ]
    assert plan_problems(placement, np.zeros((L, E, 1)), placement) == []
    assert plan_problems(other_placement(placement, 4), None, placement) == []
