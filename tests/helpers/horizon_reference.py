"""A plain-numpy restatement of the solver's horizon prediction (eplb.solver.scoring.horizon), pass by pass.

Shape legend: W window (passes), L layers, E logical experts.

Written from the module docstring, not from its code: the older plan (planned on the window
without its newest half), its load-weighted per-pass scores fitted to ``a + k (d + 1) ** 0.3``
(``k <= 0``) on that half, the in-sample levels on the newest passes (a quarter of the half, at
most 32), and the mean of the decline over the horizon; for windows without a current placement.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from eplb.placement.balance import model_balancedness
from eplb.placement.model import Placement
from eplb.solver import Plan, SolveOptions, Topology, solve


def pass_scores(load_WLE: np.ndarray, placement: Placement, weights_LER: np.ndarray | None) -> np.ndarray:
    """float64 [W]: the model balancedness of each pass."""
    return np.array([float(model_balancedness(p, placement, weights_LER)) for p in load_WLE])


def horizon_reference(
    load_WLE: np.ndarray, topology: Topology, options: SolveOptions, plan: Plan, horizon: int | None = None
) -> float:
    """What ``solve`` should predict for ``plan`` (made without a current placement) over ``horizon``
    passes (default: the window's length)."""
    W = load_WLE.shape[0]
    H = horizon or W
    size = min(max(W // 2, 2), W - 2)
    cut = W - size
    recent = max(min(size // 4, 32), 2)
    older = solve(load_WLE[:cut], topology, None, replace(options, holdout_passes=0, milp_max_solves=0))
    total_W = load_WLE.sum(axis=(1, 2))
    weight_W = total_W / total_W.sum() if total_W.sum() > 0 else np.full(W, 1.0 / W)
    s_older = pass_scores(load_WLE, older.placement, older.dispatch_weights_LER)
    s_plan = pass_scores(load_WLE, plan.placement, plan.dispatch_weights_LER)

    def mean(x: np.ndarray, a: int, b: int) -> float:
        w = weight_W[a:b]
        return float((x[a:b] * w).sum() / w.sum()) if w.sum() > 0 else float(x[a:b].mean())

    x = (np.arange(size) + 1.0) ** 0.3
    w = weight_W[cut:]
    w = w / w.sum() if w.sum() > 0 else np.full(size, 1.0 / size)
    y = s_older[cut:]
    slope = float(np.sum(w * (x - w @ x) * (y - w @ y)) / np.sum(w * (x - w @ x) ** 2))
    slope = min(slope, 0.0)
    level = float(w @ y) - slope * float(w @ x)
    plan_in = mean(s_plan, W - recent, W)
    older_in = mean(s_older, cut - recent, cut)
    drop = slope * float(((np.arange(H) + 1.0) ** 0.3).mean())
    return min(level + plan_in - older_in + drop, plan_in, 1.0)
