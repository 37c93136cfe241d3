"""``sloweave replay``: request traces under each policy (``sloweave.studies.replay``)."""

from __future__ import annotations

from pathlib import Path

import click

from sloweave.cli.command import command
from sloweave.cli.options import (
    OutFolder,
    cost_option,
    engine_options,
    gathered,
    max_chunk_option,
    max_model_len_option,
    once_each,
    out_folder_options,
    parallel_options,
    ranged,
    stacked,
    tpot_ms_option,
    trace_format_option,
    ttft_ms_option,
)
from sloweave.core.costs.resolve import ResolvedCost
from sloweave.core.validate import DURATION_S, MAX_TOKENS, RATE_RPS, SCALE, SEED, TIME_S, TOKENS, Range
from sloweave.sim.options import EngineOptions
from sloweave.sim.trace_replay import ReplayOptions, replay_workload
from sloweave.sim.traces import TraceError, load_trace
from sloweave.studies.inputs import model_len_or_default
from sloweave.studies.outputs import check_writable
from sloweave.studies.parallel import Runner
from sloweave.studies.replay import (
    DEFAULT_REPLAY_POLICIES,
    DEFAULT_TRACE_TTFT_MS,
    _write_replay,
    describe_report,
    replay_many,
)

WINDOW_OPTIONS = (
    "start_s",
    "end_s",
    "duration_s",
    "rate_scale",
    "max_prompt_tokens",
    "max_requests",
    "arrivals",
    "rate_rps",
    "seed",
)


def replay_options(
    start_s, end_s, duration_s, rate_scale, max_prompt_tokens, max_requests, arrivals, rate_rps, seed
) -> ReplayOptions:
    """The part of each trace to replay, and how, as the options give it."""
    if end_s is not None and duration_s is not None:
        raise click.UsageError("give --end-s or --duration-s, not both")
    if duration_s is not None:
        end_s = start_s + duration_s
    if arrivals == "trace" and rate_rps is not None:
        raise click.UsageError("--rate-rps only applies with --arrivals poisson")
    try:
        return ReplayOptions(
            start_s=start_s,
            end_s=end_s,
            rate_scale=rate_scale,
            max_prompt_tokens=max_prompt_tokens,
            max_requests=max_requests,
            arrivals=arrivals,
            poisson_rate_rps=rate_rps,
            seed=seed,
        )
    except ValueError as err:
        raise click.UsageError(str(err)) from None


# the options ``replay_options`` reads, in the order the help shows them
window_options = stacked(
    click.option(
        "--start-s",
        type=ranged(TIME_S),
        default=0.0,
        show_default=True,
        help="window start, seconds after the first request",
    ),
    click.option(
        "--end-s",
        type=ranged(DURATION_S),
        default=None,
        help="window end (exclusive), seconds; default: end of the trace",
    ),
    click.option("--duration-s", type=ranged(DURATION_S), default=None, help="window length instead of --end-s"),
    click.option(
        "--rate-scale",
        type=ranged(SCALE),
        default=1.0,
        show_default=True,
        help="time-scale factor: arrivals are divided by it (2 = twice as fast)",
    ),
    click.option(
        "--max-prompt-tokens",
        type=ranged(TOKENS),
        default=None,
        help="cap prompts at this length (the count is reported)",
    ),
    click.option(
        "--max-requests",
        type=ranged(Range(1, MAX_TOKENS, " of requests", whole=True)),
        default=None,
        help="keep the first N requests of the window",
    ),
    click.option(
        "--arrivals",
        type=click.Choice(["trace", "poisson"]),
        default="trace",
        show_default=True,
        help="poisson: generate arrivals (needed for length-only files)",
    ),
    click.option(
        "--rate-rps",
        type=ranged(RATE_RPS),
        default=None,
        help="rate of generated Poisson arrivals (before --rate-scale)",
    ),
    click.option("--seed", type=ranged(SEED), default=0, show_default=True, help="seed of generated arrivals"),
)


def _distinct_stems(trace_paths) -> list[str]:
    """Each trace's folder name (its file's); two traces may not share one."""
    stems = [path.stem for path in trace_paths]
    repeated = sorted({stem for stem in stems if stems.count(stem) > 1})
    if repeated:
        raise click.BadParameter(
            f"two traces would write the same folder {', '.join(repeated)}: give files of different names",
            param_hint="TRACE",
        )
    return stems


def _replayed_traces(trace_paths, fmt, max_model_len_tokens, window: ReplayOptions) -> list:
    """(workload, report) of each trace, its report printed."""
    try:
        replays = [
            replay_workload(load_trace(path, fmt, model_len_or_default(max_model_len_tokens)), window)
            for path in trace_paths
        ]
    except (TraceError, ValueError) as err:
        raise click.UsageError(str(err)) from None
    for _, report in replays:
        click.echo(describe_report(report), err=True)
    return replays


def _print_tables(out_dir: Path, stems, replays, tables, cost: ResolvedCost) -> None:
    if not cost.is_analytic or cost.kv_memory is not None:  # the model, and the KV capacity the runs used
        for line in cost.summary_lines():
            click.echo(line)
    for stem, (_, report), table in zip(stems, replays, tables):
        where = out_dir if len(stems) == 1 else out_dir / stem
        if len(stems) > 1:
            click.echo(f"== {report.source}")
        columns = ["policy", "attainment", "goodput_rps", "p99_ttft_ms", "p99_tpot_ms", "num_pending"]
        click.echo(table[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        click.echo(f"wrote {where}/metrics.csv, replay.json, requests.csv, cdf_ttft.png, cdf_p99_tpot.png")


@command()
@click.argument(
    "trace_paths", metavar="TRACE...", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path)
)
@trace_format_option()
@window_options
@gathered("window", replay_options, WINDOW_OPTIONS)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    callback=once_each,
    default=DEFAULT_REPLAY_POLICIES,
    show_default=True,
    help="repeat for several",
)
@tpot_ms_option()
@ttft_ms_option(DEFAULT_TRACE_TTFT_MS)
@max_chunk_option()
@max_model_len_option()
@parallel_options()
@engine_options()
@cost_option()
@out_folder_options(default=Path("results/replay"), resumable=True)
def replay(
    trace_paths,
    fmt,
    window: ReplayOptions,
    max_model_len_tokens,
    runner: Runner,
    policies,
    tpot_ms,
    ttft_ms,
    max_chunk,
    engine: EngineOptions,
    cost: ResolvedCost,
    out: OutFolder,
) -> None:
    """Replay request traces under each policy; write requests.csv, metrics.csv/json and CDF plots.

    One trace writes under --out; several write one folder per trace (named by its file)
    under --out, and all their runs are one batch of tasks (--jobs, --ray)."""
    check_writable(out.path, "--out")
    stems = _distinct_stems(trace_paths)
    replays = _replayed_traces(trace_paths, fmt, max_model_len_tokens, window)
    tables = []
    with out.open(resumable=True) as folder:
        try:
            results = replay_many(
                [w for w, _ in replays],
                list(policies),
                tpot_ms,
                ttft_ms,
                cost.model,
                max_chunk,
                True,
                engine,
                window.seed,
                runner,
                folder.store,
            )
        except (TraceError, ValueError) as err:
            raise click.UsageError(str(err)) from None
        for stem, (_, report), (requests, metrics) in zip(stems, replays, results):
            where = folder.path if len(trace_paths) == 1 else folder.path / stem
            tables.append(_write_replay(where, report, requests, metrics, tpot_ms, ttft_ms, max_chunk, engine, cost))
    _print_tables(out.path, stems, replays, tables, cost)
