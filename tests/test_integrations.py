"""Engine adapters without the engines: engine maps to placements, plans for an engine, TensorRT-LLM's
file, the fused-kernel replacement on hand-built SGLang-shaped inputs, and the entry points."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from eplb.integrations import sglang_remap, trtllm
from eplb.integrations.engine_plan import (
    SOLVER_OPTIONS_ENV,
    engine_placement,
    make_planner,
    plan_for_engine,
    solver_options_from_env,
)
from eplb.placement.model import Placement
from tests.helpers.placements import random_phy2log


def test_engine_placement_fills_empty_slots() -> None:
    load_LE = np.array([[5.0, 1.0, 9.0, 3.0]])
    # Expert 1 is missing; two slots are empty: the first takes expert 1, the second the expert
    # with the most load per replica afterwards (2: 9 over one replica).
    got = engine_placement(torch.tensor([[0, -1, 2, 3, -1, 0]]), load_LE, num_gpus=2, num_nodes=1)
    assert got is not None and got.phy2log_LP.tolist() == [[0, 1, 2, 3, 2, 0]]
    assert got.max_replicas == 6 - 4 + 1
    full = random_phy2log(np.random.default_rng(0), 3, 8, 12)
    same = engine_placement(full, np.ones((3, 8)), num_gpus=4, num_nodes=2)
    assert same is not None and np.array_equal(same.phy2log_LP, full) and same.num_nodes == 2


@pytest.mark.parametrize(
    "phy2log",
    [
        [[0, 1, 2, 3, 0]],  # P=5 not divisible by 2 GPUs
        [[0, 1, 2, 5, 0, 1]],  # id outside [0, E)
        [[0, 0, 0, 0, -1, 1]],  # experts 2 and 3 missing, one empty slot
        [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]],  # two layers for a one-layer load
    ],
)
def test_engine_placement_refuses(phy2log: list[list[int]]) -> None:
    assert engine_placement(np.array(phy2log), np.ones((1, 4)), num_gpus=2, num_nodes=1) is None


def test_plan_for_engine_keeps_when_nothing_to_gain() -> None:
    rng = np.random.default_rng(4)
    window = rng.integers(0, 50, size=(6, 3, 16)).astype(float)
    window[:, :, 0] += 400  # one hot expert per layer
    planner = make_planner("auto", "test")
    fresh = plan_for_engine(window, num_physical=20, num_gpus=4, num_nodes=1, num_groups=None,
                            planner=planner, current=None)  # fmt: skip
    assert fresh.applied and fresh.phy2log_int64().dtype == np.int64
    assert (fresh.placement.logcnt_LE[:, 0] > 1).all()  # the hot expert got replicas
    again = plan_for_engine(window, num_physical=20, num_gpus=4, num_nodes=1, num_groups=None,
                            planner=planner, current=fresh.placement)  # fmt: skip
    assert not again.applied and again.placement is fresh.placement
    assert again.log2phy_int64().shape == (3, 16, int(fresh.placement.logcnt_LE.max()))
    # Three nodes do not divide four GPUs: planned on one node, as vLLM does.
    odd = plan_for_engine(window, num_physical=20, num_gpus=4, num_nodes=3, num_groups=4,
                          planner=planner, current=None)  # fmt: skip
    assert odd.placement.num_nodes == 1


def test_plan_for_engine_without_load_keeps_current() -> None:
    current = Placement.trivial(2, 8, num_gpus=2, num_redundant=2)
    kept = plan_for_engine(np.zeros((2, 8)), num_physical=10, num_gpus=2, num_nodes=1, num_groups=1,
                           planner=make_planner("auto", "test"), current=current)  # fmt: skip
    assert not kept.applied and kept.placement is current
    trivial = plan_for_engine(np.zeros((2, 8)), num_physical=10, num_gpus=2, num_nodes=1, num_groups=1,
                              planner=make_planner("auto", "test"), current=None)  # fmt: skip
    assert trivial.placement == current


def test_solver_options_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SOLVER_OPTIONS_ENV, raising=False)
    assert solver_options_from_env({"copy_cost": 0.01}) == {"copy_cost": 0.01}
    monkeypatch.setenv(SOLVER_OPTIONS_ENV, '{"copy_cost": 0.02, "min_gain": 0.01}')
    assert solver_options_from_env({"copy_cost": 0.01}) == {"copy_cost": 0.02, "min_gain": 0.01}
    assert make_planner("scipy", "flag").options.min_gain == 0.01
    for bad, message in (("[1]", "JSON object"), ("{", "not JSON"), ('{"bogus": 1}', "bogus")):
        monkeypatch.setenv(SOLVER_OPTIONS_ENV, bad)
        with pytest.raises(ValueError, match=message):
            make_planner("auto", "flag")
    with pytest.raises(ValueError, match="MYFLAG"):
        make_planner("magic", "MYFLAG")


def test_trtllm_load_balancer_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    placement = Placement.from_phy2log(random_phy2log(rng, 3, 16, 20), num_gpus=4)
    balancer, options = trtllm.write_load_balancer(placement, tmp_path / "out", layer_offset=3)
    parsed = yaml.safe_load(balancer.read_text())
    assert parsed == {
        "num_slots": 20,
        "initial_global_assignments": {
            3 + layer: row for layer, row in enumerate(placement.phy2log_LP.tolist())
        },
        "layer_updates_per_iter": 0,
    }
    assert yaml.safe_load(options.read_text()) == {"moe_config": {"load_balancer": str(balancer.resolve())}}
    assert "--ep_size 4" in trtllm.launch_flags(placement, options)
    with pytest.raises(ValueError, match="layer_offset"):
        trtllm.load_balancer_config(placement, -1)


def _sglang_reference(ids: np.ndarray, dispatch: np.ndarray | None, P: int, n_valid: int | None) -> tuple:
    """SGLang's fused semantics, element by element: map ids in [0, E) on every row; count rows < n_valid."""
    E = P if dispatch is None else len(dispatch)
    out = ids.copy()
    counts = np.zeros(P, dtype=np.int64)
    for (row, k), logical in np.ndenumerate(ids):
        if 0 <= logical < E:
            phys = logical if dispatch is None else int(dispatch[logical])
            out[row, k] = phys
            if (n_valid is None or row < n_valid) and 0 <= phys < P:
                counts[phys] += 1
    return out, counts


@pytest.mark.parametrize("n_valid", [None, 0, 7, 30])
@pytest.mark.parametrize("identity", [False, True])
def test_fused_replacement_matches_sglang_semantics(n_valid: int | None, identity: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    E, P = 12, 16
    dispatch = None if identity else torch.randint(0, P, (E,), generator=gen)
    info = None if identity else SimpleNamespace(ep_dispatch_algorithm="static",
                                                 partial_logical_to_rank_dispatch_physical_map=dispatch)  # fmt: skip
    ids = torch.randint(-1, P + 2, (30, 4), generator=gen, dtype=torch.int32)
    load = torch.full((P,), 5, dtype=torch.int32)
    nvalid = None if n_valid is None else torch.tensor([n_valid], dtype=torch.int64)  # int64: converted
    got = sglang_remap.eplb_map_and_record_fused(ids, info, load, nvalid)
    want_out, want_counts = _sglang_reference(
        ids.numpy(), None if dispatch is None else dispatch.numpy(), P, n_valid
    )
    assert got is not None and got.dtype == torch.int32
    assert np.array_equal(got.numpy(), want_out)
    assert np.array_equal(load.numpy(), want_counts + 5)  # added to, not overwritten


def test_fused_replacement_falls_back_and_caches() -> None:
    dispatch_LE = torch.arange(2 * 8).reshape(2, 8) % 10
    info = SimpleNamespace(
        ep_dispatch_algorithm="static", partial_logical_to_rank_dispatch_physical_map=dispatch_LE[1, :]
    )
    ids = torch.randint(0, 8, (5, 2), dtype=torch.int32)
    load = torch.zeros(10, dtype=torch.int32)
    assert sglang_remap.eplb_map_and_record_fused(ids, info, load.to(torch.int64), None) is None
    assert (
        sglang_remap.eplb_map_and_record_fused(
            ids, SimpleNamespace(ep_dispatch_algorithm="dynamic"), load, None
        )
        is None
    )
    before = sglang_remap.TRANSLATIONS[0]
    int64_ids = ids.to(torch.int64)
    for _ in range(3):  # a new view of the same row each time: one translation
        view = SimpleNamespace(
            ep_dispatch_algorithm="static", partial_logical_to_rank_dispatch_physical_map=dispatch_LE[1, :]
        )
        got = sglang_remap.eplb_map_and_record_fused(int64_ids, view, load, None)
        assert got is not None and got.dtype == torch.int32
        assert torch.equal(got, dispatch_LE[1][ids.long()].to(torch.int32))
    assert sglang_remap.TRANSLATIONS[0] - before == 1
    dispatch_LE[1, :] = (dispatch_LE[1, :] + 1) % 10  # SGLang's update writes in place, then says so
    sglang_remap.placement_changed()
    got = sglang_remap.eplb_map_and_record_fused(ids, info, load, None)
    assert got is not None and torch.equal(got, dispatch_LE[1][ids.long()].to(torch.int32))
    assert sglang_remap.TRANSLATIONS[0] - before == 2
    assert int(load.sum()) == 4 * ids.numel()


def test_entry_points_are_installed_and_load_without_the_engines() -> None:
    groups = {"vllm.general_plugins": "eplb.integrations.vllm:register",
              "sglang.srt.plugins": "eplb.integrations.sglang:register"}  # fmt: skip
    for group, value in groups.items():
        (ep,) = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == "eplb"]
        assert ep.value == value and callable(ep.load())


def test_vllm_register_is_inert_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from eplb.integrations import vllm

    monkeypatch.delenv(vllm.POLICY_ENV, raising=False)
    vllm.register()  # would import vLLM (absent here) if it did anything
