"""Placement: constructors, validation, and round trips through DeepSeek's triple and SGLang JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.placement.model import Placement
from tests.helpers.placements import random_phy2log


def reference_log2phy(phy2log: np.ndarray, num_logical: int) -> list[list[list[int]]]:
    """Plain-Python reference: slots of each expert, ascending."""
    return [
        [[p for p, e in enumerate(row) if e == expert] for expert in range(num_logical)] for row in phy2log
    ]


@st.composite
def placements(draw: st.DrawFn) -> tuple[np.ndarray, int, int]:
    num_nodes = draw(st.sampled_from([1, 2]))
    num_gpus = num_nodes * draw(st.integers(1, 4))
    slots_per_gpu = draw(st.integers(1, 5))
    num_physical = num_gpus * slots_per_gpu
    num_logical = draw(st.integers(1, num_physical))
    num_layers = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    return random_phy2log(rng, num_layers, num_logical, num_physical), num_gpus, num_nodes


@given(placements())
@settings(max_examples=60, deadline=None)
def test_from_phy2log_matches_reference(case: tuple[np.ndarray, int, int]) -> None:
    phy2log, num_gpus, num_nodes = case
    pl = Placement.from_phy2log(phy2log, num_gpus, num_nodes)
    E = pl.num_logical
    ref = reference_log2phy(phy2log, E)
    for layer in range(pl.num_layers):
        for expert in range(E):
            cnt = pl.logcnt_LE[layer, expert]
            assert cnt == len(ref[layer][expert])
            assert pl.log2phy_LER[layer, expert, :cnt].tolist() == ref[layer][expert]
            assert (pl.log2phy_LER[layer, expert, cnt:] == -1).all()
    for arr in (pl.phy2log_LP, pl.log2phy_LER, pl.logcnt_LE):
        assert arr.dtype == np.int32
    # from_phy2log checks phy2log and the geometry only (the rest is derived): every invariant holds.
    assert pl.validate() is pl


@given(placements())
@settings(max_examples=60, deadline=None)
def test_round_trip_deepseek_and_sglang(case: tuple[np.ndarray, int, int]) -> None:
    phy2log, num_gpus, num_nodes = case
    pl = Placement.from_phy2log(phy2log, num_gpus, num_nodes)
    p2l, l2p, cnt = pl.to_deepseek()
    assert p2l.dtype == l2p.dtype == cnt.dtype == torch.int32
    assert Placement.from_deepseek(p2l, l2p, cnt, num_gpus, num_nodes) == pl
    # DeepSeek's own code returns int64 tensors; adopting them yields the same int32 placement.
    assert Placement.from_deepseek(p2l.long(), l2p.long(), cnt.long(), num_gpus, num_nodes) == pl
    text = json.dumps(pl.to_sglang_dict())
    assert Placement.from_sglang(text, num_gpus, num_nodes) == pl
    assert Placement.from_sglang(json.loads(text), num_gpus, num_nodes) == pl


def test_sglang_json_file_round_trip(tmp_path) -> None:
    pl = Placement.from_phy2log(random_phy2log(np.random.default_rng(3), 4, 16, 24), num_gpus=4)
    path = pl.write_sglang_json(tmp_path / "loc.json")
    data = json.loads(path.read_text())
    assert list(data) == ["physical_to_logical_map"]
    assert np.array_equal(np.array(data["physical_to_logical_map"]), pl.phy2log_LP)
    assert Placement.from_sglang(path, num_gpus=4) == pl


def test_deepseek_replica_order_is_kept() -> None:
    # DeepSeek's log2phy lists replicas in creation order, not slot order; adopting keeps it.
    phy2log = np.array([[0, 1, 0, 2]], dtype=np.int32)
    log2phy = np.array([[[2, 0], [1, -1], [3, -1]]], dtype=np.int32)
    logcnt = np.array([[2, 1, 1]], dtype=np.int32)
    pl = Placement.from_deepseek(phy2log, log2phy, logcnt, num_gpus=2)
    assert pl.log2phy_LER[0, 0].tolist() == [2, 0]
    assert pl.same_slots(Placement.from_phy2log(phy2log, 2))


def test_trivial_is_identity_plus_round_robin() -> None:
    pl = Placement.trivial(num_layers=2, num_logical=6, num_gpus=4, num_redundant=2, num_nodes=2)
    assert pl.phy2log_LP.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]] * 2
    assert pl.logcnt_LE.tolist() == [[2, 2, 1, 1, 1, 1]] * 2
    assert pl.slots_per_gpu == 2 and pl.gpus_per_node == 2 and pl.num_redundant == 2


def test_to_device_is_int32() -> None:
    pl = Placement.trivial(3, 8, 2, 2)
    dev = pl.to_device("cpu")
    for t, arr in (
        (dev.phy2log_LP, pl.phy2log_LP),
        (dev.log2phy_LER, pl.log2phy_LER),
        (dev.logcnt_LE, pl.logcnt_LE),
    ):
        assert t.dtype == torch.int32
        assert np.array_equal(t.numpy(), arr)
    # The maps index with int32 ids and stay int32 (no silent promotion anywhere on this path).
    ids = torch.tensor([0, 7, 3], dtype=torch.int32)
    assert dev.log2phy_LER[0][ids][:, 0].dtype == torch.int32


def _valid() -> Placement:
    return Placement.trivial(num_layers=2, num_logical=4, num_gpus=2, num_redundant=2)


def _replace(pl: Placement, **arrays: np.ndarray) -> Placement:
    fields = {"phy2log_LP": pl.phy2log_LP, "log2phy_LER": pl.log2phy_LER, "logcnt_LE": pl.logcnt_LE}
    fields.update(arrays)
    return Placement(**fields, num_gpus=arrays.get("num_gpus", pl.num_gpus), num_nodes=pl.num_nodes)  # type: ignore[arg-type]


def test_validate_rejects_expert_without_replica() -> None:
    with pytest.raises(ValueError, match="no replica"):
        Placement.from_phy2log(np.array([[0, 0, 2, 2]]), num_gpus=2)  # expert 1 missing
    pl = _valid()
    p2l = pl.phy2log_LP.copy()
    p2l[0, 2] = 0  # expert 2 of layer 0 loses its only replica
    with pytest.raises(ValueError, match="no replica"):
        _replace(pl, phy2log_LP=p2l).validate()


def test_validate_rejects_disagreeing_maps() -> None:
    pl = _valid()
    l2p = pl.log2phy_LER.copy()
    l2p[0, 2, 0] = 3  # expert 2 claims slot 3, which holds expert 3
    with pytest.raises(ValueError, match="disagree"):
        _replace(pl, log2phy_LER=l2p).validate()
    cnt = pl.logcnt_LE.copy()
    cnt[1, 0] = 1
    with pytest.raises(ValueError, match=r"logcnt\[1, 0\]"):
        _replace(pl, logcnt_LE=cnt).validate()
    l2p = pl.log2phy_LER.copy()
    l2p[0, 0, :2] = [0, 0]  # slot listed twice, slot 4 missing
    with pytest.raises(ValueError, match="twice"):
        _replace(pl, log2phy_LER=l2p).validate()
    l2p = pl.log2phy_LER.copy()
    l2p[0, 2, 1] = 5  # padding must be -1
    with pytest.raises(ValueError, match="padded"):
        _replace(pl, log2phy_LER=l2p).validate()


def test_validate_rejects_bad_topology() -> None:
    with pytest.raises(ValueError, match="not divisible by GPUs"):
        Placement.trivial(1, 5, num_gpus=2)
    with pytest.raises(ValueError, match="not divisible by nodes"):
        Placement.trivial(1, 6, num_gpus=3, num_nodes=2)
    with pytest.raises(ValueError, match="fewer physical slots"):
        _replace(_valid(), phy2log_LP=np.zeros((2, 2), dtype=np.int32)).validate()


def test_validate_rejects_wrong_dtype_and_shape() -> None:
    pl = _valid()
    with pytest.raises(ValueError, match="int32"):
        _replace(pl, phy2log_LP=pl.phy2log_LP.astype(np.int64)).validate()
    with pytest.raises(ValueError, match="dimensions"):
        _replace(pl, logcnt_LE=pl.logcnt_LE[0]).validate()
    with pytest.raises(ValueError, match="shapes disagree"):
        _replace(pl, logcnt_LE=pl.logcnt_LE[:1]).validate()
    with pytest.raises(ValueError, match="integers"):
        Placement.from_phy2log(np.array([[0.0, 1.0]]), num_gpus=1)
    with pytest.raises(ValueError, match="outside"):
        _replace(pl, phy2log_LP=np.where(pl.phy2log_LP == 0, 9, pl.phy2log_LP).astype(np.int32)).validate()
