"""Prepared remaps (eplb.remap.prepared): the public function's results and errors, checked once.

Every prepared call is compared with ``remap_and_record`` on the same inputs; the Triton direct path
runs under the interpreter through the stand-in compiled kernel of tests/test_remap_direct.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb.placement.model import Placement
from eplb.remap.api import remap_and_record
from eplb.remap.prepared import prepare_remap
from eplb.remap.tables import DispatchTables
from tests.helpers.remap_reference import LOCAL_MODES, random_ids, random_tables


def _buffers(tables: DispatchTables, T: int, rng: np.random.Generator) -> dict:
    return {
        "counts_P": torch.zeros(tables.num_physical, dtype=torch.int32),
        "logical_counts_E": torch.zeros(tables.num_logical, dtype=torch.int32)
        if rng.random() < 0.5
        else None,
        "num_valid_tokens": torch.tensor([int(rng.integers(-1, T + 2))], dtype=torch.int32)
        if rng.random() < 0.5
        else None,
        "record": torch.tensor([int(rng.integers(0, 2))], dtype=torch.int32) if rng.random() < 0.5 else None,
    }


@pytest.mark.parametrize("mode", [*LOCAL_MODES, "lp"])
def test_prepared_calls_equal_the_public_function(mode: str) -> None:
    rng = np.random.default_rng(31)
    _, tables = random_tables(rng, 13, 16, 1 if mode == "lp" else 4, rank=0)
    for T in (0, 1, 7, 90):
        bufs = _buffers(tables, T, rng)
        mine = {k: None if v is None else v.clone() for k, v in bufs.items()}
        prepared = prepare_remap(tables, 1, mode=mode, backend="torch", **mine)
        for _ in range(2):  # the buffers accumulate alike
            ids = random_ids(rng, T, 5, 13, "nasty")
            want = remap_and_record(ids, tables, 1, mode=mode, backend="torch", **bufs)
            out = torch.full_like(ids, -9)
            assert prepared(ids, out) is out and torch.equal(out, want)
            assert torch.equal(prepared(ids), want)  # allocating the output
            prepared_twice = remap_and_record(ids, tables, 1, mode=mode, backend="torch", **bufs)
            assert torch.equal(prepared_twice, want)
            for name in ("counts_P", "logical_counts_E"):
                assert (bufs[name] is None) or torch.equal(bufs[name], mine[name])


def test_prepared_calls_refuse_what_the_public_function_refuses() -> None:
    tables = DispatchTables.from_placement(Placement.trivial(2, 6, num_gpus=2, num_redundant=2), 0)
    with pytest.raises(TypeError, match=r"counts_P must be torch\.int32"):
        prepare_remap(tables, 0, counts_P=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"layer 2 outside \[0, 2\)"):
        prepare_remap(tables, 2)
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        prepare_remap(tables, 0, mode="random")
    prepared = prepare_remap(tables, 0, backend="torch")
    with pytest.raises(TypeError, match=r"torch\.int64"):
        prepared(torch.zeros((3, 2), dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        prepared(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_TK must have shape"):
        prepared(torch.zeros((3, 2), dtype=torch.int32), torch.zeros((2, 2), dtype=torch.int32))


@pytest.mark.interpreter
def test_prepared_direct_launches_equal_the_torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_remap_direct import _Harness

    harness = _Harness(monkeypatch)
    rng = np.random.default_rng(32)
    _, tables = random_tables(rng, 13, 17, 1, rank=0, num_layers=3)
    harness.register(
        tables.static_LE, tables.log2phy_LER, tables.logcnt_LE, tables.cumweights_LER, tables.seed_1
    )
    for mode in LOCAL_MODES:
        counts_LP = torch.zeros((3, 17), dtype=torch.int32)
        record = torch.ones(1, dtype=torch.int32)
        harness.register(counts_LP[2], record)
        prepared = prepare_remap(tables, 2, mode=mode, counts_P=counts_LP[2], record=record, backend="triton")
        before = harness.direct_launches
        for _ in range(3):
            ids = random_ids(rng, 40, 3, 13, "nasty")
            out = torch.empty_like(ids)
            harness.register(ids, out)
            want_counts = counts_LP[2].clone()
            want = remap_and_record(
                ids, tables, 2, mode=mode, counts_P=want_counts, record=record, backend="torch"
            )
            assert torch.equal(prepared(ids, out), want) and torch.equal(counts_LP[2], want_counts)
        # The first call compiles and keeps the kernel (kernel[grid]); the prepared path takes the rest.
        assert harness.direct_launches - before == 2, mode
