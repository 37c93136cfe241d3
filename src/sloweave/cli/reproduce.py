"""``sloweave reproduce``: the paper's study (``sloweave.studies.reproduce``)."""

from __future__ import annotations

import time
from pathlib import Path

import click
import pandas as pd

from sloweave.cli.command import command
from sloweave.cli.options import (
    OutFolder,
    cost_option,
    once_each,
    out_folder_options,
    parallel_options,
    ranged,
    requests_option,
)
from sloweave.core.costs.resolve import ResolvedCost
from sloweave.core.validate import REPEATS
from sloweave.sim.workloads import WORKLOADS
from sloweave.studies.outputs import check_writable
from sloweave.studies.parallel import Runner
from sloweave.studies.reproduce import (
    DEFAULT_REQUESTS,
    DEFAULT_SEEDS,
    QUICK_REQUESTS,
    StudyConfig,
    run_study,
    write_study,
)


@command()
@out_folder_options(default=Path("results/reproduce"), resumable=True)
@click.option("--seeds", type=ranged(REPEATS), default=DEFAULT_SEEDS, show_default=True)
@requests_option(help=f"requests per workload and seed [default: {DEFAULT_REQUESTS}, --quick: {QUICK_REQUESTS}]")
@click.option("--quick", is_flag=True, help=f"{QUICK_REQUESTS} requests per run instead of {DEFAULT_REQUESTS}")
@click.option(
    "--workload",
    "workloads",
    multiple=True,
    type=click.Choice(list(WORKLOADS)),
    callback=once_each,
    help="repeatable; default: all four",
)
@cost_option()
@parallel_options()
def reproduce(
    out: OutFolder,
    seeds: int,
    num_requests: int | None,
    quick: bool,
    workloads: tuple[str, ...],
    cost: ResolvedCost,
    runner: Runner,
) -> None:
    """Reproduce the paper's study: Table 3 (25 ms) and Table 4 (10/25/50 ms), with plots."""
    check_writable(out.path, "--out")
    if num_requests is None:
        num_requests = QUICK_REQUESTS if quick else DEFAULT_REQUESTS
    config = StudyConfig(
        workloads=workloads or tuple(WORKLOADS), seeds=seeds, num_requests=num_requests, cost=cost.model
    )
    started = time.perf_counter()
    with out.open(resumable=True) as folder:
        runs, samples = run_study(config, runner=runner, store=folder.store)
        elapsed = time.perf_counter() - started
        tables = write_study(runs, samples, config, folder.path, elapsed, cost)
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    if not cost.is_analytic:
        for line in cost.summary_lines():
            click.echo(line)
    for name, frame in tables.items():
        click.echo(f"\n== {name} ==")
        click.echo(frame.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    click.echo(
        f"\nwrote {out.path}/ (table3.csv, table4.csv, table4_extended.csv, report.md, runs.csv, plots) in {elapsed:.1f} s"
    )
