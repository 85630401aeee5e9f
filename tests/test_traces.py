"""Traces: the own format round-trips exactly; SGLang and OpenEvolve files read right; bad files are refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb.traces import Trace, TraceFormatError, load_trace, read_sglang_per_pass, write_openevolve
from eplb.workloads import WorkloadConfig, generate


@pytest.fixture(scope="module")
def deepseek_trace() -> Trace:
    return generate(WorkloadConfig(preset="deepseek-v3", num_steps=120, seed=7))


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_deepseek_sized_trace_round_trips_exactly(deepseek_trace: Trace, tmp_path: Path, suffix: str) -> None:
    assert deepseek_trace.counts_FLE.shape == (120, 58, 256)
    path = deepseek_trace.save(tmp_path / f"trace{suffix}")
    loaded = load_trace(path)
    assert loaded.equals(deepseek_trace)
    assert loaded.counts_FLE.dtype == np.int32 and loaded.is_prefill_F.dtype == np.bool_


def test_sglang_stat_dump_loads(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    counts = torch.from_numpy(rng.integers(0, 500, size=(6, 3, 16)).astype(np.int32))
    torch.save(
        {"rank": 0, "logical_count": counts, "average_utilization_rate_over_window": 0.71}, tmp_path / "s.pt"
    )
    trace = load_trace(tmp_path / "s.pt")
    assert np.array_equal(trace.counts_FLE, counts.numpy())
    assert trace.meta["source"] == "sglang-stat" and trace.meta["chronological"] is False
    # A dump with a single [L, E] table is one step.
    torch.save({"rank": 0, "logical_count": counts[0]}, tmp_path / "one.pt")
    assert load_trace(tmp_path / "one.pt").counts_FLE.shape == (1, 3, 16)


def test_sglang_per_pass_dumps_sum_ranks_and_map_physical_to_logical(tmp_path: Path) -> None:
    # 2 layers, 3 logical experts, 4 physical slots: slot 3 holds a second copy of expert 0 (layer 0)
    # and of expert 2 (layer 1).
    p2l = torch.tensor([[0, 1, 2, 0], [0, 1, 2, 2]], dtype=torch.int64)

    def rec(pass_id: int, rank: int, phys: list[list[int]]) -> dict[str, object]:
        return {"forward_pass_id": pass_id, "rank": rank, "global_physical_count": torch.tensor(phys)}

    rank0 = {
        "records": [rec(5, 0, [[1, 2, 3, 4], [0, 0, 1, 1]]), rec(6, 0, [[0, 0, 0, 1], [1, 1, 1, 1]])],
        "last_physical_to_logical_map": p2l,
    }
    rank1 = {"records": [rec(5, 1, [[10, 0, 0, 0], [0, 0, 0, 7]])], "last_physical_to_logical_map": p2l}
    torch.save(rank0, tmp_path / "r0.pt")
    torch.save(rank1, tmp_path / "r1.pt")
    trace = read_sglang_per_pass([tmp_path / "r0.pt", tmp_path / "r1.pt"])
    # Hand computation: pass 5 = rank0 + rank1, folded to logical ids; pass 6 = rank0 only.
    expected = np.array(
        [
            [[1 + 4 + 10, 2, 3], [0, 0, 1 + 1 + 7]],
            [[0 + 1, 0, 0], [1, 1, 1 + 1]],
        ]
    )
    assert np.array_equal(trace.counts_FLE, expected)
    assert trace.meta["forward_pass_ids"] == [5, 6]
    assert load_trace([tmp_path / "r0.pt", tmp_path / "r1.pt"]).equals(trace)


def test_pickle_carrying_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    torch.save({"rank": 0, "logical_count": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(TraceFormatError, match="refused"):
        load_trace(tmp_path / "evil.pt")
    assert not marker.exists()


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00" * 64,
        b"PK\x03\x04garbage",
        b"{not json",
        b'{"load_history": []}',
        b'{"other": 1}',
        b'{"load_history": [{"logical_expert_load": [[1, NaN]]}]}',
        b'{"load_history": [{"logical_expert_load": [[1, -2]]}]}',
        b'{"load_history": [{"logical_expert_load": [[1, 2]]}, {"logical_expert_load": [[1]]}]}',
    ],
)
def test_corrupt_files_raise_trace_format_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError):
        load_trace(path)


def test_truncated_own_format_and_foreign_safetensors_are_refused(
    deepseek_trace: Trace, tmp_path: Path
) -> None:
    path = deepseek_trace.slice(0, 4).save(tmp_path / "t.safetensors")
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(TraceFormatError):
        load_trace(path)
    from safetensors.numpy import save_file

    save_file({"weight": np.zeros(3, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(TraceFormatError, match="not an eplb trace"):
        load_trace(tmp_path / "model.safetensors")
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(TraceFormatError, match="neither"):
        load_trace(tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.pt")


def test_openevolve_round_trip_and_same_counts_across_formats(tmp_path: Path) -> None:
    trace = generate(WorkloadConfig(preset="tiny", num_steps=30, seed=1))
    write_openevolve(trace, tmp_path / "expert-load.json")
    data = json.loads((tmp_path / "expert-load.json").read_text())
    assert len(data["load_history"]) == 30 and len(data["load_history"][0]["logical_expert_load"]) == 4
    from_json = load_trace(tmp_path / "expert-load.json")
    torch.save({"rank": 0, "logical_count": torch.from_numpy(trace.counts_FLE)}, tmp_path / "s.pt")
    from_sglang = load_trace(tmp_path / "s.pt")
    for other in (from_json, from_sglang, load_trace(trace.save(tmp_path / "t.npz"))):
        assert np.array_equal(other.counts_FLE, trace.counts_FLE)


def test_from_counts_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="NaN"):
        Trace.from_counts(np.array([[[1.0, np.nan]]]))
    with pytest.raises(ValueError, match="fractional"):
        Trace.from_counts(np.array([[[1.5, 2.0]]]))
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        Trace.from_counts(np.array([[[-1, 2]]]))
    with pytest.raises(ValueError, match="shape"):
        Trace.from_counts(np.zeros(3))
    empty = Trace.from_counts(np.zeros((0, 2, 4), dtype=np.int64))
    assert empty.num_steps == 0 and empty.total_LE().shape == (2, 4)
    # int64 counts that fit are converted explicitly, not wrapped.
    assert Trace.from_counts(np.array([[[2**31 - 1]]], dtype=np.int64)).counts_FLE.dtype == np.int32
