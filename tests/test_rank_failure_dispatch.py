"""A lost rank under every dispatch mode in the replay (eplb.simulate.failure), against loops.

With no replanning the batch is still routed by the start-up placement: under ``lp`` the rule
runs over every GPU, dead ones included, and the survivors keep their own columns. The reference
rebuilds each step's GPU loads with the one-token-at-a-time quotas of tests/helpers/remap_reference.py
(``lp``) or an even split (``dynamic``), then scores the live columns and counts the dead ones.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from eplb.config import DISPATCH_ALGORITHMS
from eplb.placement.model import Placement
from eplb.simulate import RunSpec
from eplb.simulate.dispatch import dispatch_matrices
from eplb.simulate.dispatch_lp import PerBatchShare, join_gpus, take_gpus
from eplb.simulate.failure import simulate_rank_failures
from eplb.simulate.failure_results import RankFailure
from tests.test_simulate_lp import _brute_gpu_loads
from tests.test_simulate_rank_failure import _config, _trace


def _even_gpu_loads(counts_LE: np.ndarray, pl: Placement) -> np.ndarray:
    """float64 [L, G]: GPU tokens of one step, each expert split evenly over its replicas."""
    loads = np.zeros((pl.num_layers, pl.num_gpus))
    for slot, expert_L in enumerate(pl.phy2log_LP.T):
        for layer, expert in enumerate(expert_L):
            loads[layer, slot // pl.slots_per_gpu] += counts_LE[layer, expert] / pl.logcnt_LE[layer, expert]
    return loads


@pytest.mark.parametrize("mode", [m for m in DISPATCH_ALGORITHMS if m != "fake"])  # fake ignores placements
def test_every_mode_survives_a_loss_replanned_or_not(mode: str) -> None:
    trace = _trace(3)
    result = simulate_rank_failures(
        trace, [RunSpec("scipy", mode), RunSpec("none", mode)], _config(R=8, interval=20, dispatch=mode),
        [RankFailure(30, (1,)), RankFailure(45, (3,))],
    )  # fmt: skip
    for run in result.runs:
        assert [e.live_ranks for e in run.losses] == [3, 2], run.name
        b = run.result.balancedness_F
        assert b.shape == (60,) and np.all(np.isfinite(b)) and np.all((b > 0) & (b <= 1 + 1e-6)), run.name


@pytest.mark.parametrize(("mode", "brute"), [("lp", _brute_gpu_loads), ("dynamic", _even_gpu_loads)])
def test_no_replanning_scores_the_live_columns_of_the_routed_placement(
    mode: str, brute: Callable[[np.ndarray, Placement], np.ndarray]
) -> None:
    trace = _trace(4)
    failures = [RankFailure(30, (1,)), RankFailure(45, (3,))]
    result = simulate_rank_failures(
        trace, [RunSpec("none", mode)], _config(R=8, interval=20, dispatch=mode), failures
    )
    (run,) = result.runs
    held = run.result.final_placement
    assert held is not None and held.num_gpus == 4  # the start-up placement, dead ranks included
    lost = np.zeros(60)
    for step in range(30, 60):
        gpu_LG = brute(trace.counts_FLE[step].astype(np.int64), held)
        live = [0, 2, 3] if step < 45 else [0, 2]
        kept = gpu_LG[:, live]
        want = float((kept.mean(axis=1) / kept.max(axis=1)).mean())
        assert run.result.balancedness_F[step] == pytest.approx(want, rel=1e-5), step
        lost[step] = gpu_LG[:, [g for g in range(4) if g not in live]].sum()
    assert run.lost_tokens_F is not None
    np.testing.assert_allclose(run.lost_tokens_F[30:], lost[30:], rtol=1e-5)


def test_an_lp_share_keeps_its_columns_through_cuts_and_joins() -> None:
    rng = np.random.default_rng(5)
    pl = Placement.from_phy2log(np.stack([rng.permutation(12) % 8 for _ in range(2)]), 4, 2)
    share = dispatch_matrices(pl, "lp").share_LEG
    assert isinstance(share, PerBatchShare)
    load_LnE = rng.poisson(30.0, (2, 3, 8)).astype(np.float32)
    full_LnG = np.matmul(load_LnE, share)
    live = take_gpus(share, np.array([True, False, True, True]))
    np.testing.assert_array_equal(np.matmul(load_LnE, live), full_LnG[:, :, [0, 2, 3]])
    again = take_gpus(live, np.array([False, True, True]))  # a second loss, indexed over survivors
    np.testing.assert_array_equal(np.matmul(load_LnE, again), full_LnG[:, :, [2, 3]])
    dead = join_gpus(take_gpus(share, np.array([1])), take_gpus(live, np.array([0])))
    np.testing.assert_array_equal(np.matmul(load_LnE, dead), full_LnG[:, :, [1, 0]])
    for step in range(3):  # the rule itself, against the loops
        np.testing.assert_allclose(
            full_LnG[:, step], _brute_gpu_loads(load_LnE[:, step].astype(np.int64), pl)
        )
    with pytest.raises(TypeError, match="two lp shares or two fixed shares"):
        join_gpus(dead, np.asarray(dead))
    other = dispatch_matrices(pl, "lp").share_LEG
    with pytest.raises(ValueError, match="one routed placement"):
        join_gpus(dead, other)
