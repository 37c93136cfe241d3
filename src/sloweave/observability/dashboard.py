"""The operator's dashboard of the vLLM plug-in: Grafana JSON, and the same panels drawn without Grafana.

The panels are plain data (``PANELS``): a title, a Grafana unit and (legend, PromQL) pairs
written with Grafana's variables ``$engine`` (the data-parallel rank of one row) and
``$__rate_interval``. ``grafana_dashboard()`` turns them into an importable dashboard (the
committed ``data/observability/grafana-dashboard.json``; regenerate it with
``python -m sloweave.observability.dashboard --write``); ``render()`` asks a Prometheus for
the same expressions and draws them with matplotlib (``sloweave dashboard``).

Only files and HTTP: nothing here imports vLLM or ``prometheus_client``.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path


DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "observability"
DASHBOARD_FILE = DATA_DIR / "grafana-dashboard.json"
RULES_FILE = DATA_DIR / "prometheus-rules.yml"

# vLLM's own metrics the dashboard shows beside sloweave's (labels model_name and engine).
VLLM_METRICS = (
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:prompt_tokens", "counter"),
    ("vllm:generation_tokens", "counter"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
)

# Every selector names the row's engine; a regex match, since the variable is multi-valued
# (a repeated row gets one value, but "All" outside a repeat is a regex).
ENGINE = 'engine=~"$engine"'
WINDOW = "[$__rate_interval]"


def _rate(series: str) -> str:
    return f"sum(rate({series}{{{ENGINE}}}{WINDOW}))"


def _quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{ENGINE}}}{WINDOW})))"


def _mean(histogram: str) -> str:
    return f"{_rate(histogram + '_sum')} / {_rate(histogram + '_count')}"


def _share(counter: str, of: str) -> str:
    return f"{_rate(counter)} / {_rate(of)}"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # a Grafana unit id ("ms", "s", "percentunit", "short", "none")
    targets: tuple[tuple[str, str], ...]  # (legend, PromQL); a legend may name a label: {{where}}
    description: str = ""


# Finished steps are those with a measured time: the share of underpredicted steps is taken
# of them (a step still running has no verdict yet).
_UNDERPREDICTED_SHARE = _share("sloweave_underpredicted_steps_total", "sloweave_measured_step_ms_count")
_ALLOWED_SHARE = f"1 - max(sloweave_margin_coverage{{{ENGINE}}})"

PANELS = (
    Panel(
        "Chunk and token budget (tokens)",
        "none",
        (
            ("chunk p50", _quantile(0.5, "sloweave_chunk_tokens")),
            ("chunk p90", _quantile(0.9, "sloweave_chunk_tokens")),
            ("token budget p50", _quantile(0.5, "sloweave_token_budget_tokens")),
            ("token budget p90", _quantile(0.9, "sloweave_token_budget_tokens")),
        ),
        "Prefill tokens chosen per step, and the token budget handed to vLLM (decode tokens + chunk).",
    ),
    Panel(
        "vLLM throughput (tokens/s)",
        "short",
        (
            ("prompt tokens/s", _rate("vllm:prompt_tokens_total")),
            ("generated tokens/s", _rate("vllm:generation_tokens_total")),
        ),
    ),
    Panel(
        "vLLM inter-token latency",
        "s",
        tuple((f"ITL p{q}", _quantile(q / 100, "vllm:inter_token_latency_seconds")) for q in (50, 90, 99)),
        "What clients see of the TPOT target.",
    ),
    Panel(
        "vLLM request latency",
        "s",
        (
            ("TTFT p50", _quantile(0.5, "vllm:time_to_first_token_seconds")),
            ("TTFT p90", _quantile(0.9, "vllm:time_to_first_token_seconds")),
            ("end-to-end p90", _quantile(0.9, "vllm:e2e_request_latency_seconds")),
        ),
    ),
    Panel(
        "Time budget against the TPOT target (ms)",
        "ms",
        (
            ("time budget p10", _quantile(0.1, "sloweave_time_budget_ms")),
            ("time budget p50", _quantile(0.5, "sloweave_time_budget_ms")),
            ("TPOT target", f"max(sloweave_tpot_target_ms{{{ENGINE}}})"),
        ),
        "Time from step start to the earliest next-token deadline (steps with decodes). "
        "Far below the target: requests are already behind.",
    ),
    Panel(
        "Predicted against measured step time (ms)",
        "ms",
        (
            ("predicted p50", _quantile(0.5, "sloweave_predicted_step_ms")),
            ("measured p50", _quantile(0.5, "sloweave_measured_step_ms")),
            ("predicted p99", _quantile(0.99, "sloweave_predicted_step_ms")),
            ("measured p99", _quantile(0.99, "sloweave_measured_step_ms")),
        ),
        "The prediction is the cost model T(n, c) plus the margin.",
    ),
    Panel(
        "Underpredicted steps (share)",
        "percentunit",
        (
            ("took longer than predicted", _UNDERPREDICTED_SHARE),
            ("allowed by the margin", _ALLOWED_SHARE),
            ("alert threshold", f"{_ALLOWED_SHARE} + 0.02"),
        ),
        "Steps over their prediction, against the share the margin lets through (1 - sloweave_margin_coverage). "
        "SloweaveModelUnderpredicts fires above the threshold for 10m.",
    ),
    Panel(
        "Margin (ms)",
        "ms",
        (
            ("margin p50", _quantile(0.5, "sloweave_margin_ms")),
            ("margin p90", _quantile(0.9, "sloweave_margin_ms")),
            ("margin mean", _mean("sloweave_margin_ms")),
        ),
    ),
    Panel(
        "SLO exceptions and infeasible steps (per s)",
        "short",
        (
            ("steps forced by aging", _rate("sloweave_slo_exceptions_total")),
            ("requests made late by them", _rate("sloweave_slo_exception_requests_total")),
            ("infeasible steps", _rate("sloweave_infeasible_steps_total")),
        ),
        "SLO exception: aging forced a chunk for a starving prompt. Infeasible: even decode-only "
        "was predicted to miss the earliest deadline.",
    ),
    Panel(
        "Forced and infeasible steps (share)",
        "percentunit",
        (
            ("forced by aging (alert > 1 %)", _share("sloweave_slo_exceptions_total", "sloweave_steps_total")),
            ("infeasible (alert > 5 %)", _share("sloweave_infeasible_steps_total", "sloweave_steps_total")),
        ),
    ),
    Panel(
        "Plug-in and request target errors",
        "short",
        (
            (
                "plug-in error in {{where}}",
                f"sum by (where) (increase(sloweave_plugin_errors_total{{{ENGINE}}}{WINDOW}))",
            ),
            ("refused request target", f"sum(increase(sloweave_request_target_errors_total{{{ENGINE}}}{WINDOW}))"),
        ),
        "A plug-in error is a step that fell back to vLLM's own budget (a bug to report); a refused "
        "request target was served with the default TPOT target.",
    ),
    Panel(
        "vLLM requests",
        "short",
        (
            ("running", f"sum(vllm:num_requests_running{{{ENGINE}}})"),
            ("waiting", f"sum(vllm:num_requests_waiting{{{ENGINE}}})"),
        ),
    ),
)


# --------------------------------------------------------------------------- Grafana

# The datasource is a template variable, so the dashboard imports into any Grafana as is.
_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PANELS_PER_LINE = 3
PANEL_WIDTH, PANEL_HEIGHT = 8, 8  # Grafana's grid is 24 columns wide


def _grafana_panel(panel: Panel, panel_id: int, index: int) -> dict:
    line, column = divmod(index, PANELS_PER_LINE)
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": _DATASOURCE,
        # y counts from the row header above (height 1)
        "gridPos": {"h": PANEL_HEIGHT, "w": PANEL_WIDTH, "x": column * PANEL_WIDTH, "y": 1 + line * PANEL_HEIGHT},
        "fieldConfig": {
            "defaults": {"unit": panel.unit, "custom": {"lineWidth": 1, "fillOpacity": 0}},
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": _DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}
            for i, (legend, expr) in enumerate(panel.targets)
        ],
    }


def _template_variables() -> list[dict]:
    datasource = {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus"}
    datasource.update({"current": {}, "hide": 0, "options": [], "refresh": 1, "regex": ""})
    engines = "label_values(sloweave_steps_total, engine)"
    # multi-valued with "All" selected: the row repeats once per data-parallel rank
    engine = {"type": "query", "name": "engine", "label": "engine (data-parallel rank)", "datasource": _DATASOURCE}
    engine.update(
        {"query": engines, "definition": engines, "refresh": 2, "sort": 3, "regex": "", "hide": 0, "options": []}
    )
    engine.update(
        {"multi": True, "includeAll": True, "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}
    )
    return [datasource, engine]


def grafana_dashboard() -> dict:
    """The Grafana dashboard: one row of ``PANELS`` per engine (data-parallel rank)."""
    row = {"id": 1, "type": "row", "title": "Engine $engine", "repeat": "engine", "collapsed": False, "panels": []}
    row["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": 0}
    panels = [row] + [_grafana_panel(panel, 2 + i, i) for i, panel in enumerate(PANELS)]
    return {
        "id": None,
        "uid": "sloweave-plugin",
        "title": "sloweave: adaptive prefill chunking",
        "description": "The sloweave vLLM plug-in's decisions beside vLLM's own metrics, one row per engine.",
        "tags": ["sloweave", "vllm"],
        "editable": True,
        "graphTooltip": 1,  # a shared crosshair: the panels of a row read at one time
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": _template_variables()},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(grafana_dashboard(), indent=2) + "\n"


def queries(engine: str = "0", rate_interval: str = "1m") -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL) of every panel target, for one engine (Grafana's variables filled in)."""
    out = []
    for panel in PANELS:
        for legend, expr in panel.targets:
            concrete = expr.replace("$__rate_interval", rate_interval).replace("$engine", engine)
            out.append((panel.title, legend, concrete))
    return out


def rule_expressions(rules_file: Path = RULES_FILE) -> list[tuple[str, str]]:
    """(record or alert name, expr) of every rule in the Prometheus rules file."""
    import yaml

    rules = yaml.safe_load(Path(rules_file).read_text())
    return [
        (rule.get("record") or rule["alert"], rule["expr"].strip())
        for group in rules["groups"]
        for rule in group["rules"]
    ]


# --------------------------------------------------------------------------- Prometheus


class PrometheusError(Exception):
    """Prometheus could not be reached or refused a query (the message names which)."""


def query_range(
    prometheus_url: str, expr: str, start_s: float, end_s: float, step_s: float, timeout_s: float = 30.0
) -> list[dict]:
    """The series of ``expr`` over [start_s, end_s] (``/api/v1/query_range``): [{"metric": labels, "values": [[t, "v"], ...]}]."""
    base = prometheus_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise PrometheusError(f"not an http:// or https:// URL of a Prometheus: {prometheus_url!r}")
    params = urllib.parse.urlencode({"query": expr, "start": start_s, "end": end_s, "step": step_s})
    answer = _get_json(f"{base}/api/v1/query_range?{params}", base, expr, timeout_s)
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise PrometheusError(f"Prometheus at {base} failed the query {expr!r}: {error}")
    return answer["data"]["result"]


def _get_json(url: str, base: str, expr: str, timeout_s: float):
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as err:
        # Prometheus refuses a bad query with HTTP 400 and its reason in the JSON body
        raise PrometheusError(f"Prometheus at {base} refused the query {expr!r}: {_reason(err)}") from None
    except OSError as err:  # URLError, a refused connection, a timeout
        raise PrometheusError(f"cannot reach Prometheus at {base}: {getattr(err, 'reason', err)}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise PrometheusError(
            f"{base} answered the query {expr!r} with something other than JSON: is it a Prometheus?"
        ) from None


def _reason(err: urllib.error.HTTPError) -> str:
    try:
        return json.loads(err.read()).get("error") or f"HTTP {err.code}"
    except (ValueError, AttributeError):
        return f"HTTP {err.code} {err.reason}"


def grafana_rate_interval(step_s: float, scrape_interval_s: float = 15.0) -> str:
    """Grafana's ``$__rate_interval``: one step plus a scrape, and at least four scrapes (a rate needs two samples)."""
    return f"{math.ceil(max(step_s + scrape_interval_s, 4 * scrape_interval_s))}s"


SERIES_COLUMNS = ["panel", "legend", "time_s", "value"]


def _legend(legend: str, labels: dict) -> str:
    # Grafana's legend format: {{label}} is the series' value of that label
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), legend)


def fetch_series(
    prometheus_url: str,
    start_s: float,
    end_s: float,
    step_s: float,
    engine: str = "0",
    rate_interval: str | None = None,
):
    """Every panel's series for one engine, as a long table (``SERIES_COLUMNS``)."""
    import pandas as pd

    rate_interval = rate_interval or grafana_rate_interval(step_s)
    rows = []
    for title, legend, expr in queries(engine, rate_interval):
        for series in query_range(prometheus_url, expr, start_s, end_s, step_s):
            name = _legend(legend, series["metric"])
            rows += [(title, name, float(t), float(v)) for t, v in series["values"]]
    return pd.DataFrame(rows, columns=SERIES_COLUMNS)


# --------------------------------------------------------------------------- drawing

# how the Grafana units read on a matplotlib axis: (label, factor)
_AXIS_UNITS = {"ms": ("ms", 1.0), "s": ("s", 1.0), "percentunit": ("%", 100.0), "short": ("", 1.0), "none": ("", 1.0)}


def _draw_panel(axes, panel: Panel, series) -> None:
    import matplotlib.dates as mdates
    import pandas as pd

    label, factor = _AXIS_UNITS[panel.unit]
    axes.set_title(panel.title, fontsize=10)
    axes.set_ylabel(label, fontsize=8)
    axes.tick_params(labelsize=7)
    locator = mdates.AutoDateLocator()  # minutes for an hour, seconds for a short run
    axes.xaxis.set_major_locator(locator)
    axes.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    if series.empty:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", color="grey", transform=axes.transAxes)
        return
    # series in the panel's order of targets, as Grafana lists them
    for legend, points in series.groupby("legend", sort=False):
        axes.plot(pd.to_datetime(points["time_s"], unit="s"), points["value"] * factor, label=legend, linewidth=1)
    axes.legend(fontsize=7, loc="upper left")


def draw(series, title: str = ""):
    """A matplotlib figure with one axes per panel (``PANELS`` order) from ``fetch_series``' table."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, nothing global to close

    lines = math.ceil(len(PANELS) / PANELS_PER_LINE)
    figure = Figure(figsize=(6 * PANELS_PER_LINE, 3.6 * lines), layout="constrained")
    for index, panel in enumerate(PANELS):
        axes = figure.add_subplot(lines, PANELS_PER_LINE, index + 1)
        _draw_panel(axes, panel, series[series["panel"] == panel.title])
    figure.suptitle(title)
    return figure


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def render(
    prometheus_url: str,
    out_dir,
    start_s: float,
    end_s: float,
    step_s: float,
    engine: str = "0",
    rate_interval: str | None = None,
):
    """Draw every panel for one engine from a Prometheus: dashboard.png, dashboard.csv (the
    series) and dashboard.json (what was asked). Returns the series table."""
    from sloweave.studies.outputs import write_result_json

    rate_interval = rate_interval or grafana_rate_interval(step_s)
    series = fetch_series(prometheus_url, start_s, end_s, step_s, engine, rate_interval)
    out_dir = Path(out_dir)  # made once every query has answered: a failed run leaves nothing behind
    out_dir.mkdir(parents=True, exist_ok=True)
    series.to_csv(out_dir / "dashboard.csv", index=False)
    figure = draw(series, f"sloweave, engine {engine}: {_utc(start_s)} to {_utc(end_s)}")
    figure.savefig(out_dir / "dashboard.png", dpi=100)
    settings = {"prometheus": prometheus_url, "engine": engine, "start_s": start_s, "end_s": end_s, "step_s": step_s}
    settings["rate_interval"] = rate_interval
    panels = [
        {
            "title": panel.title,
            "unit": panel.unit,
            "queries": [
                {"legend": legend, "expr": expr}
                for title, legend, expr in queries(engine, rate_interval)
                if title == panel.title
            ],
            "series": list(series.loc[series["panel"] == panel.title, "legend"].unique()),
        }
        for panel in PANELS
    ]
    write_result_json(out_dir / "dashboard.json", {"command": "dashboard", "settings": settings, "panels": panels})
    return series


# Prometheus answers at most 11,000 points per series
MAX_POINTS = 11_000


def _main(argv: list[str]) -> None:
    """``--write``: regenerate the committed dashboard JSON; otherwise print it."""
    if argv == ["--write"]:
        DASHBOARD_FILE.write_text(dashboard_json())
        print(f"wrote {DASHBOARD_FILE}")
    elif not argv:
        sys.stdout.write(dashboard_json())
    else:
        sys.exit("usage: python -m sloweave.observability.dashboard [--write]")


if __name__ == "__main__":
    _main(sys.argv[1:])
