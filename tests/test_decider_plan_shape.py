"""A planner's plan of the wrong shape, through the one rebalance path (eplb.policy.decision): more
or fewer slots, another layer count, expert ids out of range, dispatch weights of another dtype or
with NaN, no Placement at all. Every caller of the Decider (here its own call, the simulator and
``eplb solve``) gets an outcome not applied, with cause ``shape`` and no plan, never an
exception; the run goes on, and a plan that fits is passed on untouched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eplb.cli import main
from eplb.config import EplbConfig
from eplb.placement.model import Placement
from eplb.policy.base import Proposal
from eplb.policy.decision import Decider, Request
from eplb.policy.plan_check import SHAPE
from eplb.simulate.config import SimulationConfig
from eplb.simulate.engine import simulate
from eplb.simulate.planners import RunSpec
from eplb.solver.types import Topology
from eplb.traces import Trace

L, E, G = 2, 8, 4
CURRENT = Placement.trivial(L, E, G)
FITS = Placement.from_phy2log(np.array([[2, 1, 0, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 7, 6]], np.int32), G)


def _wrong(kind: str, current: Placement) -> Proposal:
    """A plan of the wrong shape for ``current``."""
    L, E, G = current.num_layers, current.num_logical, current.num_gpus
    if kind == "more_slots":
        return Proposal(Placement.trivial(L, E, G, num_redundant=current.num_physical - E + G))
    if kind == "fewer_layers":
        return Proposal(Placement.trivial(L + 1 if L == 1 else L - 1, E, G))
    if kind == "ids_out_of_range":
        return Proposal(Placement.trivial(L, E + G, G))
    if kind == "int_weights":
        return Proposal(current, dispatch_weights_LER=np.ones((L, E, 1), np.int64))
    if kind == "nan_weights":
        return Proposal(current, dispatch_weights_LER=np.full((L, E, 1), np.nan, np.float32))
    if kind == "not_a_placement":
        return Proposal(current.phy2log_LP.astype(np.float32))  # type: ignore[arg-type]
    raise AssertionError(kind)


KINDS = {
    "more_slots": "phy2log [L, P]",
    "fewer_layers": "phy2log [L, P]",
    "ids_out_of_range": "expert ids outside",
    "int_weights": "dispatch weights of dtype int64",
    "nan_weights": "NaN",
    "not_a_placement": "not an eplb Placement",
}


class _WrongFirst:
    """A planner whose first plan is of the wrong shape, the rest fitting plans it calls applied."""

    def __init__(self, kind: str, fits: Placement | None = None) -> None:
        self.kind, self.fits, self.calls = kind, fits, 0

    def __call__(self, window: np.ndarray, current: Placement, history: Any = None) -> Proposal:
        self.calls += 1
        if self.calls == 1:
            return _wrong(self.kind, current)
        return Proposal(self.fits or current, apply=True, reason="the planner's own")


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_decider_refuses_a_plan_of_the_wrong_shape_as_an_outcome(kind: str) -> None:
    decider = Decider(EplbConfig(ep_size=G, eplb_rebalance_num_iterations=10))
    planner = _WrongFirst(kind, FITS)
    window = np.ones((10, L, E), np.int64)
    request = Request(window_WLE=window, current=CURRENT, planner=planner)
    bad = decider.rebalance(request, counted_pass=10, window_balancedness=0.5)
    assert (bad.applied, bad.cause, bad.plan, bad.diff) == (False, SHAPE, None, None)
    assert bad.reason.startswith("shape: the plan does not fit the model: ") and KINDS[kind] in bad.reason
    assert not decider.fitted  # recorded as not applied
    good = decider.rebalance(request, counted_pass=20, window_balancedness=0.5)
    assert (
        good.applied and good.cause is None and good.placement is FITS and good.reason == "the planner's own"
    )
    assert good.diff is not None and good.diff.experts_moved_across_gpus > 0


@pytest.mark.parametrize("kind", ["more_slots", "fewer_layers", "nan_weights"])
def test_the_simulator_records_a_shape_refusal_and_runs_on(kind: str) -> None:
    counts = np.random.default_rng(0).integers(0, 50, (60, L, E)).astype(np.int32)
    trace = Trace.from_counts(counts)
    flags = EplbConfig(
        enable_eplb=True, ep_size=G, eplb_rebalance_num_iterations=10, eplb_dispatch_cost="none"
    )
    planner = _WrongFirst(kind, FITS)
    result = simulate(
        trace, [RunSpec("mine", "static")], SimulationConfig(eplb=flags), planners={"mine:static": planner}
    )
    events = result.runs[0].events
    assert len(events) >= 3 and planner.calls == len(events)  # every later rebalance still planned
    assert (
        not events[0].applied and events[0].reason.startswith("shape: ") and KINDS[kind] in events[0].reason
    )
    assert events[0].predicted_balancedness is None
    assert events[1].applied and result.runs[0].final_placement is not None
    assert result.runs[0].final_placement.same_slots(FITS)


def test_eplb_solve_writes_the_start_when_the_plan_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import eplb.simulate.planners as planners

    monkeypatch.setattr(planners, "make_planner", lambda spec, config: _WrongFirst("more_slots"))
    out, report = tmp_path / "solved", tmp_path / "solve.json"
    argv = [
        "solve",
        "--preset",
        "tiny",
        "--steps",
        "40",
        "--disable-tqdm",
        "--out",
        str(out),
        "--json",
        str(report),
    ]
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(report.read_text())
    assert result["solver_says_apply"] is False and result["solver_reason"].startswith("shape: ")
    assert result["solver_predicted_balancedness"] is None
    assert result["moves"]["experts_moved_across_gpus"] == 0  # the start (trivial) placement is written
    assert result["balancedness_on_window"] == result["balancedness_on_window_before"]


class _FreshWrongFirst(_WrongFirst):
    """The same, planning fresh (no live placement) on a topology of its own."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind, CURRENT)
        self.topology = Topology(num_gpus=G, num_physical=E)

    def plan_fresh(self, window: np.ndarray) -> Proposal:
        return self(window, CURRENT)


@pytest.mark.parametrize("kind", ["more_slots", "fewer_layers", "ids_out_of_range", "nan_weights"])
def test_a_fresh_plan_of_the_wrong_shape_is_refused_on_the_planners_topology(kind: str) -> None:
    decider = Decider(EplbConfig(ep_size=G, eplb_rebalance_num_iterations=10))
    planner = _FreshWrongFirst(kind)
    request = Request(window_WLE=np.ones((10, L, E), np.int64), current=None, planner=planner)
    bad = decider.rebalance(request, counted_pass=10, window_balancedness=0.5)
    assert (bad.applied, bad.cause, bad.plan) == (False, SHAPE, None)
    assert KINDS[kind] in bad.reason
    good = decider.rebalance(request, counted_pass=20, window_balancedness=0.5)
    assert good.applied and good.cause is None and good.placement is CURRENT
