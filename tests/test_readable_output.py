"""Output a reader can interpret: rounded and labelled figures, unknown bytes and prefill flags said
as such, the sample dumps as SGLang writes them, and ``eplb solve`` leaving all its files or none."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb.cli import main
from eplb.commands.sweep import verdict
from eplb.placement.diff import BYTES_UNKNOWN, diff_placements
from eplb.placement.model import Placement
from eplb.simulate import SimulationConfig, parse_runs, simulate
from eplb.solver import Topology, solve
from eplb.traces import Trace, load_trace, read_openevolve, write_openevolve
from eplb.workloads import WorkloadConfig, generate
from tests.helpers.simulation import server

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SAMPLE_FLAGS = ["--ep-size", "4", "--nnodes", "1", "--ep-num-redundant-experts", "4"]
SAMPLE_SERVER = server(ep_size=4, nnodes=1, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=10)
"""The same topology as a simulation's flags, rebalancing every 10 passes."""


def test_diff_summary_says_bytes_unknown_instead_of_zero() -> None:
    old = Placement.trivial(2, 8, 4, 4, num_nodes=2)
    new = Placement.from_phy2log(np.roll(old.phy2log_LP, 3, axis=1), 4, 2)
    unknown = diff_placements(old, new).summary()
    assert unknown["experts_moved_across_gpus"] > 0 and unknown["experts_moved_across_nodes"] > 0
    assert unknown["bytes_across_gpus"] == unknown["bytes_across_nodes"] == BYTES_UNKNOWN == "bytes unknown"
    known = diff_placements(old, new, 10).summary()
    assert known["bytes_across_gpus"] == 10 * known["experts_moved_across_gpus"]
    assert known["bytes_across_nodes"] == 10 * known["experts_moved_across_nodes"]
    # Nothing moved: 0 bytes is true whatever the bytes per expert.
    assert diff_placements(old, old).summary()["bytes_across_gpus"] == 0
    one_node = diff_placements(Placement.trivial(2, 8, 4, 4), Placement.from_phy2log(new.phy2log_LP, 4))
    assert (
        one_node.summary()["bytes_across_nodes"] == 0
        and one_node.summary()["bytes_across_gpus"] == BYTES_UNKNOWN
    )


def test_solve_names_the_nodes_when_the_live_placement_has_other_ones() -> None:
    load = np.random.default_rng(0).integers(0, 50, size=(4, 2, 16))
    with pytest.raises(ValueError, match=r"Placement\.trivial takes num_nodes"):
        solve(load, Topology(num_gpus=4, num_nodes=2, num_physical=20), Placement.trivial(2, 16, 4, 4))


def test_traces_without_prefill_flags_say_so_once_per_result(tmp_path: Path) -> None:
    sglang = load_trace(EXAMPLES / "sglang_stat_dump.pt")
    assert not sglang.prefill_known and "no prefill flags" in (sglang.prefill_note() or "")
    write_openevolve(sglang, tmp_path / "o.json")
    assert not read_openevolve(tmp_path / "o.json").prefill_known
    sglang.save(tmp_path / "t.safetensors")  # the flag travels with the data
    assert not load_trace(tmp_path / "t.safetensors").prefill_known
    synthetic = generate(WorkloadConfig(preset="tiny", num_steps=30, seed=0))
    assert synthetic.prefill_known and synthetic.prefill_note() is None
    assert Trace.from_counts(sglang.counts_FLE, is_prefill=sglang.is_prefill_F).prefill_known
    config = SimulationConfig(eplb=SAMPLE_SERVER)
    notes = simulate(sglang, parse_runs(["none"], "static"), config).notes
    assert sum("no prefill flags" in n for n in notes) == 1


def test_simulator_says_which_bytes_per_expert_it_assumed() -> None:
    tiny = generate(WorkloadConfig(preset="tiny", num_steps=30, seed=0))
    runs = parse_runs(["none"], "static")
    config = SimulationConfig(eplb=SAMPLE_SERVER)
    (note,) = [n for n in simulate(tiny, runs, config).notes if "bytes per expert" in n]
    assert "44,040,192" in note and "the trace records 12,288" in note
    own = SimulationConfig(eplb=SAMPLE_SERVER, bytes_per_expert=12_288)
    assert not [n for n in simulate(tiny, runs, own).notes if "bytes per expert" in n]
    dump = load_trace(EXAMPLES / "sglang_stat_dump.pt")
    assert any("does not record one" in n for n in simulate(dump, runs, config).notes)


def test_sample_dumps_are_what_the_script_makes(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_sample_dump
    finally:
        sys.path.remove(str(EXAMPLES))
    assert make_sample_dump.main(["--out", str(tmp_path)]) == 0
    for name in ("sglang_stat_dump.pt", "sglang_per_pass_rank0.pt", "sglang_per_pass_rank1.pt"):
        committed = torch.load(EXAMPLES / name, weights_only=True)
        fresh = torch.load(tmp_path / name, weights_only=True)
        assert repr(committed) == repr(fresh), name  # same keys, tensors and values
        assert (EXAMPLES / name).stat().st_size < 16_000
    stat = torch.load(EXAMPLES / "sglang_stat_dump.pt", weights_only=True)
    assert set(stat) == {"rank", "logical_count", "average_utilization_rate_over_window"}
    assert stat["logical_count"].dtype == torch.int32 and tuple(stat["logical_count"].shape) == (40, 4, 16)
    # The ring buffer: pass t sits in row t mod 40, so the last 12 passes overwrote rows 0-11.
    passes = generate(WorkloadConfig(preset="tiny", num_steps=52, seed=0)).counts_FLE
    ring = stat["logical_count"].numpy()
    assert np.array_equal(ring[:12], passes[40:]) and np.array_equal(ring[12:], passes[12:40])
    per_pass = load_trace([EXAMPLES / "sglang_per_pass_rank0.pt", EXAMPLES / "sglang_per_pass_rank1.pt"])
    assert np.array_equal(per_pass.counts_FLE, passes[:12])  # both ranks' slots summed per pass


def test_solve_prints_rounded_labelled_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(EXAMPLES / "sglang_stat_dump.pt")
    args = ["solve", "--trace", trace, *SAMPLE_FLAGS, "--out", str(tmp_path / "plan")]
    assert main([*args, "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    lines = dict(line.strip().split(": ", 1) for line in printed.splitlines() if ": " in line)
    result = json.loads((tmp_path / "r.json").read_text())
    before, after = result["balancedness_on_window_before"], result["balancedness_on_window"]
    assert lines["balancedness on the window"].startswith(f"{before:.3f} (trivial) -> {after:.3f} (solved)")
    assert lines["predicted next window"].startswith(f"{result['solver_predicted_balancedness']:.3f} ")
    # No figure printed with more than 4 decimals (the JSON keeps them all).
    assert not re.search(r"\d\.\d{5,}", printed)
    copies = result["moves"]["experts_moved_across_gpus"]
    assert copies > 0 and result["moves"]["bytes_across_gpus"] == BYTES_UNKNOWN  # a dump does not say
    assert (
        lines["moves from the start"]
        == f"{copies} expert copies across GPUs, bytes unknown (give --bytes-per-expert)"
    )
    assert main([*args, "--bytes-per-expert", "1000"]) == 0
    assert f"{copies} expert copies across GPUs, " in capsys.readouterr().out


def test_failed_solve_leaves_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from eplb.integrations import trtllm

    out = tmp_path / "plan"
    args = ["solve", "--preset", "tiny", "--steps", "40", *SAMPLE_FLAGS, "--out", str(out)]

    def broken(*_: object, **__: object) -> str:
        raise ValueError("cannot lay out the TensorRT-LLM file")

    monkeypatch.setattr(trtllm, "launch_flags", broken)  # after every file is staged
    assert main(args) == 2
    assert "cannot lay out" in capsys.readouterr().err
    assert not out.exists() or list(out.iterdir()) == []
    monkeypatch.undo()
    # An output that cannot be written is refused before any work; an earlier plan is kept whole.
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "j").mkdir()
    assert main([*args, "--seed", "1", "--json", str(tmp_path / "j")]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(before) == [
        "init_expert_location.json",
        "placement.safetensors",
        "trtllm_extra_llm_api_options.yaml",
        "trtllm_load_balancer.yaml",
    ]


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ({"redundant": 32, "interval": 1000}, "fewest redundant experts 32 (at interval 500); longest interval 1000 (with 32 redundant)"),
        ({"redundant": 32, "interval": None}, "fewest redundant experts 32 (at interval 500); no interval tried reaches it with 32 redundant"),
        ({"redundant": None, "interval": 200}, "no redundant count tried reaches it at interval 500; with the most tried (64 redundant) a shorter interval does: longest 200"),
        ({"redundant": None, "interval": None}, "no redundant count tried reaches it at interval 500, and no interval tried does with the most tried (64 redundant)"),
    ],
)  # fmt: skip
def test_sweep_verdict_never_contradicts_itself(result: dict[str, int | None], expected: str) -> None:
    used = result["redundant"] if result["redundant"] is not None else 64
    assert verdict({**result, "redundant_used_for_intervals": used}, 500) == expected
