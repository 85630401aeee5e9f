"""The fused Triton kernel (eplb.kernels.remap_record) against the torch reference.

Every test but the CUDA-graph one runs on this machine's kernel device (tests/helpers/devices.py):
the compiled kernel on CUDA, the interpreted one on the CPU (TRITON_INTERPRET=1, set by conftest
when there is no CUDA), with both backends' tensors there. The gpu-only tests add the
production shape (E=256, P=288) at large T and CUDA-graph replay with the record flag toggled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb.placement.model import Placement
from eplb.remap.api import remap_and_record
from eplb.remap.call import RemapCall
from eplb.remap.tables import DispatchTables
from tests.helpers.devices import KERNEL_DEVICE as DEVICE
from tests.helpers.devices import on_kernel_device
from tests.helpers.remap_reference import LOCAL_MODES, random_ids, random_tables, run_remap

kernel = pytest.importorskip("eplb.kernels.remap_record")


def _both(
    ids,
    tables,
    layer,
    mode,
    *,
    nvalid=None,
    record=None,
    count_phys=True,
    count_logical=True,
    config=None,
    map_padded=False,
):
    """(out, counts, logical) from the torch backend and from the kernel, on identical inputs."""
    device, P, E = ids.device, tables.num_physical, tables.num_logical
    results = []
    for backend in ("torch", "triton"):
        bufs = {
            "counts": torch.full((P,), 3, dtype=torch.int32, device=device) if count_phys else None,
            "logical": torch.full((E,), 3, dtype=torch.int32, device=device) if count_logical else None,
            "nvalid": None if nvalid is None else torch.tensor([nvalid], dtype=torch.int32, device=device),
            "record": None if record is None else torch.tensor([record], dtype=torch.int32, device=device),
        }
        kernel_config = config if backend == "triton" else None
        out = run_remap(
            ids, tables, layer, mode, backend=backend, config=kernel_config, map_padded=map_padded, **bufs
        )
        results.append((out, bufs["counts"], bufs["logical"]))
    return results


def _assert_same(results) -> None:
    (o1, c1, l1), (o2, c2, l2) = results
    assert o2.dtype == torch.int32
    assert torch.equal(o1, o2)
    assert (c1 is None and c2 is None) or torch.equal(c1, c2)
    assert (l1 is None and l2 is None) or torch.equal(l1, l2)


@st.composite
def _cases(draw):
    E = draw(st.integers(1, 40))
    G = draw(st.sampled_from([1, 2, 3, 5]))
    P = G * draw(st.integers(max(1, -(-E // G)), -(-E // G) + 4))
    return {
        "seed": draw(st.integers(0, 2**31)),
        "E": E,
        "P": P,
        "G": G,
        "T": draw(st.sampled_from([0, 1, 2, 7, 64, 129, 300])),
        "K": draw(st.integers(1, 16)),
        "mode": draw(st.sampled_from(LOCAL_MODES)),
        "style": draw(st.sampled_from(["uniform", "nasty", "one_expert", "skewed"])),
        "nvalid": draw(st.one_of(st.none(), st.integers(-2, 310))),
        "record": draw(st.sampled_from([None, 0, 1, 7])),
        "count_phys": draw(st.booleans()),
        "count_logical": draw(st.booleans()),
        "map_padded": draw(st.booleans()),
    }


@on_kernel_device
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_kernel_equals_torch_reference(case: dict) -> None:
    rng = np.random.default_rng(case["seed"])
    rank = int(rng.integers(0, case["G"]))
    _, tables = random_tables(rng, case["E"], case["P"], case["G"], rank=rank, device=DEVICE)
    ids = random_ids(rng, case["T"], case["K"], case["E"], case["style"]).to(DEVICE)
    _assert_same(
        _both(
            ids,
            tables,
            1,
            case["mode"],
            nvalid=case["nvalid"],
            record=case["record"],
            count_phys=case["count_phys"],
            count_logical=case["count_logical"],
            map_padded=case["map_padded"],
        )
    )


@on_kernel_device
@pytest.mark.parametrize("mode", LOCAL_MODES)
def test_persistent_loop_over_many_blocks(mode: str) -> None:
    """Small blocks and few programs: every program strides over several blocks and flushes once."""
    rng = np.random.default_rng(11)
    _, tables = random_tables(rng, 37, 45, 5, rank=4, device=DEVICE)
    ids = random_ids(rng, 3000, 8, 37, "nasty").to(DEVICE)
    config = kernel.LaunchConfig(block=128, num_warps=4, programs_per_sm=1)
    assert kernel.grid_size(ids.numel(), config, ids.device) < ids.numel() // 128
    _assert_same(_both(ids, tables, 0, mode, nvalid=2900, config=config))


@on_kernel_device
@pytest.mark.parametrize("mode", ["static", "weighted"])
def test_histograms_without_mask_support(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton before 3.3 has no histogram mask: the spare-bin path must count the same.

    An explicit config launches through kernel[grid], which reads HIST_MASK on every call; a direct
    launch would reuse a kernel compiled with the mask (HIST_MASK is not in its key).
    """
    monkeypatch.setattr(kernel, "HIST_MASK", False)
    rng = np.random.default_rng(15)
    _, tables = random_tables(rng, 32, 40, 4, rank=1, device=DEVICE)
    ids = random_ids(rng, 300, 6, 32, "nasty").to(DEVICE)
    config = kernel.default_config(ids.numel(), ids.device)
    _assert_same(_both(ids, tables, 1, mode, nvalid=250, config=config))


@on_kernel_device
def test_one_expert_takes_every_token() -> None:
    pl = Placement.trivial(1, 250, num_gpus=10, num_redundant=30)
    tables = DispatchTables.from_placement(pl, 7, DEVICE)
    ids = torch.full((3000, 8), 17, dtype=torch.int32, device=DEVICE)
    results = _both(ids, tables, 0, "static")
    _assert_same(results)
    _out, counts, logical = results[1]
    assert int(counts.sum()) - 3 * 280 == 24000 and int(logical[17]) - 3 == 24000


@on_kernel_device
def test_weighted_shares_match_the_weights() -> None:
    """Each replica's share of an expert's tokens is its weight, within 5 binomial sigmas."""
    p2l = np.array([[0, 1, 0, 2, 0, 1, 3, 0]], dtype=np.int32)
    pl = Placement.from_phy2log(p2l, num_gpus=2)
    weights = np.zeros((1, 4, pl.max_replicas))
    weights[0, 0, :4] = [0.1, 0.2, 0.3, 0.4]
    weights[0, 1, :2] = [0.75, 0.25]
    weights[0, 2, 0] = weights[0, 3, 0] = 1.0
    tables = DispatchTables.from_placement(pl, 1, DEVICE, weights)
    T, K = 20000, 8
    ids = torch.from_numpy(np.random.default_rng(12).integers(0, 2, size=(T, K), dtype=np.int32)).to(DEVICE)
    out = remap_and_record(ids, tables, 0, mode="weighted", backend="triton").cpu().numpy()
    for expert, want in ((0, [0.1, 0.2, 0.3, 0.4]), (1, [0.75, 0.25])):
        slots = pl.log2phy_LER[0, expert, : len(want)]
        picked = out[ids.cpu().numpy() == expert]
        share = np.array([(picked == s).mean() for s in slots])
        sigma = np.sqrt(np.array(want) * (1 - np.array(want)) / picked.size)
        assert (np.abs(share - want) < 5 * sigma).all(), (share, want)


@on_kernel_device
def test_kernel_refuses_int64_ids() -> None:
    tables = DispatchTables.from_placement(Placement.trivial(1, 4, 2), 0, DEVICE)
    with pytest.raises(TypeError, match=r"torch\.int64"):
        remap_and_record(torch.zeros((2, 2), dtype=torch.int64, device=DEVICE), tables, 0, backend="triton")
    out = torch.empty((2, 2), dtype=torch.int64, device=DEVICE)
    ids = torch.zeros((2, 2), dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="int32"):
        kernel.remap_record_triton(
            RemapCall(topk_ids_TK=ids, tables=tables, layer=0, mode="static", out_TK=out)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("mode", LOCAL_MODES)
def test_compiled_kernel_equals_reference_on_gpu(mode: str) -> None:
    rng = np.random.default_rng(13)
    _, tables = random_tables(rng, 256, 288, 8, rank=5, device="cuda")
    for T in (1, 64, 4097, 65536):
        ids = random_ids(rng, T, 8, 256, "nasty").cuda()
        for map_padded in (False, True):
            _assert_same(_both(ids, tables, 1, mode, nvalid=T // 2, record=1, map_padded=map_padded))


@pytest.mark.gpu
def test_cuda_graph_replay_toggles_recording_and_follows_table_updates() -> None:
    rng = np.random.default_rng(14)
    _, tables = random_tables(rng, 64, 80, 8, rank=2, device="cuda")
    ids = random_ids(rng, 512, 8, 64, "uniform").cuda()
    counts = torch.zeros(80, dtype=torch.int32, device="cuda")
    record = torch.ones(1, dtype=torch.int32, device="cuda")
    nvalid = torch.tensor([512], dtype=torch.int32, device="cuda")
    out = torch.empty_like(ids)

    def step() -> None:
        remap_and_record(
            ids,
            tables,
            0,
            counts_P=counts,
            num_valid_tokens=nvalid,
            record=record,
            out_TK=out,
            backend="triton",
        )

    step()  # compile outside the capture
    counts.zero_()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        step()
    torch.cuda.synchronize()
    counts.zero_()
    expected = remap_and_record(ids, tables, 0, backend="torch")
    for flag, want_total in ((1, 4096), (0, 4096), (1, 8192)):
        record.fill_(flag)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected) and int(counts.sum()) == want_total
    nvalid.fill_(100)
    graph.replay()
    torch.cuda.synchronize()
    assert int(counts.sum()) == 8192 + 800
    tables.update_(Placement.trivial(2, 64, num_gpus=8, num_redundant=16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:100], remap_and_record(ids[:100], tables, 0, backend="torch"))


@on_kernel_device
@pytest.mark.parametrize("count_logical", [False, True])
def test_static_lookup_from_the_map_row_in_registers(count_logical: bool) -> None:
    """``gather_map``: the static lookup through ``tl.gather`` on the preloaded row counts the same."""
    if not kernel.HAS_GATHER:
        pytest.skip("this Triton has no tl.gather")
    rng = np.random.default_rng(16)
    _, tables = random_tables(rng, 40, 48, 4, rank=3, device=DEVICE)
    ids = random_ids(rng, 700, 8, 40, "nasty").to(DEVICE)
    base = kernel.default_config(ids.numel(), ids.device)
    config = kernel.LaunchConfig(
        block=base.block, num_warps=base.num_warps, programs_per_sm=1, gather_map=True
    )
    for record in (None, 0, 1):
        _assert_same(
            _both(
                ids,
                tables,
                1,
                "static",
                nvalid=650,
                record=record,
                count_logical=count_logical,
                config=config,
            )
        )


@on_kernel_device
@pytest.mark.parametrize("mode", LOCAL_MODES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_count_rows_sum_to_the_reference_counts(mode: str, rows: int) -> None:
    """``counts_P`` as count rows [C, P]: many programs flush into different rows; the rows' sum is
    the reference's count, for the kernel (general and direct launch) and the torch backend alike."""
    from eplb.remap.api import count_rows_sum

    rng = np.random.default_rng(17 + rows)
    _, tables = random_tables(rng, 37, 45, 5, rank=2, device=DEVICE)
    ids = random_ids(rng, 3000, 8, 37, "skewed").to(DEVICE)
    want = torch.zeros(45, dtype=torch.int32, device=DEVICE)
    ref = remap_and_record(
        ids, tables, 0, mode=mode, counts_P=want, num_valid_tokens=_scalar(2900), backend="torch"
    )
    configs = [kernel.LaunchConfig(block=128, num_warps=4, programs_per_sm=2), None, None]
    for backend, config in [("triton", c) for c in configs] + [("torch", None)]:
        counts = torch.full((rows, 45), 2, dtype=torch.int32, device=DEVICE)
        out = run_remap(
            ids, tables, 0, mode, backend=backend, config=config, counts=counts, nvalid=_scalar(2900)
        )
        assert torch.equal(out, ref)
        assert torch.equal(count_rows_sum(counts) - 2 * rows, want.to(torch.int64)), (backend, config)


@on_kernel_device
def test_count_rows_are_checked() -> None:
    tables = DispatchTables.from_placement(Placement.trivial(1, 4, 2), 0, DEVICE)
    ids = torch.zeros((2, 2), dtype=torch.int32, device=DEVICE)
    for shape in ((0, 4), (65, 4), (2, 2, 4), (2, 5)):
        with pytest.raises(ValueError, match=r"count rows|shape"):
            remap_and_record(ids, tables, 0, counts_P=torch.zeros(shape, dtype=torch.int32, device=DEVICE))


@on_kernel_device
@pytest.mark.parametrize("mode", LOCAL_MODES)
def test_shared_bins_and_register_histograms_count_the_same(mode: str) -> None:
    """Shared-memory bins (compiled on NVIDIA) and ``tl.histogram`` (everywhere) give one count,
    at the production shape and at few bins (bins replicated over more threads than there are)."""
    rng = np.random.default_rng(18)
    for E, P in ((256, 288), (20, 24)):
        _, tables = random_tables(rng, E, P, 4, rank=1, device=DEVICE)
        ids = random_ids(rng, 2500, 8, E, "skewed").to(DEVICE)
        for warps in (4, 8):
            results = [
                _both(
                    ids,
                    tables,
                    0,
                    mode,
                    nvalid=2400,
                    record=1,
                    config=kernel.LaunchConfig(
                        block=512, num_warps=warps, programs_per_sm=1, shared_bins=shared
                    ),
                )
                for shared in (True, False)
            ]
            _assert_same(results[0])
            _assert_same(results[1])


def _scalar(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32, device=DEVICE)
