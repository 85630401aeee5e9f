"""The adapters' ``EPLB_*`` variables: parsed and checked at plugin registration, a bad value stops
the engine there naming the variable (in this process, and through vLLM's and SGLang's own loaders,
where SGLang's loader swallows a plugin's ``Exception``), and the continuous mode's decisions are
eplb.config's and eplb.policy.decision's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eplb.config import CONTINUOUS_MAX_MOVED_EXPERTS, SHIFT_BURST
from eplb.integrations import engine_env
from eplb.integrations.engine_env import (
    INITIAL_FULL_PLAN_ENV,
    MAX_MOVED_ENV,
    METRICS_ENGINE_ENV,
    METRICS_PORT_ENV,
    MODE_ENV,
    MODEL_NAME_ENV,
    SHIFT_BURST_ENV,
    SOLVER_OPTIONS_ENV,
    WINDOW_PASSES_ENV,
    read_engine_env,
)
from eplb.integrations.engine_plan import CONTINUOUS_COPY_COST, EngineDecisions, make_planner
from eplb.placement.model import Placement
from eplb.policy.decision import MoveAllowance

ROOT = Path(__file__).resolve().parents[1]

BAD_SHARED = [
    (MODE_ENV, "sometimes"),
    (MAX_MOVED_ENV, "-3"),
    (MAX_MOVED_ENV, "many"),
    (SHIFT_BURST_ENV, "0"),
    (INITIAL_FULL_PLAN_ENV, "perhaps"),
    (WINDOW_PASSES_ENV, "0"),
    (SOLVER_OPTIONS_ENV, '{"bogus": 1}'),
    (SOLVER_OPTIONS_ENV, '{"copy_cost": -1}'),
    (SOLVER_OPTIONS_ENV, "[1]"),
    (METRICS_PORT_ENV, "70000"),
    (METRICS_PORT_ENV, "http"),
    (MODEL_NAME_ENV, "a\x01b"),
    (METRICS_ENGINE_ENV, "x" * 300),
]


def test_defaults_are_periodic_and_the_mode_takes_eplb_configs_defaults() -> None:
    periodic = read_engine_env({})
    assert not periodic.continuous and periodic.metrics_port is None
    config = periodic.decision_config(num_gpus=8, num_nodes=3, interval=40, num_layers=6)
    assert config.rebalance_interval == 40 and config.nnodes == 1 and config.max_moved_experts is None
    continuous = read_engine_env({MODE_ENV: "Continuous"})
    config = continuous.decision_config(num_gpus=32, num_nodes=4, interval=50, num_layers=58)
    assert config.continuous and config.nnodes == 4
    assert config.max_moved_experts == CONTINUOUS_MAX_MOVED_EXPERTS and config.eplb_shift_burst == SHIFT_BURST
    # The default budget per layer: a 6-layer model's is 160 * 6 / 58, rounded.
    assert (
        continuous.decision_config(num_gpus=32, num_nodes=4, interval=50, num_layers=6).max_moved_experts
        == 17
    )
    assert config.initial_full_plan
    given = read_engine_env(
        {MODE_ENV: "continuous", MAX_MOVED_ENV: "12", SHIFT_BURST_ENV: "3", INITIAL_FULL_PLAN_ENV: "off",
         METRICS_PORT_ENV: "0", MODEL_NAME_ENV: "m/x"}
    )  # fmt: skip
    config = given.decision_config(num_gpus=4, num_nodes=1, interval=50, num_layers=6)
    assert (config.max_moved_experts, config.eplb_shift_burst, config.initial_full_plan) == (12, 3, False)
    assert given.metrics_port == 0 and given.model_name == "m/x"


@pytest.mark.parametrize(("var", "value"), BAD_SHARED, ids=[f"{v}={x[:12]!r}" for v, x in BAD_SHARED])
def test_bad_values_name_their_variable(var: str, value: str) -> None:
    with pytest.raises(ValueError, match=var):
        read_engine_env({var: value})


def test_unknown_variables_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    read_engine_env({"EPLB_REBALANCE_MOD": "continuous", "EPLB_ENGINES_DIR": "/x"})
    assert "EPLB_REBALANCE_MOD" in caplog.text and "EPLB_ENGINES_DIR" not in caplog.text


def test_continuous_planner_is_priced_and_options_override() -> None:
    continuous = read_engine_env({MODE_ENV: "continuous"})
    assert make_planner("auto", "flag", settings=continuous).options.copy_cost == CONTINUOUS_COPY_COST
    assert make_planner("auto", "flag", settings=read_engine_env({})).options.copy_cost == 0.0
    given = read_engine_env({MODE_ENV: "continuous", SOLVER_OPTIONS_ENV: '{"copy_cost": 0.01}'})
    assert make_planner("auto", "flag", settings=given).options.copy_cost == 0.01


def test_register_stops_on_bad_values_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from eplb.integrations import sglang, vllm

    for var in [k for k in os.environ if k.startswith("EPLB_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv(SOLVER_OPTIONS_ENV, '{"bogus": 1}')
    with pytest.raises(SystemExit, match=SOLVER_OPTIONS_ENV):
        sglang.register()  # checked before SGLang (absent here) is imported
    monkeypatch.setenv(vllm.POLICY_ENV, "1")
    with pytest.raises(ValueError, match=SOLVER_OPTIONS_ENV):
        vllm.register()
    monkeypatch.delenv(SOLVER_OPTIONS_ENV)
    monkeypatch.setenv("EPLB_SGLANG_REMAP_BACKEND", "magic")
    with pytest.raises(SystemExit, match="EPLB_SGLANG_REMAP_BACKEND"):
        sglang.register()  # not skipped although the fused replacement is off
    monkeypatch.delenv("EPLB_SGLANG_REMAP_BACKEND")
    monkeypatch.setenv("EPLB_SGLANG_FUSED_REMAP", "maybe")
    with pytest.raises(SystemExit, match="EPLB_SGLANG_FUSED_REMAP"):
        sglang.register()
    monkeypatch.delenv(vllm.POLICY_ENV)
    monkeypatch.setenv(MODE_ENV, "continuous")
    with pytest.raises(ValueError, match="EPLB_VLLM_POLICY"):
        vllm.register()  # continuous mode asked for with the policy off


def _copies(old: Placement, new: Placement) -> int:
    """Arrivals of an expert on a GPU that did not hold it (plain numpy)."""
    held = []
    for p in (old, new):
        on_LGE = np.zeros((p.num_layers, p.num_gpus, p.num_logical), dtype=bool)
        gpu_P = np.arange(p.num_physical) // p.slots_per_gpu
        for layer in range(p.num_layers):
            on_LGE[layer, gpu_P, p.phy2log_LP[layer]] = True
        held.append(on_LGE)
    return int((held[1] & ~held[0]).sum())


def test_continuous_decisions_keep_history_budget_and_agree() -> None:
    """Two processes' decisions fed the same drifting windows plan the same; after the unbudgeted
    first plan every plan stays within the allowance (a MoveAllowance replayed on the copies the
    maps show: never over its budget or its shift budget); the history holds the last rows."""
    settings = read_engine_env({MODE_ENV: "continuous", MAX_MOVED_ENV: "6", SHIFT_BURST_ENV: "2"})
    rng = np.random.default_rng(3)
    L, E, G, P = 3, 16, 4, 20
    base_LE = rng.standard_normal((L, E))
    runs = []
    for _ in range(2):
        decisions = EngineDecisions(num_gpus=G, num_nodes=1, num_layers=L, passes_per_rebalance=10, settings=settings,
                                    history_rows=30)  # fmt: skip
        planner = make_planner("auto", "flag", settings=settings)
        live: Placement | None = Placement.trivial(L, E, G, P - E)
        rng = np.random.default_rng(3)
        plans = []
        for step in range(12):
            drift_LE = (
                base_LE
                + 0.15 * step * rng.standard_normal((L, E))
                + (1.5 if step == 6 else 0) * rng.standard_normal((L, E))
            )
            window = rng.poisson(200 * np.exp(drift_LE), size=(10, L, E))
            plan = decisions.rebalance(window, num_physical=P, num_gpus=G, num_nodes=1, num_groups=1,
                                       planner=planner, current=live)  # fmt: skip
            assert decisions.kept_rows == min(10 * (step + 1), 30)
            plans.append((plan.applied, plan.copies, plan.placement.phy2log_LP.tolist()))
            assert live is not None
            assert plan.copies == (_copies(live, plan.placement) if plan.applied else 0)
            live = plan.placement
        runs.append(plans)
    assert runs[0] == runs[1]
    allowance = MoveAllowance(6, 2)
    first = next(i for i, p in enumerate(runs[0]) if p[0])
    assert sum(p[0] for p in runs[0][first + 1 :]) >= 2
    for applied, copies, _ in runs[0][first + 1 :]:  # every rebalance after the first plan, skipped ones too
        assert copies <= max(allowance.budget(), allowance.shift_budget())
        allowance.record(copies if applied else 0)


def _loader_results(site: Path, engine: str, scenarios: list[dict[str, Any]]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "scenarios.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps(scenarios))
        cmd = [sys.executable, "-m", "tests.helpers.engine_settings", engine, str(spec), str(out)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and out.is_file(), done.stderr
        result: dict[str, Any] = json.loads(out.read_text())
    return result


def _table(engine: str) -> list[engine_env.EnvVar]:
    return [var for var in engine_env.ENV_VARS if engine in var.engines]


def _refused(var: engine_env.EnvVar, message: str) -> bool:
    """The message names the variable (and, for the solver options, the bad field)."""
    field = json.loads(var.bad).popitem()[0] if var.kind == "json" else ""
    return var.name in message and field in message


@pytest.mark.parametrize("engine", engine_env.ENGINES)
def test_every_variable_of_the_table_is_checked_whatever_else_is_on(engine: str) -> None:
    """Each variable an engine reads, alone with a bad value (nothing else on: no policy, no
    updater, no port), is refused naming it; the table's bad values are not vacuous (each engine's
    own variables are also refused by the other engine's check only if it reads them)."""
    for var in _table(engine):
        with pytest.raises(ValueError) as info:
            engine_env.check_engine_env(engine, {var.name: var.bad})
        assert _refused(var, str(info.value)), (var.name, str(info.value))
    good = {MODE_ENV: "continuous", METRICS_PORT_ENV: "0", engine_env.METRICS_HOST_ENV: "127.0.0.1"}
    assert engine_env.check_engine_env(engine, good).metrics_port == 0


def _busy_port() -> socket.socket:
    """A port something listens on (as an engine's own server would)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_the_metrics_endpoint_is_probed_at_start_up() -> None:
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"{METRICS_PORT_ENV}.*{port} is taken"):
            engine_env.check_engine_env("vllm", {METRICS_PORT_ENV: str(port)})
    for host in ("203.0.113.7", "no-such-host.invalid"):  # a TEST-NET address; a name that never resolves
        with pytest.raises(ValueError, match=engine_env.METRICS_HOST_ENV):
            engine_env.check_engine_env("sglang", {engine_env.METRICS_HOST_ENV: host, METRICS_PORT_ENV: "0"})
    # Probes of every process of a host at once do not collide: a bound port no one listens on is free.
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        free = str(other.getsockname()[1])
        assert engine_env.check_engine_env("vllm", {METRICS_PORT_ENV: free}).metrics_port == int(free)


def test_a_solver_option_names_its_field() -> None:
    cases = {
        '{"dispatch": "weird"}': "dispatch",
        '{"copy_cost": 0.1, "decay_half_life": "x"}': "decay_half_life",
    }
    for raw, field in cases.items():
        with pytest.raises(ValueError, match=f"{SOLVER_OPTIONS_ENV}: field '{field}'"):
            read_engine_env({SOLVER_OPTIONS_ENV: raw})


def test_the_docs_table_is_the_code_table() -> None:
    text = (ROOT / "docs/integrations.md").read_text()
    assert engine_env.env_table_markdown() in text
    documented = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `EPLB_")}
    assert documented == {var.name for var in engine_env.ENV_VARS}


def _loader_scenarios(engine: str, busy_port: int) -> list[dict[str, Any]]:
    base = {"EPLB_VLLM_POLICY": "1"} if engine == "vllm" else {}
    scenarios = [
        {
            "name": var.name,
            "env": {**base, var.name: var.bad} if var.name not in base else {var.name: var.bad},
        }
        for var in _table(engine)
    ]
    scenarios.append({"name": "busy port", "env": {**base, METRICS_PORT_ENV: str(busy_port)}})
    scenarios.append({"name": "good", "env": {**base, MODE_ENV: "continuous", METRICS_PORT_ENV: "0"}})
    return scenarios


@pytest.mark.parametrize("engine", engine_env.ENGINES)
def test_the_engines_loader_stops_on_every_bad_variable(engine_site: Path, engine: str) -> None:
    """Through vLLM's and SGLang's own plugin loaders: every variable of the table with its bad
    value (SGLang's transfer rate with the updater off, the metrics host with the policy on and no
    port, ...) and a port something listens on stop the engine at start-up naming the variable."""
    raised = "SettingsExit" if engine == "sglang" else "ValueError"
    with _busy_port() as busy:
        got = _loader_results(engine_site, engine, _loader_scenarios(engine, busy.getsockname()[1]))
    for var in _table(engine):
        result = got[var.name]
        assert result["raised"] == raised and _refused(var, result["message"]), (var.name, result)
    assert got["busy port"]["raised"] == raised and METRICS_PORT_ENV in got["busy port"]["message"]
    assert got["good"] == {"raised": None, "message": ""}


def test_sglangs_loader_takes_the_fused_backend(engine_site: Path) -> None:
    scenarios = [
        {
            "name": "fused backend",
            "env": {"EPLB_SGLANG_FUSED_REMAP": "1", "EPLB_SGLANG_REMAP_BACKEND": "magic"},
        }
    ]
    got = _loader_results(engine_site, "sglang", scenarios)
    assert got["fused backend"]["raised"] == "SettingsExit"
    assert "EPLB_SGLANG_REMAP_BACKEND" in got["fused backend"]["message"]


def test_sglang_process_exits_at_start_up_naming_the_variable(engine_site: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(engine_site), str(ROOT)]), EPLB_SOLVER_OPTIONS='{"bogus": 1}')
    code = "from sglang.srt.plugins import load_plugins; load_plugins(); print('served')"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0 and "served" not in done.stdout
    assert "EPLB_SOLVER_OPTIONS" in done.stderr and "bogus" in done.stderr


def test_vllms_loader_refuses_continuous_mode_with_the_policy_off(engine_site: Path) -> None:
    got = _loader_results(engine_site, "vllm", [{"name": "policy off", "env": {MODE_ENV: "continuous"}}])
    assert got["policy off"]["raised"] == "ValueError" and "EPLB_VLLM_POLICY" in got["policy off"]["message"]


def test_every_variable_is_documented() -> None:
    from eplb.integrations import sglang, vllm

    text = (ROOT / "docs/integrations.md").read_text()
    for var in (*engine_env.SHARED_ENV, *sglang.SGLANG_ENV, *vllm.VLLM_ENV):
        assert f"`{var}`" in text, var
