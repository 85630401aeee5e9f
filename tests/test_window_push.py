"""The recorder's one-launch end of pass (eplb.kernels.window_push) against a torch sum and fill.

The kernel runs under Triton's interpreter on CPU tensors, and compiled on CUDA, where the
recorder's stat window uses it for every pass (its first launch through ``kernel[grid]``, the later
ones directly); the reference is ``rows.sum(dim=1)`` and a zeroed copy of the rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb.placement.model import Placement
from eplb.recorder.buffers import StatWindow
from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig
from eplb.remap.api import DispatchTables


def _rows(rng: np.random.Generator, L: int, C: int, P: int, high: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, high, size=(L, C, P)).astype(np.int32))


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("L", "C", "P", "W"),
    [(3, 16, 40, 4), (1, 1, 1, 1), (58, 16, 288, 2), (2, 3, 1031, 3), (5, 2, 7, 5)],
)
def test_push_sums_the_rows_into_the_chosen_window_row_and_zeroes_them(
    L: int, C: int, P: int, W: int
) -> None:
    from eplb.kernels.window_push import WindowPush

    rng = np.random.default_rng(L * 1000 + C * 10 + P)
    window = torch.from_numpy(rng.integers(-5, 5, size=(W, L, P)).astype(np.int32))
    rows = torch.zeros((L, C, P), dtype=torch.int32)
    push = WindowPush(rows, window)
    expected = window.clone()
    for step in range(2 * W):
        # counts near the int32 ceiling over C rows: the sum is exact where it fits
        rows.copy_(_rows(rng, L, C, P, high=(2**31 - 1) // C if step == 0 else 50))
        before = rows.clone()
        w, zero = step % W, step % 3 != 2
        push(w, zero=zero)
        expected[w] = before.sum(dim=1, dtype=torch.int32)
        torch.testing.assert_close(window, expected, rtol=0, atol=0)
        torch.testing.assert_close(rows, torch.zeros_like(rows) if zero else before, rtol=0, atol=0)


@pytest.mark.interpreter
def test_push_refuses_what_it_cannot_sum() -> None:
    from eplb.kernels.window_push import WindowPush

    rows = torch.zeros((2, 3, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        WindowPush(rows.to(torch.int64), torch.zeros((1, 2, 4), dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[W, L, P\]"):
        WindowPush(rows, torch.zeros((1, 2, 5), dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        WindowPush(
            torch.zeros((2, 4, 3), dtype=torch.int32).transpose(1, 2),
            torch.zeros((1, 2, 4), dtype=torch.int32),
        )


@pytest.mark.gpu
def test_the_cuda_window_equals_the_torch_window_pass_for_pass() -> None:
    """A recorder on CUDA (fused push, direct launches after the first) keeps the CPU recorder's window."""
    rng = np.random.default_rng(7)
    pl = Placement.trivial(4, 16, num_gpus=2, num_redundant=4)
    recs = {
        dev: ExpertDistributionRecorder(
            RecorderConfig(mode="stat", window=5, prefill_only=True), pl, device=dev
        )
        for dev in ("cpu", "cuda")
    }
    for rec in recs.values():
        rec.start()
    for step in range(13):
        ids = [rng.integers(-1, 16, size=(int(rng.integers(1, 300)), 2)).astype(np.int32) for _ in range(4)]
        prefill = step % 4 != 3
        for dev, rec in recs.items():
            remaps = rec.prepare(DispatchTables.from_placement(pl, 0, device=dev))
            rec.begin_pass(has_prefill=prefill, num_tokens=int(ids[0].shape[0]), any_rank_prefill=prefill)
            for layer, layer_ids in enumerate(ids):
                remaps[layer](torch.from_numpy(layer_ids).to(dev))
            rec.end_pass()
        cpu, cuda = recs["cpu"], recs["cuda"]
        _, want = cpu.window_passes()
        _, got = cuda.window_passes()
        np.testing.assert_array_equal(got, want)
        assert int(cuda.pass_counts_LCP.abs().sum()) == 0


@pytest.mark.gpu
def test_a_cuda_stat_window_pushes_in_one_launch_exactly() -> None:
    rng = np.random.default_rng(3)
    win = StatWindow(3, 58, 288, torch.device("cuda"))
    rows = _rows(rng, 58, 16, 288, high=1000).cuda()
    for step in range(7):
        before = rows.clone()
        win.push(rows, info=None, zero=step % 2 == 0)  # type: ignore[arg-type]  # info is only kept
        torch.testing.assert_close(
            win.counts_WLP[step % 3], before.sum(dim=1, dtype=torch.int32), rtol=0, atol=0
        )
        if step % 2 == 0:
            assert int(rows.abs().sum()) == 0
            rows.copy_(_rows(rng, 58, 16, 288, high=1000).cuda())
