"""Hot-swap planning against a slot-level simulation: targets reached, order safe, rollback always possible."""

from __future__ import annotations

import numpy as np
import pytest

from eplb.hotswap.plan import SwapPlan, plan_swap
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from tests.helpers.placements import random_phy2log

GARBAGE = -7  # what a slot holds after a write that was never agreed


def simulate(
    plan: SwapPlan, cur_LP: np.ndarray, *, fail_at: int | None = None, posted_ahead: bool = False
) -> np.ndarray:
    """Slot contents after running the plan chunk by chunk with the executor's semantics.

    Within a chunk every read sees the state before the chunk; direct destinations are written at
    once, staged ones at commit. A failing chunk (and one posted ahead of it) writes garbage into
    its direct destinations and never commits.
    """
    state = np.array(cur_LP, copy=True)
    for k, chunk in enumerate(plan.chunks):
        failing = fail_at is not None and (k == fail_at or (posted_ahead and k == fail_at + 1))
        if fail_at is not None and k > fail_at + (1 if posted_ahead else 0):
            break
        before = state.copy()
        for i in chunk.transfers:
            t = plan.transfers[i]
            value = before[t.layer, t.src_slot]
            assert value == t.expert, "a transfer read a slot that no longer holds its expert"
            for d in t.dst_slots:
                if (t.layer, d) in chunk.staged:
                    continue
                state[t.layer, d] = GARBAGE if failing else value
        if not failing:
            for i in chunk.transfers:
                t = plan.transfers[i]
                for d in t.dst_slots:
                    if (t.layer, d) in chunk.staged:
                        state[t.layer, d] = before[t.layer, t.src_slot]
    return state


def random_pair(
    seed: int, L: int = 3, E: int = 12, G: int = 4, redundant: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    P = E + redundant
    return random_phy2log(rng, L, E, P), random_phy2log(rng, L, E, P)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("chunk_experts", [1, 3, 1000])
def test_plan_reaches_target_in_safe_order(seed: int, chunk_experts: int) -> None:
    cur, tgt = random_pair(seed)
    plan = plan_swap(cur, tgt, num_gpus=4, bytes_per_expert=10, chunk_bytes=10 * chunk_experts)
    assert np.array_equal(simulate(plan, cur), tgt)
    # Unchanged slots are never written; every changed slot exactly once.
    written = [(t.layer, d) for t in plan.transfers for d in t.dst_slots]
    assert len(written) == len(set(written)) == int((cur != tgt).sum())
    assert all(cur[layer, d] != tgt[layer, d] for layer, d in written)
    # Reads come no later than the write of the same slot; same chunk means staged.
    chunk_of = {i: k for k, c in enumerate(plan.chunks) for i in c.transfers}
    writer = {(t.layer, d): i for i, t in enumerate(plan.transfers) for d in t.dst_slots}
    for i, t in enumerate(plan.transfers):
        w = writer.get((t.layer, t.src_slot))
        if w is not None and w != i:
            assert chunk_of[i] <= chunk_of[w]
            if chunk_of[i] == chunk_of[w]:
                assert (t.layer, t.src_slot) in plan.chunks[chunk_of[i]].staged


@pytest.mark.parametrize("seed", range(6))
def test_counts_match_placement_diff(seed: int) -> None:
    cur, tgt = random_pair(seed)
    old, new = Placement.from_phy2log(cur, 4), Placement.from_phy2log(tgt, 4)
    diff = diff_placements(old, new, bytes_per_expert=5)
    plan = plan_swap(cur, tgt, num_gpus=4, bytes_per_expert=5, chunk_bytes=1 << 20)
    assert plan.cross_gpu_transfers == diff.experts_moved_across_gpus
    assert int(plan.bytes_received().sum()) == diff.bytes_across_gpus
    local_slots = sum(len(t.dst_slots) for t in plan.transfers if t.is_local)
    assert local_slots == diff.local_copies


def test_chunks_respect_the_budget_per_gpu() -> None:
    cur, tgt = random_pair(3, L=4, E=16, G=4, redundant=8)
    plan = plan_swap(cur, tgt, num_gpus=4, bytes_per_expert=100, chunk_bytes=300)
    assert len(plan.chunks) > 1
    for chunk in plan.chunks:
        per_gpu = np.bincount([plan.transfers[i].dst_gpu for i in chunk.transfers], minlength=4) * 100
        # Only a cycle that alone exceeds the budget may overflow it, and then it is alone.
        assert per_gpu.max() <= 300 or len({plan.transfers[i].layer for i in chunk.transfers}) == 1


def test_receives_spread_over_holders_and_prefer_local() -> None:
    # Expert 0 is held by GPUs 0 and 1; GPUs 2 and 3 each need two copies of it (4 slots).
    S = 4
    cur = np.array([[0, 1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], dtype=np.int32)
    tgt = cur.copy()
    tgt[0, 8:10] = 0
    tgt[0, 12:14] = 0
    tgt[0, 3] = 1  # a local copy: GPU 0 already holds expert 1
    plan = plan_swap(cur, tgt, num_gpus=4, bytes_per_expert=1, chunk_bytes=100)
    remote = [t for t in plan.transfers if not t.is_local]
    assert sorted(t.dst_gpu for t in remote) == [2, 3]  # one receive per GPU, fanned out locally
    assert sorted(t.src_gpu for t in remote) == [0, 1]  # spread over both holders
    assert all(len(t.dst_slots) == 2 for t in remote)
    local = [t for t in plan.transfers if t.is_local]
    assert [(t.src_slot, t.dst_slots) for t in local] == [(1, (3,))]
    assert {t.src_slot // S for t in remote} == {0, 1}


def test_swapping_two_experts_is_one_staged_chunk() -> None:
    cur = np.array([[0, 1, 2, 3]], dtype=np.int32)
    tgt = np.array([[3, 1, 2, 0]], dtype=np.int32)  # GPU 0 and GPU 1 trade experts 0 and 3
    plan = plan_swap(cur, tgt, num_gpus=2, bytes_per_expert=1, chunk_bytes=1)
    assert len(plan.chunks) == 1
    assert plan.chunks[0].staged == frozenset({(0, 0), (0, 3)})
    assert np.array_equal(simulate(plan, cur), tgt)


@pytest.mark.parametrize("seed", range(10))
def test_rollback_is_possible_after_any_failure(seed: int) -> None:
    cur, tgt = random_pair(seed)
    plan = plan_swap(cur, tgt, num_gpus=4, bytes_per_expert=1, chunk_bytes=2)
    for k in range(len(plan.chunks)):
        ahead = k + 1 < len(plan.chunks) and plan.chunks[k + 1].may_overlap_previous
        for posted_ahead in {False, ahead}:
            partial = (k, k + 1) if posted_ahead else (k,)
            actual = simulate(plan, cur, fail_at=k, posted_ahead=posted_ahead)
            known = plan.state_after(cur, done=k, partial=partial)
            # Every slot the state claims to know holds exactly that; unknown ones may hold anything.
            assert np.array_equal(actual[known >= 0], known[known >= 0])
            back = plan_swap(known, cur, num_gpus=4, bytes_per_expert=1, chunk_bytes=2)
            restored = simulate(back, np.where(known >= 0, actual, GARBAGE))
            assert np.array_equal(restored, cur)


def test_overlap_flag_means_no_write_of_a_slot_read_just_before() -> None:
    cur, tgt = random_pair(5, L=2, E=16, G=4, redundant=4)
    plan = plan_swap(cur, tgt, num_gpus=4, bytes_per_expert=1, chunk_bytes=2)
    for prev, chunk in zip(plan.chunks, plan.chunks[1:], strict=False):
        reads = {(plan.transfers[i].layer, plan.transfers[i].src_slot) for i in prev.transfers}
        writes = {(plan.transfers[i].layer, d) for i in chunk.transfers for d in plan.transfers[i].dst_slots}
        assert chunk.may_overlap_previous == (not reads & writes)


def test_layers_subset_and_nodes() -> None:
    cur, tgt = random_pair(7, L=3, E=8, G=4, redundant=8)
    plan = plan_swap(cur, tgt, num_gpus=4, num_nodes=2, bytes_per_expert=1, chunk_bytes=100, layers=[2, 0])
    assert {t.layer for t in plan.transfers} <= {0, 2}
    out = simulate(plan, cur)
    assert np.array_equal(out[[0, 2]], tgt[[0, 2]]) and np.array_equal(out[1], cur[1])
    # Sources on the destination's node are preferred when the node has one.
    for t in plan.transfers:
        holders = {int(s) // 4 for s in np.flatnonzero(cur[t.layer] == t.expert)}
        if any(h // 2 == t.dst_gpu // 2 for h in holders):
            assert t.src_gpu // 2 == t.dst_gpu // 2


def test_bad_input() -> None:
    cur = np.array([[0, 1, 2, 3]], dtype=np.int32)
    with pytest.raises(ValueError, match="no slot with known content"):
        plan_swap(
            np.array([[-1, 1, 2, 3]], dtype=np.int32), cur, num_gpus=2, bytes_per_expert=1, chunk_bytes=1
        )
    with pytest.raises(ValueError, match=r"\[L, P\]"):
        plan_swap(cur, cur[0], num_gpus=2, bytes_per_expert=1, chunk_bytes=1)
    with pytest.raises(ValueError, match="divide"):
        plan_swap(cur, cur, num_gpus=3, bytes_per_expert=1, chunk_bytes=1)
    with pytest.raises(ValueError, match="layers"):
        plan_swap(cur, cur, num_gpus=2, bytes_per_expert=1, chunk_bytes=1, layers=[4])
    assert plan_swap(cur, cur, num_gpus=2, bytes_per_expert=1, chunk_bytes=1).chunks == ()
