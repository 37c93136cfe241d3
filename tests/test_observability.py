"""The operator's view (issue 27): the Grafana dashboard, the Prometheus rules and the scrape
config are checked by Prometheus's own tools, and every panel and rule expression is run
against a real Prometheus holding synthetic series of every metric they use.

Needs promtool and prometheus on PATH (``make setup`` installs the Debian package
``prometheus``); without them these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import urllib.request

import pandas as pd
import pytest
from click.testing import CliRunner

from sloweave.core.decision_metrics import ALL_METRICS, PLUGIN_ERROR_PLACES, PLUGIN_METRICS
from sloweave.observability import dashboard
from sloweave.observability.dashboard import (
    DATA_DIR,
    DASHBOARD_FILE,
    PANELS,
    RULES_FILE,
    VLLM_METRICS,
    PrometheusError,
    draw,
    grafana_dashboard,
    queries,
    query_range,
    render,
    rule_expressions,
)

from prometheus_server import running_prometheus, tool

SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
SLOWEAVE_KINDS = {spec.name: spec.kind for spec in ALL_METRICS + PLUGIN_METRICS}
VLLM_KINDS = dict(VLLM_METRICS)


def _promtool(*args: str) -> None:
    done = subprocess.run([tool("promtool"), *args], cwd=DATA_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


def _exposed(kinds: dict[str, str]) -> set[str]:
    return {name + suffix for name, kind in kinds.items() for suffix in SUFFIXES[kind]}


def _dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in grafana_dashboard()["panels"] for target in panel.get("targets", [])]


# --------------------------------------------------------------------------- the files


def test_committed_dashboard_is_the_generated_one():
    committed = json.loads(DASHBOARD_FILE.read_text())
    assert committed == grafana_dashboard(), "regenerate it: python -m sloweave.observability.dashboard --write"


def test_dashboard_has_its_variables_and_one_row_per_engine():
    board = grafana_dashboard()
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    engine = variables["engine"]
    assert engine["query"] == "label_values(sloweave_steps_total, engine)"
    assert engine["multi"] and engine["includeAll"]
    rows = [panel for panel in board["panels"] if panel["type"] == "row"]
    assert len(rows) == 1 and rows[0]["repeat"] == "engine" and "$engine" in rows[0]["title"]
    graphs = [panel for panel in board["panels"] if panel["type"] != "row"]
    assert [panel["title"] for panel in graphs] == [panel.title for panel in PANELS]
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])
    for panel in graphs:  # the datasource variable everywhere: importable into any Grafana
        assert panel["datasource"]["uid"] == "${datasource}"
        assert all(target["datasource"]["uid"] == "${datasource}" for target in panel["targets"])


def test_every_selector_names_the_rows_engine():
    for expr in _dashboard_exprs():
        selectors = re.findall(r"\{([^}]*)\}", expr)
        assert selectors, expr
        assert all('engine=~"$engine"' in selector or 'engine="$engine"' in selector for selector in selectors), expr
        assert set(re.findall(r"\[([^\]]*)\]", expr)) <= {"$__rate_interval"}, expr


def test_every_metric_named_is_one_the_plugin_or_vllm_exports():
    exprs = _dashboard_exprs() + [expr for _, expr in rule_expressions()]
    named = {name for expr in exprs for name in re.findall(r"\b(?:sloweave_|vllm:)[A-Za-z0-9_:]+", expr)}
    unknown = named - _exposed(SLOWEAVE_KINDS) - _exposed(VLLM_KINDS)
    assert not unknown, f"not exported under these names (see sloweave.core.decision_metrics): {sorted(unknown)}"
    # and the dashboard shows every metric the plug-in exports
    shown = {name for expr in _dashboard_exprs() for name in re.findall(r"\bsloweave_[a-z_]+", expr)}
    missing = [name for name in SLOWEAVE_KINDS if not any(series.startswith(name) for series in shown)]
    assert not missing, f"not on the dashboard: {missing}"


def test_rules_have_annotations_and_alerts_per_engine():
    import yaml

    rules = [rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"] for rule in group["rules"]]
    alerts = {rule["alert"]: rule for rule in rules if "alert" in rule}
    assert {"SloweaveModelUnderpredicts", "SloweaveAgingForcesChunks", "SloweavePluginFallingBack"} <= set(alerts)
    assert alerts["SloweavePluginFallingBack"]["labels"]["severity"] == "critical"
    for name, rule in alerts.items():
        assert "{{ $labels.engine }}" in rule["annotations"]["summary"], name
        assert "{{ $value" in rule["annotations"]["description"], name
    assert all(
        rule["record"].startswith("sloweave:") and "by (engine" in rule["expr"] for rule in rules if "record" in rule
    )


def test_promtool_checks_the_rules_and_the_scrape_config():
    _promtool("check", "rules", "prometheus-rules.yml")
    _promtool("test", "rules", "prometheus-rules.test.yml")
    _promtool("check", "config", "prometheus.yml")


# --------------------------------------------------------------------------- a real Prometheus

START_S = 1_700_000_000  # the synthetic series' first sample (backfilled: in the past)
SAMPLE_S = 15
SAMPLES = 81  # 20 minutes
# engine "0" is in trouble on every alert's count, engine "1" is healthy: the alerts must pick "0" alone
SHARES = {
    "0": {"underpredicted": 0.10, "slo": 0.03, "infeasible": 0.10, "errors_per_min": 1},
    "1": {"underpredicted": 0.001, "slo": 0.0, "infeasible": 0.0, "errors_per_min": 0},
}
STEPS_PER_S = 50
VLLM_HISTOGRAMS = {  # name: (buckets, mean, observations per second)
    "vllm:time_to_first_token_seconds": ((0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), 0.4, 2),
    "vllm:inter_token_latency_seconds": ((0.005, 0.01, 0.02, 0.04, 0.08, 0.16), 0.02, 300),
    "vllm:e2e_request_latency_seconds": ((1, 2.5, 5, 10, 20, 40), 8.0, 2),
}
SLOWEAVE_MEANS = {"sloweave_chunk_tokens": 300, "sloweave_token_budget_tokens": 330, "sloweave_time_budget_ms": 20}
SLOWEAVE_MEANS.update({"sloweave_predicted_step_ms": 18, "sloweave_measured_step_ms": 17, "sloweave_margin_ms": 2})
SLOWEAVE_BUCKETS = {spec.name: spec.buckets for spec in ALL_METRICS}


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{key}="{value}"' for key, value in labels.items()) + "}"


def _series(name: str, labels: dict, value_at) -> list[str]:
    # one series' samples in time order (OpenMetrics timestamps are in seconds)
    return [f"{name}{_labels(labels)} {value_at(i * SAMPLE_S)} {START_S + i * SAMPLE_S}" for i in range(SAMPLES)]


def _histogram(name: str, labels: dict, buckets, mean: float, per_s: float) -> list[str]:
    """Observations spread evenly over [0, 2 * mean]: a cumulative bucket holds its share of them."""
    lines = [f"# TYPE {name} histogram"]
    for edge in list(buckets) + [math.inf]:
        share = min(1.0, edge / (2 * mean))
        le = "+Inf" if edge == math.inf else f"{edge:g}"
        lines += _series(f"{name}_bucket", {**labels, "le": le}, lambda t: math.floor(per_s * t * share))
    lines += _series(f"{name}_sum", labels, lambda t: per_s * t * mean)
    lines += _series(f"{name}_count", labels, lambda t: math.floor(per_s * t))
    return lines


def _counter(name: str, labels: dict, per_s: float) -> list[str]:
    return [f"# TYPE {name} counter"] + _series(f"{name}_total", labels, lambda t: math.floor(per_s * t))


def _gauge(name: str, labels: dict, value: float) -> list[str]:
    return [f"# TYPE {name} gauge"] + _series(name, labels, lambda t: value)


def _engine_series(engine: str) -> list[str]:
    labels, share = {"engine": engine}, SHARES[engine]
    lines = []
    for name, mean in SLOWEAVE_MEANS.items():
        lines += _histogram(name, labels, SLOWEAVE_BUCKETS[name], mean, STEPS_PER_S)
    lines += _counter("sloweave_steps", labels, STEPS_PER_S)
    lines += _counter("sloweave_underpredicted_steps", labels, STEPS_PER_S * share["underpredicted"])
    lines += _counter("sloweave_slo_exceptions", labels, STEPS_PER_S * share["slo"])
    lines += _counter("sloweave_slo_exception_requests", labels, 2 * STEPS_PER_S * share["slo"])
    lines += _counter("sloweave_infeasible_steps", labels, STEPS_PER_S * share["infeasible"])
    lines += _counter("sloweave_request_target_errors", labels, share["errors_per_min"] / 60)
    lines += _gauge("sloweave_margin_coverage", labels, 0.997)
    lines += _gauge("sloweave_tpot_target_ms", labels, 25)
    vllm = {"model_name": "m", "engine": engine}
    for name, (buckets, mean, per_s) in VLLM_HISTOGRAMS.items():
        lines += _histogram(name, vllm, buckets, mean, per_s)
    lines += _counter("vllm:prompt_tokens", vllm, 2000) + _counter("vllm:generation_tokens", vllm, 300)
    lines += _gauge("vllm:num_requests_running", vllm, 16) + _gauge("vllm:num_requests_waiting", vllm, 4)
    return lines


def _plugin_errors() -> list[str]:
    lines = ["# TYPE sloweave_plugin_errors counter"]
    for engine, share in SHARES.items():
        for where in PLUGIN_ERROR_PLACES:  # pre-initialised to 0; engine 0 fails in schedule
            per_s = share["errors_per_min"] / 60 if where == "schedule" else 0
            lines += _series(
                "sloweave_plugin_errors_total", {"engine": engine, "where": where}, lambda t: math.floor(per_s * t)
            )
    return lines


def _openmetrics() -> str:
    """Every engine's series in OpenMetrics text; each metric family in one piece, as the format wants."""
    families: dict[str, list[str]] = {}  # TYPE line: samples of every engine
    for engine in SHARES:
        for line in _engine_series(engine):
            if line.startswith("# TYPE"):
                family = families.setdefault(line, [])
            else:
                family.append(line)
    lines = [line for header, samples in families.items() for line in [header, *samples]]
    return "\n".join(lines + _plugin_errors() + ["# EOF"]) + "\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """A real Prometheus over backfilled synthetic series, with the rules loaded; its URL."""
    folder = tmp_path_factory.mktemp("prometheus")
    series, data = folder / "series.om", folder / "data"
    series.write_text(_openmetrics())
    done = subprocess.run(
        [tool("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(series), str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"backfill failed:\n{done.stdout}\n{done.stderr}"
    config = f"global:\n  evaluation_interval: 1m\nrule_files:\n  - {RULES_FILE}\n"
    with running_prometheus(folder, config, data, "--storage.tsdb.retention.time=100y") as url:
        yield url


# the backfilled window, after the first 5m (the rules' rate windows need them)
WINDOW = (START_S + 300, START_S + (SAMPLES - 1) * SAMPLE_S)


def _has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(value)) for series in result for _, value in series["values"])


def test_every_panel_query_returns_data(prometheus):
    for title, legend, expr in queries(engine="0", rate_interval="1m"):
        assert _has_data(query_range(prometheus, expr, *WINDOW, 60)), f"{title} / {legend}: no data for {expr}"


def test_every_rule_returns_data_and_the_alerts_pick_the_engine_in_trouble(prometheus):
    with urllib.request.urlopen(f"{prometheus}/api/v1/rules") as answer:
        loaded = [rule["name"] for group in json.load(answer)["data"]["groups"] for rule in group["rules"]]
    assert sorted(loaded) == sorted(name for name, _ in rule_expressions())  # the API lists groups by name
    for name, expr in rule_expressions():
        result = query_range(prometheus, expr, *WINDOW, 60)
        assert _has_data(result), f"{name}: no data for {expr}"
        if ":" not in name:  # an alert: engine "1" is healthy
            assert {series["metric"]["engine"] for series in result} == {"0"}, name


def test_a_refused_query_names_itself(prometheus):
    with pytest.raises(PrometheusError, match=r"refused the query 'rate\(sloweave_steps_total\)'"):
        query_range(prometheus, "rate(sloweave_steps_total)", *WINDOW, 60)


def test_render_draws_every_panel(prometheus, tmp_path):
    import matplotlib.image

    series = render(prometheus, tmp_path, *WINDOW, 30, engine="0")
    image = matplotlib.image.imread(tmp_path / "dashboard.png")
    assert image.shape[0] > 500 and image.shape[1] > 1000
    written = pd.read_csv(tmp_path / "dashboard.csv", dtype={"legend": str})
    expected = {(title, legend.replace("{{where}}", "schedule")) for title, legend, _ in queries()}
    assert expected <= set(zip(written["panel"], written["legend"]))
    settings = json.loads(
        (tmp_path / "dashboard.json").read_text(), parse_constant=lambda name: pytest.fail(f"not strict JSON: {name}")
    )
    assert settings["sloweave_version"] and settings["settings"]["engine"] == "0"
    assert [panel["title"] for panel in settings["panels"]] == [panel.title for panel in PANELS]
    figure = draw(series)
    assert [axes.get_title() for axes in figure.axes] == [panel.title for panel in PANELS]


def test_dashboard_command(prometheus, tmp_path):
    from sloweave.cli import main

    args = ["dashboard", "--prometheus", prometheus, "--out", str(tmp_path), "--engine", "1"]
    result = CliRunner().invoke(main, args + ["--start", str(WINDOW[0]), "--end", str(WINDOW[1])])
    assert result.exit_code == 0, result.output
    assert {"dashboard.png", "dashboard.csv", "dashboard.json"} <= {path.name for path in tmp_path.iterdir()}


def test_dashboard_command_says_when_prometheus_is_unreachable(tmp_path):
    from sloweave.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["dashboard", "--prometheus", "http://127.0.0.1:1", "--out", str(out), "--minutes", "5"]
    )
    assert result.exit_code == 1
    assert "cannot reach Prometheus at http://127.0.0.1:1" in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert not out.exists()  # nothing written when nothing was read


def test_dashboard_module_prints_the_committed_json():
    assert dashboard.dashboard_json() == DASHBOARD_FILE.read_text()
