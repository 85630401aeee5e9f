"""After a rank is lost: the survivors form a group of their own, agree on the degraded plan and
reload what only the lost ranks held (docs/architecture.md, "Surviving a lost rank").

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs (ranks),
S slots per GPU.

:func:`regroup` is what every survivor runs, in the same order, on inputs they agree on:

1. The members (eplb.manager.rendezvous): who serves on, decided once in the store.
2. Checks every member makes on the same arrivals, so all refuse alike: one placement, as many
   process groups, room for every logical expert in the survivors' slots, an engine that can
   serve on another group, a source for every expert only the lost ranks held.
3. A process group over the members (``new_group(ranks, use_local_synchronization=True)``: only
   the members meet in the store, so it forms after a member died), with its control group and
   liveness watch. Member i is the i-th lowest surviving global rank and keeps its slots: the
   survivors' slot ``i * S + s`` is its slot ``s``.
4. The window: every member's counts of the passes all of them recorded, summed over the members.
5. The degraded plan: eplb.solver.solve with ``alive_ranks`` (no wall-clock budget; the members
   check they computed the same), and the repaired placement it starts from
   (eplb.solver.degraded.survivors), in which each lost expert took one slot of an expert that
   keeps another replica.
6. The reloads into those slots, from a host copy (the keeper's, sent point to point, or this
   rank's own) or the caller's loader. They land in temporaries; only once every member agrees
   that all arrived are the slots written, so a failed reload leaves every slot as it was.

The slots then hold the repaired placement; the manager serves on it and moves on to the plan
by a hot-swap on the survivors' own swap group.
"""

from __future__ import annotations

import datetime
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from eplb.manager.backup import ExpertLoader, HostBackup, Move, SlotsOf, checked_weights, move_experts
from eplb.manager.collectives import RankAgreement
from eplb.manager.liveness import Liveness, RankLost
from eplb.manager.rendezvous import Arrival, Loss, Members, RankLossError, rendezvous
from eplb.placement.degraded import orphans, survivors_phy2log
from eplb.placement.model import Placement
from eplb.recorder.buffers import PassInfo

if TYPE_CHECKING:
    from eplb.solver.types import Plan, SolveOptions

__all__ = [
    "RankLossError",
    "RecoveryRecord",
    "RecoverySetup",
    "Regrouped",
    "Reload",
    "Survivors",
    "regroup",
    "reload_plan",
]

log = logging.getLogger("eplb.manager.recovery")


@dataclass(frozen=True, kw_only=True)
class RecoveryRecord:
    """One recovery from a lost rank, the same on every member (``seconds``: this rank's clock)."""

    at_pass: int
    lost: tuple[int, ...]
    """Global ranks left out."""
    ranks: tuple[int, ...]
    """Global ranks serving on, ascending (member i is rank i of the survivors' group)."""
    accounted: bool
    """Every rank was accounted for when the members were decided (False: at the deadline)."""
    seconds: float
    reloads: int
    """(layer, expert) pairs reloaded: those whose every replica was on a lost rank."""
    reload_source: str
    """host (a host copy) | loader (the caller's) | none (nothing to reload)."""
    survivor_copies: int
    """Expert copies between survivors the plan moved beyond the repair (0 when not rebalanced)."""
    bytes_reloaded: int
    bytes_moved: int
    rebalanced: bool
    """The plan went beyond the repair and its hot-swap committed."""
    reason: str
    balancedness_before: float
    """The agreed window's balancedness on the repaired placement (as this server dispatches)."""
    balancedness_after: float
    """... on the placement served after the recovery."""
    solve_seconds: float


@dataclass(frozen=True)
class Reload:
    """One lost expert's reload into the survivors' slot ``slot`` (on member ``slot // S``)."""

    layer: int
    expert: int
    slot: int
    dest: int
    """Member index of the rank receiving it."""
    source: int | None
    """Member index of the keeper sending its host copy (``dest``: its own copy); None: the
    caller's loader, on ``dest``."""


@dataclass(frozen=True, kw_only=True)
class RecoverySetup:
    """What every recovery of one manager takes, the same for the manager's life."""

    device: torch.device
    """Where the collectives' tensors of the survivors' data group live (the manager's device)."""
    timeout_s: float
    """The longest the survivors wait for each other, and the timeout of their new group."""
    lost_after_s: float
    """A heartbeat that stands still this long while a rank waits: its rank is gone."""
    num_groups: int
    """Expert groups of the model (the degraded plan's topology)."""
    backup: HostBackup | None
    """This rank's host copies (``--eplb-host-backup``), or None."""
    loader: ExpertLoader | None
    """The caller's loader of one expert's weights, or None."""
    slots_of: SlotsOf
    """This rank's slot buffers of a layer (the engine's)."""


@dataclass(frozen=True, kw_only=True)
class Survivors:
    """Step 3's group over the members, and this rank's place in it."""

    ranks: tuple[int, ...]
    """The members' global ranks, ascending (member i is rank i of ``group``)."""
    rank: int
    """This rank's index among the members (its rank in ``group``)."""
    group: dist.ProcessGroup
    """The members' process group (the serving group from now on)."""
    agree: RankAgreement
    """Its collectives, watched by ``liveness``."""
    liveness: Liveness
    """Its heartbeat watch: a member lost during the recovery raises RankLost."""


@dataclass
class Regrouped:
    """What :func:`regroup` leaves: the survivors' group, their plan, and the slots repaired."""

    members: Members
    survivors: Survivors
    """Their group, and this rank's place in it."""
    alive_G: np.ndarray
    """bool [G]: the old group's ranks that serve on."""
    load_WLE: np.ndarray
    plan: Plan
    repaired: Placement
    reloads: list[Reload]


def placement_digest(placement: Placement) -> int:
    return zlib.crc32(np.ascontiguousarray(placement.phy2log_LP, dtype=np.int32).tobytes())


def window_span(infos: Sequence[PassInfo], counted: int) -> tuple[int, int]:
    """[first, end) counted-pass ids of a recorder's window (``(counted, counted)`` when empty)."""
    return (infos[0].pass_id, infos[-1].pass_id + 1) if infos else (counted, counted)


def reload_plan(
    current: Placement,
    repaired_LP: np.ndarray,
    alive_G: np.ndarray,
    *,
    keepers_of: Mapping[tuple[int, int], tuple[int, ...]] | None,
    ranks: Sequence[int],
    has_loader: bool,
) -> list[Reload]:
    """The reloads that turn the survivors' part of ``current`` into ``repaired_LP`` [L, P'].

    Every slot the repair changed gets an expert no survivor held. Its source: a keeper of its
    host copy among the members (the receiving rank itself first, else the lowest), else the
    loader. ``keepers_of``: global ranks keeping each lost (layer, expert) (None: no host copy);
    ``ranks``: the members' global ranks. RankLossError when an expert has no source.
    """
    S = current.slots_per_gpu
    live_LP = survivors_phy2log(current, alive_G)
    held_LE = np.zeros((current.num_layers, current.num_logical), dtype=bool)
    np.put_along_axis(held_LE, live_LP.astype(np.int64), True, axis=1)
    out = []
    for layer, slot in zip(*np.nonzero(live_LP != repaired_LP), strict=True):
        expert = int(repaired_LP[layer, slot])
        assert not held_LE[layer, expert], "the repair gives changed slots to lost experts only"
        dest = int(slot) // S
        keeping = [] if keepers_of is None else [r for r in keepers_of[(int(layer), expert)] if r in ranks]
        members = [ranks.index(r) for r in keeping]
        if dest in members:
            source: int | None = dest
        elif members:
            source = min(members)
        elif has_loader:
            source = None
        else:
            what = "and its host copies were" if keepers_of is not None else "was"
            raise RankLossError(
                f"expert {expert} of layer {layer}: every replica {what} on lost rank(s), and there is "
                "nothing to reload it from: pass the manager a loader, or run with --eplb-host-backup"
            )
        out.append(Reload(int(layer), expert, int(slot), dest, source))
    return out


def check_arrivals(members: Members, current: Placement) -> None:
    """The checks every member makes on the same arrivals (RankLossError, alike on all)."""
    arrivals = list(members.arrivals.values())
    if len({a.placement for a in arrivals}) > 1:
        raise RankLossError("the survivors hold different placements: they cannot plan together")
    if len({a.groups for a in arrivals}) > 1:
        raise RankLossError(
            "the survivors hold different numbers of process groups, so a group over them would get "
            "a different name on each"
        )
    if not all(a.can_regroup for a in arrivals):
        raise RankLossError(
            "the engine cannot serve on the survivors' group: give it a set_world(world) method "
            "(eplb.manager.types.ExpertEngine)"
        )
    S, E = current.slots_per_gpu, current.num_logical
    if len(members.ranks) * S < E:
        raise RankLossError(
            f"{len(members.ranks)} surviving rank(s) hold {len(members.ranks) * S} slots ({S} each), fewer "
            f"than the {E} logical experts: every expert cannot be served"
        )


def regroup(
    setup: RecoverySetup,
    loss: Loss,
    *,
    old_group: dist.ProcessGroup | None,
    current: Placement,
    window: tuple[Sequence[PassInfo], np.ndarray],
    to_logical: Callable[[np.ndarray, list[int]], np.ndarray],
    base_options: SolveOptions,
) -> Regrouped:
    """Steps 1-6 on this rank (see the module's doc); collective over the survivors.

    ``old_group``: the group that lost a rank (``loss.world`` its global ranks); ``window``:
    this rank's recorder window (its passes and slot counts); ``to_logical``: the recorder's
    conversion of slot counts to expert counts. RankLossError, alike on every member, when they
    cannot serve on together.
    """
    from eplb.hotswap.heartbeat import group_store, root_store

    store = group_store(old_group)
    members = rendezvous(
        store, root_store(store), loss, timeout_s=setup.timeout_s, lost_after_s=setup.lost_after_s
    )
    check_arrivals(members, current)
    alive_G = np.isin(np.asarray(loss.world), members.ranks)
    keepers_of = None
    backup = setup.backup
    if backup is not None:
        keepers_of = {
            (layer, e): backup.keepers(layer, e) for layer, e in np.argwhere(orphans(current, alive_G))
        }
    has_loader = all(a.loader for a in members.arrivals.values())
    survivors = _survivors_group(old_group, members, loss.me, setup)
    agree = survivors.agree
    try:
        infos, phys_FLP = window
        load_WLE = agreed_window(
            infos, phys_FLP, to_logical, members.arrivals, agree, (current.num_layers, current.num_logical)
        )
        options = degraded_options(base_options, alive_G, backup is not None)
        plan, repaired = degraded_plan(load_WLE, current, options, setup.num_groups)
        same = agree.same(placement_digest(plan.placement), placement_digest(repaired))
    except RankLost as exc:
        raise RankLossError(f"a rank was lost while the survivors agreed on their plan: {exc}") from exc
    if not all(same):
        raise RankLossError("the survivors computed different degraded plans from the same inputs")
    reloads = reload_plan(
        current,
        repaired.phy2log_LP,
        alive_G,
        keepers_of=keepers_of,
        ranks=members.ranks,
        has_loader=has_loader,
    )
    run_reloads(reloads, survivors, setup, current.slots_per_gpu)
    return Regrouped(members, survivors, alive_G, load_WLE, plan, repaired, reloads)


def _survivors_group(
    old_group: dist.ProcessGroup | None, members: Members, me: int, setup: RecoverySetup
) -> Survivors:
    """Step 3: the members' group (collective over them), its agreement and its liveness watch."""
    backend = str(dist.get_backend(old_group))
    if "nccl" in backend:  # free the stream a collective with the lost peer may hold
        pg = old_group if old_group is not None else dist.distributed_c10d._get_default_group()
        try:
            pg.abort()
        except Exception as exc:  # the survivors' group does not depend on it
            log.warning("rank %d: aborting the old serving group failed: %s", me, exc)
    try:
        group = dist.new_group(
            list(members.ranks),
            backend="nccl" if "nccl" in backend else "gloo",
            timeout=datetime.timedelta(seconds=setup.timeout_s),
            use_local_synchronization=True,
        )
    except RuntimeError as exc:  # a member lost meanwhile, or the store gone (DistError is one)
        raise RankLossError(f"the survivors could not form their group: {type(exc).__name__}: {exc}") from exc
    rank = members.ranks.index(me)
    liveness = Liveness(group, members.ranks, rank, setup.lost_after_s)
    agree = RankAgreement.create(group, len(members.ranks), setup.device, liveness)
    return Survivors(ranks=members.ranks, rank=rank, group=group, agree=agree, liveness=liveness)


def agreed_window(
    infos: Sequence[PassInfo],
    phys_FLP: np.ndarray,
    to_logical: Callable[[np.ndarray, list[int]], np.ndarray],
    arrivals: Mapping[int, Arrival],
    agree: RankAgreement,
    shape_LE: tuple[int, int],
) -> np.ndarray:
    """float64 [W, L, E]: the passes every member's window holds, summed over the members (one
    all-reduce; each member fills the rows by pass id, so the shapes agree whatever it holds)."""
    first = max(a.window[0] for a in arrivals.values())
    end = min(a.window[1] for a in arrivals.values())
    if end <= first:
        return np.ones((1, *shape_LE))  # no pass in common: plan for an even load
    rows = [f for f, info in enumerate(infos) if first <= info.pass_id < end]
    local_FLE = np.zeros((end - first, *shape_LE), dtype=np.int64)
    if rows:
        got = to_logical(phys_FLP[rows], [infos[f].map_version for f in rows])
        local_FLE[[infos[f].pass_id - first for f in rows]] = got
    summed = agree.sum(torch.from_numpy(local_FLE)).numpy()
    return summed.astype(np.float64)


def degraded_plan(
    load_WLE: np.ndarray, current: Placement, options: SolveOptions, num_groups: int
) -> tuple[Plan, Placement]:
    """Step 5: the degraded plan and the repaired placement it starts from (both compact: over
    the members' slots), planned and judged by eplb.policy.decision with ``options`` as given."""
    from eplb.policy.decision import RankLoss, Request, plan_and_judge
    from eplb.solver.planner import SolverPlanner
    from eplb.solver.types import Plan

    assert options.alive_ranks is not None, "a degraded plan names the ranks alive"
    request = Request(
        window_WLE=load_WLE,
        current=current,
        planner=SolverPlanner(options=options, num_groups=num_groups),
        loss=RankLoss(alive_G=np.asarray(options.alive_ranks, dtype=bool), prepared=False),
    )
    plan = plan_and_judge(request).plan
    assert isinstance(plan, Plan) and plan.repaired is not None, "eplb's solver repairs before it plans"
    return plan, plan.repaired


def degraded_options(base: SolveOptions, alive_G: np.ndarray, host_backup: bool) -> SolveOptions:
    """``base`` for the degraded plan: the ranks alive, where reloads come from, and no
    wall-clock budget (every member must compute the same plan)."""
    return replace(
        base,
        alive_ranks=tuple(bool(a) for a in alive_G),
        reload_source="host" if host_backup else "checkpoint",
        time_budget_s=None,
    )


def run_reloads(
    reloads: Sequence[Reload], survivors: Survivors, setup: RecoverySetup, slots_per_gpu: int
) -> None:
    """Step 6 on this rank: gather its reloads into temporaries, agree that every member's
    arrived, then write them into the slots (RankLossError on every member when one failed)."""
    rank, slots_of, backup, loader = survivors.rank, setup.slots_of, setup.backup, setup.loader
    moves: list[Move] = [
        (r.source, r.dest, (r.layer, r.expert, r.slot)) for r in reloads if r.source is not None
    ]

    def host_copy(key: tuple[int, int, int]) -> Mapping[str, torch.Tensor]:
        assert backup is not None, "a host copy's keeper has the backup"
        return backup.kept[(key[0], key[1])]

    failure = ""
    got: dict[tuple[int, int, int], Mapping[str, torch.Tensor]] = {}
    try:
        got.update(
            move_experts(
                moves,
                me=rank,
                ranks=survivors.ranks,
                group=survivors.group,
                read=host_copy,
                like=lambda key: slots_of(key[0]),
                liveness=survivors.liveness,
                what="reloading from the host copies",
            )
        )
    except RankLost as exc:
        raise RankLossError(f"a rank was lost while the survivors reloaded experts: {exc}") from exc
    for r in reloads:
        if r.dest != rank or (key := (r.layer, r.expert, r.slot)) in got:
            continue
        try:
            if r.source == rank:
                got[key] = host_copy(key)
            else:
                assert loader is not None, "reload_plan names the loader only when there is one"
                got[key] = checked_weights(
                    loader(r.layer, r.expert),
                    slots_of(r.layer),
                    f"reloading layer {r.layer} expert {r.expert}",
                )
        except Exception as exc:  # reported to every member below
            failure = failure or f"{type(exc).__name__}: {exc}"
    try:
        failed = survivors.agree.any(bool(failure))
    except RankLost as exc:
        raise RankLossError(f"a rank was lost while the survivors reloaded experts: {exc}") from exc
    if failed:
        raise RankLossError(
            f"reloading the lost experts failed ({failure or 'on another rank'}); no slot was written"
        )
    for r in reloads:
        if r.dest == rank:
            views = got[(r.layer, r.expert, r.slot)]
            for name, t in slots_of(r.layer).items():
                t[r.slot % slots_per_gpu].copy_(views[name])
