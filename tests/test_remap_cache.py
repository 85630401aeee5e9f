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
from collections.abc import Callable
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


def _nasty(tables: DispatchTables) -> dict[str, Callable[[dict[str, Any]], None]]:
    """Ways to change one argument of a cached call into a bad one (each edits the call's keywords)."""
    E, P = tables.num_logical, tables.num_physical

    def put(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda kw: kw.__setitem__(name, value)

    i32 = torch.int32
    return {
        "counts_P short": put("counts_P", torch.zeros(P - 1, dtype=i32)),
        "counts_P int64": put("counts_P", torch.zeros(P, dtype=torch.int64)),
        "counts_P strided": put("counts_P", torch.zeros(2 * P, dtype=i32)[::2]),
        "counts_P too many rows": put("counts_P", torch.zeros((65, P), dtype=i32)),
        "counts_P on meta": put("counts_P", torch.zeros(P, dtype=i32, device="meta")),
        "counts_P a list": put("counts_P", [0] * P),
        "logical_counts_E long": put("logical_counts_E", torch.zeros(E + 1, dtype=i32)),
        "num_valid_tokens two": put("num_valid_tokens", torch.zeros(2, dtype=i32)),
        "num_valid_tokens float": put("num_valid_tokens", torch.zeros(1)),
        "num_valid_tokens on meta": put("num_valid_tokens", torch.zeros(1, dtype=i32, device="meta")),
        "record int64": put("record", torch.ones(1, dtype=torch.int64)),
        "record empty": put("record", torch.ones(0, dtype=i32)),
        "ids int64": put("topk_ids_TK", torch.zeros((3, 2), dtype=torch.int64)),
        "ids 1-D": put("topk_ids_TK", torch.zeros(6, dtype=i32)),
        "ids transposed": put("topk_ids_TK", torch.zeros((2, 3), dtype=i32).t()),
        "ids on meta": put("topk_ids_TK", torch.zeros((3, 2), dtype=i32, device="meta")),
        "ids a list": put("topk_ids_TK", [[0, 1]]),
        "out_TK shape": put("out_TK", torch.zeros((2, 2), dtype=i32)),
        "out_TK int64": put("out_TK", torch.zeros((3, 2), dtype=torch.int64)),
        "out_TK transposed": put("out_TK", torch.zeros((2, 3), dtype=i32).t()),
        "out_TK on meta": put("out_TK", torch.zeros((3, 2), dtype=i32, device="meta")),
        "layer past the end": put("layer", tables.num_layers),
        "layer negative": put("layer", -1),
        "mode unknown": put("mode", "random"),
        "backend unknown": put("backend", "nope"),
        "tables on meta": put(
            "tables",
            DispatchTables.from_placement(
                Placement.trivial(2, E, num_gpus=2, num_redundant=P - E), 0, "meta"
            ),
        ),
    }


def _error(kw: dict[str, Any]) -> tuple[type[BaseException], str]:
    with pytest.raises((TypeError, ValueError)) as info:
        remap_and_record(kw.pop("topk_ids_TK"), kw.pop("tables"), kw.pop("layer"), **kw)
    return info.type, str(info.value)


@pytest.mark.parametrize(
    "change",
    list(_nasty(DispatchTables.from_placement(Placement.trivial(2, 6, num_gpus=2, num_redundant=2), 0))),
)
def test_a_bad_argument_after_cached_calls_raises_what_a_first_call_raises(change: str) -> None:
    """Once a layer's call runs through its kept preparation, changing any one argument to a bad
    one still raises, with the same error as when nothing is cached, and the cache still serves
    the good call afterwards with the right results."""
    rng = np.random.default_rng(73)
    tables = DispatchTables.from_placement(Placement.trivial(2, 6, num_gpus=2, num_redundant=2), 0)
    counts_P = torch.zeros(8, dtype=torch.int32)
    good: dict[str, Any] = {
        "tables": tables,
        "layer": 1,
        "counts_P": counts_P,
        "logical_counts_E": torch.zeros(6, dtype=torch.int32),
        "num_valid_tokens": torch.tensor([2], dtype=torch.int32),
        "record": torch.ones(1, dtype=torch.int32),
        "out_TK": torch.zeros((3, 2), dtype=torch.int32),
        "backend": "torch",
    }
    ids = random_ids(rng, 3, 2, 6, "nasty")

    def call(kw: dict[str, Any]) -> torch.Tensor:
        kw = dict(kw)
        return remap_and_record(kw.pop("topk_ids_TK", ids), kw.pop("tables"), kw.pop("layer"), **kw)

    for _ in range(3):
        call(good)
    assert tables.derived[api._KEPT][1].counts_P is counts_P  # the layer's calls now skip the checks
    bad = {"topk_ids_TK": ids, **good}
    _nasty(tables)[change](bad)
    cached_error = _error(dict(bad))
    clear_prepared_cache()
    assert _error(dict(bad)) == cached_error  # the same type and message as with nothing kept
    for _ in range(3):  # the good call is kept again, and still right
        counts_P.zero_()
        out = call(good)
        ref = brute_remap(ids.tolist(), tables, 1, "static", 2, True)
        assert out.tolist() == ref.out_TK and counts_P.tolist() == ref.counts_P


def test_cached_calls_of_every_documented_form_skip_the_full_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """After its first two calls a layer's call runs its kept preparation: no full check, for a
    ``**`` dict and named keywords alike (here into a recorder's rows), with the brute force's counts."""
    from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig

    checks = [0]
    full = api.check_remap_args

    def counting(*args: Any) -> Any:
        checks[0] += 1
        return full(*args)

    monkeypatch.setattr(api, "check_remap_args", counting)
    rng = np.random.default_rng(74)
    placement, tables = random_tables(rng, 10, 14, 2, rank=1, num_layers=3)
    rec = ExpertDistributionRecorder(RecorderConfig(window=8), placement)
    rec.start()
    ids = random_ids(rng, 9, 3, 10, "nasty")
    out = torch.empty_like(ids)
    kwargs: list[dict[str, Any]] = [
        {"counts_P": row, "record": rec.record_flag_1} for row in rec.pass_counts_LCP.unbind(0)
    ]

    def by_kwargs(layer: int) -> torch.Tensor:
        return remap_and_record(ids, tables, layer, backend="torch", **kwargs[layer])

    forms: list[Callable[[int], torch.Tensor]] = [
        by_kwargs,
        lambda layer: remap_and_record(
            ids,
            tables,
            layer,
            counts_P=kwargs[layer]["counts_P"],
            record=rec.record_flag_1,
            out_TK=out,
            backend="torch",
        ),
    ]
    want = np.zeros((3, tables.num_physical), dtype=np.int64)
    for step in range(8):
        rec.begin_pass(has_prefill=True, num_tokens=9)
        for layer in range(3):
            got = forms[step % 2](layer)
            ref = brute_remap(ids.tolist(), tables, layer, "static", None, True)
            assert got.tolist() == ref.out_TK
            want[layer] += ref.counts_P
        rec.end_pass()
        if step == 1:
            assert checks[0] == 6  # two calls per layer checked in full; the second prepared
            checks[0] = 0
    assert checks[0] == 0
    assert rec.window_passes()[1].sum(0).tolist() == want.tolist()


def test_argument_sets_taking_turns_on_one_layer_stay_right_without_the_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks = [0]
    full = api.check_remap_args
    monkeypatch.setattr(
        api, "check_remap_args", lambda *a: (checks.__setitem__(0, checks[0] + 1), full(*a))[1]
    )
    rng = np.random.default_rng(75)
    _, tables = random_tables(rng, 9, 12, 3, rank=2, num_layers=2)
    sets: list[dict[str, Any]] = [
        {"counts_P": torch.zeros((3, 12), dtype=torch.int32), "record": torch.ones(1, dtype=torch.int32)},
        {},
        {"logical_counts_E": torch.zeros(9, dtype=torch.int32), "mode": "dynamic"},
    ]
    want_P, want_E = np.zeros(12, dtype=np.int64), np.zeros(9, dtype=np.int64)
    for step in range(12):
        which = step % 3
        kw = sets[which]
        ids = random_ids(rng, 7, 2, 9, "nasty")
        got = remap_and_record(ids, tables, 1, backend="torch", **kw)
        ref = brute_remap(ids.tolist(), tables, 1, kw.get("mode", "static"), None, True)
        assert got.tolist() == ref.out_TK
        if which == 0:
            want_P += ref.counts_P
            assert count_rows_sum(kw["counts_P"]).tolist() == want_P.tolist()
        if which == 2:
            want_E += ref.logical_E
            assert kw["logical_counts_E"].tolist() == want_E.tolist()
        if step == 5:
            assert checks[0] == 6  # each set: checked on its first two calls, then taken back
            checks[0] = 0
    assert checks[0] == 0


def test_clear_prepared_cache_forgets_the_layer_entries() -> None:
    tables = DispatchTables.from_placement(Placement.trivial(2, 4, num_gpus=2, num_redundant=2), 0)
    counts_P = torch.zeros(6, dtype=torch.int32)
    ids = torch.zeros((2, 2), dtype=torch.int32)
    for _ in range(3):
        remap_and_record(ids, tables, 0, counts_P=counts_P, backend="torch")
    assert api._KEPT in tables.derived and tables in api._KEPT_IN
    clear_prepared_cache()
    assert api._KEPT not in tables.derived and not api._KEPT_IN and not api._PREPARED
    remap_and_record(ids, tables, 0, counts_P=counts_P, backend="torch")  # checked in full again
    assert int(counts_P.sum()) == 4 * 4  # four calls of four valid ids each


@pytest.mark.interpreter
def test_cached_public_calls_launch_through_the_prepared_direct_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the Triton backend a cached public call is a prepared call: its launches go direct (the
    stand-in compiled kernel of tests/test_remap_direct.py), with the brute force's results."""
    from tests.test_remap_direct import _Harness

    harness = _Harness(monkeypatch)
    rng = np.random.default_rng(76)
    _, tables = random_tables(rng, 13, 17, 1, rank=0, num_layers=3)
    harness.register(
        tables.static_LE, tables.log2phy_LER, tables.logcnt_LE, tables.cumweights_LER, tables.seed_1
    )
    counts_CP = torch.zeros((2, 17), dtype=torch.int32)
    record = torch.ones(1, dtype=torch.int32)
    harness.register(counts_CP, record)
    want_P = np.zeros(17, dtype=np.int64)
    for step in range(4):
        ids = random_ids(rng, 40, 3, 13, "nasty")
        out = torch.empty_like(ids)
        harness.register(ids, out)
        before = harness.direct_launches
        got = remap_and_record(
            ids, tables, 2, counts_P=counts_CP, record=record, out_TK=out, backend="triton"
        )
        ref = brute_remap(ids.tolist(), tables, 2, "static", None, True)
        want_P += ref.counts_P
        assert got is out and got.tolist() == ref.out_TK
        assert count_rows_sum(counts_CP).tolist() == want_P.tolist()
        # First call: kernel[grid] (compiles, keeps); then direct, through the public path and,
        # from the second call, the kept preparation.
        assert harness.direct_launches - before == (step > 0)
    assert tables.derived[api._KEPT][2].counts_P is counts_CP
