"""The adapters' metrics (eplb.integrations.engine_metrics) in process: what each rebalance reports,
against values recomputed here in plain numpy; nothing without a port."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from eplb.integrations.engine_env import read_engine_env
from eplb.integrations.engine_metrics import EngineMetrics
from eplb.integrations.engine_plan import EngineDecisions, make_planner
from eplb.metrics import names
from eplb.placement.model import Placement
from eplb.policy.base import Proposal
from eplb.solver.planner import SolverPlanner


def _balancedness(load_LE: np.ndarray, phy2log_LP: np.ndarray, G: int) -> float:
    E = load_LE.shape[1]
    replicas_LE = np.stack([np.bincount(row, minlength=E) for row in phy2log_LP])
    share_LP = np.take_along_axis(load_LE / replicas_LE, phy2log_LP, axis=1)
    gpu_LG = share_LP.reshape(load_LE.shape[0], G, -1).sum(axis=2)
    return float(np.mean(gpu_LG.mean(axis=1) / gpu_LG.max(axis=1)))


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_each_rebalance_is_reported_and_only_with_a_port() -> None:
    L, E, G, P = 3, 12, 4, 16
    settings = read_engine_env({"EPLB_REBALANCE_MODE": "continuous", "EPLB_METRICS_PORT": "0",
                                "EPLB_MODEL_NAME": "m"})  # fmt: skip
    metrics = EngineMetrics(settings, logging.getLogger("test"))
    try:
        decisions = EngineDecisions(num_gpus=G, num_nodes=1, num_layers=L, passes_per_rebalance=5, settings=settings,
                                    history_rows=10, metrics=metrics)  # fmt: skip
        planner = make_planner("auto", "flag", settings=settings)
        rng = np.random.default_rng(1)
        live = Placement.trivial(L, E, G, P - E)
        windows = [rng.poisson(50 * np.exp(rng.standard_normal((L, E))), size=(5, L, E)) for _ in range(3)]
        plans, befores = [], []
        for window in windows:
            befores.append(_balancedness(window.sum(axis=0).astype(float), live.phy2log_LP, G))
            plan = decisions.rebalance(window, num_physical=P, num_gpus=G, num_nodes=1, num_groups=1,
                                       planner=planner, current=live)  # fmt: skip
            plans.append(plan)
            live = plan.placement
        assert metrics.exporter is not None
        got = _samples(metrics.sink.render().decode())  # type: ignore[union-attr]
        const = (("engine", "0"), ("model_name", "m"))

        def value(name: str, **labels: str) -> float:
            return got[(name, tuple(sorted({**labels, **dict(const)}.items())))]

        assert sum(v for (n, _), v in got.items() if n == names.REBALANCES) == 3
        assert value(names.REBALANCES, outcome="applied", cause="applied") == sum(p.applied for p in plans)
        assert value(names.EXPERTS_MOVED) == sum(p.copies for p in plans)
        assert value(names.LAST_REBALANCE_BALANCEDNESS, when="before") == befores[-1]
        after = _balancedness(windows[-1].sum(axis=0).astype(float), plans[-1].placement.phy2log_LP, G)
        assert value(names.LAST_REBALANCE_BALANCEDNESS, when="after") == after
        # The last window was served by what the second rebalance left; it predicted this for it.
        assert plans[1].predicted is not None
        assert value(names.LAST_REBALANCE_BALANCEDNESS, when="predicted") == plans[1].predicted
        assert value(names.LAST_REBALANCE_BALANCEDNESS, when="realized") == befores[-1]
        assert value(names.MODEL_BALANCEDNESS) == befores[-1]
        assert value(names.MANAGER_PHASE, phase="idle") == 1.0
    finally:
        metrics.close()
    quiet = EngineMetrics(read_engine_env({}), logging.getLogger("test"))
    quiet.start()
    assert quiet.exporter is None


def test_an_applied_plan_is_counted_with_its_transfer_and_passes_are_counted() -> None:
    """With the engine's transfer hooked, an applied plan's rebalance is reported once the engine
    moved its last layer, with the seconds it was told (summed over the layers); a kept placement
    at once; a pending one before the next rebalance; every pass counted."""
    L, E, G, P = 3, 12, 4, 16
    settings = read_engine_env({"EPLB_METRICS_PORT": "0"})
    metrics = EngineMetrics(settings, logging.getLogger("test"), transfers_follow=True)
    try:
        decisions = EngineDecisions(num_gpus=G, num_nodes=1, num_layers=L, passes_per_rebalance=5, settings=settings,
                                    history_rows=5, metrics=metrics)  # fmt: skip
        planner, live = make_planner("auto", "flag", settings=settings), Placement.trivial(L, E, G, P - E)
        rng = np.random.default_rng(2)

        def sample(name: str, **labels: str) -> float:
            got = _samples(metrics.sink.render().decode())  # type: ignore[union-attr]
            return got[(name, tuple(sorted({**labels, "engine": "0", "model_name": "unknown"}.items())))]

        window = rng.poisson(50 * np.exp(2 * rng.standard_normal((L, E))), size=(5, L, E))
        plan = decisions.rebalance(window, num_physical=P, num_gpus=G, num_nodes=1, num_groups=1,
                                   planner=planner, current=live)  # fmt: skip
        assert plan.applied
        assert sample(names.REBALANCES, outcome="applied", cause="applied") == 0  # moving
        assert sample(names.MANAGER_PHASE, phase="applying") == 1.0
        for layer, seconds in enumerate((0.25, 0.5, 0.125)):
            metrics.transfer(seconds, layer=layer)
        assert sample(names.REBALANCES, outcome="applied", cause="applied") == 1
        assert sample(names.TRANSFER_SECONDS + "_sum") == 0.875
        assert sample(names.TRANSFER_SECONDS + "_count") == 1
        assert sample(names.MANAGER_PHASE, phase="idle") == 1.0
        # A plan whose transfer never ends is counted at the next rebalance, with what was moved.
        second = decisions.rebalance(window[:, :, ::-1], num_physical=P, num_gpus=G, num_nodes=1,
                                     num_groups=1, planner=planner, current=plan.placement)  # fmt: skip
        assert second.applied
        metrics.transfer(0.5, last=False)
        third = decisions.rebalance(window, num_physical=P, num_gpus=G, num_nodes=1, num_groups=1,
                                    planner=planner, current=second.placement)  # fmt: skip
        total = sum(v for (n, _), v in _samples(metrics.sink.render().decode()).items()  # type: ignore[union-attr]
                    if n == names.REBALANCES)  # fmt: skip
        assert total == 2 + (0 if third.applied else 1)  # an applied third one is moving
        assert sample(names.TRANSFER_SECONDS + "_sum") == 0.875 + 0.5
        for recorded in (True, False, True):
            metrics.forward_pass(kind="decode", recorded=recorded)
        assert sample(names.FORWARD_PASSES, kind="decode", recorded="true") == 2
        assert sample(names.FORWARD_PASSES, kind="decode", recorded="false") == 1
    finally:
        metrics.close()


def test_an_exporter_that_cannot_bind_is_logged_not_raised(caplog: Any) -> None:
    import socket

    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        settings = read_engine_env({"EPLB_METRICS_PORT": str(busy.getsockname()[1])})
        metrics = EngineMetrics(settings, logging.getLogger("test"))
        metrics.start()
        metrics.forward_pass(kind="decode", recorded=True)  # a no-op, no error
    assert metrics.exporter is None and "no metrics" in caplog.text


@dataclasses.dataclass(frozen=True, kw_only=True)
class _WrongShapePlanner(SolverPlanner):
    """The solver's planner, but its plans carry one more GPU's worth of slots than the model."""

    def __call__(self, window_WLE: np.ndarray, current: Placement, history: Any = None) -> Any:
        L, E, G = current.num_layers, current.num_logical, current.num_gpus
        return Proposal(Placement.trivial(L, E, G, num_redundant=current.num_physical - E + G), apply=True)


def test_a_plan_of_the_wrong_shape_is_counted_as_failed_shape_and_the_placement_kept() -> None:
    L, E, G, P = 2, 8, 4, 12
    settings = read_engine_env({"EPLB_METRICS_PORT": "0", "EPLB_MODEL_NAME": "m"})
    metrics = EngineMetrics(settings, logging.getLogger("test"))
    try:
        decisions = EngineDecisions(num_gpus=G, num_nodes=1, num_layers=L, passes_per_rebalance=5, settings=settings,
                                    history_rows=10, metrics=metrics)  # fmt: skip
        planner = _WrongShapePlanner(options=make_planner("auto", "flag", settings=settings).options)
        live = Placement.trivial(L, E, G, P - E)
        window = np.random.default_rng(3).poisson(40.0, size=(5, L, E))
        plan = decisions.rebalance(window, num_physical=P, num_gpus=G, num_nodes=1, num_groups=1,
                                   planner=planner, current=live)  # fmt: skip
        assert (plan.applied, plan.failed, plan.placement) == (False, True, live)
        assert plan.reason.startswith("shape")
        got = _samples(metrics.sink.render().decode())  # type: ignore[union-attr]
        labels = (("cause", "failed_shape"), ("engine", "0"), ("model_name", "m"), ("outcome", "failed"))
        assert got[(names.REBALANCES, labels)] == 1.0
        assert sum(v for (n, _), v in got.items() if n == names.REBALANCES) == 1
    finally:
        metrics.close()
