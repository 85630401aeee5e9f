"""Hot-swap programs (pieces, staging, commit, checksum positions) against the plan; the Triton checksum against torch."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from eplb.hotswap.checksum import SlotChecksum, block_checksums
from eplb.hotswap.plan import SwapPlan, plan_swap
from eplb.hotswap.program import GroupProgram, ProgramSpec, SwapProgram, compile_swap
from eplb.hotswap.swap import HotSwapOptions, hot_swap, prepare_swap
from eplb.moe.model import slot_buffers
from eplb.placement.model import Placement
from tests.helpers.devices import on_kernel_device
from tests.helpers.placements import random_phy2log

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

VIEWS = [((4, 8), torch.float32), ((8, 4), torch.float32)]  # w13-like and w2-like, 256 bytes per expert
PER_EXPERT = 2 * 4 * 8 * 4


def compiled(plan: SwapPlan, fractions: tuple[float, ...], verify: bool = True) -> list[SwapProgram]:
    """[rank] swap programs."""
    return [
        compile_swap(
            plan,
            ProgramSpec(
                rank=r,
                piece_fractions=fractions,
                view_shapes=VIEWS,
                device=torch.device("cpu"),
                verify=verify,
            ),
        )
        for r in range(plan.num_gpus)
    ]


def programs(plan: SwapPlan, fractions: tuple[float, ...], verify: bool = True) -> list[list[GroupProgram]]:
    """[rank][chunk] programs."""
    return [p.groups for p in compiled(plan, fractions, verify)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fractions", [(1.0,), (0.25, 0.5, 0.25), (1.0, 1.0, 1.0, 1.0, 1.0)])
def test_programs_match_across_ranks_and_cover_the_plan(seed: int, fractions: tuple[float, ...]) -> None:
    G = 4
    rng = np.random.default_rng(seed)
    cur, tgt = random_phy2log(rng, 3, 12, 16), random_phy2log(rng, 3, 12, 16)
    plan = plan_swap(cur, tgt, num_gpus=G, bytes_per_expert=PER_EXPERT, chunk_bytes=3 * PER_EXPERT)
    S = plan.slots_per_gpu
    swaps = compiled(plan, fractions)
    progs = [p.groups for p in swaps]
    staging: list[dict[int, int]] = [{} for _ in range(G)]  # rank -> staging row -> expert it holds
    for k, chunk in enumerate(plan.chunks):
        group = [progs[r][k] for r in range(G)]
        assert len({len(p.pieces) for p in group}) == 1  # every rank walks the same pieces
        totals: Counter[int] = Counter()
        for i in chunk.transfers:
            t = plan.transfers[i]
            totals[t.dst_gpu] += 0 if t.is_local else 1
        for j in range(len(group[0].pieces)):
            arriving: Counter[int] = Counter()
            for src in range(G):
                for dst in range(G):
                    sent = [s for peer, s in group[src].pieces[j].sends if peer == dst]
                    got = [s for peer, s in group[dst].pieces[j].recvs if peer == src]
                    assert [s.count for s in sent] == [s.count for s in got], (k, j, src, dst)  # same order
                    arriving[dst] += sum(s.count for s in got)
                    for a, b in zip(sent, got, strict=True):  # what each staging row receives
                        assert not a.staging and b.staging  # read from slots, written to staging
                        for m in range(a.count):
                            staging[dst][b.start + m] = int(cur[a.layer, src * S + a.start + m])
            # Piece j carries its fraction of each GPU's arrivals (rounded up to whole slots).
            share = fractions[j] / sum(fractions) if len(group[0].pieces) == len(fractions) else 1.0
            for g, count in arriving.items():
                assert count <= np.ceil(share * totals[g]) + 1, (j, g, count, totals[g])
        for r, prog in enumerate(group):
            for a, b in prog.local.copies:  # local moves: slots into staging too
                assert not a.staging and b.staging
                for m in range(a.count):
                    staging[r][b.start + m] = int(cur[a.layer, r * S + a.start + m])
        # Each transfer has, per view, one source and one destination checksum position, all distinct.
        n, W = len(chunk.transfers), 2 * len(VIEWS)
        positions = [
            p
            for prog in group
            for stage in [*prog.pieces, prog.local]
            for check in stage.src_checks + stage.dst_checks
            for p in check.task.pos2.tolist()
        ]
        assert sorted(positions) == list(range(2, 2 + 2 * n * W))
    for r, swap in enumerate(swaps):
        # One staging row per transfer arriving at this rank, all filled; nothing else is staged.
        arrivals = sum(t.dst_gpu == r for t in plan.transfers)
        assert swap.staging_rows == arrivals and sorted(staging[r]) == list(range(arrivals))
        # The commit writes every changed slot of this rank once and leaves it holding the target.
        state = cur[:, r * S : (r + 1) * S].copy()
        written = [(slot.layer, slot.start + m) for _, slot in swap.commit for m in range(slot.count)]
        assert len(written) == len(set(written))
        assert sorted(written) == sorted(
            zip(*np.nonzero(cur[:, r * S : (r + 1) * S] != tgt[:, r * S : (r + 1) * S]), strict=True)
        )
        for rows, slot in swap.commit:
            assert rows.staging and not slot.staging and rows.count == slot.count
            for m in range(slot.count):
                state[slot.layer, slot.start + m] = staging[r][rows.start + m]
        assert np.array_equal(state, tgt[:, r * S : (r + 1) * S])


def test_a_trade_is_cut_into_pieces_that_carry_both_directions() -> None:
    S = 8
    cur = np.arange(2 * S, dtype=np.int32)[None]
    tgt = cur.copy()
    tgt[0, :6], tgt[0, S : S + 6] = cur[0, S : S + 6], cur[0, :6]
    plan = plan_swap(cur, tgt, num_gpus=2, bytes_per_expert=PER_EXPERT, chunk_bytes=1 << 20)
    swap0 = compiled(plan, (1.0, 2.0, 3.0))[0]
    prog0 = swap0.groups[0]
    assert len(prog0.pieces) == 3
    for piece, m in zip(prog0.pieces, (1, 2, 3), strict=True):
        assert [(p, s.count, s.staging) for p, s in piece.sends] == [(1, m, False)]  # from the slots
        assert [(p, s.count, s.staging) for p, s in piece.recvs] == [(1, m, True)]  # into staging
    # Nothing is backed up: the six traded slots are written once, at the commit, from staging.
    assert swap0.staging_rows == 6 and sum(slot.count for _, slot in swap0.commit) == 6
    assert [(rows.start, rows.count, slot.start) for rows, slot in swap0.commit] == [(0, 6, 0)]  # one block


@on_kernel_device
@pytest.mark.parametrize(
    "shape,config,programs",
    [
        ((5, 40, 24), (64, 4), 3),  # several row blocks per segment, three column blocks
        ((4, 3, 8), (4096, 8), 7),
        ((3, 1, 100), (16, 4), 1),  # one row, masked columns
        ((3, 37, 17), (32, 4), 50),  # rows and columns both ragged, many segments per slot
        ((6, 64, 48), (128, 4), 1000),
        ((3, 5, 3), (8, 4), 4),
    ],
)
def test_triton_checksum_equals_torch(
    shape: tuple[int, int, int], config: tuple[int, int], programs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eplb.kernels import slot_checksum

    monkeypatch.setattr(slot_checksum, "MIN_SEGMENT_BYTES", 0)  # small slots still split into segments
    g = torch.Generator().manual_seed(sum(shape))
    words = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=g).to(DEVICE)
    rows, pos = [shape[0] - 1, 0, 1, 1], [2, 8, 4, 12]  # a slot twice, positions out of order
    rows_t, pos_t = torch.tensor(rows, device=DEVICE), torch.tensor(pos, device=DEVICE)
    out = torch.zeros(16, dtype=torch.int64, device=DEVICE)
    out[0] = 5  # the kernel adds: other positions keep their values
    slot_checksum.slot_checksum_into(words, rows_t, pos_t, out, programs, config)
    expected = torch.cat([block_checksums([words[r : r + 1]]) for r in rows])
    assert torch.equal(torch.stack([out[[p, p + 1]] for p in pos]), expected)
    assert out[0] == 5 and out[[1, 6, 7, 10, 11, 14, 15]].eq(0).all()
    with pytest.raises(ValueError, match="int32"):
        slot_checksum.slot_checksum_into(words.view(torch.float32), rows_t, pos_t, out, programs)
    with pytest.raises(ValueError, match="int64"):
        slot_checksum.slot_checksum_into(words, rows_t.to(torch.int32), pos_t, out, 1)


@on_kernel_device
def test_triton_checksum_detects_the_corruptions_torch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flipped bit and two swapped rows change the kernel's checksum, across segment boundaries."""
    from eplb.kernels import slot_checksum

    monkeypatch.setattr(slot_checksum, "MIN_SEGMENT_BYTES", 0)
    g = torch.Generator().manual_seed(11)
    base = torch.randint(-(2**31), 2**31 - 1, (2, 48, 32), dtype=torch.int32, generator=g).to(DEVICE)

    def checksum(words: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(2, dtype=torch.int64, device=DEVICE)
        one = torch.tensor([1], device=DEVICE)
        slot_checksum.slot_checksum_into(words, one, one - 1, out, 8, (64, 4))
        return out

    flipped = base.clone()
    flipped[1, 30, 7] ^= 1 << 20
    swapped = base.clone()
    swapped[1, [3, 40]] = base[1, [40, 3]]  # rows in different segments
    for bad in (flipped, swapped):
        assert not torch.equal(checksum(bad), checksum(base))
    assert torch.equal(checksum(base), block_checksums([base[1:2]])[0])


def test_slot_checksum_writes_positions_and_needs_cuda_for_triton() -> None:
    buf = torch.arange(5 * 6 * 4, dtype=torch.float32).reshape(5, 6, 4)
    task = SlotChecksum((6, 4), torch.float32, [4, 2, 3], [2, 8, 4], torch.device("cpu"), "auto")
    out = torch.zeros(10, dtype=torch.int64)
    task(buf, out)
    expected = block_checksums([buf[[4, 2, 3]]])
    assert torch.equal(out[[2, 3, 8, 9, 4, 5]], expected.reshape(-1)) and out[[0, 1, 6, 7]].eq(0).all()
    with pytest.raises(ValueError, match="CUDA"):
        SlotChecksum((6, 4), torch.float32, [0], [2], torch.device("cpu"), "triton")


def test_prepared_swap_runs_once_and_equals_hot_swap() -> None:
    g = torch.Generator().manual_seed(1)
    w = {"w13": torch.randn(2, 6, 8, 4, generator=g), "w2": torch.randn(2, 6, 4, 8, generator=g)}
    rng = np.random.default_rng(1)
    old = Placement.from_phy2log(random_phy2log(rng, 2, 6, 9), 1, max_replicas=4)
    new = Placement.from_phy2log(random_phy2log(rng, 2, 6, 9), 1, max_replicas=4)
    a = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    b = slot_buffers(w, old, 0, torch.device("cpu"), torch.float32)
    options = HotSwapOptions(piece_fractions=(1.0, 1.0))
    prepared = prepare_swap(a, old, new, options=options)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)  # nothing moved yet
    res = prepared.execute()
    assert res.ok and {"plan", "compile", "check", "post", "agree"} <= set(res.phase_seconds)
    with pytest.raises(RuntimeError, match="runs once"):
        prepared.execute()
    assert hot_swap(b, old, new, options=options).ok
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)
    with pytest.raises(ValueError, match="piece_fractions"):
        HotSwapOptions(piece_fractions=(0.5, 0.0))
    with pytest.raises(ValueError, match="checksum_backend"):
        HotSwapOptions(checksum_backend="cuda")
