"""What a placement will get over the passes it serves, predicted from the window it was planned on.

Shape legend: W window (passes), n passes, L layers, l layers (scored), E logical experts, P
physical slots, G GPUs.

A plan serves the ``H`` passes until the next rebalance (from ``delay`` passes on, where its swap
runs beside them). What it gets there is the mean over those passes of its model balancedness,
each pass weighted by its load (large passes take most of the MoE time; the simulator's
*realized* figure is this mean), and that falls as the load drifts away from what the plan was
fitted to. On the drifting workloads (docs/solver.md) a fitted placement's score ``d`` passes
after its data ends follows ``a + k (d + 1) ** 0.3`` closely (k < 0): fast at first, then slower.
So ``solve`` calibrates on the window itself (:func:`calibrate`):

1. the *older* plan: the same policy on the window without its newest ``h`` passes, ``h`` half of
   the passes since the last domain shift (a jump, :func:`find_shift`) or of the whole window;
2. its score on those ``h`` passes, fitted to ``a + k (d + 1) ** 0.3`` (load-weighted);
3. the plan's own level: ``a`` plus its in-sample advantage over the older plan (its score on
   the newest passes minus the older plan's on the passes just before its cut);
4. the prediction: that level with the decline averaged over ``[delay, delay + H)``;
5. the current placement: its score on the newest passes, declining on from its age (passes
   since the data it was fitted to ended; no decline for one nobody fitted).

Only the layers that differ from the current placement are scored again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.placement.share import ShareModel
from eplb.solver.scoring.served import Scored
from eplb.solver.types import LoadWindow

DECLINE_POWER = 0.3
"""The shape of a fitted placement's decline with lag. Fitted on the first half of the horizon
and extrapolated to all of it, over plans not hit by a domain shift on the presets and drifting
workloads (deepseek-v3 EP32, windows and horizons of 200 and 1000 passes): power 0.3 predicts the
horizon's mean within 0.002-0.012 on average, a square root within 0.005-0.022 (it keeps falling
where the drift's correlation time caps the decline), a straight line within 0.009-0.053."""
BATCH_RULE_SHARE = 0.5
"""Passes carrying at least this fraction of the mean pass load are scored with a per-batch
dispatch rule (``lp``); on the presets that keeps the prefill passes (about 95% of the load)."""
MIN_CALIBRATION = 4
"""Fewest passes a calibration needs: two blocks of two."""


class PassScores:
    """A window's passes, ready to score placements pass by pass as the server dispatches."""

    def __init__(self, load: np.ndarray | LoadWindow, dispatch: ShareModel, num_gpus: int) -> None:
        """``load``: the checked window, float64 [W, L, E], or a solve's :class:`LoadWindow` of it
        (whose float32 copy and pass totals the solve's other steps share)."""
        window = load if isinstance(load, LoadWindow) else LoadWindow(load)
        # float32 in the window's own layout: a transposed view is a strided matrix per layer that
        # the products read as they are (no copy), the same numbers as a contiguous [L, W, E].
        self.load_WLE = window.load32_WLE
        total_W = window.total_W
        self.weight_W = (
            total_W / total_W.sum() if total_W.sum() > 0 else np.full(total_W.size, 1 / total_W.size)
        )
        """float64 [W]: each pass's share of the window's load."""
        self.dispatch = dispatch
        self.num_gpus = num_gpus
        self.batch_W = self.weight_W >= BATCH_RULE_SHARE / max(self.weight_W.size, 1)
        """bool [W]: passes scored with a per-batch rule (``lp``); the others, small passes that
        weigh little in a load-weighted mean, with the mean shares (the rule costs about 10 ms a
        pass at DeepSeek-V3's shape)."""

    @property
    def num_passes(self) -> int:
        return self.load_WLE.shape[0]

    def layer_pass(self, scored: Scored, layers: np.ndarray, start: int, stop: int) -> np.ndarray:
        """float64 [l, n]: balancedness of ``layers`` on passes [start, stop)."""
        if layers.size == 0 or stop <= start:
            return np.zeros((layers.size, max(stop - start, 0)))
        rows_nLE = self.load_WLE[start:stop]
        if layers.size != rows_nLE.shape[1] or (layers != np.arange(layers.size)).any():
            rows_nLE = rows_nLE[:, layers]
        gpu_lnG = self.dispatch.pass_gpu_load(
            rows_nLE.transpose(1, 0, 2),
            scored.phy2log_LP[layers],
            scored.share_LP[layers],
            self.num_gpus,
        )
        peak_ln = gpu_lnG.max(axis=-1).astype(np.float64)
        mean_ln = gpu_lnG.sum(axis=-1, dtype=np.float64) / self.num_gpus
        return np.where(peak_ln > 0, mean_ln / np.where(peak_ln > 0, peak_ln, 1.0), 1.0)

    def model(
        self, scored: Scored, base: Scored | None, base_LW: np.ndarray | None, start: int, stop: int
    ) -> np.ndarray:
        """float64 [n]: model balancedness of ``scored`` on passes [start, stop), rescoring only the
        layers that differ from ``base`` (whose per-layer scores ``base_LW`` cover the window)."""
        L = scored.phy2log_LP.shape[0]
        if base is None or base_LW is None:
            return self.layer_pass(scored, np.arange(L), start, stop).mean(axis=0)
        changed = np.flatnonzero(
            (scored.phy2log_LP != base.phy2log_LP).any(axis=1)
            | (scored.share_LP != base.share_LP).any(axis=1)
        )
        out_Ln = base_LW[:, start:stop].copy()
        out_Ln[changed] = self.layer_pass(scored, changed, start, stop)
        return out_Ln.mean(axis=0)

    def mean(self, score_n: np.ndarray, start: int, stop: int) -> float:
        """Load-weighted mean of per-pass scores ``score_n`` of passes [start, stop)."""
        w_n = self.weight_W[start:stop]
        return float((score_n * w_n).sum() / w_n.sum()) if w_n.sum() > 0 else float(score_n.mean())


@dataclass(frozen=True)
class Shift:
    """A jump of the current placement's score in the newer half of the window."""

    at: int
    """Pass index (in the window) where it jumped most: the split of the last half of the window
    that maximises the difference of the load-weighted mean scores before it and from it."""
    drop: float
    """The load-weighted mean score on the window's third quarter minus that on its last quarter
    (negative: it rose, the placement was refitted after a shift)."""


def find_shift(score_W: np.ndarray, passes: PassScores) -> Shift | None:
    """The current placement's score change between the window's last two quarters, and where in
    them it jumped most; None for a window of fewer than 4 passes.

    A domain shift is a jump: drift moves a placement's score by a few hundredths per quarter of
    the window on the presets, a shift by 0.2-0.3 (down for a placement fitted before it, up for
    one refitted after it). Two fixed blocks tell the two apart (scanning every split for the
    largest jump reads the noise of a few large passes as a jump); the scan only places the jump
    once the blocks show one.
    """
    W = score_W.size
    quarter = W // 4
    if quarter < 1:
        return None
    w_W = np.maximum(passes.weight_W, 1e-300)
    tail = slice(W - 2 * quarter, W - quarter)
    held = slice(W - quarter, W)
    drop = float(
        (w_W[tail] @ score_W[tail]) / w_W[tail].sum() - (w_W[held] @ score_W[held]) / w_W[held].sum()
    )
    start = W - 2 * quarter
    w_n, s_n = w_W[start:], w_W[start:] * score_W[start:]
    before_w, before_s = np.cumsum(w_n)[:-1], np.cumsum(s_n)[:-1]
    after_w, after_s = w_n.sum() - before_w, s_n.sum() - before_s
    jump_n = (before_s / before_w - after_s / after_w) * np.sign(drop)
    return Shift(start + int(np.argmax(jump_n)) + 1, drop)


RECENT_PASSES = 32
"""Most passes an in-sample level is read on: a decaying forecast fits the newest passes (its
half-life is 8 passes), and older ones have drifted away from it already."""
MIN_SPAN = 16
"""Fewest passes after a shift that calibrate on their own; after a more recent shift the
decline is calibrated on the passes before it and the plan's level on those after it."""


@dataclass(frozen=True)
class Cuts:
    """Where a calibration reads the window: the older plan, its decline, the in-sample levels."""

    cut: int
    """The older plan is planned on passes [0, cut)."""
    stop: int
    """Its decline is fitted on passes [cut, stop)."""
    recent: int
    """Passes before ``cut`` on which its in-sample level is read."""
    plan_from: int
    """The plan's (and the current placement's) level is read on passes [plan_from, W)."""

    @classmethod
    def of(cls, num_passes: int, shift_at: int | None, holdout_passes: int | None) -> Cuts | None:
        """The cuts for a window of ``num_passes`` with a shift at ``shift_at`` (None: none); None:
        no calibration (``holdout_passes`` 0, or a window too short), the forecast is scored."""
        W = num_passes
        if holdout_passes == 0 or W < MIN_CALIBRATION:
            return None
        since = shift_at or 0
        span = W - since
        if span < MIN_SPAN and since >= MIN_CALIBRATION:
            # A recent shift: the decline from before it, the plan's level on the passes after it.
            size = since // 2 if holdout_passes is None else min(holdout_passes, since - 2)
            cut = since - max(size, 2)
            return cls(
                cut=cut, stop=since, recent=max(min((since - cut) // 4, RECENT_PASSES), 2), plan_from=since
            )
        if span < MIN_CALIBRATION:
            return None
        size = span // 2 if holdout_passes is None else holdout_passes
        size = int(min(max(size, 2), span - 2))
        recent = max(min(size // 4, RECENT_PASSES), 2)
        return cls(cut=W - size, stop=W, recent=recent, plan_from=W - recent)


@dataclass(frozen=True)
class Decline:
    """A fitted placement's score ``lag`` passes after its data ends: ``level + slope (lag + 1) ** DECLINE_POWER``."""

    level: float
    slope: float
    """<= 0 per square root of a pass."""

    @classmethod
    def fit(cls, score_n: np.ndarray, weight_n: np.ndarray) -> Decline:
        """Weighted least squares on ``score_n`` at lags 0..n-1; a rising fit counts as flat."""
        x_n = (np.arange(score_n.size) + 1.0) ** DECLINE_POWER
        w_n = weight_n / weight_n.sum() if weight_n.sum() > 0 else np.full(score_n.size, 1 / score_n.size)
        mx, my = float(w_n @ x_n), float(w_n @ score_n)
        var = float(w_n @ (x_n - mx) ** 2)
        slope = float(w_n @ ((x_n - mx) * (score_n - my))) / var if var > 0 else 0.0
        slope = min(slope, 0.0)
        return cls(level=my - slope * mx, slope=slope)

    def mean_drop(self, first_lag: float, passes: int) -> float:
        """Mean of ``slope (lag + 1) ** DECLINE_POWER`` over lags [first_lag, first_lag + passes)."""
        lags = first_lag + np.arange(max(passes, 1), dtype=np.float64)
        return float(self.slope * ((lags + 1.0) ** DECLINE_POWER).mean())


@dataclass(frozen=True)
class Calibrated:
    """Predictions for the plan and the current placement, with the numbers behind them."""

    decline: Decline
    plan_recent: float
    """The plan's score on the newest passes (in-sample)."""
    older_recent: float
    """The older plan's score on the passes just before its cut (in-sample)."""
    current_recent: float | None
    """The current placement's score on the newest passes."""
    current_lag: float
    """Load-weighted mean of ``(lag + 1) ** DECLINE_POWER`` of the current placement on the newest passes."""
    current_age: int | None

    def plan(self, delay: int, horizon: int) -> float:
        """The plan's mean score over lags [delay, delay + horizon) after the window: no better than
        on the newest passes, which it was fitted to."""
        level = self.decline.level + (self.plan_recent - self.older_recent)
        return min(level + self.decline.mean_drop(delay, horizon), self.plan_recent, 1.0)

    def current(self, delay: int, horizon: int) -> float | None:
        """The current placement's mean score over the same passes (it ages on from its age)."""
        if self.current_recent is None:
            return None
        if self.current_age is None:
            return min(self.current_recent, 1.0)
        ahead = self.decline.mean_drop(self.current_age + delay, horizon)
        return min(self.current_recent + ahead - self.decline.slope * self.current_lag, 1.0)

    def stats(self) -> dict[str, float]:
        out = {
            "decline_level": self.decline.level,
            "decline_slope": self.decline.slope,
            "plan_recent": self.plan_recent,
            "older_recent": self.older_recent,
        }
        if self.current_recent is not None:
            out["current_recent"] = self.current_recent
        return out


def calibrate(
    passes: PassScores,
    plan: Scored,
    older: Scored,
    current: Scored | None,
    current_LW: np.ndarray | None,
    cuts: Cuts,
    current_age: int | None,
) -> Calibrated:
    """Steps 2-5 of the module docstring: the decline of ``older`` (planned on passes before
    ``cuts.cut``) and the in-sample levels; ``current_LW`` holds the current placement's per-layer
    scores on the whole window."""
    W = passes.num_passes
    cut, stop, recent, start = cuts.cut, cuts.stop, cuts.recent, cuts.plan_from
    older_n = passes.model(older, current, current_LW, cut - recent, stop)
    decline = Decline.fit(older_n[recent:], passes.weight_W[cut:stop])
    older_in = passes.mean(older_n[:recent], cut - recent, cut)
    plan_in = passes.mean(passes.model(plan, current, current_LW, start, W), start, W)
    current_in, lag_in = None, 0.0
    if current is not None and current_LW is not None:
        current_in = passes.mean(current_LW[:, start:].mean(axis=0), start, W)
        if current_age is not None:
            lag_n = np.maximum(current_age - (W - np.arange(start, W)), 0).astype(np.float64)
            w_n = passes.weight_W[start:]
            lag_in = float((lag_n + 1.0) ** DECLINE_POWER @ w_n / w_n.sum()) if w_n.sum() > 0 else 0.0
    return Calibrated(decline, plan_in, older_in, current_in, lag_in, current_age)
