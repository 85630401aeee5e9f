"""Hot-swap on one rank (no process group): in place, exact, rolled back on injected failures; checksums; layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb.hotswap.checksum import expert_checksum
from eplb.hotswap.layout import (
    BlockShuffleLayout,
    PlainLayout,
    get_layout,
    shuffle_scale_tiles,
    shuffle_weight_tiles,
    unshuffle_scale_tiles,
    unshuffle_weight_tiles,
)
from eplb.hotswap.swap import HotSwapOptions, HotSwapShapeError, hot_swap
from eplb.moe.model import slot_buffers
from eplb.placement.model import Placement
from tests.helpers.placements import random_phy2log

L, E, P = 3, 6, 10

pytestmark = pytest.mark.usefixtures("one_thread")


def logical(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w13": torch.randn(L, E, 64, 32, generator=g), "w2": torch.randn(L, E, 32, 32, generator=g)}


def placements(seed: int) -> tuple[Placement, Placement]:
    rng = np.random.default_rng(seed)
    old = Placement.from_phy2log(random_phy2log(rng, L, E, P), 1, max_replicas=P - E + 1)
    new = Placement.from_phy2log(random_phy2log(rng, L, E, P), 1, max_replicas=P - E + 1)
    return old, new


def assert_holds(
    slots_L: list[dict[str, torch.Tensor]], w: dict[str, torch.Tensor], pl: Placement, layout=None
) -> None:
    layout = layout or PlainLayout()
    for layer in range(L):
        for name in ("w13", "w2"):
            plain = layout.to_plain(name, slots_L[layer][name])
            expected = w[name][layer][torch.from_numpy(pl.phy2log_LP[layer].astype(np.int64))]
            assert torch.equal(plain, expected), (layer, name)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget_experts", [1, 4, 100])
def test_swap_in_place_is_exact(seed: int, budget_experts: int) -> None:
    w = logical(seed)
    old, new = placements(seed)
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    ptrs = [t.data_ptr() for d in slots_L for t in d.values()]
    per_expert = (64 * 32 + 32 * 32) * 4
    updated = []
    res = hot_swap(
        slots_L,
        old,
        new,
        options=HotSwapOptions(staging_budget_bytes=budget_experts * per_expert),
        update_maps=lambda: updated.append(True),
    )
    assert res.ok and res.error is None and updated == [True]
    assert res.experts_moved == 0 and res.local_copies > 0  # one GPU: every move is local
    assert_holds(slots_L, w, new)
    assert ptrs == [t.data_ptr() for d in slots_L for t in d.values()]


def test_layers_subset_leaves_other_layers_alone() -> None:
    w = logical(1)
    old, new = placements(1)
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    hot_swap(slots_L, old, new, layers=[1])
    mixed = old.phy2log_LP.copy()
    mixed[1] = new.phy2log_LP[1]
    assert_holds(slots_L, w, Placement.from_phy2log(mixed, 1))


@pytest.mark.parametrize("stage", ["prepare", "received"])
@pytest.mark.parametrize("fractions", [(1.0,), (0.25, 0.5, 0.25)])
def test_injected_failure_rolls_back_exactly(stage: str, fractions: tuple[float, ...]) -> None:
    w = logical(2)
    old, new = placements(2)
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    before = [{k: v.clone() for k, v in d.items()} for d in slots_L]
    ptrs = [t.data_ptr() for d in slots_L for t in d.values()]
    called = []

    def fault(where: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if where == stage and chunk == 1:
            raise RuntimeError("injected")

    res = hot_swap(
        slots_L,
        old,
        new,
        options=HotSwapOptions(
            staging_budget_bytes=2 * (64 * 32 + 32 * 32) * 4,
            piece_fractions=fractions,
        ),
        update_maps=lambda: called.append(True),
        fault=fault,
    )
    assert not res.ok and "injected" in (res.error or "") and res.chunks > 2
    assert called == []
    assert all(torch.equal(a[k], b[k]) for a, b in zip(slots_L, before, strict=True) for k in a)
    assert ptrs == [t.data_ptr() for d in slots_L for t in d.values()]


def test_local_copy_corruption_is_caught_by_checksum(monkeypatch: pytest.MonkeyPatch) -> None:
    # One rank receives nothing, so corrupt the first local copy once, after it landed.
    from eplb.hotswap import group as hotswap_group

    w = logical(3)
    old, new = placements(3)
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    before = [{k: v.clone() for k, v in d.items()} for d in slots_L]
    original = hotswap_group.local_copy
    done: list[bool] = []

    def corrupting_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        original(dst, src)
        if not done:
            dst[0].view(-1)[0] += 1.0
            done.append(True)

    monkeypatch.setattr(hotswap_group, "local_copy", corrupting_copy)
    res = hot_swap(slots_L, old, new, options=HotSwapOptions(staging_budget_bytes=1 << 20))
    assert done and not res.ok and "checksum mismatch" in (res.error or "")
    assert all(torch.equal(a[k], b[k]) for a, b in zip(slots_L, before, strict=True) for k in a)


def test_placements_must_match_the_group() -> None:
    w = logical(0)
    old = Placement.trivial(L, E, 2, num_redundant=4)
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="2 GPUs but the group has 1") as raised:
        hot_swap(slots_L, old, old)
    # A ValueError that carries the swap's cause and the rank that found it.
    assert isinstance(raised.value, HotSwapShapeError) and (raised.value.cause, raised.value.rank) == (
        "shape",
        0,
    )
    assert str(raised.value).startswith("shape: rank 0 cannot run this hot-swap")


# ---- checksums -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,dtype",
    [((8, 16), torch.float32), ((4, 6), torch.bfloat16), ((3, 5), torch.uint8), ((7,), torch.float16)],
)
def test_checksum_detects_changes(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.rand(shape, generator=g) * 200).to(dtype)
    base = expert_checksum([t])
    assert torch.equal(base, expert_checksum([t.clone()]))
    bumped = t.clone()
    bumped.view(torch.uint8).view(-1)[1] ^= 1
    assert not torch.equal(base, expert_checksum([bumped]))
    if len(shape) == 2:
        swapped = t.clone()
        swapped[[0, 1]] = t[[1, 0]]
        if not torch.equal(t[0], t[1]):
            assert not torch.equal(base, expert_checksum([swapped]))


def test_checksum_of_nan_payload_is_exact() -> None:
    t = torch.full((4, 4), float("nan"))
    assert torch.equal(expert_checksum([t]), expert_checksum([t.clone()]))
    with pytest.raises(ValueError):
        expert_checksum([])
    with pytest.raises(ValueError, match="contiguous"):
        expert_checksum([torch.zeros(4, 4).T])


# ---- layouts ---------------------------------------------------------------------------------
def test_tile_shuffles_invert_and_move_data() -> None:
    w = torch.arange(3 * 32 * 64, dtype=torch.float32).reshape(3, 32, 64)
    shuffled = shuffle_weight_tiles(w)
    assert shuffled.shape == w.shape and not torch.equal(shuffled, w)
    assert torch.equal(unshuffle_weight_tiles(shuffled), w)
    # Known element: with 4-byte elements a 16-byte pack holds 4; rows come in tiles of 16.
    assert shuffled[0, 0, 4] == w[0, 1, 0]
    s = torch.arange(2 * 64 * 16, dtype=torch.float32).reshape(2, 64, 16)
    assert torch.equal(unshuffle_scale_tiles(shuffle_scale_tiles(s)), s)
    with pytest.raises(ValueError, match="tile"):
        shuffle_weight_tiles(torch.zeros(2, 8, 32))
    with pytest.raises(ValueError, match="divisible by 32"):
        shuffle_scale_tiles(torch.zeros(2, 8, 8))


def test_swap_through_a_shuffled_layout() -> None:
    layout = get_layout("block_shuffle")
    assert isinstance(layout, BlockShuffleLayout)
    w = logical(4)
    old, new = placements(4)
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32, layout=layout)
    first = torch.from_numpy(old.phy2log_LP[0].astype(np.int64))
    assert not torch.equal(slots_L[0]["w13"], w["w13"][0][first])  # the engine layout really differs
    assert_holds(slots_L, w, old, layout)
    res = hot_swap(slots_L, old, new, layout=layout, options=HotSwapOptions(staging_budget_bytes=1 << 14))
    assert res.ok
    assert_holds(slots_L, w, new, layout)


def test_layout_registry() -> None:
    assert get_layout("plain").name == "plain"
    with pytest.raises(ValueError, match="ROCm"):
        get_layout("aiter")  # this machine has no ROCm torch
    with pytest.raises(ValueError, match="unknown slot layout"):
        get_layout("nope")


def test_consecutive_slots_move_as_one_block() -> None:
    from eplb.hotswap.plan import plan_swap
    from eplb.hotswap.program import chunk_blocks

    # GPU 0 holds experts 0..5 and 0..1 again; GPU 1 holds 6..11 and 6..7 (S = 8).
    cur = np.array([[0, 1, 2, 3, 4, 5, 0, 1, 6, 7, 8, 9, 10, 11, 6, 7]], dtype=np.int32)
    tgt = cur.copy()
    tgt[0, 14:16] = [2, 3]  # GPU 1's redundant slots take experts 2, 3 from GPU 0: one block of 2
    tgt[0, 6] = 8  # one expert from GPU 1 to GPU 0: a block of 1
    tgt[0, 0], tgt[0, 1] = 1, 0  # a local swap of two slots: staged
    plan = plan_swap(cur, tgt, num_gpus=2, bytes_per_expert=1, chunk_bytes=100)
    blocks = chunk_blocks(plan, 0)
    cross = sorted(
        (b.src_gpu, b.dst_gpu, b.count, b.src_slot, b.dst_slot) for b in blocks if b.src_gpu != b.dst_gpu
    )
    assert cross == [(0, 1, 2, 2, 14), (1, 0, 1, 10, 6)]
    local = [b for b in blocks if b.src_gpu == b.dst_gpu]
    # Slot 0 is read (expert 0 for slot 1) and written (expert 1, from the unchanged slot 7): staged.
    assert {(b.dst_slot, b.staged) for b in local} == {(0, True), (1, False)}
    assert sorted(i for b in blocks for i in b.transfers) == list(range(len(plan.transfers)))


def test_block_moves_on_one_rank() -> None:
    g = torch.Generator().manual_seed(5)
    w = {"w13": torch.randn(1, 8, 64, 32, generator=g), "w2": torch.randn(1, 8, 32, 32, generator=g)}
    old = Placement.from_phy2log(
        np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]], dtype=np.int32), 1, max_replicas=5
    )
    # Slots 8..11 take experts 4..7 (one block), slots 0..3 rotate (a staged cycle).
    new = Placement.from_phy2log(
        np.array([[1, 2, 3, 0, 4, 5, 6, 7, 4, 5, 6, 7]], dtype=np.int32), 1, max_replicas=5
    )
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    res = hot_swap(slots_L, old, new)
    assert res.ok
    for name in ("w13", "w2"):
        expected = w[name][0][torch.from_numpy(new.phy2log_LP[0].astype(np.int64))]
        assert torch.equal(slots_L[0][name], expected)


# ---- the commit point on one rank ------------------------------------------------------------
def test_maps_follow_the_weights_at_the_commit_or_go_back() -> None:
    from eplb.hotswap.swap import HotSwapError

    w = logical(5)
    old, new = placements(5)
    options = HotSwapOptions(staging_budget_bytes=2 * (64 * 32 + 32 * 32) * 4)
    maps: list[str] = []

    def failing_update() -> None:
        maps.append("new")
        raise RuntimeError("no maps")

    # With restore_maps, update_maps runs before the vote: its exception fails the swap, the old
    # maps go back and the weights never changed.
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    res = hot_swap(
        slots_L,
        old,
        new,
        options=options,
        update_maps=failing_update,
        restore_maps=lambda: maps.append("old"),
    )
    assert not res.ok and res.cause == "error" and res.rank == 0 and "no maps" in (res.error or "")
    assert maps == ["new", "old"]
    assert_holds(slots_L, w, old)
    # Without, it runs after the commit: the weights are new, the maps undefined, and it says so.
    with pytest.raises(HotSwapError, match="after the commit") as raised:
        hot_swap(slots_L, old, new, options=options, update_maps=failing_update)
    assert raised.value.committed and not raised.value.consistent and raised.value.cause == "error"
    assert_holds(slots_L, w, new)


@pytest.mark.parametrize("stage", ["prepare", "received", "committed"])
def test_keyboard_interrupt_leaves_one_placement_then_propagates(stage: str) -> None:
    w = logical(6)
    old, new = placements(6)
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    maps: list[str] = []

    def interrupt(where: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if where == stage and chunk in (1, -1):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hot_swap(
            slots_L,
            old,
            new,
            options=HotSwapOptions(staging_budget_bytes=2 * (64 * 32 + 32 * 32) * 4),
            update_maps=lambda: maps.append("new"),
            restore_maps=lambda: maps.append("old"),
            fault=interrupt,
        )
    # Before the commit point: old weights, maps never changed; after it: the commit finishes first.
    assert_holds(slots_L, w, new if stage == "committed" else old)
    assert maps == (["new"] if stage == "committed" else [])


@pytest.mark.parametrize(
    ("timeout_s", "group_s"),
    [(0.01, 10.0), (2.0, 10.0), (10.0 / 3, 10.0), (5.0, 15.0), (60.0, 180.0), (150.0, 450.0), (600.0, 900.0)],
)
def test_a_swap_groups_own_timeout_is_a_few_times_the_swaps(timeout_s: float, group_s: float) -> None:
    from eplb.hotswap.runtime import swap_group_timeout_s

    # Three times timeout_s, at least 10 s (to make the group), at most 5 minutes past timeout_s.
    assert swap_group_timeout_s(timeout_s) == pytest.approx(group_s)
    assert swap_group_timeout_s(timeout_s) > timeout_s  # never ends a wait the swap still runs


def test_without_a_process_group_no_swap_group_is_made() -> None:
    import torch.distributed as dist

    from eplb.hotswap import owned

    assert not dist.is_initialized()
    old, new = placements(4)
    w = logical(4)
    slots_L = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    assert hot_swap(slots_L, old, new).ok
    assert_holds(slots_L, w, new)
    assert owned.owned_group(torch.device("cpu"), 60.0) is None and not owned._OWNED
    owned.refuse_serving(None)  # nothing to refuse: no default group
