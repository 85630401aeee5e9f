"""The ``track`` forecast (eplb.solver.forecast) against a plain-numpy reference written from its
definition: explicit loops over candidate shift points, layers, half-lives and folds.

Shape legend: W window (passes), L layers, E logical experts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from eplb.placement.model import Placement
from eplb.solver import SolveOptions, Topology, solve
from eplb.solver import forecast as fc
from eplb.solver.predict import predict
from eplb.solver.types import as_load_array


# ---- the reference -------------------------------------------------------------------------------
def ref_shift_start(load_WLE: np.ndarray, threshold: float) -> int:
    """shift_start's definition, one candidate and one layer at a time."""
    W, L, _ = load_WLE.shape
    b, side_blocks = fc.SHIFT_BLOCK, fc.SHIFT_SIDE // fc.SHIFT_BLOCK
    B = W // b
    if side_blocks + 1 > B:
        return 0
    first = W - B * b
    points, excess = [], []
    for j in range(side_blocks, B):
        at = first + j * b
        lo, hi = first + (j - side_blocks) * b, min(first + (j + side_blocks) * b, W)
        values = []
        for layer in range(L):
            before = load_WLE[lo:at, layer].sum(axis=0)
            after = load_WLE[at:hi, layer].sum(axis=0)
            if before.sum() <= 0 or after.sum() <= 0:
                continue
            p, q = before / before.sum(), after / after.sum()
            window = load_WLE[first:, layer].sum(axis=0)
            share = window / window.sum()
            spread = sum(math.sqrt(x * (1 - x)) for x in share)
            noise = 0.5 * math.sqrt(2 / math.pi) * spread * math.sqrt(1 / before.sum() + 1 / after.sum())
            values.append(0.5 * np.abs(p - q).sum() - noise)
        points.append(at)
        excess.append(sum(values) / len(values) if values else 0.0)
    level = max(threshold, fc.SHIFT_RATIO * float(np.median(excess)))
    found = 0
    for i, (at, x) in enumerate(zip(points, excess, strict=True)):
        left = excess[i - 1] if i > 0 else -np.inf
        right = excess[i + 1] if i + 1 < len(excess) else -np.inf
        if x > level and x >= left and x >= right and at >= W - fc.SHIFT_SEARCH:
            found = at
    return found


def ref_track(
    load_WLE: np.ndarray,
    half_lives: tuple[float, ...],
    threshold: float | None,
    horizon: int,
    fallback: float,
) -> np.ndarray:
    """track's definition: reset, backtest every half-life on every fold directly, decayed total."""
    W, L, _ = load_WLE.shape
    rows = list(range(0, L, math.ceil(L / fc.SCAN_LAYERS)))  # every k-th layer, at most SCAN_LAYERS
    assert len(rows) <= fc.SCAN_LAYERS
    start = 0 if threshold is None else ref_shift_start(load_WLE[:, rows], threshold)
    kept = load_WLE[start:]
    scanned = kept[:, rows]
    n = kept.shape[0]

    def decayed(x: np.ndarray, h: float) -> np.ndarray:
        out = np.zeros(x.shape[1:])
        for w in range(x.shape[0]):
            out += 0.5 ** ((x.shape[0] - 1 - w) / h) * x[w]
        return out

    def shares(x: np.ndarray) -> np.ndarray:
        total = x.sum(axis=-1, keepdims=True)
        return np.where(total > 0, x / np.where(total > 0, total, 1), 0.0)

    fold = 0
    if n >= 2 * fc.MIN_FOLD:
        fold = max(min(horizon, n // (fc.FOLDS + 1)), fc.MIN_FOLD)
    half_life = fallback
    if len(half_lives) == 1:
        half_life = half_lives[0]
    elif fold and n >= 2 * fold:
        folds = min(fc.FOLDS, n // fold - 1)
        errors = []
        for h in half_lives:
            error = 0.0
            for j in range(1, folds + 1):
                at = n - j * fold
                forecast, held = shares(decayed(scanned[:at], h)), shares(scanned[at : at + fold].sum(axis=0))
                error += float(((forecast - held) ** 2).sum())
            errors.append(error)
        half_life = half_lives[int(np.argmin(errors))]
    weights = np.array([0.5 ** ((n - 1 - w) / half_life) for w in range(n)])
    weights *= W / weights.sum()
    return np.tensordot(weights, kept, axes=1)


# ---- inputs --------------------------------------------------------------------------------------
def drifting_window(
    rng: np.random.Generator, W: int, L: int, E: int, shift_at: int | None = None
) -> np.ndarray:
    """Multinomial passes of a drifting popularity (prefill and decode sizes), optionally a new domain at ``shift_at``."""
    logits_LE = rng.normal(0.0, 0.8, (L, E))
    domain_LE = rng.normal(0.0, 0.7, (L, E))
    out = np.zeros((W, L, E))
    for w in range(W):
        logits_LE = logits_LE + rng.normal(0.0, 0.02, (L, E))
        z = logits_LE + (domain_LE if shift_at is not None and w >= shift_at else 0.0)
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        tokens = int(rng.choice([64, 8192], p=[0.7, 0.3]))
        for layer in range(L):
            out[w, layer] = rng.multinomial(tokens * 4, p[layer])
    return out


SHAPES = [(200, 3, 16), (57, 2, 8), (23, 1, 5), (12, 2, 4), (1, 2, 6), (6, 1, 3), (90, 40, 6)]


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(len(SHAPES)))
@pytest.mark.parametrize("shift", [False, True])
def test_track_matches_the_reference(seed: int, shift: bool) -> None:
    rng = np.random.default_rng(seed)
    W, L, E = SHAPES[seed]
    load = drifting_window(rng, W, L, E, shift_at=max(W - 30, 0) if shift else None)
    for horizon in (1, 7, 50, 1000):
        for half_lives in ((2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0), (5.0,), (1.5, 40.0)):
            for threshold in (None, 0.05, 0.3):
                got = fc.track(
                    load,
                    half_lives=half_lives,
                    shift_threshold=threshold,
                    horizon=horizon,
                    fallback_half_life=8.0,
                )
                want = ref_track(load, half_lives, threshold, horizon, 8.0)
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * max(1.0, load.max()))


@pytest.mark.parametrize("seed", range(8))
def test_shift_start_matches_the_reference(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    W = int(rng.integers(20, 220))
    L, E = int(rng.integers(1, 4)), int(rng.integers(2, 20))
    shift_at = int(rng.integers(0, W)) if seed % 2 else None
    load = drifting_window(rng, W, L, E, shift_at=shift_at)
    for threshold in (0.01, 0.05, 0.2):
        assert fc.shift_start(load, threshold) == ref_shift_start(load, threshold)


def test_a_shift_is_found_where_it_is_and_stationary_load_has_none() -> None:
    rng = np.random.default_rng(7)
    for shift_at in (150, 172, 187, 195):
        load = drifting_window(rng, 200, 4, 32, shift_at=shift_at)
        found = fc.shift_start(load, 0.05)
        assert abs(found - shift_at) <= fc.SHIFT_BLOCK, (shift_at, found)
    for _ in range(3):
        assert fc.shift_start(drifting_window(rng, 200, 4, 32), 0.05) == 0
    # Too old to matter (before the newest SHIFT_SEARCH passes): not reported.
    assert fc.shift_start(drifting_window(rng, 200, 4, 32, shift_at=60), 0.05) == 0


def test_one_half_life_without_reset_is_decay() -> None:
    rng = np.random.default_rng(3)
    load = rng.poisson(20.0, (120, 3, 12)).astype(np.float64)
    for h in (1.0, 8.0, 33.0):
        options = SolveOptions(prediction="track", track_half_lives=(h,), track_shift=None, decay_half_life=h)
        np.testing.assert_allclose(
            predict(load, options, "track").point_LE, predict(load, options, "decay").point_LE, rtol=1e-12
        )


def test_the_backtest_prefers_short_half_lives_on_fast_drift_and_long_ones_on_noise() -> None:
    rng = np.random.default_rng(11)
    E, L, n = 16, 2, 200
    # Stationary, noisy: every pass a small multinomial draw of one fixed popularity.
    p = rng.dirichlet(np.ones(E))
    noisy = np.stack([[rng.multinomial(200, p) for _ in range(L)] for _ in range(n)]).astype(np.float64)
    candidates = np.array([2.0, 4.0, 8.0, 16.0, 32.0])
    assert candidates[fc.track_half_life(noisy, candidates, 50)] >= 16.0
    # A popularity on a fast random walk, drawn with many tokens: the newest passes tell most.
    walk = np.zeros((n, L, E))
    z = np.log(p)
    for w in range(n):
        z = z + rng.normal(0.0, 0.3, E)
        q = np.exp(z - z.max())
        walk[w] = [rng.multinomial(100_000, q / q.sum()) for _ in range(L)]
    assert candidates[fc.track_half_life(walk, candidates, 50)] == 2.0


@pytest.mark.parametrize(
    "load",
    [
        np.zeros((200, 3, 8)),  # nothing routed
        np.zeros((1, 2, 4)),  # one empty pass
        np.ones((1, 2, 4)),  # one pass
        np.concatenate([np.zeros((100, 2, 8)), np.ones((100, 2, 8))]),  # load starts mid-window
        np.concatenate([np.ones((150, 2, 8)), np.zeros((50, 2, 8))]),  # load stops mid-window
        np.where(np.arange(8) == 3, 1e12, 1.0) * np.ones((60, 2, 8)),  # a huge hot expert
        np.concatenate([np.ones((199, 2, 8)), np.full((1, 2, 8), 1e15)]),  # a huge last pass
        np.stack([np.eye(8)[w % 8] for w in range(100)])[:, None].repeat(2, axis=1),  # one expert a pass
    ],
)
def test_nasty_windows(load: np.ndarray) -> None:
    checked = as_load_array(load)
    for shift in (None, 0.05):
        options = SolveOptions(prediction="track", track_shift=shift)
        got = predict(checked, options, "track").point_LE
        assert got.shape == checked.shape[1:] and np.isfinite(got).all() and (got >= 0).all()
        # The pass weights sum to W: each layer's forecast is a weighted mean pass times W.
        assert (got.sum(axis=-1) <= checked.sum(axis=-1).max(axis=0) * checked.shape[0] * (1 + 1e-9)).all()
        want = ref_track(checked, options.track_half_lives, shift, checked.shape[0], 8.0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12 * max(1.0, float(checked.max())))
        np.testing.assert_array_equal(
            got, predict(checked.copy(), options, "track").point_LE
        )  # deterministic


def test_solve_plans_on_track() -> None:
    rng = np.random.default_rng(5)
    G, E = 4, 16
    topology = Topology(num_gpus=G, num_physical=E + G)
    load = drifting_window(rng, 120, 3, E, shift_at=100)
    current = Placement.trivial(3, E, G, G)
    for budget, shift in ((None, None), (6, None), (6, 0.05)):
        options = SolveOptions(
            algorithm="scipy",
            prediction="track",
            dispatch="static",
            max_moved_experts=budget,
            track_shift=shift,
        )
        plan = solve(load, topology, current, options)
        assert plan.placement.num_physical == E + G
        if budget is not None and plan.diff is not None:
            assert plan.diff.experts_moved_across_gpus <= budget
        again = solve(load, topology, current, options)
        np.testing.assert_array_equal(plan.placement.phy2log_LP, again.placement.phy2log_LP)


def test_track_options_are_checked() -> None:
    assert SolveOptions(track_half_lives=[4, 8]).track_half_lives == (4.0, 8.0)  # type: ignore[arg-type]
    assert SolveOptions.from_mapping({"track_half_lives": [3, 6], "track_shift": None}).track_half_lives == (
        3.0,
        6.0,
    )
    for bad in ((), (0.0,), (-1.0,), (float("inf"),), (True,), ("8",)):
        with pytest.raises(ValueError, match="track_half_lives"):
            SolveOptions(track_half_lives=bad)  # type: ignore[arg-type]
    for bad_shift in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="track_shift"):
            SolveOptions(track_shift=bad_shift)
    with pytest.raises(ValueError, match="prediction"):
        SolveOptions(prediction="holt")
