"""The MoE path on one rank against dense references: grouped GEMM, exchange forms, padding, counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eplb.moe.experts import expert_ffn, grouped_mm_works
from eplb.moe.model import MoEModel, MoEModelConfig, logical_weights
from eplb.moe.reference import dense_moe, reference_forward
from eplb.moe.spawn import run_ranks
from eplb.placement.model import Placement
from tests.helpers.placements import random_phy2log
from tests.helpers.ranks import rank1_fails

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def per_row_ffn(x: torch.Tensor, slot: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The FFN one row at a time (the most literal reading of the contract)."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for m in range(x.shape[0]):
        s = int(slot[m])
        if s >= 0:
            h = w13[s] @ x[m]
            out[m] = w2[s] @ (F.silu(h[:inter]) * h[inter:])
    return out


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_expert_ffn_matches_per_row(grouped: bool, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    S, H, inter = 5, 16, 8
    w13, w2 = torch.randn(S, 2 * inter, H, generator=g), torch.randn(S, H, inter, generator=g)
    x = torch.randn(rows, H, generator=g)
    slot = torch.randint(-1, S, (rows,), generator=g, dtype=torch.int32)
    if rows:
        slot[0] = 2  # slot 2 non-empty, some slots likely empty
    got = expert_ffn(x, slot, w13, w2, use_grouped_mm=grouped)
    torch.testing.assert_close(got, per_row_ffn(x, slot, w13, w2), rtol=1e-5, atol=1e-5)
    assert (got[slot < 0] == 0).all()


def test_grouped_mm_probe() -> None:
    assert grouped_mm_works("cpu", torch.float32, 16, 8) == hasattr(torch, "_grouped_mm")
    assert not grouped_mm_works("cpu", torch.bfloat16, 4, 2)  # strides below 16 bytes are refused


def test_dense_reference_against_a_token_loop() -> None:
    g = torch.Generator().manual_seed(0)
    T, K, E, H, inter = 9, 3, 5, 8, 4
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[0, 1] = -1
    w = torch.rand(T, K, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    want = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e >= 0:
                h = w13[e] @ x[t]
                want[t] += w[t, k] * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    torch.testing.assert_close(dense_moe(x, ids, w, w13, w2), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity", [None, 64 * 4])
@pytest.mark.parametrize("mode", ["static", "dynamic", "weighted"])
def test_model_equals_dense_reference(capacity: int | None, mode: str) -> None:
    cfg = MoEModelConfig(num_layers=3, num_experts=8, top_k=4)
    w = logical_weights(cfg)
    rng = np.random.default_rng(1)
    placement = Placement.from_phy2log(random_phy2log(rng, 3, 8, 12), 1, max_replicas=5)
    model = MoEModel(
        cfg, placement, rank=0, device=CPU, weights=w, capacity=capacity, mode=mode, remap_backend="torch"
    )
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, cfg.hidden, generator=g)
    bias = 2 * torch.randn(cfg.num_layers, cfg.num_experts, generator=g)
    torch.testing.assert_close(model(x, bias), reference_forward(cfg, w, x, bias), rtol=1e-5, atol=1e-5)


def test_padding_rows_and_ids_contribute_nothing_and_are_not_counted() -> None:
    cfg = MoEModelConfig(num_layers=1, num_experts=6, top_k=2, hidden=16, intermediate=8)
    w = logical_weights(cfg)
    placement = Placement.trivial(1, 6, 1, num_redundant=2)
    for capacity in (None, 32):
        model = MoEModel(
            cfg, placement, rank=0, device=CPU, weights=w, capacity=capacity, remap_backend="torch"
        )
        layer = model.layers[0]
        g = torch.Generator().manual_seed(3)
        x = torch.randn(8, 16, generator=g)
        ids = torch.tensor(
            [[0, 1], [2, -1], [5, 4], [9, 3], [1, 1], [0, 2], [3, 4], [5, 0]], dtype=torch.int32
        )
        wts = torch.rand(8, 2, generator=g)
        counts = torch.zeros(6, dtype=torch.int32)
        n_valid = torch.tensor([6], dtype=torch.int32)
        y = layer(x, ids, wts, logical_counts_E=counts, num_valid_tokens=n_valid)
        keep = ids.clone()
        keep[(keep >= 6) | (torch.arange(8)[:, None] >= 6)] = -1
        w13 = w["w13"][0]
        w2 = w["w2"][0]
        torch.testing.assert_close(y, dense_moe(x, keep, wts, w13, w2), rtol=1e-5, atol=1e-5)
        assert (y[6:] == 0).all()
        expected = torch.bincount(keep[keep >= 0].long(), minlength=6).to(torch.int32)
        assert torch.equal(counts, expected)


def test_padded_exchange_counts_dropped_copies() -> None:
    cfg = MoEModelConfig(num_layers=1, num_experts=4, top_k=2, hidden=16, intermediate=8)
    w = logical_weights(cfg)
    placement = Placement.trivial(1, 4, 1)
    model = MoEModel(cfg, placement, rank=0, device=CPU, weights=w, capacity=5, remap_backend="torch")
    x = torch.randn(4, 16)
    ids = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]], dtype=torch.int32)
    y = model.layers[0](x, ids, torch.ones(4, 2))
    dropped = model.layers[0].exchange.dropped_1
    assert dropped is not None and int(dropped) == 3
    # The first 5 copies (in token order) were computed; the rest contribute nothing.
    keep = ids.clone().view(-1)
    keep[5:] = -1
    torch.testing.assert_close(y, dense_moe(x, keep.view(4, 2), torch.ones(4, 2), w["w13"][0], w["w2"][0]))


def test_int64_ids_are_refused() -> None:
    cfg = MoEModelConfig(num_layers=1, num_experts=4, top_k=2, hidden=16, intermediate=8)
    model = MoEModel(cfg, Placement.trivial(1, 4, 1), rank=0, device=CPU, remap_backend="torch")
    with pytest.raises(TypeError, match="int64"):
        model.layers[0](torch.zeros(2, 16), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2))


def test_empty_batch() -> None:
    cfg = MoEModelConfig(num_layers=2, num_experts=4, top_k=2, hidden=16, intermediate=8)
    model = MoEModel(cfg, Placement.trivial(2, 4, 1), rank=0, device=CPU, remap_backend="torch")
    assert model(torch.zeros(0, 16)).shape == (0, 16)


def test_config_and_shape_errors() -> None:
    with pytest.raises(ValueError, match="top_k"):
        MoEModelConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="dtype"):
        MoEModelConfig(dtype="float64")
    cfg = MoEModelConfig(num_layers=2, num_experts=4)
    with pytest.raises(ValueError, match="placement shape"):
        MoEModel(cfg, Placement.trivial(3, 4, 1), rank=0, device=CPU)


@pytest.mark.parametrize("how,message", [("raise", "rank 1 failed"), ("exit", "exit code 3")])
def test_a_failing_rank_ends_the_run_quickly(how: str, message: str) -> None:
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=message):
        run_ranks(rank1_fails, 2, args=(how,), timeout_s=120, rank0_in_process=True)
    assert time.monotonic() - start < 60  # far below the 120 s timeout
