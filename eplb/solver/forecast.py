"""``track``: a decayed forecast whose half-life and first pass the window itself chooses.

Shape legend: W window (passes), n passes (those kept after a shift), L layers, l layers (those
scanned), E logical experts, x any leading dimensions (blocks of passes, candidate shift points or
candidate half-lives).

``decay`` weighs the window's passes with one fixed half-life (8 passes). The best half-life
depends on how fast the load drifts against how noisy a pass is: on the workload variants of
``benchmarks/bench_forecast.py`` the half-life this module picks ranged from 2 passes (hot-expert
churn) to 8 (the presets' slow drift). ``track``:

1. **picks the half-life by backtest** (:func:`track_half_life`): each of ``track_half_lives``
   forecasts each of the last ``FOLDS`` folds of the kept passes from the passes before that
   fold, the folds as long as the horizon the plan serves (``pricing.horizon_passes``, at most a
   quarter of the kept passes); the half-life with the least squared error of the forecast
   shares, summed over folds and layers, wins (one half-life for the whole model: per layer the
   choice is noisier and measured worse);
2. with ``track_shift`` set, **resets at a shift** (:func:`shift_start`): the newest pass where
   the experts' shares jump (the total variation between the passes before and after it, less
   what sampling noise alone gives, mean over layers, above ``track_shift`` and well above the
   window's own level of drift) starts the window; the passes before it are dropped. Off by
   default: continuous plans did no better with it (docs/benchmarks.md, "Forecast");
3. returns the decayed total of the kept passes with that half-life, pass weights summing to W
   (scaled like ``decay``'s), so that with one candidate and no reset it is ``decay``.

Every step is a fixed sequence of numpy reductions of the window: the same window gives the same
forecast on every rank.
"""

from __future__ import annotations

import numpy as np

SHIFT_BLOCK = 5
"""Passes per block in the shift scan: candidate shift points are block boundaries."""
SHIFT_SIDE = 25
"""Passes compared on each side of a candidate shift point (fewer at the window's newest end)."""
SHIFT_SEARCH = 100
"""Newest passes in which a shift is looked for: before them even a 32-pass half-life has
decayed the old domain's weight below 12%."""
SHIFT_RATIO = 3.0
"""A shift's excess total variation must also be this many times the window's median excess:
fast drift moves the shares by as much as a shift does on slow workloads, and is no shift."""
NOISE_TV = 0.5 * np.sqrt(2.0 / np.pi)
"""E|X| / sigma of a normal X, halved: the expected total variation of two multinomial samples of
the same shares is NOISE_TV * sum_e sqrt(p_e (1 - p_e)) * sqrt(1 / N_a + 1 / N_b)."""
FOLDS = 3
"""Backtest folds of the half-life choice."""
MIN_FOLD = 5
"""Shortest backtest fold, in passes; fewer kept passes than two folds fall back to ``decay``."""
SCAN_LAYERS = 8
"""Most layers on which the shift and the half-life are decided (every ``ceil(L / SCAN_LAYERS)``-th
layer from the first): both are properties of the traffic, seen in every layer, and 8 layers of
128-256 experts are 1,000-2,000 shares; on DeepSeek-V3's 58 layers this keeps the whole forecast
within a few milliseconds (timed in benchmarks/bench_forecast.py)."""


def scan_step(num_layers: int) -> int:
    """The stride of the layers the shift scan and the backtest read (1: every layer)."""
    return -(-num_layers // SCAN_LAYERS)


def decayed_weights(num_passes: int, half_life: float) -> np.ndarray:
    """float64 [n]: weight of each pass (oldest first), halving every ``half_life`` passes, summing to n."""
    age_n = np.arange(num_passes - 1, -1, -1, dtype=np.float64)
    weights_n = 0.5 ** (age_n / half_life)
    return weights_n * (num_passes / weights_n.sum())


def shift_start(load_WLE: np.ndarray, threshold: float) -> int:
    """The first pass after the newest domain shift in the window (0: none found).

    Candidates are the boundaries of ``SHIFT_BLOCK``-pass blocks counted from the newest pass
    with ``SHIFT_SIDE`` passes before them and at least one block after. At each, the shares of
    the passes on either side (up to ``SHIFT_SIDE`` each, per layer) differ by a total variation;
    less its expected value under sampling noise alone (``NOISE_TV`` with the window's shares and
    each side's count) and averaged over the layers loaded on both sides, that is the candidate's
    *excess*. A shift is a local peak of the excess in the newest ``SHIFT_SEARCH`` passes above
    ``threshold`` and above ``SHIFT_RATIO`` times the median excess of every candidate; the
    newest such peak wins.
    """
    W = load_WLE.shape[0]
    num_blocks = W // SHIFT_BLOCK
    side = SHIFT_SIDE // SHIFT_BLOCK
    if side + 1 > num_blocks:
        return 0
    first = W - num_blocks * SHIFT_BLOCK
    blocks_xLE = load_WLE[first:].reshape(num_blocks, SHIFT_BLOCK, *load_WLE.shape[1:]).sum(axis=1)
    cum_xLE = np.concatenate([np.zeros((1, *blocks_xLE.shape[1:])), np.cumsum(blocks_xLE, axis=0)])
    at = np.arange(side, num_blocks)  # the shift point before block j: `side` blocks before, >= 1 after
    before_xLE = cum_xLE[at] - cum_xLE[at - side]
    after_xLE = cum_xLE[np.minimum(at + side, num_blocks)] - cum_xLE[at]
    n_before_xL, n_after_xL = before_xLE.sum(axis=-1), after_xLE.sum(axis=-1)
    both_xL = (n_before_xL > 0) & (n_after_xL > 0)
    before_xLE /= np.where(n_before_xL > 0, n_before_xL, 1.0)[..., None]
    after_xLE /= np.where(n_after_xL > 0, n_after_xL, 1.0)[..., None]
    tv_xL = 0.5 * np.abs(before_xLE - after_xLE).sum(axis=-1)
    total_LE = cum_xLE[-1]
    share_LE = total_LE / np.maximum(total_LE.sum(axis=-1, keepdims=True), 1e-300)
    spread_L = np.sqrt(share_LE * (1.0 - share_LE)).sum(axis=-1)
    with np.errstate(divide="ignore"):
        scale_xL = np.sqrt(1.0 / n_before_xL + 1.0 / n_after_xL)
    excess_xL = np.where(both_xL, tv_xL - NOISE_TV * spread_L * np.where(both_xL, scale_xL, 0.0), 0.0)
    counted_x = both_xL.sum(axis=-1)
    excess_x = np.where(counted_x > 0, excess_xL.sum(axis=-1) / np.maximum(counted_x, 1), 0.0)
    level = max(threshold, SHIFT_RATIO * float(np.median(excess_x)))
    prev_x = np.concatenate([[-np.inf], excess_x[:-1]])
    next_x = np.concatenate([excess_x[1:], [-np.inf]])
    peak_x = (excess_x > level) & (excess_x >= prev_x) & (excess_x >= next_x)
    peak_x &= first + at * SHIFT_BLOCK >= W - SHIFT_SEARCH
    found = np.flatnonzero(peak_x)
    return int(first + at[found[-1]] * SHIFT_BLOCK) if found.size else 0


def track_half_life(load_nLE: np.ndarray, half_lives_x: np.ndarray, fold: int) -> int:
    """Index into ``half_lives_x`` of the half-life that backtests best on ``load_nLE``.

    Folds: the last ``FOLDS`` runs of ``fold`` passes (as many as leave ``fold`` passes before
    the oldest); each is forecast from the passes before it. The decayed sums at every fold's
    start are built segment by segment (one product per segment over all half-lives), so the
    whole choice costs about one pass of the window per candidate.
    """
    n = load_nLE.shape[0]
    folds = min(FOLDS, n // fold - 1)
    assert folds >= 1, "track_half_life needs at least two folds of passes"
    starts = [n - j * fold for j in range(folds, 0, -1)]  # oldest fold first
    error_x = np.zeros(half_lives_x.size)
    summed_xLE = np.zeros((half_lives_x.size, *load_nLE.shape[1:]))
    done = 0
    for start in starts:
        span = start - done
        age_n = np.arange(span - 1, -1, -1, dtype=np.float64)
        # Decayed sum to `start`: the older part decays by the segment's length, the segment adds its own.
        summed_xLE *= (0.5 ** (span / half_lives_x))[:, None, None]
        summed_xLE += np.tensordot(
            0.5 ** (age_n[None, :] / half_lives_x[:, None]), load_nLE[done:start], axes=1
        )
        done = start
        share_xLE = summed_xLE / np.maximum(summed_xLE.sum(axis=-1, keepdims=True), 1e-300)
        held_LE = load_nLE[start : start + fold].sum(axis=0)
        held_share_LE = held_LE / np.maximum(held_LE.sum(axis=-1, keepdims=True), 1e-300)
        error_x += ((share_xLE - held_share_LE[None]) ** 2).sum(axis=(1, 2))
    return int(np.argmin(error_x))


def track(
    load_WLE: np.ndarray,
    *,
    half_lives: tuple[float, ...],
    shift_threshold: float | None,
    horizon: int,
    fallback_half_life: float,
) -> np.ndarray:
    """float64 [L, E]: the ``track`` forecast of a checked window (module docstring).

    ``shift_threshold`` None: no reset at a shift. Fewer kept passes than two folds of
    ``MIN_FOLD``: the decayed total with ``fallback_half_life``. The shift and the half-life are
    decided on every :func:`scan_step`-th layer; the total covers every layer.
    """
    W = load_WLE.shape[0]
    scanned_WlE = np.ascontiguousarray(load_WLE[:, :: scan_step(load_WLE.shape[1])])
    start = 0 if shift_threshold is None else shift_start(scanned_WlE, shift_threshold)
    kept_nLE = load_WLE[start:]
    n = kept_nLE.shape[0]
    fold = min(horizon, n // (FOLDS + 1)) if n >= 2 * MIN_FOLD else 0
    fold = max(fold, MIN_FOLD) if fold else 0
    half_life = fallback_half_life
    if len(half_lives) > 1 and fold and n >= 2 * fold:
        candidates_x = np.asarray(half_lives, dtype=np.float64)
        half_life = float(candidates_x[track_half_life(scanned_WlE[start:], candidates_x, fold)])
    elif len(half_lives) == 1:
        half_life = float(half_lives[0])
    weights_n = decayed_weights(n, half_life) * (W / n)
    return np.tensordot(weights_n, kept_nLE, axes=1)
