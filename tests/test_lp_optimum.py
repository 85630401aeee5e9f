"""``lp`` dispatch's rule against the exact min-max split (SciPy HiGHS) on the same counts.

The LP: split each replicated expert's tokens over the GPUs holding it so the busiest GPU is as
light as possible; its optimum rounded up is the floor of any integer split. The rule
(eplb.remap.lp_rule) must come within 1% of it on average and within 5% on every batch, on
random placements with heavy-tailed counts, with idle ranks, and on adversarial counts (one expert
taking everything, every token on the replicated experts).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linprog

from eplb.placement.model import Placement
from eplb.remap.lp_rule import lp_quotas, lp_tables
from tests.helpers.placements import random_phy2log


def _optimum(counts_E: np.ndarray, placement: Placement, layer: int) -> float:
    """The busiest GPU's LP optimum, built from the placement's maps (not from the rule's tables)."""
    S, G = placement.slots_per_gpu, placement.num_gpus
    base_G = np.zeros(G)
    variables: list[tuple[int, int]] = []  # (expert, gpu)
    for expert in range(placement.num_logical):
        slots = placement.log2phy_LER[layer, expert, : placement.logcnt_LE[layer, expert]]
        gpus = sorted({int(s) // S for s in slots})
        if len(gpus) == 1:
            base_G[gpus[0]] += counts_E[expert]
        else:
            variables += [(expert, g) for g in gpus]
    experts = sorted({e for e, _ in variables})
    n = len(variables) + 1
    a_eq = np.zeros((len(experts), n))
    a_ub = np.zeros((G, n))
    for j, (expert, g) in enumerate(variables):
        a_eq[experts.index(expert), j] = 1
        a_ub[g, j] = 1
    a_ub[:, -1] = -1
    cost = np.zeros(n)
    cost[-1] = 1
    res = linprog(
        cost, A_ub=a_ub, b_ub=-base_G, A_eq=a_eq if experts else None,
        b_eq=counts_E[experts].astype(float) if experts else None,
    )  # fmt: skip
    assert res.status == 0
    return float(res.x[-1])


def _excess(placement: Placement, counts_nLE: np.ndarray) -> np.ndarray:
    """[n, L]: the rule's busiest GPU over the integer floor, minus one."""
    _, loads_LnG = lp_quotas(np.transpose(counts_nLE, (1, 0, 2)), lp_tables(placement))
    peak_nL = loads_LnG.max(axis=2).T
    floor_nL = np.array(
        [
            [np.ceil(_optimum(c_E, placement, layer) - 1e-6) for layer, c_E in enumerate(c_LE)]
            for c_LE in counts_nLE
        ]
    )
    return peak_nL / np.maximum(floor_nL, 1) - 1


@pytest.mark.parametrize(("E", "P", "G"), [(16, 24, 4), (64, 96, 16), (60, 80, 8)])
def test_the_rule_comes_within_one_percent_of_the_lp_optimum(E: int, P: int, G: int) -> None:
    rng = np.random.default_rng(E + P + G)
    placement = Placement.from_phy2log(random_phy2log(rng, 3, E, P), num_gpus=G)
    counts = np.rint(200 * (rng.pareto(1.2, size=(12, 3, E)) + 0.05)).astype(np.int64)  # heavy tail
    S = P // G
    idle = placement.phy2log_LP[:, : (G // 4 or 1) * S]  # the first quarter of the GPUs' experts idle
    for layer in range(3):
        counts[:6, layer, np.unique(idle[layer])] = 0
    adversarial = np.zeros((2, 3, E), dtype=np.int64)
    hot = np.argmax(placement.logcnt_LE, axis=1)
    adversarial[0, np.arange(3), hot] = 10_000  # one expert takes everything
    replicated = placement.logcnt_LE >= 2
    adversarial[1] = np.where(replicated, rng.integers(1, 5_000, size=(3, E)), 0)  # only replicated ones
    excess = _excess(placement, np.concatenate([counts, adversarial]))
    assert excess.mean() <= 0.01, excess.mean()
    assert excess.max() <= 0.05, excess.max()
    assert excess.min() >= -1e-9  # never below the optimum: the LP is a true floor
