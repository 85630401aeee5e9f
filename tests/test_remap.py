"""eplb.remap.api: the public function, argument checks, tables and the torch reference backend.

The torch backend is checked against a plain-Python brute force (tests/helpers/remap_reference.py).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from eplb.placement.dispatch_map import static_dispatch_map
from eplb.placement.model import Placement
from eplb.remap.api import available_backends, get_backend, remap_and_record
from eplb.remap.tables import DispatchTables
from tests.helpers.remap_reference import LOCAL_MODES, brute_remap, random_ids, random_tables, run_remap


def _run(ids, tables, layer, mode, nvalid, record, backend="torch", map_padded=False):
    E, P = tables.num_logical, tables.num_physical
    bufs = {
        "counts": torch.full((P,), 5, dtype=torch.int32),
        "logical": torch.full((E,), 7, dtype=torch.int32),
        "nvalid": None if nvalid is None else torch.tensor([nvalid], dtype=torch.int32),
        "record": None if record is None else torch.tensor([record], dtype=torch.int32),
    }
    out = run_remap(ids, tables, layer, mode, backend=backend, map_padded=map_padded, **bufs)
    return out, bufs["counts"] - 5, bufs["logical"] - 7


@pytest.mark.parametrize("mode", LOCAL_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_torch_backend_equals_brute_force(mode: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    E, P, G = [(7, 10, 5), (12, 16, 4), (5, 5, 1)][seed]
    _, tables = random_tables(rng, E, P, G, rank=int(rng.integers(0, G)))
    for style, T, K, nvalid, record in [
        ("nasty", 41, 3, None, None),
        ("uniform", 30, 8, 17, 1),
        ("skewed", 25, 1, -3, 1),
        ("one_expert", 19, 16, 40, None),
        ("nasty", 13, 5, 13, 0),
    ]:
        ids = random_ids(rng, T, K, E, style)
        for map_padded in (False, True):
            out, counts, logical = _run(ids, tables, 1, mode, nvalid, record, map_padded=map_padded)
            want = brute_remap(ids.tolist(), tables, 1, mode, nvalid, record != 0, map_padded)
            assert out.dtype == torch.int32
            assert out.tolist() == want.out_TK
            assert counts.tolist() == want.counts_P
            assert logical.tolist() == want.logical_E


def test_padded_rows_mapped_on_request_equal_the_unpadded_map_and_are_not_counted() -> None:
    """SGLang's contract: with ``map_padded_rows`` every row maps as with no padding at all, and
    only the rows below ``num_valid_tokens`` count (a plain torch reference, not the brute force)."""
    rng = np.random.default_rng(11)
    _, tables = random_tables(rng, 9, 12, 3, rank=1)
    ids = random_ids(rng, 23, 4, 9, "nasty")
    unpadded = remap_and_record(ids, tables, 0, backend="torch")
    counts = torch.zeros(12, dtype=torch.int32)
    out = remap_and_record(
        ids,
        tables,
        0,
        counts_P=counts,
        num_valid_tokens=torch.tensor([7], dtype=torch.int32),
        backend="torch",
        map_padded_rows=True,
    )
    assert torch.equal(out, unpadded)
    head = unpadded[:7].reshape(-1).to(torch.int64)
    want = torch.bincount(head[(ids[:7].reshape(-1) >= 0) & (ids[:7].reshape(-1) < 9)], minlength=12)
    assert counts.tolist() == want.tolist()


def test_map_padded_rows_is_a_bool_and_not_for_lp() -> None:
    rng = np.random.default_rng(12)
    _, tables = random_tables(rng, 6, 8, 2, rank=0)
    ids = random_ids(rng, 4, 2, 6, "uniform")
    with pytest.raises(TypeError, match="map_padded_rows must be a bool"):
        remap_and_record(ids, tables, 0, backend="torch", map_padded_rows=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not supported in lp mode"):
        remap_and_record(ids, tables, 0, mode="lp", backend="torch", map_padded_rows=True)


def test_static_mode_uses_the_rank_dispatch_map() -> None:
    rng = np.random.default_rng(3)
    pl, tables = random_tables(rng, 9, 12, 4, rank=2, weighted=False)
    ids = torch.arange(9, dtype=torch.int32).repeat(3, 1)
    out = remap_and_record(ids, tables, 0, mode="static", backend="torch")
    assert out[0].tolist() == static_dispatch_map(pl, 2)[0].tolist()


@pytest.mark.parametrize("mode", ["dynamic", "dynamic_row", "weighted"])
def test_replicas_chosen_hold_the_expert(mode: str) -> None:
    rng = np.random.default_rng(4)
    pl, tables = random_tables(rng, 6, 14, 7, rank=3)
    ids = random_ids(rng, 400, 4, 6, "uniform")
    out = remap_and_record(ids, tables, 1, mode=mode, backend="torch")
    assert (pl.phy2log_LP[1][out.numpy()] == ids.numpy()).all()


def test_dynamic_spreads_uniformly_and_changes_with_the_seed() -> None:
    pl = Placement.from_phy2log(np.array([[0, 1, 0, 1, 0, 2]], dtype=np.int32), num_gpus=3)
    tables = DispatchTables.from_placement(pl, 0)
    ids = torch.zeros((30000, 1), dtype=torch.int32)
    first = remap_and_record(ids, tables, 0, mode="dynamic", backend="torch")
    share = np.bincount(first.numpy().ravel(), minlength=6)[[0, 2, 4]] / 30000
    assert np.allclose(share, 1 / 3, atol=0.015)
    tables.advance_seed_()
    second = remap_and_record(ids, tables, 0, mode="dynamic", backend="torch")
    assert not torch.equal(first, second)
    rows = remap_and_record(ids[:6], tables, 0, mode="dynamic_row", backend="torch")
    assert rows.ravel().tolist() == [0, 2, 4, 0, 2, 4]


def test_record_flag_zero_remaps_without_counting() -> None:
    rng = np.random.default_rng(5)
    _, tables = random_tables(rng, 8, 8, 2, rank=0)
    ids = random_ids(rng, 20, 4, 8, "uniform")
    out0, counts0, logical0 = _run(ids, tables, 0, "static", None, 0)
    out1, counts1, _ = _run(ids, tables, 0, "static", None, 1)
    assert torch.equal(out0, out1)
    assert counts0.sum() == 0 and logical0.sum() == 0 and counts1.sum() == 80


def test_empty_batch_and_pure_remap() -> None:
    rng = np.random.default_rng(6)
    _, tables = random_tables(rng, 4, 6, 2, rank=1)
    counts = torch.zeros(6, dtype=torch.int32)
    empty = torch.empty((0, 8), dtype=torch.int32)
    out = remap_and_record(empty, tables, 0, counts_P=counts, backend="torch")
    assert out.shape == (0, 8) and out.dtype == torch.int32 and counts.sum() == 0
    ids = torch.tensor([[0, 3, -1]], dtype=torch.int32)
    dest = torch.empty_like(ids)
    assert remap_and_record(ids, tables, 0, out_TK=dest, backend="torch") is dest


def test_int64_ids_are_refused_with_the_dtype_named() -> None:
    rng = np.random.default_rng(7)
    _, tables = random_tables(rng, 4, 4, 2, rank=0)
    with pytest.raises(TypeError, match=r"torch\.int64"):
        remap_and_record(torch.zeros((3, 2), dtype=torch.int64), tables, 0)
    with pytest.raises(TypeError, match=r"float32"):
        remap_and_record(torch.zeros((3, 2)), tables, 0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"counts_P": torch.zeros(4, dtype=torch.int64)}, TypeError, "counts_P must be torch.int32"),
        ({"counts_P": torch.zeros(5, dtype=torch.int32)}, ValueError, r"counts_P must have shape \[6\]"),
        ({"logical_counts_E": torch.zeros(6, dtype=torch.int32)}, ValueError, "logical_counts_E"),
        ({"num_valid_tokens": torch.zeros(2, dtype=torch.int32)}, ValueError, "one element"),
        ({"record": torch.zeros(1, dtype=torch.bool)}, TypeError, "record must be torch.int32"),
        ({"mode": "random"}, ValueError, "unknown dispatch mode"),
        ({"mode": "auto"}, ValueError, "picks static or lp per pass: call with the pass's mode"),
        ({"backend": "cuda"}, ValueError, "unknown remap backend"),
        ({"layer": 2}, ValueError, r"layer 2 outside \[0, 2\)"),
    ],
)
def test_bad_arguments_say_what_is_wrong(kwargs: dict, error: type, message: str) -> None:
    rng = np.random.default_rng(8)
    _, tables = random_tables(rng, 4, 6, 2, rank=0)
    layer = kwargs.pop("layer", 0)
    with pytest.raises(error, match=message):
        remap_and_record(torch.zeros((3, 2), dtype=torch.int32), tables, layer, **kwargs)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        remap_and_record(torch.zeros(3, dtype=torch.int32), tables, 0)


def test_update_in_place_keeps_addresses_and_takes_the_new_placement() -> None:
    rng = np.random.default_rng(9)
    old, tables = random_tables(rng, 6, 9, 3, rank=1)
    ptrs = [
        t.data_ptr() for t in (tables.static_LE, tables.log2phy_LER, tables.logcnt_LE, tables.cumweights_LER)
    ]
    new = Placement.trivial(2, 6, num_gpus=3, num_redundant=3)
    tables.update_(new)
    assert ptrs == [
        t.data_ptr() for t in (tables.static_LE, tables.log2phy_LER, tables.logcnt_LE, tables.cumweights_LER)
    ]
    assert tables.static_LE.tolist() == static_dispatch_map(new, 1).tolist()
    assert tables.logcnt_LE.tolist() == new.logcnt_LE.tolist()
    with pytest.raises(ValueError, match="differs from the tables"):
        tables.update_(Placement.trivial(2, 6, num_gpus=3, num_redundant=6))
    assert old.num_physical == 9


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (np.full((1, 2, 2), np.nan), "NaN"),
        (-np.ones((1, 2, 2)), "non-negative"),
        (np.array([[[1.0, 1.0], [0.0, 0.0]]]), "expert 1 in layer 0 sum to zero"),
        (np.ones((1, 2)), "weights must be"),
    ],
)
def test_bad_weights_are_refused(weights: np.ndarray, message: str) -> None:
    pl = Placement.from_phy2log(np.array([[0, 1, 0, 1]], dtype=np.int32), num_gpus=2)
    with pytest.raises(ValueError, match=message):
        DispatchTables.from_placement(pl, 0, "cpu", weights)


def test_registry_and_lazy_imports() -> None:
    assert "torch" in available_backends()
    if getattr(torch.version, "hip", None) is None:
        assert "aiter" not in available_backends()
        with pytest.raises(RuntimeError, match="ROCm build of torch and the amd-aiter package"):
            get_backend("aiter", torch.device("cpu"))
    assert get_backend("auto", torch.device("cpu")).__name__ == "remap_record_torch"
    code = (
        "import sys, torch, numpy as np\n"
        "from eplb.remap.api import remap_and_record, DispatchTables\n"
        "from eplb.placement.model import Placement\n"
        "t = DispatchTables.from_placement(Placement.trivial(1, 4, 2), 0)\n"
        "remap_and_record(torch.zeros((2, 2), dtype=torch.int32), t, 0)\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
