"""Load prediction: from a recorded window of passes to the load the next window will bring.

Shape legend: W window (passes), L layers, E logical experts, K scenarios.

Expert popularity drifts, so the plain sum of the window is stale by half a window before the next
one starts (measured in docs/benchmarks.md: fitting the past harder does not help). The predictors:

- ``sum``: the window's total (what DeepSeek's EPLB plans on);
- ``recent``: the total of the last ``recent_fraction`` of the window;
- ``decay``: a weighted total whose pass weights halve every ``decay_half_life`` passes;
- ``robust``: the decayed total as the point forecast and as one scenario (weight 1/2), plus one
  scenario per sub-window: the forecast times the sub-window's relative deviation from the
  window's mean shape (weight 1/(2K) each), so that the solver maximises the expected
  balancedness over plausible futures rather than the balancedness of one guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.solver.types import SolveOptions


@dataclass(frozen=True)
class Prediction:
    """The load to plan for."""

    point_LE: np.ndarray
    """float64 [L, E]: the forecast load (scaled like one window)."""
    scenarios_KLE: np.ndarray
    """float64 [K, L, E]: scenarios of the next window, each with the forecast's total per layer; K=1
    holds the forecast alone."""
    scenario_weights_K: np.ndarray
    """float64 [K]: probability of each scenario (sum 1)."""


def pass_weights(num_passes: int, options: SolveOptions, method: str) -> np.ndarray:
    """float64 [W]: weight of each pass of the window in the forecast (oldest first), summing to W."""
    W = num_passes
    if method == "sum":
        weights = np.ones(W)
    elif method == "recent":
        keep = max(1, round(options.recent_fraction * W))
        weights = np.zeros(W)
        weights[W - keep :] = 1.0
    else:  # decay, robust
        age = np.arange(W - 1, -1, -1, dtype=np.float64)
        weights = 0.5 ** (age / options.decay_half_life)
    return weights * (W / weights.sum())


def predict(load_WLE: np.ndarray, options: SolveOptions, method: str) -> Prediction:
    """Forecast the next window's load from a checked window ``load_WLE`` float64 [W, L, E].

    ``method`` is a concrete predictor (sum | decay | recent | robust); the other settings come
    from ``options``.
    """
    W = load_WLE.shape[0]
    point_LE = np.tensordot(pass_weights(W, options, method), load_WLE, axes=1)
    if method != "robust" or W < 2 or options.num_scenarios < 2:
        return Prediction(point_LE, point_LE[None], np.ones(1))
    K = min(options.num_scenarios, W)
    bounds = np.linspace(0, W, K + 1).round().astype(int)
    sums_KLE = np.add.reduceat(load_WLE, bounds[:-1], axis=0)
    shape_KLE = sums_KLE * _safe_ratio(np.ones(1), sums_KLE.sum(axis=-1))[:, :, None]
    mean_shape_LE = shape_KLE.mean(axis=0)
    deviation_KLE = _safe_ratio(shape_KLE, mean_shape_LE[None])
    deviation_KLE = np.where(mean_shape_LE[None] > 0, deviation_KLE, 1.0)
    scenarios_KLE = point_LE[None] * deviation_KLE
    scenarios_KLE *= _safe_ratio(point_LE.sum(axis=-1)[None], scenarios_KLE.sum(axis=-1))[:, :, None]
    scenarios_KLE = np.concatenate([point_LE[None], scenarios_KLE])
    weights_K = np.concatenate([[0.5], np.full(K, 0.5 / K)])
    return Prediction(point_LE, scenarios_KLE, weights_K)


def _safe_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
