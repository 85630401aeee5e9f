"""One GPU plans nothing and says why; SIGINT / SIGTERM end ``eplb demo`` and all its ranks fast.

The signal cases run the demo in its own session (a real subprocess, as a terminal or a service
manager runs it) and send the signal either to the demo's process alone (``kill PID``) or to
its whole process group (Ctrl-C in a terminal), once ranks are serving and while the rank
processes are still starting. Every process of the session must be gone within 2 s, with one
line on stderr and exit status 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.config import EplbConfig
from eplb.placement.model import Placement
from eplb.policy.decision import ONE_GPU, Decider
from eplb.solver import Topology, solve
from eplb.solver.types import SolveOptions
from tests.helpers.demo_session import demo_session, session, wait_for, wait_serving

ROOT = Path(__file__).resolve().parents[1]
GONE_SECONDS = 2.0
"""The bound of the issue, from the signal to the last process of the demo's session exiting."""


def test_demo_on_one_rank_runs_to_the_end_skipping_every_rebalance(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--nproc", "1", "--steps", "120", "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passes"] == 120 and result["ranks"] == 1
    outcomes = {(r["outcome"], r["reason"]) for r in result["rebalances"]}
    assert outcomes == {("skipped", ONE_GPU)}  # planned every interval, never failed


@pytest.mark.parametrize("dispatch", ["static", "dynamic", "weighted"])
def test_solve_on_one_gpu_keeps_the_placement_and_says_why(dispatch: str) -> None:
    load_WLE = np.random.default_rng(0).integers(0, 100, size=(10, 4, 16))
    topology = Topology(num_gpus=1, num_physical=17)
    current = Placement.from_phy2log(np.array([[*range(16), 3]] * 4), 1, max_replicas=2)
    for start in (current, None):
        plan = solve(load_WLE, topology, start, SolveOptions(dispatch=dispatch))
        if start is not None:  # a live placement: kept, and why
            assert not plan.apply and plan.reason == ONE_GPU
            assert plan.placement == start
        else:  # no placement yet: a valid one to start from
            assert plan.apply
            plan.placement.validate()
            assert plan.placement.num_gpus == 1 and plan.placement.num_physical == 17
        weights = plan.dispatch_weights_LER
        assert (weights is not None) == (dispatch == "weighted")
        if weights is not None:
            assert weights.shape == plan.placement.log2phy_LER.shape
            assert np.allclose(weights.sum(axis=2), 1.0, atol=1e-5)


def test_the_decision_skips_one_gpu_before_planning() -> None:
    decider = Decider(EplbConfig())

    def screen(num_gpus: int | None, passes: int = 10) -> str | None:
        return decider.screen(
            window_passes=passes, window_load=100.0, window_balancedness=0.5, num_gpus=num_gpus
        )

    assert screen(1) == ONE_GPU and screen(1, passes=0) == ONE_GPU
    assert screen(4) is None
    assert screen(None) is None  # the caller did not say


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("moment", ["serving", "starting"])
@pytest.mark.parametrize("target", ["process", "group"])
def test_a_signal_ends_the_demo_and_every_rank_at_once(sig: str, moment: str, target: str) -> None:
    with demo_session("--nproc", "2", "--steps", "20000") as demo:
        if moment == "serving":
            wait_serving(demo)
        else:
            # A rank process exists (still importing torch, or joining the group).
            wait_for(
                lambda: any("spawn_main" in cmd for cmd in session(demo.pid).values()),
                120,
                "no rank process started",
            )
        assert len(session(demo.pid)) >= 2
        (os.killpg if target == "group" else os.kill)(demo.pid, getattr(signal, sig))
        sent = time.monotonic()
        wait_for(lambda: not session(demo.pid), 30, "processes of the demo outlived it")
        gone = time.monotonic() - sent
        _, err = demo.communicate(timeout=30)
    word, code = ("interrupted", 130) if sig == "SIGINT" else ("terminated", 143)
    assert (demo.returncode, err) == (code, f"eplb demo: {word}\n")
    assert gone < GONE_SECONDS
