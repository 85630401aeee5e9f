"""Hot-swap fault scenarios on real ranks (tests/test_hotswap_faults*.py): one swap per case on a new
group, a fault on one rank, and what every rank ended with, per layer, against references.

Each case's outcome also goes to the store (``test/<case>/result/<rank>``), so a rank that dies in
a later case has reported the earlier ones; the faulting rank stamps ``test/<case>/fault_at``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import torch

from eplb.moe.spawn import RankContext

TIMEOUT_S = 2.0
STALL_S = TIMEOUT_S + 1.5


def setup(G: int, seed: int) -> tuple[Any, Any, Any, Any]:
    from eplb.moe.model import MoEModelConfig, logical_weights
    from eplb.placement.model import Placement
    from tests.helpers.placements import random_phy2log

    cfg = MoEModelConfig(num_layers=3, num_experts=8, top_k=2, hidden=16, intermediate=8)
    slots = G * (-(-cfg.num_experts // G) + 2)  # two spare slots per GPU, any G
    old = Placement.trivial(cfg.num_layers, cfg.num_experts, G, num_redundant=slots - cfg.num_experts)
    rng = np.random.default_rng(seed)
    p2l = random_phy2log(rng, cfg.num_layers, cfg.num_experts, old.num_physical)
    new = Placement.from_phy2log(p2l, G, max_replicas=old.max_replicas)
    return cfg, logical_weights(cfg), old, new


def run_case(ctx: RankContext, case: dict[str, Any]) -> dict[str, Any] | None:
    """One hot-swap on a new group of ``case["members"]`` (global ranks) with ``case``'s fault on
    its rank ``case["rank"]``; what this rank ended with (None: not a member)."""
    import torch.distributed as dist

    from eplb.hotswap.control import group_store, root_store
    from eplb.hotswap.swap import HotSwapError, HotSwapOptions, hot_swap
    from eplb.moe.model import MoEModel
    from eplb.placement.model import Placement

    members = case.get("members", list(range(ctx.world_size)))
    if ctx.rank not in members:
        return None
    G, me, kind = len(members), members.index(ctx.rank), case["kind"]
    group = dist.new_group(members, backend="gloo", use_local_synchronization=True)
    cfg, w, old, new = setup(G, case["seed"])
    model = MoEModel(cfg, old, rank=me, device=ctx.device, weights=w, group=group, remap_backend="torch")
    mine = me == case["rank"]
    store = root_store(group_store(None))

    def fire() -> None:
        store.set(f"test/{case['name']}/fault_at", str(time.time()))
        if kind == "exit":
            os._exit(1)
        if kind == "stall":
            time.sleep(STALL_S)
        if kind in ("interrupt", "maps_interrupt"):
            raise KeyboardInterrupt
        if kind == "maps_error":
            raise RuntimeError("maps injected")

    def fault(stage: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if mine and stage == case.get("stage") and chunk == case.get("chunk", -1):
            fire()

    def update_maps() -> None:
        model.set_placement(new)
        if mine and kind in ("maps_error", "maps_interrupt"):
            fire()

    target = new
    if mine and kind == "shape":  # this rank alone gets a placement with fewer slots
        store.set(f"test/{case['name']}/fault_at", str(time.time()))
        target = Placement.trivial(cfg.num_layers, cfg.num_experts, G, num_redundant=G)
    per_expert = sum(t[0].numel() * t.element_size() for t in model.slots_L[0].values())
    options = HotSwapOptions(staging_budget_bytes=per_expert, timeout_s=TIMEOUT_S)  # many chunks
    out: dict[str, Any] = {"rank": me}
    try:
        res = hot_swap(
            model.slots_L,
            old,
            target,
            group=group,
            options=options,
            update_maps=update_maps,
            restore_maps=lambda: model.set_placement(old),
            fault=fault,
        )
        out.update(
            type="result", ok=res.ok, cause=res.cause, blamed=res.rank, error=res.error, chunks=res.chunks
        )
    except HotSwapError as exc:
        out.update(
            type="HotSwapError", cause=exc.cause, blamed=exc.rank, error=str(exc), committed=exc.committed
        )
    except (ValueError, KeyboardInterrupt) as exc:  # HotSwapShapeError carries its cause and rank
        out.update(
            type=type(exc).__name__,
            error=str(exc),
            cause=getattr(exc, "cause", None),
            blamed=getattr(exc, "rank", None),
        )
    out["ended_at"] = time.time()
    out["layers"] = layer_states(model, w, old, new, me)
    if case.get("then_swap"):  # the group is still usable: a clean swap on it works
        res = hot_swap(
            model.slots_L,
            old,
            new,
            group=group,
            options=options,
            update_maps=lambda: model.set_placement(new),
        )
        out["then_ok"] = res.ok and all(s == NEW for s in layer_states(model, w, old, new, me))
    # For the caller, should this rank die in a later case.
    store.set(f"test/{case['name']}/result/{me}", json.dumps(out))
    return out


def group_timeout_s(group: Any) -> float:
    """The timeout a Gloo process group was made with."""
    return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())


def layer_states(
    model: Any, w: dict[str, torch.Tensor], old: Any, new: Any, rank: int
) -> list[tuple[bool, ...]]:
    """Per layer: (weights are old, weights are new, maps are old, maps are new), against references."""
    from eplb.remap.tables import DispatchTables

    S = old.slots_per_gpu
    refs = [DispatchTables.from_placement(p, rank) for p in (old, new)]
    out = []
    for layer in range(old.num_layers):
        weights = []
        for p in (old, new):
            ids = torch.from_numpy(p.phy2log_LP[layer, rank * S : (rank + 1) * S].astype(np.int64))
            weights.append(all(torch.equal(model.slots_L[layer][k], w[k][layer][ids]) for k in ("w13", "w2")))
        maps = [
            all(
                torch.equal(getattr(model.tables, f)[layer], getattr(ref, f)[layer])
                for f in ("static_LE", "log2phy_LER", "logcnt_LE")
            )
            for ref in refs
        ]
        out.append((*weights, *maps))
    return out


def run_cases(ctx: RankContext, cases: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    return [run_case(ctx, case) for case in cases]


OLD, NEW = (True, False, True, False), (False, True, False, True)


def check(case: dict[str, Any], outs: list[dict[str, Any] | None], fault_at: float, expect: str) -> None:
    """Every survivor: each layer old/old or new/new (all ``expect``), same outcome, noticed in time."""
    survivors = [o for o in outs if o is not None]
    assert len(survivors) == len(outs) - (case["kind"] == "exit")  # only the rank that exits is gone
    for o in survivors:
        for state in o["layers"]:
            assert state in (OLD, NEW), (case["name"], o["rank"], o["layers"])  # never mixed
        assert all(s == (OLD if expect == "old" else NEW) for s in o["layers"]), (case["name"], o)
        if not (case["kind"] == "stall" and o["rank"] == case["rank"]):  # the late rank is late
            assert o["ended_at"] - fault_at <= TIMEOUT_S + 1.0, (
                case["name"],
                o["rank"],
                o["ended_at"] - fault_at,
            )


def reported(server: Any, case: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """What group rank ``rank`` reported for ``case`` (None: it did not live to report)."""
    key = f"test/{case['name']}/result/{rank}"
    if not server.check([key]):
        return None
    out = json.loads(server.get(key))
    out["layers"] = [tuple(x) for x in out["layers"]]
    return out


def fault_time(server: Any, name: str) -> float:
    key = f"test/{name}/fault_at"
    assert server.check([key]), f"the fault of {name} never fired"
    return float(server.get(key))


def outcome(o: dict[str, Any]) -> tuple[Any, ...]:
    return (o["type"], o.get("cause"), o.get("blamed"))
