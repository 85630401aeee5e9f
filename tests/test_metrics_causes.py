"""Rebalance causes: every reason the code writes maps to the cause it means; the list is closed.

The solver's reasons come from live ``solve`` calls (so a rewording there shows up here); the
manager's and the hot-swap's are the formats they write, with the numbers they interpolate.
"""

from __future__ import annotations

import numpy as np
import pytest

from eplb.metrics.causes import (
    CAUSE_HELP,
    REBALANCE_CAUSES,
    REBALANCE_OUTCOMES,
    causes_of,
    check_cause,
    rebalance_cause,
)
from eplb.placement.model import Placement
from eplb.solver.solve import solve
from eplb.solver.types import SolveOptions, Topology

SWAP = "hot-swap of layers [3, 4] failed and was rolled back: "


@pytest.mark.parametrize(
    ("outcome", "reason", "cause"),
    [
        ("applied", "predicted balancedness 0.6123 -> 0.9310 for 17 expert copies", "applied"),
        ("applied", "", "applied"),
        ("skipped", "the window holds no load", "skipped_empty"),
        ("skipped", "balancedness 0.9512 above threshold 0.9", "skipped_threshold"),
        ("skipped", "the plan equals the current placement", "skipped_unchanged"),
        ("skipped", "moves 40 expert copies (1761607680 bytes), over max_bytes_moved=1000", "skipped_budget"),
        ("skipped", "predicted balancedness gain +0.0010 (0.9 -> 0.901) < min_gain 0.002", "skipped_gain"),
        ("skipped", "gain too small", "skipped_gain"),
        ("skipped", "test plan", "skipped_other"),
        ("failed", "planner failed: ZeroDivisionError: division by zero", "failed_planner"),
        ("failed", "planner failed: TimeoutError: solver ran out of time", "failed_planner"),
        ("failed", SWAP + "chunk 0 wait: TimeoutError: not done after 5.0 s", "failed_timeout"),
        ("failed", SWAP + "TimeoutError: transfers not done after 5.0 s", "failed_timeout"),
        ("failed", SWAP + "chunk 1 verify: checksum mismatch in transfers [2, 7]", "failed_checksum"),
        ("failed", SWAP + "another rank failed; layers [1] restored", "failed_peer"),
        ("failed", "preparing the swap failed on another rank", "failed_peer"),
        ("failed", "preparing the swap failed: ValueError: ranks disagree on the placements", "failed_peer"),
        (
            "failed",
            SWAP + "chunk 0 post: RuntimeError: 1 rank(s) could not allocate 88 bytes",
            "failed_memory",
        ),
        ("failed", SWAP + "chunk 0 post: torch.OutOfMemoryError: CUDA out of memory", "failed_memory"),
        (
            "failed",
            "preparing the swap failed: ValueError: layer 2 tensor 'w1' has 6 slots, expected S=8",
            "failed_shape",
        ),
        (
            "failed",
            "preparing the swap failed: ValueError: current (3, 8) and target (3, 9) must both be [L, P]",
            "failed_shape",
        ),
        (
            "failed",
            "preparing the swap failed: ValueError: the placement spans 4 GPUs but the group has 2 ranks",
            "failed_shape",
        ),
        ("failed", "rebalance watchdog: in flight over the bound of 600 s, in the solve", "failed_watchdog"),
        (
            "failed",
            SWAP
            + "timeout: rebalance watchdog: in flight over the bound of 600 s, in the transfer; the swap's "
            "process group was dropped",
            "failed_watchdog",
        ),
        ("failed", SWAP + "timeout: rank 1 (at chunk 1) timed out: rank 0 waited 2.0 s", "failed_timeout"),
        ("failed", SWAP + "peer lost: rank 1 left the swap at chunk 1 (KeyboardInterrupt: )", "failed_peer"),
        (
            "failed",
            "preparing the swap failed: HotSwapShapeError: shape: rank 1 cannot run this hot-swap: x",
            "failed_shape",
        ),
        (
            "failed",
            "cannot make a fresh swap group: after a swap given up, the ranks disagree on the placement they hold",
            "failed_peer",
        ),
        ("failed", SWAP + "chunk 0 post: RuntimeError: NCCL error", "failed_other"),
        ("failed", "", "failed_other"),
    ],
)
def test_reasons_the_code_writes_map_to_their_cause(outcome: str, reason: str, cause: str) -> None:
    assert rebalance_cause(outcome, reason) == cause
    assert cause in causes_of(outcome)


def _solver_case() -> tuple[np.ndarray, Topology, Placement]:
    rng = np.random.default_rng(0)
    L, E, G = 2, 8, 2
    topology = Topology(num_gpus=G, num_physical=10)
    current = Placement.trivial(L, E, G, num_redundant=2)
    return rng.gamma(0.5, size=(4, L, E)) * 100, topology, current


def test_the_solvers_own_reasons_map_to_their_cause() -> None:
    load_WLE, topology, current = _solver_case()
    gain = solve(load_WLE, topology, current, SolveOptions(algorithm="scipy", min_gain=5.0))
    assert not gain.apply and rebalance_cause("skipped", gain.reason) == "skipped_gain", gain.reason
    # min_gain applies to a priced policy only: DeepSeek's plans are applied as SGLang applies them.
    unpriced = solve(load_WLE, topology, current, SolveOptions(algorithm="deepseek", min_gain=5.0))
    assert unpriced.apply and "applied unpriced" in unpriced.reason, unpriced.reason
    assert rebalance_cause("applied", unpriced.reason) == "applied"
    for algorithm in ("deepseek", "scipy"):
        none = solve(load_WLE, topology, current, SolveOptions(algorithm=algorithm, max_moved_experts=0))
        assert not none.apply and rebalance_cause("skipped", none.reason) == "skipped_unchanged", none.reason
    first = solve(load_WLE, topology, None)
    assert first.apply and rebalance_cause("applied", first.reason) == "applied"


def test_a_plan_that_does_not_pay_for_its_transfer_has_a_listed_cause() -> None:
    load_WLE, topology, current = _solver_case()
    # Moving freely (copy_cost 0) with experts of 1 GB: the gain does not pay for the transfer.
    dear = solve(load_WLE, topology, current, SolveOptions(copy_cost=0.0, bytes_per_expert=10**9))
    assert not dear.apply and "does not pay" in dear.reason, dear.reason
    # The gain against its cost: not a window, threshold, unchanged-plan or budget skip, nor the
    # custom planners' catch-all.
    assert rebalance_cause("skipped", dear.reason) == "skipped_gain", dear.reason


def test_the_enumeration_is_closed_and_documented() -> None:
    assert set(REBALANCE_OUTCOMES) == {"applied", "skipped", "failed"}
    by_outcome = [causes_of(o) for o in REBALANCE_OUTCOMES]
    # Each cause belongs to exactly one outcome and names it first.
    assert sorted(c for group in by_outcome for c in group) == sorted(REBALANCE_CAUSES)
    for outcome, group in zip(REBALANCE_OUTCOMES, by_outcome, strict=True):
        assert all(c.split("_")[0] == outcome for c in group)
        assert outcome == "applied" or group[-1] == f"{outcome}_other"  # the catch-all, tried last
        for cause in group:
            assert check_cause(outcome, cause) == cause
    assert causes_of("applied") == ("applied",)
    assert set(CAUSE_HELP) == set(REBALANCE_CAUSES) and all(CAUSE_HELP.values())


@pytest.mark.parametrize(
    "call",
    [
        lambda: rebalance_cause("maybe", "x"),
        lambda: causes_of("maybe"),
        lambda: check_cause("skipped", "failed_timeout"),
        lambda: check_cause("applied", "skipped_gain"),
        lambda: check_cause("failed", "failed_everything"),
    ],
)
def test_unknown_outcomes_and_causes_are_value_errors(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]
