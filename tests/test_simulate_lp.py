"""The simulator's ``lp`` dispatch (eplb.simulate.dispatch_lp) against a one-token-at-a-time brute force.

Every step's GPU loads are rebuilt here from the brute-force quotas of tests/helpers/remap_reference.py
(each replicated expert's tokens per GPU) plus the experts with one replica.
"""

from __future__ import annotations

import numpy as np
import pytest

from eplb.config import DISPATCH_ALGORITHMS
from eplb.placement.balance import balancedness
from eplb.placement.model import Placement
from eplb.simulate import RunSpec, SimulationConfig, simulate
from eplb.simulate.dispatch import dispatch_matrices
from eplb.simulate.dispatch_lp import PerBatchShare
from eplb.traces import Trace
from tests.helpers.placements import random_phy2log
from tests.helpers.remap_reference import brute_lp_quotas
from tests.helpers.simulation import server


def _brute_gpu_loads(counts_LE: np.ndarray, pl: Placement) -> np.ndarray:
    """float64 [L, G]: GPU tokens of one step under the rule, by loops."""
    S = pl.slots_per_gpu
    loads = np.zeros((pl.num_layers, pl.num_gpus))
    for layer in range(pl.num_layers):
        quota = brute_lp_quotas(counts_LE[layer].tolist(), pl, layer)
        for expert in range(pl.num_logical):
            if expert in quota:
                for gpu, q in quota[expert].items():
                    loads[layer, gpu] += q
            else:
                loads[layer, pl.log2phy_LER[layer, expert, 0] // S] += counts_LE[layer, expert]
    return loads


def _even_split_peak(counts_LE: np.ndarray, pl: Placement) -> np.ndarray:
    """[L]: the busiest GPU when every expert's tokens are split evenly over the GPUs holding it."""
    S = pl.slots_per_gpu
    loads = np.zeros((pl.num_layers, pl.num_gpus))
    for layer in range(pl.num_layers):
        for expert in range(pl.num_logical):
            gpus = sorted({int(s) // S for s in pl.log2phy_LER[layer, expert, : pl.logcnt_LE[layer, expert]]})
            c, w = int(counts_LE[layer, expert]), len(gpus)
            for i, gpu in enumerate(gpus):
                loads[layer, gpu] += c // w + (1 if i < c % w else 0)
    return loads.max(axis=1)


def test_lp_is_a_simulated_dispatch_mode() -> None:
    assert "lp" in DISPATCH_ALGORITHMS
    assert RunSpec.parse("scipy:lp", "static").dispatch == "lp"


@pytest.mark.parametrize("seed", range(3))
def test_every_step_loads_the_gpus_as_the_rule_does(seed: int) -> None:
    rng = np.random.default_rng(seed)
    L, E, P, G = 3, 10, 16, 4
    pl = Placement.from_phy2log(random_phy2log(rng, L, E, P), num_gpus=G, num_nodes=2)
    counts = rng.integers(0, 60, size=(20, L, E)) * (rng.random((20, L, E)) < 0.8)
    trace = Trace.from_counts(counts.astype(np.int32))
    flags = server(
        ep_size=G,
        nnodes=2,
        ep_num_redundant_experts=P - E,
        eplb_rebalance_num_iterations=5,
        ep_dispatch_algorithm="lp",
    )
    config = SimulationConfig(eplb=flags)
    run = simulate(trace, [RunSpec("none", "lp")], config, initial=pl).runs[0]
    for t in range(trace.num_steps):
        loads = _brute_gpu_loads(counts[t], pl)
        assert run.balancedness_F[t] == pytest.approx(float(balancedness(loads).mean()), rel=1e-6)
        # Re-filling never raises an expert's busiest GPU: never above the even split's peak.
        assert (loads.max(axis=1) <= _even_split_peak(counts[t], pl)).all()


def test_the_share_is_an_array_whose_product_applies_the_rule() -> None:
    rng = np.random.default_rng(5)
    pl = Placement.from_phy2log(random_phy2log(rng, 2, 8, 12), num_gpus=3)
    matrices = dispatch_matrices(pl, "lp")
    share = matrices.share_LEG
    assert isinstance(share, PerBatchShare) and share.shape == (2, 8, 3)
    np.testing.assert_allclose(np.asarray(share).sum(axis=2), 1.0)  # the even split, read as an array
    doubled = share * 2
    assert type(doubled) is np.ndarray and np.allclose(doubled, 2 * np.asarray(share))
    load_LnE = rng.integers(0, 30, size=(2, 4, 8)).astype(np.float32)
    got = np.matmul(load_LnE, share)
    for n in range(4):
        np.testing.assert_array_equal(got[:, n], _brute_gpu_loads(load_LnE[:, n].astype(np.int64), pl))
    with pytest.raises(ValueError, match=r"\[L, n, E\]"):
        np.matmul(load_LnE[0], share)
    assert matrices.replicas_LEG.sum() == pl.num_layers * pl.num_physical  # every copy counts as active
