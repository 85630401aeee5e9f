"""eplb's plugins with EP ranks lost, through SGLang 0.5.23's and vLLM 0.33.0's own code (from PyPI).

Shape legend: L layers, E logical experts, P physical slots, G GPUs (EP ranks).

tests.helpers.elastic_checks runs in two separate processes per engine (every rank plans alone):
SGLang with the ``ElasticEPStateManager`` mask its fault path leaves, vLLM with the sizes its
scale-down ``rank_mapping`` gives the policy. Here: every logical expert served, no dead rank's
slot in eplb's plan, the engine's form of the maps, and the same answer in both processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eplb.placement.balance import model_balancedness
from eplb.placement.model import Placement
from tests.helpers.engine_checks import E, G, L, P

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
S = P // G


def _run(site: Path, engine: str) -> dict[str, Any]:
    """``tests.helpers.elastic_checks ENGINE`` in a fresh process with the engines importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "tests.helpers.elastic_checks", engine, str(out)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0 and out.is_file(), f"{engine}: {done.stdout}\n{done.stderr}"
        result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module")
def sglang_runs(engine_site: Path) -> list[dict[str, Any]]:
    return [_run(engine_site, "sglang") for _ in range(2)]


@pytest.fixture(scope="module")
def vllm_runs(engine_site: Path) -> list[dict[str, Any]]:
    return [_run(engine_site, "vllm") for _ in range(2)]


def _dead_slots(dead: list[int]) -> np.ndarray:
    mask = np.zeros(P, dtype=bool)
    for rank in dead:
        mask[rank * S : (rank + 1) * S] = True
    return mask


def _check_sglang_form(triple: list[Any], dead: list[int]) -> Placement:
    """SGLang's form: phy2log with expert 0 in dead slots, log2phy and logcnt over live slots only.
    Returns the survivors' placement (validated: every expert on a live rank)."""
    phy2log, log2phy, logcnt = (np.asarray(t) for t in triple)
    assert phy2log.shape == (L, P) and logcnt.shape == (L, E) and log2phy.shape[:2] == (L, E)
    dead_P = _dead_slots(dead)
    assert (phy2log[:, dead_P] == 0).all()
    used = log2phy >= 0
    assert not dead_P[log2phy[used]].any(), "a dead rank's slot in log2phy"
    assert (used.sum(axis=2) == logcnt).all() and (logcnt >= 1).all()
    layer, expert, _ = np.nonzero(used)
    assert (phy2log[layer, log2phy[used]] == expert).all()
    live_LP = phy2log[:, ~dead_P]
    survivors = Placement.from_phy2log(live_LP, G - len(dead))  # every expert on a live rank
    assert (survivors.logcnt_LE == logcnt).all()
    return survivors


def test_sglang_keeps_its_elasticity_aware(sglang_runs: list[dict[str, Any]]) -> None:
    assert sglang_runs[0]["theirs_is_sglang"]


@pytest.mark.parametrize("case", ["one", "first", "reserved"])
def test_sglang_plan_serves_every_expert_on_live_ranks(sglang_runs: list[dict[str, Any]], case: str) -> None:
    first, second = (run["cases"][case] for run in sglang_runs)
    assert first == second  # two processes, the same plan
    dead = first["dead"]
    assert first["dtypes"] == ["torch.int64"] * 3
    ours = _check_sglang_form(first["eplb"], dead)
    assert first["eplb_again"] == first["eplb"]
    # SGLang's recorder turns slot counts into expert counts through the map: live slots only.
    recorded = np.asarray(first["recorded"])[0]
    logcnt = np.asarray(first["eplb"][2])
    assert (recorded == logcnt).all()
    # Installed, then planned again with the same ranks lost: still valid, nothing to reload.
    _check_sglang_form(first["eplb_next"], dead)
    assert ours.num_gpus == G - len(dead)


@pytest.mark.parametrize("case", ["one", "first"])
def test_sglang_plan_keeps_more_than_elasticity_aware(sglang_runs: list[dict[str, Any]], case: str) -> None:
    """SGLang's own ``elasticity_aware`` (its maps are the form checked above, too) repacks from
    scratch; eplb's plan keeps more of the survivors' slots, at least as balanced on the window."""
    got = sglang_runs[0]["cases"][case]
    dead_P = _dead_slots(got["dead"])
    live = np.asarray(sglang_runs[0]["live"])
    theirs = _check_sglang_form(got["sglang"], got["dead"])
    ours = _check_sglang_form(got["eplb"], got["dead"])
    kept = {
        name: int((np.asarray(maps[0])[:, ~dead_P] == live[:, ~dead_P]).sum())
        for name, maps in (("eplb", got["eplb"]), ("sglang", got["sglang"]))
    }
    assert kept["eplb"] > kept["sglang"], kept
    load_LE = np.asarray(sglang_runs[0]["tokens"]).sum(axis=0)
    assert model_balancedness(load_LE, ours) >= model_balancedness(load_LE, theirs)


def test_sglang_too_few_live_slots_is_a_clear_error(sglang_runs: list[dict[str, Any]]) -> None:
    assert "fewer than the 32 logical experts" in sglang_runs[0]["cases"]["too_many"]["error"]


def test_vllm_scale_down_plans_over_the_kept_ranks(vllm_runs: list[dict[str, Any]]) -> None:
    first, second = vllm_runs
    assert first == second  # two processes, the same plans
    new = first["new_ranks"]
    down = np.asarray(first["down"])
    assert first["down_dtype"] == "torch.int64" and down.shape == (L, new * S)
    assert first["down_again"] == first["down"]
    Placement.from_phy2log(down, new)  # full, every expert on a kept rank
    assert (np.asarray(first["down_counts"]) >= 1).all()
    # vLLM maps the answer back to the old ranks: -1 on the leaving rank, the plan elsewhere.
    mapped = np.asarray(first["down_mapped"])
    assert (mapped[:, new * S :] == -1).all() and (mapped[:, : new * S] == down).all()
    live = np.asarray(first["live"])[:, : new * S]
    kept = {
        name: int((np.asarray(first[key]) == live).sum())
        for name, key in (("eplb", "down"), ("vllm", "down_vllm"))
    }
    assert kept["eplb"] > kept["vllm"], kept


def test_vllm_scale_up_fills_the_new_ranks(vllm_runs: list[dict[str, Any]]) -> None:
    got = vllm_runs[0]
    new = got["new_ranks"]
    padded = np.asarray(got["up_padded"])
    assert (padded[:, new * S :] == -1).all()  # vLLM's own padding of the old ranks' map
    up = np.asarray(got["up"])
    assert got["up_narrow"] == got["up"]  # the old ranks' map alone plans the same
    Placement.from_phy2log(up, G)
    assert (up >= 0).all() and (np.asarray(got["up_counts"]) >= 1).all()
