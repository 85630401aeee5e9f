"""The SGLang fused-remap adapter with count rows: SGLang still reads its own buffer, same totals.

Through SGLang 0.5.23's real recorder (tests.helpers.sglang_rows_checks, in the engines'
subprocess): every pass SGLang's stat accumulator collects equals the single-row path's counts (the
adapter into a plain [P] buffer, as before count rows) and a plain numpy count of the same ids, on
seeded random and nasty ids; the kernel spread its counts over several rows, SGLang's buffer held
none of them until its read, a pass never collected leaves nothing behind. In-process: the rows'
life cycle (attach, fold, zero, which backends get rows). Triton runs interpreted (``interpreter``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.remap_inputs import SGLangDispatchInfo
from eplb.integrations import sglang_remap
from tests.helpers import sglang_rows_checks as rows_checks


@pytest.fixture(scope="module")
def rows_run(engine_site: Path) -> dict[str, Any]:
    from tests.helpers.engines import run_engine_checks

    env = {"TRITON_INTERPRET": "1", "EPLB_SGLANG_FUSED_REMAP": "1", "EPLB_SGLANG_REMAP_BACKEND": "triton"}
    return run_engine_checks(engine_site, "sglang_rows", env=env)


@pytest.mark.interpreter
def test_the_plugin_wraps_sglangs_gatherer_where_it_zeroes_and_reads(rows_run: dict[str, Any]) -> None:
    assert rows_run["fused_replaced"] and rows_run["reset_wrapped"] and rows_run["collect_wrapped"]
    assert rows_run["gatherer"] == "_SelectExpertsSinglePassGatherer"
    assert rows_run["count_rows"] == 16


@pytest.mark.interpreter
@pytest.mark.parametrize("n", [n for n in range(rows_checks.PASSES) if n != rows_checks.STALE_PASS])
def test_sglang_reads_the_single_row_paths_totals(rows_run: dict[str, Any], n: int) -> None:
    want = rows_checks.reference_counts(n)
    assert np.array_equal(np.asarray(rows_run["single_row"][n]), want)
    assert np.array_equal(np.asarray(rows_run["sglang_read"][str(n)]), want)


@pytest.mark.interpreter
def test_counts_went_to_the_rows_and_reach_sglang_only_at_its_read(rows_run: dict[str, Any]) -> None:
    assert all(used >= 2 for used in rows_run["rows_used"]), rows_run["rows_used"]  # spread, not one row
    unfused = 700 * rows_checks.K  # pass 3's layer SGLang counted itself, straight into its buffer
    assert rows_run["direct_before_read"] == [unfused if n == 3 else 0 for n in range(rows_checks.PASSES)]


@pytest.mark.interpreter
def test_a_pass_never_collected_leaves_nothing_for_the_next(rows_run: dict[str, Any]) -> None:
    assert str(rows_checks.STALE_PASS) not in rows_run["sglang_read"]
    after = rows_checks.STALE_PASS + 1
    assert np.array_equal(
        np.asarray(rows_run["sglang_read"][str(after)]), rows_checks.reference_counts(after)
    )


# ---- the rows' life cycle, in this process (no SGLang) ------------------------------------------


@pytest.fixture
def triton_backend() -> Iterator[None]:
    before = sglang_remap._BACKEND[0]
    sglang_remap._BACKEND[0] = "triton"
    yield
    sglang_remap._BACKEND[0] = before


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", [0, 1])
def test_folded_rows_equal_the_single_row_path(triton_backend: None, seed: int) -> None:
    L, E, P, K = 4, 24, 32, 8
    gen = torch.Generator().manual_seed(seed)
    data_LP = torch.zeros(L, P, dtype=torch.int32)
    single_LP = torch.zeros(L, P, dtype=torch.int32)
    maps_LE = torch.randint(0, P, (L, E), generator=gen)
    for step in range(2):  # two passes: the second starts from zeroed rows
        sglang_remap.attach_rows(data_LP)
        data_LP.zero_(), single_LP.zero_()
        for layer in range(L):
            T = int(torch.randint(1, 1500, (1,), generator=gen))
            ids = torch.randint(-3, E + 3, (T, K), generator=gen, dtype=torch.int32)
            nvalid = torch.tensor([max(T - 11 * step, 0)], dtype=torch.int32)
            info = SGLangDispatchInfo(maps_LE[layer])
            got = sglang_remap.eplb_map_and_record_fused(ids, info, data_LP[layer], nvalid)
            want = sglang_remap.eplb_map_and_record_fused(ids, info, single_LP[layer], nvalid)
            assert got is not None and want is not None and torch.equal(got, want)
        assert int(data_LP.sum()) == 0  # everything went to the rows
        sglang_remap.fold_rows(data_LP)
        assert torch.equal(data_LP, single_LP)
        sglang_remap.fold_rows(data_LP)  # a second read adds nothing
        assert torch.equal(data_LP, single_LP)


@pytest.mark.interpreter
def test_rows_go_only_where_the_kernel_spreads_them(triton_backend: None) -> None:
    E, P = 8, 12
    info = SGLangDispatchInfo(torch.arange(E) % P)
    ids = torch.randint(0, E, (64, 4), dtype=torch.int32)
    sglang_remap._BACKEND[0] = "torch"  # the torch backend adds every count to one row
    data_LP = torch.zeros(2, P, dtype=torch.int32)
    sglang_remap.attach_rows(data_LP)
    assert data_LP[0].data_ptr() not in sglang_remap._ROW_OF
    sglang_remap.eplb_map_and_record_fused(ids, info, data_LP[0], None)
    assert int(data_LP[0].sum()) == ids.numel()
    sglang_remap._BACKEND[0] = "triton"
    for bad in (torch.zeros(2, P, dtype=torch.int64), torch.zeros(2, 2 * P, dtype=torch.int32)[:, :P]):
        sglang_remap.attach_rows(bad)  # not SGLang's int32 contiguous [L, P]: counted into directly
        assert bad[0].data_ptr() not in sglang_remap._ROW_OF


@pytest.mark.interpreter
def test_old_buffers_give_their_rows_back(triton_backend: None) -> None:
    buffers = [torch.zeros(1, 8, dtype=torch.int32) for _ in range(sglang_remap._MAX_BUFFERS + 2)]
    for data_LP in buffers:
        sglang_remap.attach_rows(data_LP)
    assert len(sglang_remap._ROWS) <= sglang_remap._MAX_BUFFERS
    assert buffers[-1][0].data_ptr() in sglang_remap._ROW_OF
    assert buffers[0][0].data_ptr() not in sglang_remap._ROW_OF


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 300, 4096, 65536])
def test_folded_rows_equal_sglangs_own_kernel_on_cuda(rows: int) -> None:
    """Compiled on CUDA: the adapter with count rows, folded, against SGLang 0.5.23's fused kernel
    (benchmarks.peers: its file from the wheel, its one SGLang import stubbed) into a [P] buffer."""
    from benchmarks.peers import load_sglang_fused_kernel

    sglang_fused = load_sglang_fused_kernel().eplb_map_and_record_fused
    L, E, P, K = 4, 256, 288, 8
    gen = torch.Generator().manual_seed(rows)
    data_LP = torch.zeros(L, P, dtype=torch.int32, device="cuda")
    theirs_LP = torch.zeros(L, P, dtype=torch.int32, device="cuda")
    sglang_remap.attach_rows(data_LP)  # auto: Triton on CUDA spreads the rows
    assert sglang_remap._counts_for(data_LP[0]).dim() == 2
    for layer in range(L):
        ids = torch.randint(-1, E, (rows, K), generator=gen, dtype=torch.int32).cuda()
        info = SGLangDispatchInfo(torch.randint(0, P, (E,), generator=gen).cuda())
        nvalid = (
            torch.tensor([max(rows - 3 * layer, 0)], dtype=torch.int32, device="cuda") if layer % 2 else None
        )
        ours = sglang_remap.eplb_map_and_record_fused(ids, info, data_LP[layer], nvalid)
        want = sglang_fused(ids, info, theirs_LP[layer], nvalid)
        assert ours is not None and want is not None and torch.equal(ours.long(), want.long())
    assert int(data_LP.sum()) == 0
    sglang_remap.fold_rows(data_LP)
    assert torch.equal(data_LP, theirs_LP)
