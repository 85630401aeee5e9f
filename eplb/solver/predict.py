"""Load prediction: from a recorded window of passes to the load the next window will bring.

Shape legend: W window (passes), L layers, E logical experts, K scenarios.

Expert popularity drifts, so the plain sum of the window is stale by half a window before the next
one starts (design.md §5: fitting the past harder does not help). The predictors:

- ``sum``: the window's total (what DeepSeek's EPLB plans on);
- ``recent``: the total of the last ``recent_fraction`` of the window;
- ``decay``: a weighted total whose pass weights halve every ``decay_half_life`` of the window;
- ``robust``: the decayed total as the point forecast, plus the window's sub-windows as scenarios
  (each scaled to the same total per layer) so that the solver can minimise the expected busiest
  GPU over plausible futures rather than the busiest GPU of one guess.
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


def pass_weights(num_passes: int, options: SolveOptions) -> np.ndarray:
    """float64 [W]: weight of each pass of the window in the forecast (oldest first), summing to W."""
    W = num_passes
    if options.prediction == "sum":
        weights = np.ones(W)
    elif options.prediction == "recent":
        keep = max(1, round(options.recent_fraction * W))
        weights = np.zeros(W)
        weights[W - keep :] = 1.0
    else:  # decay, robust
        age = np.arange(W - 1, -1, -1, dtype=np.float64)
        weights = 0.5 ** (age / max(options.decay_half_life * W, 1e-9))
    return weights * (W / weights.sum())


def predict(load_WLE: np.ndarray, options: SolveOptions) -> Prediction:
    """Forecast the next window's load from a checked window ``load_WLE`` float64 [W, L, E]."""
    W = load_WLE.shape[0]
    point_LE = np.tensordot(pass_weights(W, options), load_WLE, axes=1)
    if options.prediction != "robust" or W < 2 or options.num_scenarios < 2:
        return Prediction(point_LE, point_LE[None], np.ones(1))
    K = min(options.num_scenarios, W)
    bounds = np.linspace(0, W, K + 1).round().astype(int)
    sums_KLE = np.add.reduceat(load_WLE, bounds[:-1], axis=0)
    scale_KL = _safe_ratio(point_LE.sum(axis=-1)[None], sums_KLE.sum(axis=-1))
    scenarios_KLE = sums_KLE * scale_KL[:, :, None]
    # The forecast is itself a scenario; recent sub-windows are likelier than old ones.
    scenarios_KLE = np.concatenate([point_LE[None], scenarios_KLE])
    centre_age = W - (bounds[:-1] + bounds[1:]) / 2.0
    sub_weights = 0.5 ** (centre_age / max(options.decay_half_life * W, 1e-9))
    weights_K = np.concatenate([[sub_weights.sum()], sub_weights])
    return Prediction(point_LE, scenarios_KLE, weights_K / weights_K.sum())


def _safe_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
