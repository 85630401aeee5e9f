"""Load prediction: from a recorded window of passes to the load the next window will bring.

Shape legend: W window (passes), L layers, E logical experts, Z scenarios.

Expert popularity drifts, so the plain sum of the window is stale by half a window before the next
one starts (measured in docs/benchmarks.md: fitting the past harder does not help). The predictors:

- ``sum``: the window's total (what DeepSeek's EPLB plans on);
- ``recent``: the total of the last ``recent_fraction`` of the window;
- ``decay``: a weighted total whose pass weights halve every ``decay_half_life`` passes;
- ``track``: the decayed total with a half-life the window's own backtest picks, from the
  passes after the newest domain shift in the window (eplb.solver.forecast);
- ``robust``: the decayed total as the point forecast and as one scenario (weight 1/2), plus one
  scenario per sub-window: the forecast times the sub-window's relative deviation from the
  window's mean shape (weight 1/(2K) each), so that the solver maximises the expected
  balancedness over plausible futures rather than the balancedness of one guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.solver.forecast import track
from eplb.solver.types import SolveOptions


@dataclass(frozen=True)
class Prediction:
    """The load to plan for."""

    point_LE: np.ndarray
    """float64 [L, E]: the forecast load (scaled like one window)."""
    scenarios_ZLE: np.ndarray
    """float64 [Z, L, E]: scenarios of the next window, each with the forecast's total per layer; Z=1
    holds the forecast alone."""
    scenario_weights_Z: np.ndarray
    """float64 [Z]: probability of each scenario (sum 1)."""


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

    ``method`` is a concrete predictor (sum | decay | recent | robust | track); the other settings
    come from ``options``.
    """
    W = load_WLE.shape[0]
    if method == "track":
        point_LE = track(
            load_WLE,
            half_lives=options.track_half_lives,
            shift_threshold=options.track_shift,
            horizon=options.pricing.horizon_passes or W,
            fallback_half_life=options.decay_half_life,
        )
        return Prediction(point_LE, point_LE[None], np.ones(1))
    point_LE = np.tensordot(pass_weights(W, options, method), load_WLE, axes=1)
    if method != "robust" or W < 2 or options.num_scenarios < 2:
        return Prediction(point_LE, point_LE[None], np.ones(1))
    Z = min(options.num_scenarios, W)
    bounds = np.linspace(0, W, Z + 1).round().astype(int)
    sums_ZLE = np.add.reduceat(load_WLE, bounds[:-1], axis=0)
    shape_ZLE = sums_ZLE * _safe_ratio(np.ones(1), sums_ZLE.sum(axis=-1))[:, :, None]
    mean_shape_LE = shape_ZLE.mean(axis=0)
    deviation_ZLE = _safe_ratio(shape_ZLE, mean_shape_LE[None])
    deviation_ZLE = np.where(mean_shape_LE[None] > 0, deviation_ZLE, 1.0)
    scenarios_ZLE = point_LE[None] * deviation_ZLE
    scenarios_ZLE *= _safe_ratio(point_LE.sum(axis=-1)[None], scenarios_ZLE.sum(axis=-1))[:, :, None]
    scenarios_ZLE = np.concatenate([point_LE[None], scenarios_ZLE])
    weights_Z = np.concatenate([[0.5], np.full(Z, 0.5 / Z)])
    return Prediction(point_LE, scenarios_ZLE, weights_Z)


def _safe_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
