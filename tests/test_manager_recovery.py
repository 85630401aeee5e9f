"""The manager after a swap given up, and its watchdog; real Gloo ranks (2 and 4), and one rank.

A peer that sleeps past ``timeout_s`` mid-transfer, then one interrupted (KeyboardInterrupt,
which the engine catches and serves on): every rank drops the swap group on the same pass,
serves on its placement (forward passes, an all_reduce and an all_to_all on the serving group),
and the next rebalance commits on a fresh swap group; every process exits 0. The watchdog ends a
rebalance whose solve hangs (rank 0's planner) and one whose transfer hangs (a peer asleep in the
swap, whose own timeout is far longer), the same way on every rank, and the metrics show it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from eplb.config import EplbConfig
from eplb.hotswap import HotSwapError, HotSwapResult, HotSwapShapeError
from eplb.manager.collectives import RankAgreement
from eplb.manager.health import SwapGroups
from eplb.manager.manager import EplbManager
from eplb.metrics import names
from eplb.metrics.prometheus import PrometheusSink
from tests.helpers.manager import CPU, FakePlan, make, other_placement, run_passes
from tests.helpers.swap_recovery import (
    HANG_S,
    WATCHDOG_S,
    manager_recovers,
    manager_watchdog,
    run_to_exit,
)


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_a_swap_given_up_drops_its_group_and_the_next_rebalance_commits_on_a_fresh_one(world: int) -> None:
    at = world - 1
    outs = run_to_exit(manager_recovers, world, args=(at,), timeout_s=120)
    r0 = outs[0]
    for o in outs:  # every rank took the same steps on the same passes
        assert o["history"] == r0["history"] or [h[0] for h in o["history"]] == [h[0] for h in r0["history"]]
        assert o["groups"] == r0["groups"] and o["placement"] == r0["placement"]
    outcomes = [outcome for outcome, _ in r0["history"]]
    assert outcomes == ["failed", "applied", "failed", "applied"], r0["history"]
    late, left = r0["history"][0][1], r0["history"][2][1]
    assert "timeout" in late and f"rank {at}" in late and "dropped" in late, late
    assert "peer lost" in left and f"rank {at}" in left and "dropped" in left, left
    # One swap group at start, a fresh one at each rebalance after a failure (never the old one).
    assert r0["groups"] == [1, 2, 2, 3], r0["groups"]
    assert outs[at]["interrupted"] and all(not o["interrupted"] for r, o in enumerate(outs) if r != at)
    assert all(all(o["serving"]) and len(o["serving"]) == 3 for o in outs), [o["serving"] for o in outs]
    assert all(o["phase"] == "idle" and o["back_to_old"] and o["err"] < 1e-5 for o in outs)


def test_the_watchdog_ends_a_hung_solve_and_a_hung_transfer_on_every_rank() -> None:
    r0, r1 = run_to_exit(manager_watchdog, 2, timeout_s=120)
    assert [h[0] for h in r0["history"]] == [h[0] for h in r1["history"]] == ["failed", "failed", "applied"]
    solve, transfer = r0["history"][0][1], r0["history"][1][1]
    assert solve.startswith("rebalance watchdog") and "in the solve" in solve, solve
    assert "watchdog" in transfer and "in the transfer" in transfer and "dropped" in transfer, transfer
    # Rank 0 gave the swap up at the bound, not at the swap's timeout (60 s) nor when rank 1 woke.
    assert r0["ended_in_s"][1] < HANG_S, r0["ended_in_s"]
    for o in (r0, r1):  # a line naming the phase, on every rank
        assert any("rebalance watchdog" in line and "in the solve" in line for line in o["logged"]), o[
            "logged"
        ]
        assert any("in the transfer" in line for line in o["logged"]), o["logged"]
        assert o["groups"] == 2 and o["phase"] == "idle" and o["err"] < 1e-5 and o["serving"]
    # Scraped every 50 ms from another thread, also while the manager's was blocked in the swap:
    # the gauge grew to the bound (less a scrape period and the ranks' clock skew: rank 1's clock
    # may end the rebalance first).
    most = r0["most_in_flight"]
    assert most["solving"] > WATCHDOG_S - 0.25 and most["applying"] > WATCHDOG_S - 0.25, most
    assert most["idle"] == 0.0, most
    (count,) = r0["watchdog_count"]
    assert count.endswith(" 2.0"), count


# ---- one rank: the watchdog and the phase metrics without spawning ------------------------------
def test_one_rank_watchdog_reports_the_phase_and_ends_a_hung_solve(caplog: pytest.LogCaptureFixture) -> None:
    model, placement, _ = make()
    target = other_placement(placement)
    calls: list[float] = []

    def planner(load: Any, cur: Any) -> FakePlan:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(1.5)  # hangs past the bound (its daemon thread ends on its own)
        return FakePlan(target)

    sink = PrometheusSink()
    manager = EplbManager(
        EplbConfig(eplb_rebalance_num_iterations=2),
        model,
        placement,
        device=CPU,
        sink=sink,
        planner=planner,
        watchdog_s=0.5,
    )
    model.recorder = manager.recorder
    phase = names.BY_NAME[names.MANAGER_PHASE]
    assert (
        sink.registry.get_sample_value(phase.name, {"phase": "idle", "engine": "0", "model_name": "unknown"})
        == 1
    )
    with caplog.at_level(logging.WARNING, logger="eplb.manager.watchdog"):
        run_passes(manager, model, 2)  # the rebalance begins
        assert manager.state().phase == "solving"
        time.sleep(0.6)
        labels = {"engine": "0", "model_name": "unknown"}
        assert sink.registry.get_sample_value(names.IN_FLIGHT_SECONDS, labels) > 0.5
        assert sink.registry.get_sample_value(phase.name, {"phase": "solving", **labels}) == 1
        run_passes(manager, model, 1)  # this pass's agreement ends it
    state = manager.state()
    assert state.phase == "idle" and [r.outcome for r in state.history] == ["failed"]
    assert "watchdog" in state.history[0].reason and state.in_flight_seconds == 0.0
    assert any("in the solve" in r.getMessage() for r in caplog.records)
    assert (
        sink.registry.get_sample_value(
            names.REBALANCES, {"outcome": "failed", "cause": "failed_watchdog", **labels}
        )
        == 1
    )
    assert sink.registry.get_sample_value(names.IN_FLIGHT_SECONDS, labels) == 0.0
    assert sink.registry.get_sample_value(names.LAST_REBALANCE_AGE, labels) < 1.0  # it just ended
    deadline = time.monotonic() + 5
    while not any(r.outcome == "applied" for r in manager.state().history):  # the next one applies
        assert time.monotonic() < deadline
        run_passes(manager, model, 1)
    assert manager.state().placement.same_slots(target) and len(calls) >= 2
    manager.close()


class _Swap:
    """A stand-in for a PreparedSwap whose execute raises ``error`` (decided: ``decided``)."""

    def __init__(self, error: BaseException, decided: HotSwapResult | HotSwapError) -> None:
        self.error, self._decided = error, decided

    def execute(self, **kwargs: Any) -> HotSwapResult:
        raise self.error

    def decided(self) -> HotSwapResult:
        if isinstance(self._decided, HotSwapError):
            raise self._decided
        return self._decided


@pytest.mark.parametrize(
    ("error", "state"),
    [
        (HotSwapError("timeout: rank 1 timed out", cause="timeout", rank=1), "dropped"),
        (HotSwapError("peer lost: rank 1 left", cause="peer lost", rank=1), "dropped"),
        (
            HotSwapError("peer lost: rank 1's heartbeat stopped", cause="peer lost", rank=1, alive=False),
            "stopped",
        ),
        (HotSwapError("error: rank 0: update_maps", cause="error", rank=0, consistent=False), "stopped"),
        (HotSwapShapeError("shape: rank 1 cannot run this hot-swap", rank=1), "usable"),
        (RuntimeError("rank(s) [1] could not allocate 8 bytes of swap staging"), "usable"),
    ],
)
def test_a_swap_given_up_drops_its_group_or_stops_by_what_the_error_says(
    error: Exception, state: str
) -> None:
    swaps = SwapGroups(None, RankAgreement(None, None, 1, CPU), CPU, 0)
    result, leaving = swaps.execute((0,), _Swap(error, HotSwapResult.not_started((0,), "")))  # type: ignore[arg-type]
    assert not result.ok and leaving is None and str(error) in (result.error or "")
    assert result.cause == getattr(error, "cause", None) and result.rank == getattr(error, "rank", None)
    assert (swaps.dropped is not None, swaps.stopped is not None) == (state == "dropped", state == "stopped")
    assert swaps.usable == (state == "usable") and swaps.running == (state != "stopped")


def test_an_interrupted_rank_gets_the_swaps_decision_and_its_interruption_back() -> None:
    swaps = SwapGroups(None, RankAgreement(None, None, 1, CPU), CPU, 0)
    committed = replace(HotSwapResult.not_started((0,), ""), ok=True, error=None)
    result, leaving = swaps.execute((0,), _Swap(KeyboardInterrupt(), committed))  # type: ignore[arg-type]
    assert result.ok and isinstance(leaving, KeyboardInterrupt) and swaps.usable  # committed everywhere
    left = HotSwapError("peer lost: rank 0 left the swap", cause="peer lost", rank=0)
    result, leaving = swaps.execute((0,), _Swap(KeyboardInterrupt(), left))  # type: ignore[arg-type]
    assert not result.ok and isinstance(leaving, KeyboardInterrupt) and swaps.dropped and swaps.running


def test_the_watchdog_bound_must_be_positive() -> None:
    model, placement, _ = make()
    with pytest.raises(ValueError, match="watchdog"):
        EplbManager(EplbConfig(), model, placement, device=CPU, watchdog_s=0.0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
def test_nccl_a_swap_given_up_drops_its_group_and_the_next_commits_on_a_fresh_one() -> None:
    outs = run_to_exit(manager_recovers, 2, args=(1,), timeout_s=180, backend="nccl")
    assert [h[0] for h in outs[0]["history"]] == ["failed", "applied", "failed", "applied"]
    assert all(all(o["serving"]) and o["err"] < 1e-3 for o in outs)
