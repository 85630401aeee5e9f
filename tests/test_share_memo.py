"""ShareModel.expert_shares memoises one expert's static shares: a batch larger than the memo, whose
first experts were memoised before, answers as a fresh computation does."""

from __future__ import annotations

import numpy as np
import pytest

import eplb.placement.share as share
from eplb.placement.share import ShareModel


def test_a_batch_past_the_memo_size_answers_every_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    G, N, S = 8, 2, 3
    rng = np.random.default_rng(0)
    slots_X = [
        sorted(rng.choice(G * S, size=int(rng.integers(2, 5)), replace=False).tolist()) for _ in range(9)
    ]
    offsets_X = rng.integers(0, 1000, size=len(slots_X)).tolist()
    model = ShareModel("static", N)
    monkeypatch.setattr(share, "_EXPERT", {})
    want_X = [shares.copy() for shares in model.expert_shares(slots_X, offsets_X, G, S)]
    # A memo of 2 holding the batch's first two experts: the batch's seven new ones evict them.
    monkeypatch.setattr(share, "_EXPERT", {})
    monkeypatch.setattr(share, "_EXPERT_SIZE", 2)
    model.expert_shares(slots_X[:2], offsets_X[:2], G, S)
    got_X = model.expert_shares(slots_X, offsets_X, G, S)
    assert len(share._EXPERT) == 2
    for want, got in zip(want_X, got_X, strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.sum() == pytest.approx(1.0)
