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
from eplb.metrics.causes import CAUSE_HELP, REBALANCE_OUTCOMES, causes_of
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
        ('eplb_rank_tokens{layer=~"$nope"}', "variable $nope is not defined"),
        ('eplb_rank_tokens{gpu=~"$layer"}', "no label 'gpu'"),
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
        'eplb_rank_tokens{instance="$instance",model_name="$model_name",engine="0",job="eplb"}',
        'sum by (engine, model_name) (eplb_rebalances_total{cause="failed_timeout"})',
        "rate(eplb_moved_bytes_total[$__rate_interval])",
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
    steps = [t["id"] for t in heatmap["transformations"]]
    assert steps == ["convertFieldType", "sortBy", "groupingToMatrix", "sortBy"]
    # Layers and ranks become numbers before anything sorts them (rank 10 after rank 9).
    conversions = heatmap["transformations"][0]["options"]["conversions"]
    assert {(c["targetField"], c["destinationType"]) for c in conversions} == {
        ("layer", "number"),
        ("rank", "number"),
    }
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == ["datasource", "instance", "model_name", "layer"]
    variable = variables["layer"]
    assert variable["name"] == "layer" and variable["multi"] and variable["includeAll"]
    # One process at a time: sums over its ranks and layers never mix two servers.
    for name in ("instance", "model_name"):
        assert variables[name]["type"] == "query" and not variables[name]["multi"]
        assert not variables[name]["includeAll"]
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


def test_the_datasource_is_a_variable_that_defaults_to_the_provisioned_one() -> None:
    datasources = yaml.safe_load((DASHBOARDS / "provisioning/datasources/eplb.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    text = generate.DASHBOARD_PATH.read_text()
    dashboard = json.loads(text)
    # No datasource uid is written into the dashboard: Grafana's default Prometheus (the one
    # provisioned here, or a user's own) fills $datasource.
    assert source["uid"] not in text
    variable = dashboard["templating"]["list"][0]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    assert variable["name"] == "datasource" and variable["current"] == {}
    ref = {"type": "prometheus", "uid": "${datasource}"}
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == ref
        assert all(t["datasource"] == ref for t in panel["targets"])
    assert all(v["datasource"] == ref for v in dashboard["templating"]["list"][1:])
    annotations = [a for a in dashboard["annotations"]["list"] if "expr" in a]
    assert annotations and all(a["datasource"] == ref for a in annotations)


def test_every_query_selects_one_process() -> None:
    # Each eplb metric in a panel or an annotation carries the $instance and $model_name matchers
    # (exact: single-valued), so a Prometheus scraping many servers shows the chosen one only.
    dashboard = panels.build_dashboard()
    checked = 0
    for query in promql.queries(dashboard):
        if query.where.startswith("variable"):
            continue
        selectors = promql._SELECTOR.findall(query.expr)
        assert len(selectors) == len(promql._METRIC.findall(query.expr)), query
        for metric, matchers in selectors:
            found = {(k, op, v) for k, op, v in promql._MATCHER.findall(matchers)}
            assert {("instance", "=", "$instance"), ("model_name", "=", "$model_name")} <= found, (
                query.where,
                metric,
            )
            checked += 1
    assert checked >= 20
    annotation = dashboard["annotations"]["list"][-1]
    # Labels only, from the fixed list: the annotation never shows free text.
    assert annotation["textFormat"] == "{{cause}}" and "reason" not in json.dumps(annotation)


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
    expr = 'x{instance="$instance",model_name="${model_name}",layer=~"$layer"}[$__interval]'
    got = promstack.expand(expr, rate_interval="5s", instance="h:1", model_name="m/x")
    assert got == 'x{instance="h:1",model_name="m/x",layer=~".*"}[5s]'


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
    # ... and the rebalance causes with the meaning and outcome the code gives them.
    causes = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].strip("`") in CAUSE_HELP:
            causes[cells[0].strip("`")] = (cells[1], cells[2])
    assert causes == {c: (o, CAUSE_HELP[c]) for o in REBALANCE_OUTCOMES for c in causes_of(o)}
    assert "img/observability-dashboard.png" in text
    assert (REPO / "docs/img/observability-dashboard.png").exists()


def test_live_demo_that_fails_to_start_says_why_and_leaves_nothing_behind() -> None:
    demo = promstack.LiveDemo("--nproc", "0")
    with pytest.raises(RuntimeError, match="exited with 2") as exc:
        demo.start()
    assert "--nproc" in str(exc.value)
    demo.close()
    assert demo.log_tail() == ""  # the temporary folder is gone
