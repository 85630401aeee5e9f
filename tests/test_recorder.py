"""The expert distribution recorder in one process: window, prefill-only, placements, dumps, modes.

Expected counts are computed by hand or by numpy bincounts of the ids fed to the kernel.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from eplb.config import EplbConfig
from eplb.placement.model import Placement
from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig
from eplb.remap.api import DispatchTables
from eplb.traces import load_trace

L, E, G = 2, 6, 2


def _setup(mode: str = "stat", window: int = 3, prefill_only: bool = False, **kw):
    pl = Placement.trivial(L, E, num_gpus=G, num_redundant=2)
    rec = ExpertDistributionRecorder(
        RecorderConfig(mode=mode, window=window, prefill_only=prefill_only, **kw), pl
    )
    return pl, DispatchTables.from_placement(pl, 0), rec


def _pass(rec, tables, ids_by_layer, *, prefill: bool = True) -> bool:
    T = int(ids_by_layer[0].shape[0])
    remaps = rec.prepare(tables, backend="torch")
    rec.begin_pass(has_prefill=prefill, num_tokens=T)
    for layer, ids in enumerate(ids_by_layer):
        remaps[layer](ids)
        rec.record_topk(layer, ids)
    return rec.end_pass()


def _ids(seed: int, T: int = 5, K: int = 2) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(-1, E, size=(T, K)).astype(np.int32)) for _ in range(L)]


def _counts(ids_by_layer: list[torch.Tensor]) -> np.ndarray:
    out = np.zeros((L, E), dtype=np.int64)
    for layer, ids in enumerate(ids_by_layer):
        flat = ids.numpy().ravel()
        out[layer] = np.bincount(flat[flat >= 0], minlength=E)
    return out


def test_window_wraps_around_keeping_the_newest_passes_in_order() -> None:
    _, tables, rec = _setup(window=3)
    rec.start()
    passes = [_ids(s) for s in range(5)]
    for i, ids in enumerate(passes):
        assert _pass(rec, tables, ids)
        assert rec.window_full == (i >= 2)
    assert rec.num_counted_passes == 5 and rec.num_window_passes == 3
    want = np.stack([_counts(p) for p in passes[2:]])
    assert np.array_equal(rec.window_logical_counts(), want)
    assert rec.window_logical_total().dtype == np.int64
    assert np.array_equal(rec.window_logical_total(), want.sum(axis=0))
    assert int(rec.pass_counts_LP.abs().sum()) == 0  # cleared after every pass


def test_prefill_only_records_and_counts_prefill_passes_only() -> None:
    _, tables, rec = _setup(window=4, prefill_only=True)
    rec.start()
    flags = [True, False, True, False, False]
    passes = [_ids(10 + s) for s in range(5)]
    counted = [_pass(rec, tables, ids, prefill=f) for ids, f in zip(passes, flags, strict=True)]
    assert counted == flags
    assert rec.num_counted_passes == 2
    want = np.stack([_counts(p) for p, f in zip(passes, flags, strict=True) if f])
    assert np.array_equal(rec.window_logical_counts(), want)


def test_stopped_recorder_counts_passes_without_recording() -> None:
    _, tables, rec = _setup()
    assert _pass(rec, tables, _ids(1))
    assert rec.num_counted_passes == 1 and rec.num_window_passes == 0
    rec.start()
    _pass(rec, tables, _ids(2))
    rec.stop()
    _pass(rec, tables, _ids(3))
    assert rec.num_counted_passes == 3
    assert np.array_equal(rec.window_logical_counts(), _counts(_ids(2))[None])
    rec.reset()
    assert rec.num_window_passes == 0 and rec.num_counted_passes == 3


def test_each_pass_converts_through_the_placement_it_ran_under() -> None:
    old = Placement.from_phy2log(np.array([[0, 1, 2, 3], [0, 1, 2, 3]], dtype=np.int32), num_gpus=2)
    new = Placement.from_phy2log(np.array([[3, 2, 1, 0], [1, 0, 3, 2]], dtype=np.int32), num_gpus=2)
    tables = DispatchTables.from_placement(old, 1)
    rec = ExpertDistributionRecorder(RecorderConfig(window=4), old)
    rec.start()
    ids = [torch.tensor([[0, 0], [1, 3]], dtype=torch.int32)] * 2
    _pass(rec, tables, ids)
    tables.update_(new)
    rec.set_placement(new)
    _pass(rec, tables, ids)
    want = np.array([[2, 1, 0, 1], [2, 1, 0, 1]])
    assert np.array_equal(rec.window_logical_counts(), np.stack([want, want]))
    _, phys = rec.window_passes()
    assert phys[1, 0].tolist() == [1, 0, 1, 2]  # slot 3 holds expert 0 in layer 0 after the swap
    with pytest.raises(ValueError, match="keep L, E and P"):
        rec.set_placement(Placement.trivial(2, 4, num_gpus=2, num_redundant=2))


def test_sglang_stat_dump_equals_a_hand_computation(tmp_path: Path) -> None:
    # 2 layers, 4 experts, 4 slots on 2 GPUs (slots 0-1 on GPU 0).
    pl = Placement.from_phy2log(np.array([[0, 1, 2, 3], [2, 3, 0, 1]], dtype=np.int32), num_gpus=2)
    tables = DispatchTables.from_placement(pl, 0)
    rec = ExpertDistributionRecorder(RecorderConfig(window=2), pl)
    rec.start()
    _pass(rec, tables, [torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)] * 2)
    _pass(rec, tables, [torch.tensor([[3, -1], [3, 9]], dtype=torch.int32)] * 2)
    path = rec.dump(tmp_path / "stat.pt", fmt="sglang")
    assert path is not None
    obj = torch.load(path, weights_only=True)
    assert obj["rank"] == 0
    assert obj["logical_count"].dtype == torch.int32
    assert obj["logical_count"].tolist() == [[[2, 1, 1, 0]] * 2, [[0, 0, 0, 2]] * 2]
    # Window expert totals [2, 1, 1, 2] per layer. Layer 0 GPU loads: (2+1, 1+2) -> 3/3 = 1.0.
    # Layer 1 (GPU 0 holds experts 2, 3): (1+2, 2+1) -> 1.0. Mean over layers: 1.0.
    assert obj["average_utilization_rate_over_window"] == pytest.approx(1.0)
    rec.reset()
    _pass(rec, tables, [torch.tensor([[0, 0], [0, 1]], dtype=torch.int32)] * 2)
    obj = torch.load(rec.dump(tmp_path / "s2.pt", fmt="sglang"), weights_only=True)  # type: ignore[arg-type]
    # Layer 0: GPU loads (3+1, 0) -> mean 2 / max 4 = 0.5; layer 1 (experts 0, 1 on GPU 1): (0, 4) -> 0.5.
    assert obj["average_utilization_rate_over_window"] == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["stat", "per_pass"])
@pytest.mark.parametrize("name", ["w.safetensors", "w.npz", "w.pt"])
def test_dump_and_load_round_trip(mode: str, name: str, tmp_path: Path) -> None:
    _, tables, rec = _setup(mode=mode, window=4, prefill_only=True)
    rec.start()
    passes = [_ids(20 + s, T=3 + s) for s in range(6)]
    flags = [True, True, False, True, True, True]
    for ids, f in zip(passes, flags, strict=True):
        _pass(rec, tables, ids, prefill=f)
    path = rec.dump(tmp_path / name, fmt="sglang" if name.endswith(".pt") else "eplb")
    assert path is not None
    trace = load_trace(path)
    kept = [p for p, f in zip(passes, flags, strict=True) if f][-4:]
    assert np.array_equal(trace.counts_FLE, np.stack([_counts(p) for p in kept]))
    assert np.array_equal(trace.counts_FLE, rec.window_logical_counts())
    if not name.endswith(".pt"):
        assert trace.num_tokens_F.tolist() == [int(p[0].shape[0]) for p in kept]
        assert trace.meta["mode"] == mode and trace.meta["forward_pass_ids"] == [1, 2, 3, 4]


def test_per_pass_keeps_a_bounded_number_of_records() -> None:
    _, tables, rec = _setup(mode="per_pass", window=2)
    rec.start()
    passes = [_ids(30 + s) for s in range(7)]
    for ids in passes:
        _pass(rec, tables, ids)
    assert rec.num_window_passes == 2 and rec.window_full
    assert np.array_equal(rec.window_logical_counts(), np.stack([_counts(p) for p in passes[-2:]]))


def test_per_token_keeps_ids_up_to_the_budget(tmp_path: Path) -> None:
    _, tables, rec = _setup(mode="per_token", token_budget=12, top_k=2, prefill_only=True)
    rec.start()
    passes = [_ids(40 + s, T=5) for s in range(4)]
    flags = [True, False, True, True]
    for ids, f in zip(passes, flags, strict=True):
        _pass(rec, tables, ids, prefill=f)
    ids_TLK, pass_T, dropped = rec.recorded_tokens()
    want = np.concatenate(
        [np.stack([p[layer].numpy() for layer in range(L)], axis=1) for p in (passes[0], passes[2])]
    )
    want = np.concatenate([want, np.stack([passes[3][layer].numpy()[:2] for layer in range(L)], axis=1)])
    assert np.array_equal(ids_TLK, want)
    assert pass_T.tolist() == [0] * 5 + [1] * 5 + [2] * 2 and dropped == 3
    path = rec.dump(tmp_path / "tok.npz")
    assert path is not None
    with np.load(path, allow_pickle=False) as z:
        assert str(z["format"]) == "eplb-per-token" and np.array_equal(z["topk_ids"], want)
    with pytest.raises(ValueError, match="per_token"):
        rec.window_logical_counts()
    with pytest.raises(ValueError, match="only in the eplb format"):
        rec.dump(tmp_path / "tok.pt", fmt="sglang")


def test_sums_over_passes_are_int64_and_never_wrap() -> None:
    _, _, rec = _setup(window=4)
    rec.start()
    big = 2**31 - 10
    for _ in range(3):
        rec.begin_pass(has_prefill=True)
        rec.pass_counts_LP[0, 0] = big  # one pass may hold up to int32 max per slot
        rec.end_pass()
    total = rec.window_logical_total()
    assert total.dtype == np.int64 and total[0, 0] == 3 * big
    assert rec.window_logical_counts().sum(axis=0)[0, 0] == 3 * big


def test_config_and_protocol_errors() -> None:
    cfg = EplbConfig(
        enable_eplb=True, ep_size=2, eplb_rebalance_num_iterations=50, eplb_record_prefill_only=True
    )
    rc = RecorderConfig.from_eplb_config(cfg, top_k=4)
    assert (rc.mode, rc.window, rc.prefill_only, rc.top_k) == ("stat", 50, True, 4)
    with pytest.raises(ValueError, match="unknown recorder mode"):
        RecorderConfig(mode="histogram")
    _, _, rec = _setup()
    with pytest.raises(RuntimeError, match="without begin_pass"):
        rec.end_pass()
    rec.begin_pass(has_prefill=False)
    with pytest.raises(RuntimeError, match="twice"):
        rec.begin_pass(has_prefill=False)
    with pytest.raises(ValueError, match="unknown dump format"):
        rec.dump("x.bin", fmt="pickle")


def test_calls_prepared_once_record_every_later_pass() -> None:
    """As a captured graph replays them: one preparation, then passes recorded by the flag alone."""
    _, tables, rec = _setup(window=4)
    remaps = rec.prepare(tables, backend="torch")
    assert len(remaps) == L
    rec.start()
    passes = [_ids(60 + s) for s in range(5)]
    for ids_by_layer in passes:
        rec.begin_pass(has_prefill=True, num_tokens=5)
        for layer, ids in enumerate(ids_by_layer):
            remaps[layer](ids)
        rec.end_pass()
    assert np.array_equal(rec.window_logical_counts(), np.stack([_counts(p) for p in passes[1:]]))


def test_a_known_batch_kind_needs_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    import eplb.recorder.recorder as recorder_module

    def no_collective(*args: object) -> bool:
        raise AssertionError("end_pass ran the prefill agreement although the engine gave it")

    _, tables, rec = _setup(window=4, prefill_only=True)
    remaps = rec.prepare(tables, backend="torch")
    rec.start()
    monkeypatch.setattr(recorder_module, "any_rank", no_collective)
    # Another rank's prefill counts the pass here too (a zero row: this rank decoded).
    for local, anywhere in ((True, True), (False, True), (False, False), (True, True)):
        rec.begin_pass(has_prefill=local, num_tokens=5, any_rank_prefill=anywhere)
        for layer, ids in enumerate(_ids(70)):
            remaps[layer](ids)
        assert rec.end_pass() is anywhere
    assert rec.num_counted_passes == 3
    window = rec.window_logical_counts()
    assert window[1].sum() == 0 and np.array_equal(window[0], _counts(_ids(70)))
    with pytest.raises(ValueError, match="any_rank_prefill=False"):
        rec.begin_pass(has_prefill=True, any_rank_prefill=False)


def test_record_flag_follows_the_pass_without_refilling_it() -> None:
    _, _, rec = _setup(prefill_only=True)
    rec.start()
    fills = []
    for prefill in (True, True, False, False, True):
        rec.begin_pass(has_prefill=prefill)
        fills.append(int(rec.record_flag_1.item()))
        rec.end_pass()
    assert fills == [1, 1, 0, 0, 1]
    rec.stop()
    rec.begin_pass(has_prefill=True)
    assert int(rec.record_flag_1.item()) == 0
    rec.end_pass()


@pytest.mark.parametrize("num_tokens", [-1, 2**31, 2**40, 1.5, 2.0, True, "8"])
def test_a_pass_that_would_wrap_int32_counts_or_is_not_whole_is_refused(num_tokens: object) -> None:
    _, _, rec = _setup(window=3)
    rec.start()
    with pytest.raises(ValueError, match="num_tokens"):
        rec.begin_pass(has_prefill=True, num_tokens=num_tokens)  # type: ignore[arg-type]
    rec.begin_pass(has_prefill=True, num_tokens=np.int64(7))  # numpy integers are whole
    rec.end_pass()


@pytest.mark.parametrize("mode", ["stat", "per_pass"])
def test_placements_no_stored_pass_uses_are_dropped(mode: str) -> None:
    """Swaps every pass (a paced continuous run): the maps kept stay bounded by the window, and
    every kept pass still converts through the placement it ran under (a numpy reference)."""
    rng = np.random.default_rng(41)
    window = 3
    first = Placement.trivial(L, E, num_gpus=G, num_redundant=2)
    tables = DispatchTables.from_placement(first, 0)
    rec = ExpertDistributionRecorder(RecorderConfig(mode=mode, window=window), first)
    rec.start()
    expected = []
    for step in range(40):
        p2l = np.stack([rng.permutation(first.phy2log_LP[layer]) for layer in range(L)]).astype(np.int32)
        placement = Placement.from_phy2log(p2l, num_gpus=G)
        tables.update_(placement)
        rec.set_placement(placement)
        ids = _ids(100 + step)
        _pass(rec, tables, ids)
        expected.append(_counts(ids))
        in_flight = len(rec._per_pass.staging) if rec._per_pass is not None else 0  # copies not yet collected
        assert len(rec._maps) <= window + in_flight + 1
    assert np.array_equal(rec.window_logical_counts(), np.stack(expected[-window:]))
