"""The dispatch modes: how each token picks one replica of its logical expert.

One table for ``--ep-dispatch-algorithm``, the remap kernel's modes and the simulator's. A mode may
exist only on the device path (``dynamic_row``, a rank-invariant variant of ``dynamic``) or be
offered as a flag; each says whether it needs the rebalancer's per-replica weights. ``auto`` picks
``lp`` or ``static`` per pass (eplb.policy.auto_dispatch); the rebalancer plans it for static's maps,
which most passes run (the ``lp`` rule balances about as well on a plan packed for them: on
deepseek-v3's first 16 layers, 0.859 held-out prefill balancedness against 0.861 on an ``lp`` plan).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DispatchMode:
    """One way of choosing a replica."""

    name: str
    """The name users pass (``--ep-dispatch-algorithm NAME``, ``remap_and_record(mode=NAME)``)."""
    summary: str
    """One line for ``--help`` and docs."""
    needs_weights: bool = False
    """Reads per-replica dispatch weights [L, E, R] that the rebalancer fits."""
    static_maps: bool = False
    """Each rank sends an expert's tokens to the one replica its static map picks, so a replica
    receives the fraction of ranks mapped to it: the solver scores plans with those shares."""
    collective: bool = False
    """Exchanges this batch's counts over the EP group on every call (every rank must call, an
    idle one with T = 0 too); plans are scored with the per-batch split."""
    per_pass: tuple[str, ...] = ()
    """The modes it picks from, pass by pass, alike on every rank (empty: always itself); on a pass
    it runs ``lp``, every rank calls, as for ``lp``."""
    flag: bool = True
    """Offered as ``--ep-dispatch-algorithm`` (False: a device-path variant only)."""


DISPATCH_MODES: dict[str, DispatchMode] = {
    mode.name: mode
    for mode in (
        DispatchMode(
            name="static",
            summary="a fixed replica per (rank, expert): same GPU, else same node",
            static_maps=True,
        ),
        DispatchMode(name="dynamic", summary="a uniformly random replica per token"),
        DispatchMode(
            name="dynamic_row",
            summary="a replica hashed from the token row (the same on every rank)",
            flag=False,
        ),
        DispatchMode(name="fake", summary="uniformly random experts (benchmarking only)"),
        DispatchMode(
            name="weighted",
            summary="a replica drawn by the rebalancer's per-replica weights",
            needs_weights=True,
        ),
        DispatchMode(
            name="lp",
            summary="this batch's tokens of each replicated expert water-filled over its GPUs "
            "(counts all-gathered over the EP group per layer)",
            collective=True,
        ),
        DispatchMode(
            name="auto",
            summary="lp on the passes where its modeled gain exceeds its kernels' cost, static on "
            "the others (--eplb-dispatch-cost)",
            static_maps=True,
            per_pass=("static", "lp"),
        ),
    )
}
"""name -> mode; insertion order is the order shown to users."""


def dispatch_mode_names(*, flags_only: bool = False) -> tuple[str, ...]:
    """Every mode name, or only those offered as ``--ep-dispatch-algorithm``."""
    return tuple(name for name, mode in DISPATCH_MODES.items() if mode.flag or not flags_only)


def dispatch_mode(name: str) -> DispatchMode:
    """The mode ``name``; ValueError listing the choices for an unknown one."""
    mode = DISPATCH_MODES.get(name)
    if mode is None:
        raise ValueError(f"unknown dispatch mode {name!r}; choose from {dispatch_mode_names()}")
    return mode
