"""Gloo, 2 and 4 ranks: the EP model equals the dense reference before and after a hot-swap;
injected failures the agreements settle (checksum mismatch, exception) leave weights and outputs
exactly as before on every rank, with the same cause and rank everywhere; slot buffers never move;
swaps without a group run on groups of their own (the default group is refused). One process
group per world size runs every scenario (lost and late peers: test_hotswap_faults)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from eplb.moe.spawn import RankContext, run_ranks


def scenario(ctx: RankContext, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    from eplb.hotswap.owned import owned_group
    from eplb.hotswap.swap import HotSwapOptions, hot_swap
    from eplb.moe.model import MoEModel, MoEModelConfig, logical_weights
    from eplb.moe.reference import dense_moe, reference_forward
    from eplb.placement.model import Placement
    from tests.helpers.placements import random_phy2log
    from tests.helpers.swap_faults import group_timeout_s

    G, rank = ctx.world_size, ctx.rank
    cfg = MoEModelConfig(num_layers=3, num_experts=8, top_k=3, hidden=32, intermediate=16)
    w = logical_weights(cfg)
    old = Placement.trivial(cfg.num_layers, cfg.num_experts, G, num_redundant=2 * G)
    rng = np.random.default_rng(seed)
    new = Placement.from_phy2log(
        random_phy2log(rng, cfg.num_layers, cfg.num_experts, old.num_physical),
        G,
        max_replicas=old.max_replicas,
    )
    exact = MoEModel(cfg, old, rank=rank, device=ctx.device, weights=w, remap_backend="torch")
    g = torch.Generator().manual_seed(100 + rank)
    tokens = 0 if rank == G - 1 else 11 + 5 * rank  # the last rank is idle: collectives must still line up
    x = torch.randn(tokens, cfg.hidden, generator=g)
    bias = 2 * torch.randn(cfg.num_layers, cfg.num_experts, generator=g)
    padded = MoEModel(cfg, old, rank=rank, device=ctx.device, weights=w, capacity=64, remap_backend="torch")
    ref = reference_forward(cfg, w, x, bias)
    out: dict[str, Any] = {}

    def err(y: torch.Tensor) -> float:
        return max_diff(y, ref)

    ids = torch.randint(0, cfg.num_experts, (tokens, cfg.top_k), generator=g, dtype=torch.int32)
    wts = torch.rand(tokens, cfg.top_k, generator=g)
    layer_ref = dense_moe(x, ids, wts, w["w13"][0], w["w2"][0])
    out["layer_before"] = max_diff(exact.layers[0](x, ids, wts), layer_ref)
    out["exact_before"], out["padded_before"] = err(exact(x, bias)), err(padded(x, bias))
    ptrs = [t.data_ptr() for d in exact.slots_L for t in d.values()]
    budget = 2 * sum(t[0].numel() * 4 for t in exact.slots_L[0].values())  # one expert per chunk and rank
    y0 = exact(x, bias)
    snapshot = [{k: v.clone() for k, v in d.items()} for d in exact.slots_L]

    corrupted: list[int] = []

    def corrupt(stage: str, k: int, bufs: list[torch.Tensor]) -> None:
        # Mid-swap: the first chunk after chunk 0 in which rank 1 receives an expert.
        if stage == "received" and k >= 1 and rank == 1 and bufs and not corrupted:
            bufs[0].view(-1)[0] += 1.0
            corrupted.append(k)

    def boom(stage: str, k: int, bufs: list[torch.Tensor]) -> None:
        if stage == "prepare" and k == 1 and rank == 0:
            raise RuntimeError("injected")

    # Several pieces per chunk (checksums while the next piece travels) or one.
    faults = [("mismatch", corrupt, (0.25, 0.5, 0.25)), ("exception", boom, (0.5, 0.5))]
    for name, fault, piece in faults:
        res = hot_swap(
            exact.slots_L,
            old,
            new,
            options=HotSwapOptions(staging_budget_bytes=budget, timeout_s=0.4, piece_fractions=piece),
            update_maps=lambda: exact.set_placement(new),
            fault=fault,
        )
        out[f"{name}_ok"] = res.ok
        out[f"{name}_error"] = res.error
        out[f"{name}_cause"] = (res.cause, res.rank)
        out[f"{name}_chunks"] = res.chunks
        out[f"{name}_weights_same"] = all(
            torch.equal(a[k], b[k]) for a, b in zip(exact.slots_L, snapshot, strict=True) for k in a
        )
        out[f"{name}_output_same"] = torch.equal(exact(x, bias), y0)
    for model in (exact, padded):
        res = hot_swap(
            model.slots_L,
            old,
            new,
            options=HotSwapOptions(staging_budget_bytes=budget),
            update_maps=lambda m=model: m.set_placement(new),
        )
        out.setdefault("swap_ok", []).append(res.ok)
    out["moved"] = res.experts_moved
    out["exact_after"], out["padded_after"] = err(exact(x, bias)), err(padded(x, bias))
    out["layer_after"] = max_diff(exact.layers[0](x, ids, wts), layer_ref)
    # Contiguous runs of slots trade places between ranks: multi-slot messages and staged blocks.
    shifted = np.roll(new.phy2log_LP, new.slots_per_gpu // 2, axis=1)
    block_target = Placement.from_phy2log(shifted, G, max_replicas=old.max_replicas)
    res = hot_swap(exact.slots_L, new, block_target, update_maps=lambda: exact.set_placement(block_target))
    out["block_swap_ok"] = res.ok
    out["block_after"] = err(exact(x, bias))
    # The trade back, with a corrupted arrival: backed-up slots are restored on every rank.
    held = [{k: v.clone() for k, v in d.items()} for d in exact.slots_L]

    def flip(stage: str, k: int, bufs: list[torch.Tensor]) -> None:
        if stage == "received" and rank == 0 and bufs:
            bufs[-1].view(-1)[-1] += 1.0

    res = hot_swap(
        exact.slots_L, block_target, new, fault=flip, options=HotSwapOptions(piece_fractions=(1.0, 1.0, 1.0))
    )
    out["trade_back_rolled_back"] = (not res.ok) and all(
        torch.equal(a[k], b[k]) for a, b in zip(exact.slots_L, held, strict=True) for k in a
    )
    out["ptrs_same"] = ptrs == [t.data_ptr() for d in exact.slots_L for t in d.values()]
    S = new.slots_per_gpu
    mine = torch.from_numpy(block_target.phy2log_LP[:, rank * S : (rank + 1) * S].astype(np.int64))
    out["slots_hold_new"] = all(
        torch.equal(exact.slots_L[layer]["w13"], w["w13"][layer][mine[layer]])
        for layer in range(cfg.num_layers)
    )
    # Without a group every swap above ran on a swap group of its own (one per group timeout),
    # never on the default group, which is refused as a swap's group (on every rank, before any
    # collective).
    try:
        hot_swap(exact.slots_L, block_target, new, group=dist.group.WORLD)
        out["world_refused"] = None
    except ValueError as exc:
        out["world_refused"] = str(exc)
    out["owned"] = []
    for timeout_s in (0.4, HotSwapOptions().timeout_s):
        own = owned_group(ctx.device, timeout_s)  # the one the swaps with this timeout_s ran on
        assert own is not None
        out["owned"].append(
            (own is dist.group.WORLD, dist.get_process_group_ranks(own), group_timeout_s(own), own.group_name)
        )
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max()) if a.numel() else 0.0


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    world = int(request.param)
    return run_ranks(scenario, world, args=(world,), timeout_s=150)


def test_outputs_equal_dense_reference_before_and_after(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["swap_ok"] == [True, True]
        for key in (
            "layer_before",
            "exact_before",
            "padded_before",
            "layer_after",
            "exact_after",
            "padded_after",
        ):
            assert r[key] < 1e-5, (key, r[key])
        assert r["slots_hold_new"]
    assert results[0]["moved"] > 0


def test_failures_roll_back_exactly_on_every_rank(results: list[dict[str, Any]]) -> None:
    for name in ("mismatch", "exception"):
        errors = [r[f"{name}_error"] for r in results]
        for r in results:
            assert r[f"{name}_ok"] is False
            assert r[f"{name}_chunks"] > 1
            assert r[f"{name}_weights_same"] and r[f"{name}_output_same"]
        expected = {"mismatch": "checksum mismatch", "exception": "injected"}[name]
        assert all(expected in (e or "") for e in errors), errors  # every rank names the first failure
        # The same cause and rank everywhere: the corrupted arrival landed on rank 1, rank 0 raised.
        assert {r[f"{name}_cause"] for r in results} == {
            {"mismatch": ("checksum", 1), "exception": ("error", 0)}[name]
        }


def test_failed_trade_restores_backups(results: list[dict[str, Any]]) -> None:
    assert all(r["trade_back_rolled_back"] for r in results)


def test_storage_never_moves(results: list[dict[str, Any]]) -> None:
    assert all(r["ptrs_same"] for r in results)


def test_without_a_group_swaps_run_on_groups_of_their_own_never_on_the_default_one(
    results: list[dict[str, Any]],
) -> None:
    G = len(results)
    for r in results:
        assert r["world_refused"] is not None and r["world_refused"].startswith("group: "), r["world_refused"]
        assert "group=None" in r["world_refused"] and "swap_group" in r["world_refused"]
        # Over every rank, each with a timeout of its own: 10 s at least, else 3 x timeout_s.
        (world_a, ranks_a, timeout_a, name_a), (world_b, ranks_b, timeout_b, name_b) = r["owned"]
        assert not world_a and not world_b and name_a != name_b
        assert ranks_a == ranks_b == list(range(G))
        assert (timeout_a, timeout_b) == (10.0, 180.0)
    assert len({tuple(o[3] for o in r["owned"]) for r in results}) == 1  # the same groups on every rank
