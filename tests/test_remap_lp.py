"""``lp`` dispatch in one process: the rule, the torch reference and the Triton kernels.

Several ranks are played in turn, their counts exchange replaced by a gather over counts computed
here by numpy; outputs are checked against a one-token-at-a-time brute force
(tests/helpers/remap_reference.py), and the kernels against the torch reference bit for bit, on
this machine's kernel device (compiled on CUDA, interpreted on the CPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb.placement.model import Placement
from eplb.remap import lp_rule
from eplb.remap.api import remap_and_record
from eplb.remap.exchange import LpExchange
from eplb.remap.lp import lp_quotas_torch
from eplb.remap.lp_rule import LP_FILL_WIDTH, lp_quotas, lp_tables
from eplb.remap.tables import DispatchTables
from tests.helpers.devices import KERNEL_DEVICE as DEVICE
from tests.helpers.devices import on_kernel_device
from tests.helpers.placements import random_phy2log
from tests.helpers.remap_reference import brute_lp, brute_lp_quotas, random_ids

CASES = [(12, 20, 4), (7, 10, 5), (30, 40, 8), (5, 5, 1), (16, 24, 2)]


def _placement(rng: np.random.Generator, E: int, P: int, G: int) -> Placement:
    return Placement.from_phy2log(random_phy2log(rng, 2, E, P), num_gpus=G)


def _valid_counts(ids: torch.Tensor, E: int, nvalid: int | None) -> np.ndarray:
    x = ids.cpu().numpy()
    keep = (x >= 0) & (x < E)
    if nvalid is not None:
        keep &= np.arange(x.shape[0])[:, None] < nvalid
    return np.bincount(x[keep], minlength=E).astype(np.int32)


def _play_ranks(pl, ids_by_rank, nvalid_by_rank, backend, *, record=None, device="cpu"):
    """Each rank's (out, slot counts, logical counts), its exchange fed the others' numpy counts."""
    E, P, G = pl.num_logical, pl.num_physical, pl.num_gpus
    local = [_valid_counts(ids, E, nv) for ids, nv in zip(ids_by_rank, nvalid_by_rank, strict=True)]
    results = []
    for rank in range(G):
        tables = DispatchTables.from_placement(pl, rank, device)
        calls = []

        def gather(local_E, out_GE, rank=rank, calls=calls):
            calls.append(local_E.cpu().numpy().copy())
            for g in range(G):
                out_GE[g].copy_(local_E if g == rank else torch.from_numpy(local[g]).to(out_GE.device))

        lp = LpExchange(tables, gather=gather)
        counts = torch.zeros(P, dtype=torch.int32, device=device)
        logical = torch.zeros(E, dtype=torch.int32, device=device)
        nv = nvalid_by_rank[rank]
        out = remap_and_record(
            ids_by_rank[rank].to(device),
            tables,
            1,
            mode="lp",
            counts_P=counts,
            logical_counts_E=logical,
            num_valid_tokens=None if nv is None else torch.tensor([nv], dtype=torch.int32, device=device),
            record=None if record is None else torch.tensor([record], dtype=torch.int32, device=device),
            backend=backend,
            lp=lp,
        )
        assert len(calls) == 1 and np.array_equal(calls[0], local[rank])  # took part once, own counts
        results.append((out.cpu(), counts.cpu(), logical.cpu()))
    return results


@pytest.mark.parametrize("seed", range(6))
def test_numpy_and_torch_quotas_equal_the_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    E, P, G = CASES[seed % len(CASES)]
    pl = _placement(rng, E, P, G)
    tables = lp_tables(pl)
    torch_tables = DispatchTables.from_placement(pl, 0)
    batches = [rng.integers(0, 40, size=E), np.zeros(E, int), np.full(E, 7), rng.integers(0, 3, size=E)]
    counts_LnE = np.stack([np.stack(batches)] * 2)
    quota_LnXD, loads_LnG = lp_quotas(counts_LnE, tables)
    for b, counts in enumerate(batches):
        want = brute_lp_quotas(counts.tolist(), pl, 1)
        got_torch = lp_quotas_torch(torch.from_numpy(counts.astype(np.int64)), torch_tables, 1)
        assert torch.equal(got_torch, torch.from_numpy(quota_LnXD[1, b]))
        for n, expert in enumerate(tables.expert_LX[1]):
            if expert < 0:
                assert not quota_LnXD[1, b, n].any()
                continue
            gpus = tables.slot_LXD[1, n][tables.slot_LXD[1, n] >= 0] // pl.slots_per_gpu
            assert (
                dict(zip(gpus.tolist(), quota_LnXD[1, b, n, : gpus.size].tolist(), strict=True))
                == want[expert]
            )
            assert quota_LnXD[1, b, n].sum() == counts[expert]  # every token placed
        assert loads_LnG[1, b].sum() == counts.sum()


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_torch_reference_equals_the_brute_force_on_every_rank(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    E, P, G = CASES[seed]
    pl = _placement(rng, E, P, G)
    ids = [random_ids(rng, int(rng.integers(1, 60)), 4, E, "nasty") for _ in range(G)]
    nvalid = [None if g % 2 else int(rng.integers(-2, 50)) for g in range(G)]
    results = _play_ranks(pl, ids, nvalid, "torch")
    want = brute_lp([x.tolist() for x in ids], pl, 1, nvalid)
    total = np.zeros(P, np.int64)
    for rank, (out, counts, logical) in enumerate(results):
        assert out.dtype == torch.int32 and out.tolist() == want[rank]
        flat = np.array(want[rank], dtype=np.int64).ravel()
        x = ids[rank].numpy().ravel()
        keep = (x >= 0) & (x < E)
        if nvalid[rank] is not None:
            keep &= np.repeat(np.arange(ids[rank].shape[0]), 4) < nvalid[rank]
        assert counts.tolist() == np.bincount(flat[keep], minlength=P).tolist()
        assert logical.tolist() == np.bincount(x[keep], minlength=E).tolist()
        total += counts.numpy()
    # Quotas met exactly: over all ranks, each replica received what the rule gave its GPU.
    global_counts = sum(_valid_counts(x, E, nv) for x, nv in zip(ids, nvalid, strict=True))
    quota = brute_lp_quotas(global_counts.tolist(), pl, 1)
    for expert, per_gpu in quota.items():
        for g, q in per_gpu.items():
            slots = [s for s in range(P) if pl.phy2log_LP[1, s] == expert and s // pl.slots_per_gpu == g]
            assert total[slots[0]] == q and total[slots[1:]].sum() == 0


@on_kernel_device
@pytest.mark.parametrize(
    ("seed", "style", "gather_map"),
    [
        (0, "nasty", True),
        (1, "skewed", True),
        (2, "nasty", True),
        (3, "one_expert", True),
        (4, "skewed", True),
        (4, "nasty", False),
    ],
)
def test_kernels_equal_the_torch_reference(
    seed: int, style: str, gather_map: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both forms of the map kernel: the program's map in registers (tl.gather) and loaded per id."""
    import eplb.kernels.remap_lp_launch as launch

    if gather_map and not launch.HAS_GATHER:
        pytest.skip("this Triton has no tl.gather")
    monkeypatch.setattr(launch, "GATHER_MAP", gather_map)
    rng = np.random.default_rng(200 + seed)
    E, P, G = CASES[seed]
    pl = _placement(rng, E, P, G)
    sizes = [int(rng.integers(0, 300)) for _ in range(G)]
    ids = [random_ids(rng, T, 8, E, style) for T in sizes]
    nvalid = [int(rng.integers(-1, T + 3)) if g % 2 else None for g, T in enumerate(sizes)]
    for record in (1, 0):
        ref = _play_ranks(pl, ids, nvalid, "torch", record=record, device=DEVICE)
        got = _play_ranks(pl, ids, nvalid, "triton", record=record, device=DEVICE)
        for (o1, c1, l1), (o2, c2, l2) in zip(ref, got, strict=True):
            assert o2.dtype == torch.int32
            assert torch.equal(o1, o2) and torch.equal(c1, c2) and torch.equal(l1, l2)
            if record == 0:
                assert int(c2.sum()) == 0 and int(l2.sum()) == 0


@on_kernel_device
def test_one_expert_taking_everything_is_spread_over_its_gpus() -> None:
    # 8 experts and 4 more copies of expert 3 on 4 GPUs of 3 slots: expert 3 on every GPU (twice on GPU 1).
    p2l = np.array([[0, 3, 1, 3, 2, 3, 4, 3, 5, 6, 7, 3]], dtype=np.int32)
    pl = Placement.from_phy2log(np.repeat(p2l, 2, axis=0), num_gpus=4)
    ids = [torch.full((1000, 8), 3, dtype=torch.int32) for _ in range(4)]
    ids[2] = torch.zeros((0, 8), dtype=torch.int32)  # an idle rank still takes part
    for backend in ("torch", "triton"):
        results = _play_ranks(pl, ids, [None] * 4, backend, device=DEVICE)
        total = sum(c.numpy().astype(np.int64) for _, c, _ in results)
        # 24000 tokens, no other load: 6000 per GPU, on each GPU's first copy of expert 3.
        assert total.tolist() == [0, 6000, 0, 6000, 0, 0, 0, 6000, 0, 0, 0, 6000]
        assert results[2][0].shape == (0, 8)


@on_kernel_device
def test_an_expert_wider_than_the_fill_width_keeps_the_even_split() -> None:
    # 12 GPUs of 2 slots: expert 0 on GPUs 0-9 (wider than LP_FILL_WIDTH), experts 1-3 on two each.
    p2l = np.array([[0, 1 + g] for g in range(10)] + [[11, 1], [2, 3]], dtype=np.int32).reshape(1, 24)
    pl = Placement.from_phy2log(np.repeat(p2l, 2, axis=0), num_gpus=12)
    tables = lp_tables(pl)
    assert LP_FILL_WIDTH < 10 and tables.color_LX[1, 0] == -1 and (tables.color_LX[1, 1:4] >= 0).all()
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 500, size=12)
    counts[0] = 1003
    quota_LnXD, _ = lp_quotas(np.stack([counts[None]] * 2), tables)
    assert quota_LnXD[1, 0, 0, :10].tolist() == [101, 101, 101] + [100] * 7  # 1003 over 10, evenly
    want = brute_lp_quotas(counts.tolist(), pl, 1)
    got_torch = lp_quotas_torch(
        torch.from_numpy(counts.astype(np.int64)), DispatchTables.from_placement(pl, 0), 1
    )
    assert torch.equal(got_torch, torch.from_numpy(quota_LnXD[1, 0]))
    for n, expert in enumerate(tables.expert_LX[1][tables.expert_LX[1] >= 0]):
        gpus = tables.slot_LXD[1, n][tables.slot_LXD[1, n] >= 0] // pl.slots_per_gpu
        assert (
            dict(zip(gpus.tolist(), quota_LnXD[1, 0, n, : gpus.size].tolist(), strict=True)) == want[expert]
        )
    ids = [random_ids(rng, int(rng.integers(0, 200)), 4, 12, "skewed") for _ in range(12)]
    ref = _play_ranks(pl, ids, [None] * 12, "torch", device=DEVICE)
    got = _play_ranks(pl, ids, [None] * 12, "triton", device=DEVICE)
    for (o1, c1, l1), (o2, c2, l2) in zip(ref, got, strict=True):
        assert torch.equal(o1, o2) and torch.equal(c1, c2) and torch.equal(l1, l2)


@on_kernel_device
@pytest.mark.parametrize(("scale_rounds", "passes"), [(4, 1), (8, 2)])
def test_the_proportional_start_is_one_rule_in_every_backend(
    scale_rounds: int, passes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy, torch, the kernels and the brute force agree with the start's rounds switched on."""
    import eplb.kernels.remap_lp_launch as launch
    import eplb.remap.lp as reference

    rng = np.random.default_rng(300 + scale_rounds)
    E, P, G = CASES[2]
    pl = _placement(rng, E, P, G)
    tables, torch_tables = lp_tables(pl), DispatchTables.from_placement(pl, 0)
    hot = np.zeros(E, int)
    hot[np.argmax(pl.logcnt_LE[1])] = 5_000
    batches = [
        np.rint(200 * (rng.pareto(1.2, size=E) + 0.05)).astype(int),
        np.zeros(E, int),
        np.where(pl.logcnt_LE[1] >= 2, rng.integers(1, 5_000, size=E), 0),
        hot,
        rng.integers(0, 3, size=E),
    ]
    counts_LnE = np.stack([np.stack(batches)] * 2)
    even_LnXD, _ = lp_quotas(counts_LnE, tables)
    for module in (lp_rule, reference, launch):
        monkeypatch.setattr(module, "LP_SCALE_ROUNDS", scale_rounds)
        monkeypatch.setattr(module, "LP_PASSES", passes)
    quota_LnXD, loads_LnG = lp_quotas(counts_LnE, tables)
    assert not np.array_equal(quota_LnXD, even_LnXD)  # the start changes some split
    for b, counts in enumerate(batches):
        want = brute_lp_quotas(counts.tolist(), pl, 1, scale_rounds=scale_rounds, passes=passes)
        got_torch = lp_quotas_torch(torch.from_numpy(counts.astype(np.int64)), torch_tables, 1)
        assert torch.equal(got_torch, torch.from_numpy(quota_LnXD[1, b]))
        for n, expert in enumerate(tables.expert_LX[1][tables.expert_LX[1] >= 0]):
            gpus = tables.slot_LXD[1, n][tables.slot_LXD[1, n] >= 0] // pl.slots_per_gpu
            got = dict(zip(gpus.tolist(), quota_LnXD[1, b, n, : gpus.size].tolist(), strict=True))
            assert got == want[expert] and sum(got.values()) == counts[expert]
        assert loads_LnG[1, b].sum() == counts.sum()
    # The kernels on a smaller placement (the interpreter runs every round op by op).
    E, P, G = CASES[0]
    pl = _placement(rng, E, P, G)
    ids = [random_ids(rng, int(rng.integers(0, 80)), 4, E, style) for style in ("skewed", "nasty") * (G // 2)]
    ref = _play_ranks(pl, ids, [None] * G, "torch", record=1, device=DEVICE)
    got_kernels = _play_ranks(pl, ids, [None] * G, "triton", record=1, device=DEVICE)
    for (o1, c1, l1), (o2, c2, l2) in zip(ref, got_kernels, strict=True):
        assert torch.equal(o1, o2) and torch.equal(c1, c2) and torch.equal(l1, l2)


@on_kernel_device
def test_one_exchange_serves_call_after_call_and_survives_a_failed_gather() -> None:
    """The rank's counts are zero between calls (the kernels count into them and the quota kernel
    zeroes them), whichever backend ran last and when a gather raised."""
    rng = np.random.default_rng(11)
    E, P, G, rank = 30, 40, 8, 5
    pl = _placement(rng, E, P, G)
    tables = DispatchTables.from_placement(pl, rank, DEVICE)
    others = [rng.integers(0, 60, size=E).astype(np.int32) for _ in range(G)]
    fail = [False]

    def gather(local_E: torch.Tensor, out_GE: torch.Tensor) -> None:
        if fail[0]:
            fail[0] = False
            raise RuntimeError("the collective failed")
        for g in range(G):
            out_GE[g].copy_(local_E if g == rank else torch.from_numpy(others[g]).to(out_GE.device))

    lp = LpExchange(tables, gather=gather)
    for step, backend in enumerate(
        ["triton", "triton", "torch", "triton", "fail", "triton", "torch", "triton"]
    ):
        ids = random_ids(rng, int(rng.integers(1, 200)), 8, E, "skewed" if step % 2 else "nasty").to(DEVICE)
        layer = step % 2
        if backend == "fail":
            fail[0] = True
            with pytest.raises(RuntimeError, match="collective failed"):
                remap_and_record(ids, tables, layer, mode="lp", backend="triton", lp=lp)
        else:
            counts = torch.zeros(P, dtype=torch.int32, device=DEVICE)
            got = remap_and_record(ids, tables, layer, mode="lp", counts_P=counts, backend=backend, lp=lp)
            fresh = LpExchange(tables, gather=gather)
            want_counts = torch.zeros(P, dtype=torch.int32, device=DEVICE)
            want = remap_and_record(
                ids, tables, layer, mode="lp", counts_P=want_counts, backend="torch", lp=fresh
            )
            assert torch.equal(got, want) and torch.equal(counts, want_counts), (step, backend)
        assert int(lp.local_E.abs().sum()) == 0, (step, backend)


def test_ties_are_broken_the_same_way_on_every_run() -> None:
    rng = np.random.default_rng(7)
    pl = _placement(rng, 12, 20, 4)
    ids = [torch.from_numpy(np.tile(np.arange(12, dtype=np.int32), (5, 1))) for _ in range(4)]
    first = _play_ranks(pl, ids, [None] * 4, "torch")
    again = _play_ranks(pl, ids, [None] * 4, "torch")
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    assert [r[0].tolist() for r in first] == brute_lp([x.tolist() for x in ids], pl, 1, [None] * 4)


def test_lp_needs_a_group_or_a_gather_beyond_one_rank() -> None:
    pl = Placement.trivial(1, 4, num_gpus=2, num_redundant=2)
    tables = DispatchTables.from_placement(pl, 0)
    with pytest.raises(ValueError, match=r"needs torch\.distributed"):
        remap_and_record(torch.zeros((2, 2), dtype=torch.int32), tables, 0, mode="lp", backend="torch")
    one = DispatchTables.from_placement(Placement.trivial(1, 4, num_gpus=1, num_redundant=2), 0)
    out = remap_and_record(torch.tensor([[0, 1]], dtype=torch.int32), one, 0, mode="lp", backend="torch")
    assert out.tolist() == [[0, 1]]
    other = DispatchTables.from_placement(pl, 1)
    with pytest.raises(ValueError, match="other dispatch tables"):
        remap_and_record(
            torch.zeros((2, 2), dtype=torch.int32), tables, 0, mode="lp", lp=LpExchange(other, gather=print)
        )


@pytest.mark.gpu
def test_lp_replays_in_a_cuda_graph_with_new_ids() -> None:
    """The three kernels and the exchange (here a device copy) capture; a replay follows the ids."""
    rng = np.random.default_rng(9)
    pl = _placement(rng, 64, 80, 8)
    tables = DispatchTables.from_placement(pl, 2, "cuda")
    others = torch.from_numpy(rng.integers(0, 50, size=64).astype(np.int32)).cuda()

    def gather(local_E: torch.Tensor, out_GE: torch.Tensor) -> None:
        out_GE.copy_(others[None].expand_as(out_GE))
        out_GE[2].copy_(local_E)

    lp = LpExchange(tables, gather=gather)
    ids = random_ids(rng, 512, 8, 64, "nasty").cuda()
    counts = torch.zeros(80, dtype=torch.int32, device="cuda")
    out = torch.empty_like(ids)

    def step() -> None:
        remap_and_record(ids, tables, 1, mode="lp", counts_P=counts, out_TK=out, backend="triton", lp=lp)

    step()  # compile and allocate the scratch outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        ids.copy_(random_ids(np.random.default_rng(seed), 512, 8, 64, "skewed").cuda())
        counts.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want_counts = torch.zeros_like(counts)
        want = remap_and_record(ids, tables, 1, mode="lp", counts_P=want_counts, backend="torch", lp=lp)
        assert torch.equal(out, want) and torch.equal(counts, want_counts)


class _FakeCompiled:
    """A CompiledKernel stand-in for the lp kernels' direct path: integer pointers back to tensors."""

    launch_metadata = None
    packed_metadata = "packed"
    function = "function"

    def __init__(self, jit, tensors: dict, launches: list) -> None:
        self._jit, self._tensors, self._launches = jit, tensors, launches

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, leave, *args):
        assert (gy, gz, function, metadata, launch_metadata, enter, leave) == (
            1,
            1,
            "function",
            "packed",
            None,
            None,
            None,
        )
        self._launches.append(gx)
        names = self._jit.arg_names
        n_ptr = sum(1 for name in names if name.endswith("_ptr"))
        runtime = [self._tensors[a] if i < n_ptr else a for i, a in enumerate(args[: len(names)])]
        consts = {name: runtime.pop() for name in reversed(names) if name.isupper()}
        self._jit[(gx,)](*runtime, **consts)


@pytest.mark.interpreter
def test_direct_launches_of_the_lp_kernels_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    import eplb.kernels.remap_lp_launch as lp_kernels
    from eplb.kernels.direct_launch import DirectLaunchCache

    tensors: dict[int, torch.Tensor] = {}
    launches: list[int] = []
    real_data_ptr = torch.Tensor.data_ptr

    def data_ptr(t: torch.Tensor) -> int:
        p = real_data_ptr(t)
        tensors[p] = t
        return p

    monkeypatch.setattr(torch.Tensor, "data_ptr", data_ptr)
    for launcher in (lp_kernels.COUNT, lp_kernels.QUOTA, lp_kernels.MAP):
        jit = launcher.kernel

        class _Jit:
            arg_names = jit.arg_names

            def __getitem__(self, grid, jit=jit):
                def launch(*args, num_warps, **constexprs):
                    jit[grid](*args, num_warps=num_warps, **constexprs)
                    return _FakeCompiled(jit, tensors, launches)

                return launch

        monkeypatch.setattr(launcher, "kernel", _Jit())
        monkeypatch.setattr(launcher, "cache", DirectLaunchCache(True, lambda: (-1, 0)))
    rng = np.random.default_rng(41)
    pl = _placement(rng, 12, 20, 4)
    ids = [random_ids(rng, int(rng.integers(1, 200)), 4, 12, "nasty") for _ in range(4)]
    ref = _play_ranks(pl, ids, [None, 30, None, 5], "torch", record=1)
    got = _play_ranks(pl, ids, [None, 30, None, 5], "triton", record=1)
    for (o1, c1, l1), (o2, c2, l2) in zip(ref, got, strict=True):
        assert torch.equal(o1, o2) and torch.equal(c1, c2) and torch.equal(l1, l2)
    assert len(launches) >= 4  # ranks after the first of each specialisation launch directly
