"""Held-out scores: what a plan will get on the next window, from load it was not fitted to.

Shape legend: W window (passes), n scored passes, L layers, E logical experts, P physical slots,
G GPUs, l layers scored.

A plan scored on the load it was fitted to looks better than it is (it fits that load's noise,
and the load drifts on), so ``solve`` also plans on the window without its newest ``B`` passes
(the *older* plan) and compares:

- score ``f(X, passes)``: the mean over passes of the model balancedness of placement X, each
  pass weighted by its total load (large passes, prefill, weigh most, as they take most of the
  MoE time);
- a placement's decline: its score on the last ``B`` passes it was planned on (``tail``) minus
  its score on the ``B`` passes after them (``held``). The older plan's decline is the optimism of
  planning (fit to noise, then drift); the current placement's decline is the drift alone;
- predicted score: the score on ``held`` minus the decline of the placement that played its
  role at the older cut (the older plan for the plan, the current placement for itself). The
  predicted gain, their difference, compares every placement on the same passes, so most of the
  pass-to-pass noise cancels.

Only layers that differ from the current placement are scored again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def holdout_size(num_passes: int, holdout_passes: int | None) -> int:
    """Passes held out at the end of a window of ``num_passes`` (0: score in-sample)."""
    if num_passes < 2 or holdout_passes == 0:
        return 0
    size = num_passes // 4 if holdout_passes is None else holdout_passes
    return int(min(max(size, 1), num_passes - 1))


@dataclass(frozen=True)
class PassScores:
    """Per-layer scores of placements on a fixed set of passes."""

    load_LnE: np.ndarray
    """float32 [L, n, E]: the scored passes, layer-major (one matrix product per layer)."""
    weight_n: np.ndarray
    """float64 [n]: each pass's weight (its share of the load), summing to 1."""

    @classmethod
    def of(cls, load_nLE: np.ndarray) -> PassScores:
        total_n = load_nLE.sum(axis=(1, 2))
        if total_n.sum() > 0:
            weight_n = total_n / total_n.sum()
        else:
            weight_n = np.full(total_n.shape, 1.0 / total_n.size)
        return cls(np.ascontiguousarray(load_nLE.transpose(1, 0, 2), dtype=np.float32), weight_n)

    def layers(
        self, phy2log_LP: np.ndarray, share_LP: np.ndarray, num_gpus: int, layers: np.ndarray
    ) -> np.ndarray:
        """float64 [l]: weighted mean over passes of the balancedness of ``layers``."""
        if layers.size == 0:
            return np.zeros(0)
        return np.asarray(self._bal_ln(phy2log_LP, share_LP, num_gpus, layers) @ self.weight_n)

    def per_pass(
        self, phy2log_LP: np.ndarray, share_LP: np.ndarray, num_gpus: int, layers: np.ndarray
    ) -> np.ndarray:
        """float64 [n]: each pass's balancedness, the mean over ``layers``."""
        return np.asarray(self._bal_ln(phy2log_LP, share_LP, num_gpus, layers).mean(axis=0))

    def _bal_ln(
        self, phy2log_LP: np.ndarray, share_LP: np.ndarray, num_gpus: int, layers: np.ndarray
    ) -> np.ndarray:
        nl, E, G = layers.size, self.load_LnE.shape[2], num_gpus
        p2l_lP = phy2log_LP[layers]
        gpu_P = np.arange(p2l_lP.shape[1]) // (p2l_lP.shape[1] // G)
        flat = ((np.arange(nl)[:, None] * E + p2l_lP) * G + gpu_P).ravel()
        share_lEG = np.bincount(flat, share_LP[layers].ravel(), minlength=nl * E * G)
        # float32 products are exact enough for a score and several times faster than a gather.
        gpu_lnG = np.matmul(self.load_LnE[layers], share_lEG.reshape(nl, E, G).astype(np.float32))
        peak_ln = gpu_lnG.max(axis=-1).astype(np.float64)
        mean_ln = gpu_lnG.sum(axis=-1, dtype=np.float64) / G
        return np.where(peak_ln > 0, mean_ln / np.where(peak_ln > 0, peak_ln, 1.0), 1.0)


def shift_start(load_nLE: np.ndarray, scored: Scored, num_gpus: int) -> int:
    """The pass (in [1, n)) where ``scored``'s balancedness dropped most: the split that maximises
    the load-weighted mean over the passes before it minus that over the passes from it.

    A domain shift is a jump, not a trend: calibrating across it would charge the jump again to
    the plans made after it, so ``solve`` calibrates on the passes from here on.
    """
    n = load_nLE.shape[0]
    if n < 2:
        return max(n - 1, 0)
    passes = PassScores.of(load_nLE)
    L = load_nLE.shape[1]
    bal_n = passes.per_pass(scored.phy2log_LP, scored.share_LP, num_gpus, np.arange(L))
    w_n = np.maximum(passes.weight_n, 1e-300)
    before_w, before_s = np.cumsum(w_n)[:-1], np.cumsum(w_n * bal_n)[:-1]
    after_w, after_s = w_n.sum() - before_w, (w_n * bal_n).sum() - before_s
    drop = before_s / before_w - after_s / after_w
    return int(np.argmax(drop)) + 1


def even_share_LP(phy2log_LP: np.ndarray, cnt_LE: np.ndarray) -> np.ndarray:
    """float64 [L, P]: each slot's share of its expert's tokens under an even split over replicas."""
    return 1.0 / np.take_along_axis(cnt_LE, phy2log_LP, axis=1).astype(np.float64)


@dataclass(frozen=True)
class Scored:
    """A placement as the held-out scorer needs it."""

    phy2log_LP: np.ndarray
    """int [L, P]."""
    share_LP: np.ndarray
    """float64 [L, P]: share of its expert's tokens each slot receives."""


@dataclass(frozen=True)
class Blocks:
    """A window's last two hold-out blocks (``tail`` before ``held``) and the current placement's
    per-layer scores on them: computed once per solve, for the shift check and the prediction."""

    tail: PassScores
    held: PassScores
    current_held_L: np.ndarray | None
    """float64 [L]: the current placement's scores on ``held`` (None: no current placement)."""
    current_tail_L: np.ndarray | None

    @classmethod
    def of(cls, load_WLE: np.ndarray, size: int, current: Scored | None, num_gpus: int) -> Blocks:
        """The blocks of the last ``size`` passes and the ``size`` before them (``size`` >= 1)."""
        W = load_WLE.shape[0]
        tail = PassScores.of(load_WLE[max(W - 2 * size, 0) : W - size])
        held = PassScores.of(load_WLE[W - size :])
        if current is None:
            return cls(tail, held, None, None)
        all_L = np.arange(load_WLE.shape[1])
        return cls(
            tail,
            held,
            held.layers(current.phy2log_LP, current.share_LP, num_gpus, all_L),
            tail.layers(current.phy2log_LP, current.share_LP, num_gpus, all_L),
        )

    def current_decline(self) -> float:
        """The current placement's score on ``tail`` minus that on ``held``."""
        assert self.current_held_L is not None and self.current_tail_L is not None
        return float(self.current_tail_L.mean() - self.current_held_L.mean())


def held_out_scores(
    blocks: Blocks,
    plan: Scored,
    older: Scored,
    current: Scored | None,
    num_gpus: int,
) -> dict[str, float]:
    """Predicted next-window scores of ``plan`` (and ``current``) from the older plan's decline.

    Keys: predicted (the plan), current (None when there is no current placement: absent),
    gain, held_plan / held_older / tail_older (raw scores), and held_current / tail_current.
    """
    L = plan.phy2log_LP.shape[0]
    all_L = np.arange(L)
    tail, held = blocks.tail, blocks.held
    if current is None:
        held_plan = held.layers(plan.phy2log_LP, plan.share_LP, num_gpus, all_L).mean()
        held_older = held.layers(older.phy2log_LP, older.share_LP, num_gpus, all_L).mean()
        tail_older = tail.layers(older.phy2log_LP, older.share_LP, num_gpus, all_L).mean()
        decline = tail_older - held_older
        return {
            "predicted": float(held_plan - decline),
            "held_plan": float(held_plan),
            "held_older": float(held_older),
            "tail_older": float(tail_older),
        }
    held_cur_L, tail_cur_L = blocks.current_held_L, blocks.current_tail_L
    assert held_cur_L is not None and tail_cur_L is not None, "blocks made without the current placement"

    def score(x: Scored, base_L: np.ndarray, passes: PassScores) -> float:
        changed = np.flatnonzero(
            (x.phy2log_LP != current.phy2log_LP).any(axis=1) | (x.share_LP != current.share_LP).any(axis=1)
        )
        out_L = base_L.copy()
        out_L[changed] = passes.layers(x.phy2log_LP, x.share_LP, num_gpus, changed)
        return float(out_L.mean())

    held_cur, tail_cur = float(held_cur_L.mean()), float(tail_cur_L.mean())
    held_plan = score(plan, held_cur_L, held)
    held_older = score(older, held_cur_L, held)
    tail_older = score(older, tail_cur_L, tail)
    predicted = held_plan - (tail_older - held_older)
    predicted_current = held_cur - (tail_cur - held_cur)
    return {
        "predicted": predicted,
        "current": predicted_current,
        "gain": predicted - predicted_current,
        "held_plan": held_plan,
        "held_older": held_older,
        "tail_older": tail_older,
        "held_current": held_cur,
        "tail_current": tail_cur,
    }
