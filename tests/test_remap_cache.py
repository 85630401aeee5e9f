"""The public ``remap_and_record``'s per-object cache of its fixed arguments' checks (eplb.remap.api).

Shape legend: T tokens, K top-k, E logical experts, P physical slots, C count rows.

From the second call with the same tensor objects the public function goes through a prepared remap;
these tests check, against the brute-force reference of tests/helpers/remap_reference.py, that the
results and counts stay those of every call checked in full, that a bad argument still raises after
its neighbours were cached, that fresh views every call stay correct and keep the cache bounded,
and that a kept object's id is never taken by another object.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch

from eplb.placement.model import Placement
from eplb.remap import api
from eplb.remap.api import clear_prepared_cache, count_rows_sum, remap_and_record
from eplb.remap.tables import DispatchTables
from tests.helpers.remap_reference import LOCAL_MODES, brute_remap, random_ids, random_tables


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    clear_prepared_cache()


@pytest.mark.parametrize("mode", LOCAL_MODES)
def test_repeated_calls_equal_the_brute_force(mode: str) -> None:
    rng = np.random.default_rng(71)
    _, tables = random_tables(rng, 11, 15, 3, rank=1, num_layers=3)
    E, P = tables.num_logical, tables.num_physical
    counts_CP = torch.zeros((3, P), dtype=torch.int32)
    logical_E = torch.zeros(E, dtype=torch.int32)
    nvalid_1 = torch.tensor([5], dtype=torch.int32)
    record_1 = torch.ones(1, dtype=torch.int32)
    want_P = np.zeros(P, dtype=np.int64)
    want_E = np.zeros(E, dtype=np.int64)
    for step in range(6):  # first call checks in full, second prepares, the rest hit the cache
        T = int(rng.integers(0, 9))
        nvalid_1.fill_(int(rng.integers(-1, T + 2)))  # device scalars are read at run time, not cached
        record_1.fill_(int(step % 3 != 1))
        ids = random_ids(rng, T, 4, E, "nasty")
        out = remap_and_record(
            ids,
            tables,
            2,
            mode=mode,
            counts_P=counts_CP,
            logical_counts_E=logical_E,
            num_valid_tokens=nvalid_1,
            record=record_1,
            backend="torch",
        )
        ref = brute_remap(ids.tolist(), tables, 2, mode, int(nvalid_1.item()), bool(record_1.item()))
        assert out.tolist() == ref.out_TK
        want_P += np.asarray(ref.counts_P, dtype=np.int64)
        want_E += np.asarray(ref.logical_E, dtype=np.int64)
        assert count_rows_sum(counts_CP).tolist() == want_P.tolist()
        assert logical_E.tolist() == want_E.tolist()
    assert any(callable(v) and not isinstance(v, tuple) for v in api._PREPARED.values())


def test_bad_arguments_still_raise_once_their_neighbours_are_cached() -> None:
    tables = DispatchTables.from_placement(Placement.trivial(2, 6, num_gpus=2, num_redundant=2), 0)
    counts_P = torch.zeros(8, dtype=torch.int32)
    record_1 = torch.ones(1, dtype=torch.int32)
    ids = torch.zeros((3, 2), dtype=torch.int32)
    for _ in range(3):
        remap_and_record(ids, tables, 0, counts_P=counts_P, record=record_1, backend="torch")
    kw: dict[str, Any] = {"counts_P": counts_P, "record": record_1, "backend": "torch"}
    with pytest.raises(TypeError, match=r"torch\.int64"):
        remap_and_record(ids.long(), tables, 0, **kw)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        remap_and_record(torch.zeros(3, dtype=torch.int32), tables, 0, **kw)
    with pytest.raises(ValueError, match="must be contiguous"):
        remap_and_record(torch.zeros((2, 3), dtype=torch.int32).t(), tables, 0, **kw)
    with pytest.raises(ValueError, match="out_TK must have shape"):
        remap_and_record(ids, tables, 0, out_TK=torch.zeros((2, 2), dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match=r"layer 2 outside \[0, 2\)"):
        remap_and_record(ids, tables, 2, **kw)
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        remap_and_record(ids, tables, 0, mode="random", counts_P=counts_P, record=record_1)
    with pytest.raises(ValueError, match="counts_P must have shape"):
        remap_and_record(ids, tables, 0, counts_P=torch.zeros(7, dtype=torch.int32), record=record_1)
    with pytest.raises(TypeError, match=r"record must be torch\.int32"):
        remap_and_record(ids, tables, 0, counts_P=counts_P, record=torch.ones(1))
    with pytest.raises(ValueError, match="unknown remap backend"):
        remap_and_record(ids, tables, 0, counts_P=counts_P, record=record_1, backend="nope")
    with pytest.raises(TypeError):  # unhashable layer: the checks' own error, not the cache's
        remap_and_record(ids, tables, [0], **kw)  # type: ignore[arg-type]


def test_fresh_views_every_call_stay_correct_and_the_cache_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "_PREPARED_MAX", 16)
    rng = np.random.default_rng(72)
    _, tables = random_tables(rng, 9, 12, 2, rank=0, num_layers=2)
    counts_LP = torch.zeros((2, tables.num_physical), dtype=torch.int32)
    want_LP = np.zeros(counts_LP.shape, dtype=np.int64)
    for _ in range(40):
        layer = int(rng.integers(0, 2))
        ids = random_ids(rng, 6, 3, 9, "nasty")
        out = remap_and_record(ids, tables, layer, counts_P=counts_LP[layer], backend="torch")  # a new view
        ref = brute_remap(ids.tolist(), tables, layer, "static", None, True)
        assert out.tolist() == ref.out_TK
        want_LP[layer] += ref.counts_P
        assert len(api._PREPARED) <= 16
    assert counts_LP.tolist() == want_LP.tolist()


def test_a_kept_objects_id_is_never_reused_by_a_bad_tensor() -> None:
    tables = DispatchTables.from_placement(Placement.trivial(1, 4, num_gpus=2, num_redundant=2), 0)
    ids = torch.zeros((2, 2), dtype=torch.int32)
    counts_P = torch.zeros(6, dtype=torch.int32)
    for _ in range(3):
        remap_and_record(ids, tables, 0, counts_P=counts_P, backend="torch")
    del counts_P
    gc.collect()
    for _ in range(50):  # were the cached tensor freed, one of these could take its id and skip the checks
        with pytest.raises(ValueError, match="counts_P must have shape"):
            remap_and_record(ids, tables, 0, counts_P=torch.zeros(5, dtype=torch.int32), backend="torch")
    clear_prepared_cache()
    assert not api._PREPARED
