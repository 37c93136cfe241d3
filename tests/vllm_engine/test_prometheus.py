"""The dashboard and the alert rules on a real Prometheus scraping a served plug-in, both started here on loopback.

The served plug-in decides with a step-time model that is deliberately wrong (a hundredth of this
machine's step times, far below any CPU's), so its steps take longer than predicted on every
run, however fast the machine is: the underprediction alert must fire, the fallback alert must not.
Then the served run is drawn from its step log and the dashboard from Prometheus.
"""

import json
import os
import shutil
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from sloweave.observability.dashboard import RULES_FILE, queries, rule_expressions
from sloweave.cli.observability import dashboard, served_run

from prometheus_server import running_prometheus
from real_engine import CPU_ANALYTIC
from test_serve import REQUEST_TIMEOUT_S, completion, serving, stream

WRONG_MODEL = {name: value / 100 for name, value in CPU_ANALYTIC.items()}
SCRAPE_S = 1
SCRAPE_TIMEOUT_S = 60
ALERT_TIMEOUT_S = 90
# Set to a folder to keep the pictures of this run (docs/operator-tools.md's were made so).
KEEP = os.environ.get("KEEP_SERVED_PICTURES")


def rules_firing_at_once(tmp: Path) -> Path:
    """The repository's rules with every alert's hold time (`for`) dropped, so a short run can
    see them fire; the expressions and thresholds are the repository's own."""
    rules = yaml.safe_load(RULES_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = "0s"
    path = tmp / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    return path


def prometheus(tmp: Path, target: str):
    """Prometheus scraping ``target`` every second, evaluating the rules as often."""
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(rules_firing_at_once(tmp))],
        "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": [target]}]}],
    }
    return running_prometheus(tmp, yaml.safe_dump(config), tmp / "tsdb")


def until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = condition()
            if result:
                return result
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout_s} s")
        time.sleep(0.5)


def scraped(prom: str) -> bool:
    up = api(prom, "query", query='up{job="vllm"}')["result"]
    return bool(up) and up[0]["value"][1] == "1"


def api(base: str, path: str, **params) -> dict:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def drive(base: str) -> None:
    """Two waves of six concurrent streamed completions, short and long prompts (bounded in time)."""
    done = []

    def run(i: int) -> None:
        done.append(len(stream(base, completion(150 + 300 * i, 32))[0]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for wave in (threads[:6], threads[6:]):
        for thread in wave:
            thread.start()
        time.sleep(1.0)  # the second wave arrives while the first decodes
    for thread in threads:
        thread.join(timeout=REQUEST_TIMEOUT_S)
    assert done == [32] * 12


@pytest.fixture(scope="module")
def served_and_scraped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    step_log = tmp / "steps.jsonl"
    with serving(tmp, analytic=WRONG_MODEL, online_correction=False, step_log=str(step_log)) as (base, _):
        with prometheus(tmp, base.removeprefix("http://")) as prom:
            started_s = time.time()
            # Prometheus takes its targets up a few seconds after start: the workload waits for
            # the first scrape, so the counters are seen before, during and after it.
            until(lambda: scraped(prom), SCRAPE_TIMEOUT_S, "the served plug-in scraped")
            drive(base)
            time.sleep(3 * SCRAPE_S)  # the last steps scraped, the rules evaluated on them
            yield prom, started_s, step_log, tmp


def test_every_dashboard_panel_and_recording_rule_returns_data_from_the_served_plug_in(served_and_scraped):
    prom, *_ = served_and_scraped
    empty = []
    for title, legend, expr in queries(engine="0", rate_interval="1m"):
        if not api(prom, "query", query=expr)["result"]:
            empty.append(f"{title} / {legend}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    for name, expr in rule_expressions():
        api(prom, "query", query=expr)  # every rule parses (an alert's returns data only while it fires)
        if not name.startswith("Sloweave"):  # a recording rule: its series exists for the served engine
            assert api(prom, "query", query=f'{name}{{engine="0"}}')["result"], name


def test_the_underprediction_alert_fires_and_the_fallback_alert_does_not(served_and_scraped):
    prom, *_ = served_and_scraped

    def firing() -> set[str]:
        alerts = api(prom, "alerts")["alerts"]
        return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing" and a["labels"].get("engine") == "0"}

    names = until(
        lambda: firing() if "SloweaveModelUnderpredicts" in firing() else None, ALERT_TIMEOUT_S, "underprediction alert"
    )
    assert "SloweavePluginFallingBack" not in names  # nothing failed: no step ran on vLLM's own budget
    share = api(prom, "query", query='sloweave:underpredicted_steps:ratio_rate5m{engine="0"}')["result"]
    assert float(share[0]["value"][1]) > 0.9  # a hundredth of the real step times: nearly every step runs late


def test_the_served_run_is_drawn_from_its_step_log_and_the_dashboard_from_prometheus(served_and_scraped):
    prom, started_s, step_log, tmp = served_and_scraped
    runner = CliRunner()
    result = runner.invoke(served_run, [str(step_log), "--out", str(tmp / "served")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp / "served" / "served_run.json").read_text())
    assert summary["steps"] > 8 and summary["underpredicted_share"] > 0.9
    end_s = time.time()
    args = [
        "--prometheus",
        prom,
        "--out",
        str(tmp / "dashboard"),
        "--start",
        str(started_s),
        "--end",
        str(end_s),
        "--step-s",
        "1",
    ]
    result = runner.invoke(dashboard, args)
    assert result.exit_code == 0, result.output
    for picture in (tmp / "served" / "timeline.png", tmp / "dashboard" / "dashboard.png"):
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if KEEP:
        shutil.copytree(tmp / "served", Path(KEEP) / "served", dirs_exist_ok=True)
        shutil.copytree(tmp / "dashboard", Path(KEEP) / "dashboard", dirs_exist_ok=True)
