"""The record of a remap call's fixed arguments (eplb.remap.call.RemapArgs) and what reads it.

Shape legend: T tokens, K top-k, E logical experts, P physical slots.

One record serves the public function's cache, its checks, the backend's RemapCall and
``PreparedRemap``: these tests check that the public signatures and the record name the same
arguments with the same defaults, that the RemapCall it builds is the one RemapCall's constructor
builds, that the cache tells calls apart by object and not by value, and that many argument sets
taking turns on one layer stay right against the brute force of tests/helpers/remap_reference.py.
"""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from eplb.placement.model import Placement
from eplb.remap import api
from eplb.remap.api import clear_prepared_cache, remap_and_record
from eplb.remap.call import RemapArgs, RemapCall
from eplb.remap.prepared import PreparedRemap, prepare_remap
from eplb.remap.tables import DispatchTables
from tests.helpers.remap_reference import brute_remap, random_ids, random_tables


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    clear_prepared_cache()


def _keyword_defaults(fn: Any) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def test_the_public_signatures_take_the_records_arguments_with_its_defaults() -> None:
    record = {f.name: f.default for f in fields(RemapArgs)}
    public = _keyword_defaults(remap_and_record)
    assert public.pop("out_TK") is None  # the one per-call keyword
    assert public == record
    assert _keyword_defaults(PreparedRemap.__init__) == record
    assert list(inspect.signature(remap_and_record).parameters)[:3] == ["topk_ids_TK", "tables", "layer"]


def test_the_backends_call_is_the_one_its_constructor_builds() -> None:
    tables = DispatchTables.from_placement(Placement.trivial(2, 6, num_gpus=2, num_redundant=2), 0)
    ids, out = torch.zeros((3, 2), dtype=torch.int32), torch.empty((3, 2), dtype=torch.int32)
    exchange = object()  # any object: remap_call only carries it
    args = RemapArgs(
        mode="dynamic",
        counts_P=torch.zeros(8, dtype=torch.int32),
        logical_counts_E=torch.zeros(6, dtype=torch.int32),
        num_valid_tokens=torch.tensor([2], dtype=torch.int32),
        record=torch.ones(1, dtype=torch.int32),
        backend="torch",
        map_padded_rows=True,
    )
    for fixed in (args, RemapArgs()):
        got = fixed.remap_call(ids, tables, 1, out, exchange)  # type: ignore[arg-type]
        want = RemapCall(
            topk_ids_TK=ids,
            tables=tables,
            layer=1,
            mode=fixed.mode,
            out_TK=out,
            counts_P=fixed.counts_P,
            logical_counts_E=fixed.logical_counts_E,
            num_valid_tokens=fixed.num_valid_tokens,
            record=fixed.record,
            lp=exchange,  # type: ignore[arg-type]
            map_padded_rows=fixed.map_padded_rows,
        )
        assert type(got) is RemapCall
        for f in fields(RemapCall):
            assert getattr(got, f.name) is getattr(want, f.name), f.name


def test_keys_tell_objects_apart_and_equal_names_alike() -> None:
    counts_P = torch.zeros(8, dtype=torch.int32)
    same = RemapArgs(mode="static", counts_P=counts_P)
    assert same.key() == RemapArgs(mode="".join(["sta", "tic"]), counts_P=counts_P).key()
    assert same.key() != RemapArgs(counts_P=counts_P.clone()).key()  # equal values, another object
    assert same.key() != RemapArgs(counts_P=counts_P, backend="torch").key()
    assert RemapArgs(map_padded_rows=True).key() != RemapArgs(map_padded_rows=1).key()  # type: ignore[arg-type]


def test_a_prepared_remap_of_a_record_holds_its_arguments() -> None:
    tables = DispatchTables.from_placement(Placement.trivial(2, 6, num_gpus=2, num_redundant=2), 0)
    args = RemapArgs(counts_P=torch.zeros(8, dtype=torch.int32), backend="torch", map_padded_rows=True)
    prepared = PreparedRemap.of(tables, 1, args)
    assert prepared.key() == args.key() and prepared.layer == 1 and prepared.tables is tables
    assert prepared.earlier is None
    by_keywords = prepare_remap(tables, 1, counts_P=args.counts_P, backend="torch", map_padded_rows=True)
    assert by_keywords.key() == args.key()
    with pytest.raises(ValueError, match=r"layer 2 outside \[0, 2\)"):
        PreparedRemap.of(tables, 2, args)  # checked as the constructor checks


def test_a_non_bool_map_padded_rows_is_refused_after_cached_bool_calls() -> None:
    tables = DispatchTables.from_placement(Placement.trivial(2, 6, num_gpus=2, num_redundant=2), 0)
    ids = torch.zeros((3, 2), dtype=torch.int32)
    counts_P = torch.zeros(8, dtype=torch.int32)
    for _ in range(3):
        remap_and_record(ids, tables, 0, counts_P=counts_P, backend="torch", map_padded_rows=True)
    with pytest.raises(TypeError, match="map_padded_rows must be a bool"):
        remap_and_record(ids, tables, 0, counts_P=counts_P, backend="torch", map_padded_rows=1)  # type: ignore[arg-type]


def test_more_argument_sets_than_a_layer_keeps_stay_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six count rows taking turns on one layer (SGLang's adapter calls every MoE layer as layer
    0): the layer keeps four, the rest come from the global table; every result and count is the
    brute force's, and after the first two rounds no call is checked in full."""
    checks = mock.Mock(wraps=api.check_remap_args)
    monkeypatch.setattr(api, "check_remap_args", checks)
    rng = np.random.default_rng(77)
    _, tables = random_tables(rng, 9, 12, 3, rank=1, num_layers=1)
    rows_SP = [torch.zeros(12, dtype=torch.int32) for _ in range(6)]
    want_SP = np.zeros((6, 12), dtype=np.int64)
    nvalid = torch.tensor([4], dtype=torch.int32)
    for step in range(5):
        for s, row in enumerate(rows_SP):
            ids = random_ids(rng, 6, 2, 9, "nasty")
            got = remap_and_record(ids, tables, 0, counts_P=row, num_valid_tokens=nvalid, backend="torch")
            ref = brute_remap(ids.tolist(), tables, 0, "static", 4, True)
            assert got.tolist() == ref.out_TK
            want_SP[s] += ref.counts_P
        if step == 1:
            assert checks.call_count == 12  # two full checks per set
            checks.reset_mock()
    assert checks.call_count == 0
    assert [row.tolist() for row in rows_SP] == want_SP.tolist()
    kept, chain = tables.derived[api._KEPT][0], []
    while kept is not None:
        chain.append(kept)
        kept = kept.earlier
    assert len(chain) == 4 and len({id(p) for p in chain}) == 4
