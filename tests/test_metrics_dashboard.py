"""dashboards/: the generator's --check catches unknown metrics and labels and stale JSON; provisioning agrees."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eplb.metrics import names
from tests.helpers.dashboards import generate, panels, promql, promstack

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"


def test_committed_dashboard_passes_check() -> None:
    done = subprocess.run(
        [sys.executable, str(DASHBOARDS / "generate.py"), "--check"], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout


@pytest.mark.parametrize("argv", [["generate.py", "--check"], ["snapshot.py", "--help"]])
def test_scripts_find_their_siblings_from_any_folder(tmp_path: Path, argv: list[str]) -> None:
    # The scripts import each other by file name; that must not depend on the working directory.
    done = subprocess.run(
        [sys.executable, str(DASHBOARDS / argv[0]), *argv[1:]], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr


def test_check_fails_on_a_stale_json(tmp_path: Path) -> None:
    stale = tmp_path / "d.json"
    dashboard = panels.build_dashboard()
    dashboard["panels"][1]["title"] = "edited by hand"
    stale.write_text(panels.render(dashboard))
    assert generate.main(["--check", "--out", str(stale)]) == 1
    assert generate.main(["--check", "--out", str(tmp_path / "missing.json")]) == 1
    assert generate.main(["--out", str(stale)]) == 0
    assert generate.main(["--check", "--out", str(stale)]) == 0


def _with_expr(expr: str) -> dict:
    dashboard = copy.deepcopy(panels.build_dashboard())
    dashboard["panels"][1]["targets"][0]["expr"] = expr
    return dashboard


@pytest.mark.parametrize(
    ("expr", "complaint"),
    [
        ("eplb_model_balance", "not defined"),
        ("rate(eplb_rebalances[5m])", "not defined"),
        ("eplb_rebalance_solve_seconds_bucket_total", "not defined"),
        ('eplb_rank_tokens{gpu="0"}', "no label 'gpu'"),
        ('eplb_layer_balancedness{layer="$layer"}', "needs =~"),
        ("sum by (expert) (eplb_rank_tokens)", "groups by 'expert'"),
        ("vector(1)", "no eplb metric"),
    ],
)
def test_check_names_the_bad_query(expr: str, complaint: str) -> None:
    found = promql.problems(_with_expr(expr))
    assert len(found) == 1 and complaint in found[0], found


def test_good_variants_pass() -> None:
    for expr in (
        "eplb_rebalance_solve_seconds_count",
        "histogram_quantile(0.9, sum by (le) (rate(eplb_rebalance_transfer_seconds_bucket[1m])))",
        'eplb_expert_tokens{layer=~"$layer", expert="007"}',
        "eplb_forward_passes_created",
    ):
        assert promql.problems(_with_expr(expr)) == []


def test_dashboard_covers_every_default_metric_and_the_required_panels() -> None:
    dashboard = panels.build_dashboard()
    used = " ".join(q.expr for q in promql.queries(dashboard))
    for spec in names.METRICS:
        if not spec.per_expert:
            assert any(series in used for series in spec.series_names()), f"no panel shows {spec.name}"
    kinds = {p["type"] for p in dashboard["panels"]}
    assert {"timeseries", "table", "bargauge", "stat", "row"} <= kinds
    heatmap = next(p for p in dashboard["panels"] if "layer x rank" in p["title"])
    assert heatmap["transformations"][1]["id"] == "groupingToMatrix"
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "layer" and variable["multi"] and variable["includeAll"]
    annotation = dashboard["annotations"]["list"][-1]
    assert names.LAST_REBALANCE_TIMESTAMP in annotation["expr"] and annotation["useValueForTime"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    # Panels do not overlap on Grafana's 24-column grid.
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine


def test_every_panel_and_target_uses_the_provisioned_datasource() -> None:
    datasources = yaml.safe_load((DASHBOARDS / "provisioning/datasources/eplb.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["uid"] == panels.DATASOURCE_UID and source["type"] == "prometheus"
    dashboard = json.loads(generate.DASHBOARD_PATH.read_text())
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == source["uid"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])


def test_dashboard_provider_points_at_this_folder() -> None:
    providers = yaml.safe_load((DASHBOARDS / "provisioning/dashboards/eplb.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "${EPLB_DASHBOARDS_DIR}"
    # The provider loads every *.json in the folder: the dashboard must be the only one.
    assert [p.name for p in DASHBOARDS.glob("**/*.json")] == [generate.DASHBOARD_PATH.name]


def test_scrape_config_is_valid_and_substitutable() -> None:
    text = promstack.scrape_config("127.0.0.1:12345", 0.5)
    config = yaml.safe_load(text)
    assert config["global"]["scrape_interval"] == "500ms"
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:12345"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    for path in (DASHBOARDS / "prometheus.yml",):
        done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_variable_expansion() -> None:
    expr = 'rate(x{layer=~"$layer"}[$__rate_interval])'
    assert promstack.expand(expr, rate_interval="5s") == 'rate(x{layer=~".*"}[5s])'


def test_docs_metrics_table_matches_the_names_module() -> None:
    # docs/observability.md lists every metric with the type and labels the code exports.
    text = (REPO / "docs/observability.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`eplb_"):
            labels = tuple(c.strip(" `") for c in cells[2].split(",")) if cells[2] != "—" else ()
            rows[cells[0].strip("`")] = (cells[1], labels)
    assert rows == {spec.name: (spec.kind, spec.labels) for spec in names.METRICS}
    assert "img/observability-dashboard.png" in text
    assert (REPO / "docs/img/observability-dashboard.png").exists()


def test_live_demo_that_fails_to_start_says_why_and_leaves_nothing_behind() -> None:
    demo = promstack.LiveDemo("--nproc", "0")
    with pytest.raises(RuntimeError, match="exited with 2") as exc:
        demo.start()
    assert "--nproc" in str(exc.value)
    demo.close()
    assert demo.log_tail() == ""  # the temporary folder is gone
