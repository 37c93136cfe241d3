"""``sloweave served-run`` (a served run's pictures, from its step log) and ``sloweave dashboard``
(the Grafana panels drawn from a Prometheus): ``sloweave.observability``."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import click

from sloweave.cli.command import command
from sloweave.cli.options import OutFolder, out_folder_options, ranged
from sloweave.core.step_log import StepLogError, read_step_log
from sloweave.core.validate import DURATION_S, MAX_SECONDS, TIME_S, Range
from sloweave.observability.dashboard import MAX_POINTS, PrometheusError, render
from sloweave.observability.served_run import write_served_run
from sloweave.studies.outputs import check_writable, command_settings


@command("served-run")
@click.argument("step_log", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@out_folder_options(required=True, help="result folder")
@click.option(
    "--window-s",
    type=ranged(DURATION_S),
    default=None,
    show_default="the whole run",
    help="seconds of the run the timeline shows, from its first step",
)
def served_run(step_log: Path, out: OutFolder, window_s: float) -> None:
    """Pictures and summaries of a served run, from the vLLM plug-in's STEP_LOG."""
    check_writable(out.path, "--out")
    # --force never deletes the folder the step log is in
    with out.open(inputs={"the step log": step_log}) as folder:
        try:
            log = read_step_log(step_log)
        except StepLogError as err:
            raise click.ClickException(str(err)) from None
        try:
            summary = write_served_run(log, folder.path, math.inf if window_s is None else window_s, command_settings())
        except StepLogError as err:
            raise click.ClickException(f"{step_log}: {err}") from None
    if log.stopped is not None:
        click.echo(
            f"warning: the step log stopped early ({log.stopped}); the pictures cover the steps before", err=True
        )
    click.echo(
        f"wrote {out.path}: {summary['steps']} steps, {summary['underpredicted_share']:.1%} underpredicted", err=True
    )


def _window(minutes: float, start_s: float | None, end_s: float | None) -> tuple[float, float]:
    if (start_s is None) != (end_s is None):
        raise click.UsageError("give both --start and --end (unix seconds), or neither (the last --minutes)")
    if start_s is None:
        end_s = time.time()
        return end_s - 60 * minutes, end_s
    if end_s <= start_s:
        raise click.BadParameter(f"must be after --start ({start_s}), got {end_s}", param_hint="--end")
    return start_s, end_s


def _checked_engine(ctx, param, value: str) -> str:
    # the value goes into PromQL label matchers: a rank, not arbitrary text
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
        raise click.BadParameter(f"an engine label value (the data-parallel rank, e.g. 0), got {value!r}")
    return value


@command("dashboard")
@click.option(
    "--prometheus",
    "prometheus_url",
    required=True,
    help="the Prometheus that scrapes the vLLM server, e.g. http://127.0.0.1:9090",
)
@out_folder_options(required=True, help="folder for dashboard.png, dashboard.csv, dashboard.json")
@click.option(
    "--minutes",
    type=ranged(Range(0, MAX_SECONDS / 60, " of minutes", low_open=True)),
    default=60.0,
    show_default=True,
    help="the last N minutes (without --start/--end)",
)
@click.option(
    "--start", "start_s", type=ranged(TIME_S), default=None, help="start of the window (unix seconds; with --end)"
)
@click.option(
    "--end", "end_s", type=ranged(TIME_S), default=None, help="end of the window (unix seconds; with --start)"
)
@click.option(
    "--step-s",
    type=ranged(DURATION_S),
    default=None,
    help="seconds between points [default: the window / 300, at least 15]",
)
@click.option(
    "--engine",
    default="0",
    show_default=True,
    callback=_checked_engine,
    help="the data-parallel rank to draw (label engine)",
)
def dashboard(prometheus_url, out: OutFolder, minutes, start_s, end_s, step_s, engine) -> None:
    """Draw the Grafana dashboard's panels from a Prometheus, without Grafana."""
    check_writable(out.path, "--out")
    start_s, end_s = _window(minutes, start_s, end_s)
    step_s = step_s or max(15.0, (end_s - start_s) / 300)
    if (end_s - start_s) / step_s > MAX_POINTS:
        raise click.BadParameter(
            f"too fine for the window: Prometheus answers at most {MAX_POINTS} points a series", param_hint="--step-s"
        )
    with out.open() as folder:  # nothing written when a query fails
        try:
            series = render(prometheus_url, folder.path, start_s, end_s, step_s, engine)
        except PrometheusError as err:
            raise click.ClickException(str(err)) from None
    if series.empty:
        click.echo(
            f"warning: no series for engine {engine} in that window: does {prometheus_url} scrape the plug-in's vLLM server?",
            err=True,
        )
    click.echo(
        f"wrote {out.path}/dashboard.png, dashboard.csv, dashboard.json ({series.groupby(['panel', 'legend']).ngroups} series)",
        err=True,
    )
