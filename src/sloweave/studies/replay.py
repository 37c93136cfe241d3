"""Replay a trace under several policies: per-request outcomes, metrics and CDF plots.

Also holds what the capacity search shares with it: running one policy and the plots.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import click
import numpy as np
import pandas as pd

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.protocols import CostModel
from sloweave.core.costs.resolve import ResolvedCost, cost_option
from sloweave.sim.metrics import RunMetrics, per_request_frame, run_duration_ms, slo_met, summarize
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS, Policy, make_policy
from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions, engine_options
from sloweave.core.validate import DURATION_MS, DURATION_S, MAX_TOKENS, RATE_RPS, SCALE, SEED, TIME_S, TOKENS, Range
from sloweave.studies.inputs import max_model_len_option, model_len_or_default, once_each, parallel_options, runner_of
from sloweave.studies.outputs import check_writable, command_settings, write_result_json
from sloweave.studies.result_folders import result_folder, result_folder_options
from sloweave.studies.parallel import SERIAL, Runner, run_tasks
from sloweave.studies.pictures import pyplot
from sloweave.sim.traces import FORMATS, ReplayOptions, ReplayReport, TraceError, load_trace, replay_workload
from sloweave.sim.workloads import Workload

DEFAULT_REPLAY_POLICIES = ("sloweave", "full", "fixed-256", "fixed-1024", "fixed-2048")
# The conversation trace is an interactive chat service: SPEC.md's chat TTFT target (see docs/capacity.md).
DEFAULT_TRACE_TTFT_MS = 1000.0


def build_policy(name: str, cost: CostModel, max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS) -> Policy:
    return make_policy(name, cost=cost, max_chunk_tokens=max_chunk_tokens)


def run_policy(
    workload: Workload,
    policy: Policy,
    tpot_ms: float,
    cost: CostModel,
    options: EngineOptions = DEFAULT_OPTIONS,
    ttft_ms: float | None = None,
    noise_seed: int = 0,
) -> tuple[pd.DataFrame, float]:
    """Simulate and return (per-request frame, run duration in ms).

    ``cost`` is the machine's model for every policy (times ``options``' prediction error),
    so static and deadline policies run on the same machine, with the same engine options.
    """
    result = options.simulate(workload, policy, tpot_ms, ttft_ms, cost, noise_seed)
    return per_request_frame(result), run_duration_ms(result)


# --------------------------------------------------------------------------- plots


def policy_style(policy: str, index: int) -> dict:
    """SLOWeave thick, black and on top; the other policies in the default colour cycle, by list order."""
    if policy == "sloweave":
        return {"color": "black", "linewidth": 2.4, "zorder": 10}
    return {"color": f"C{index % 10}", "linewidth": 1.3, "zorder": 2}


def plot_cdfs(
    series: dict[str, np.ndarray], path: Path, xlabel: str, title: str, target: float | None = None, log_x: bool = False
) -> None:
    """Empirical CDFs, one line per label. Unfinished requests (nan) are left out of the
    curve but counted in the denominator, so a curve that stops below 1 shows them."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, (label, values) in enumerate(series.items()):
        values = np.asarray(values, dtype=float)
        finite = np.sort(values[np.isfinite(values)])
        if values.size == 0 or finite.size == 0:
            continue
        ax.step(
            finite, np.arange(1, finite.size + 1) / values.size, where="post", label=label, **policy_style(label, index)
        )
    if target is not None:
        ax.axvline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:g}", zorder=1)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- replay command


def replay_many(
    workloads: list[Workload],
    policies: list[str],
    tpot_ms: float,
    ttft_ms: float,
    cost: CostModel | None = None,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
    progress: bool = False,
    options: EngineOptions = DEFAULT_OPTIONS,
    noise_seed: int = 0,
    runner: Runner = SERIAL,
    store=None,
) -> list[tuple[pd.DataFrame, dict[str, RunMetrics]]]:
    """Run every policy on each workload (each trace), each with the same engine ``options``;
    per workload, all per-request rows and the metrics by policy. A policy named twice is
    refused. One batch of tasks, one per (workload, policy), run where ``runner`` says."""
    cost = cost or AnalyticCost()
    built = [build_policy(name, cost, max_chunk_tokens) for name in policies]
    twice = sorted(name for name, count in Counter(p.name for p in built).items() if count > 1)
    if twice:
        raise ValueError(f"policy given more than once: {', '.join(twice)} (each policy is replayed once)")
    context = (tuple(workloads), tpot_ms, ttft_ms, cost, options, noise_seed)
    tasks = [(w, policy) for w in range(len(workloads)) for policy in built]
    outcomes = iter(run_tasks(_replayed, tasks, context, runner, "replay", progress, store))
    replayed = []
    for _ in workloads:
        runs = [next(outcomes) for _ in built]
        metrics = {policy.name: m for policy, (_, m) in zip(built, runs)}
        replayed.append((pd.concat([frame for frame, _ in runs], ignore_index=True), metrics))
    return replayed


def _replayed(context, workload_index: int, policy) -> tuple[pd.DataFrame, RunMetrics]:
    workloads, tpot_ms, ttft_ms, cost, options, noise_seed = context
    frame, duration_ms = run_policy(workloads[workload_index], policy, tpot_ms, cost, options, ttft_ms, noise_seed)
    metrics = summarize(frame, duration_ms, ttft_ms, tpot_ms)
    frame.insert(0, "policy", policy.name)
    frame["slo_met"] = slo_met(frame, ttft_ms, tpot_ms)
    return frame, metrics


def _options_from_cli(
    start_s, end_s, duration_s, rate_scale, max_prompt_tokens, max_requests, arrivals, rate_rps, seed
):
    if end_s is not None and duration_s is not None:
        raise click.UsageError("give --end-s or --duration-s, not both")
    if duration_s is not None:
        end_s = start_s + duration_s
    if arrivals == "trace" and rate_rps is not None:
        raise click.UsageError("--rate-rps only applies with --arrivals poisson")
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


def describe_report(report: ReplayReport) -> str:
    lines = [f"trace {report.source} ({report.fmt}): {report.num_requests} of {report.num_requests_in_file} requests"]
    if report.arrivals_generated:
        lines.append(f"ARRIVALS {report.arrivals}")
    else:
        lines.append(
            f"window [{report.window_start_s:g}, {report.window_end_s:g}) s of the trace, "
            f"replayed x{report.rate_scale:g}: {report.base_rate_rps:.3f} -> {report.offered_rate_rps:.3f} req/s"
        )
    if report.max_prompt_tokens is not None:
        lines.append(f"prompt cap {report.max_prompt_tokens} tokens: {report.num_prompts_capped} prompt(s) capped")
    return "\n".join(lines)


@click.command()
@click.argument(
    "trace_paths", metavar="TRACE...", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path)
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True)
@click.option(
    "--start-s",
    type=TIME_S.option(),
    default=0.0,
    show_default=True,
    help="window start, seconds after the first request",
)
@click.option(
    "--end-s", type=DURATION_S.option(), default=None, help="window end (exclusive), seconds; default: end of the trace"
)
@click.option("--duration-s", type=DURATION_S.option(), default=None, help="window length instead of --end-s")
@click.option(
    "--rate-scale",
    type=SCALE.option(),
    default=1.0,
    show_default=True,
    help="time-scale factor: arrivals are divided by it (2 = twice as fast)",
)
@click.option(
    "--max-prompt-tokens", type=TOKENS.option(), default=None, help="cap prompts at this length (the count is reported)"
)
@click.option(
    "--max-requests",
    type=Range(1, MAX_TOKENS, " of requests", whole=True).option(),
    default=None,
    help="keep the first N requests of the window",
)
@click.option(
    "--arrivals",
    type=click.Choice(["trace", "poisson"]),
    default="trace",
    show_default=True,
    help="poisson: generate arrivals (needed for length-only files)",
)
@click.option(
    "--rate-rps", type=RATE_RPS.option(), default=None, help="rate of generated Poisson arrivals (before --rate-scale)"
)
@click.option("--seed", type=SEED.option(), default=0, show_default=True, help="seed of generated arrivals")
@click.option(
    "--policy",
    "policies",
    multiple=True,
    callback=once_each,
    default=DEFAULT_REPLAY_POLICIES,
    show_default=True,
    help="repeat for several",
)
@click.option("--tpot-ms", type=DURATION_MS.option(), default=25.0, show_default=True)
@click.option("--ttft-ms", type=DURATION_MS.option(), default=DEFAULT_TRACE_TTFT_MS, show_default=True)
@click.option("--max-chunk", type=TOKENS.option(), default=DEFAULT_MAX_CHUNK_TOKENS, show_default=True)
@max_model_len_option()
@parallel_options()
@engine_options()
@cost_option()
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("results/replay"),
    show_default=True,
)
@result_folder_options(resumable=True)
def replay(
    trace_paths,
    fmt,
    start_s,
    end_s,
    duration_s,
    rate_scale,
    max_prompt_tokens,
    max_requests,
    arrivals,
    rate_rps,
    seed,
    max_model_len_tokens,
    jobs,
    ray_address,
    policies,
    tpot_ms,
    ttft_ms,
    max_chunk,
    engine: EngineOptions,
    cost: ResolvedCost,
    out_dir,
    force,
    resume,
) -> None:
    """Replay request traces under each policy; write requests.csv, metrics.csv/json and CDF plots.

    One trace writes under --out; several write one folder per trace (named by its file)
    under --out, and all their runs are one batch of tasks (--jobs, --ray)."""
    check_writable(out_dir, "--out")
    stems = [path.stem for path in trace_paths]
    repeated = sorted({stem for stem in stems if stems.count(stem) > 1})
    if repeated:
        raise click.BadParameter(
            f"two traces would write the same folder {', '.join(repeated)}: give files of different names",
            param_hint="TRACE",
        )
    try:
        options = _options_from_cli(
            start_s, end_s, duration_s, rate_scale, max_prompt_tokens, max_requests, arrivals, rate_rps, seed
        )
        replays = [
            replay_workload(load_trace(path, fmt, model_len_or_default(max_model_len_tokens)), options)
            for path in trace_paths
        ]
        for _, report in replays:
            click.echo(describe_report(report), err=True)
    except (TraceError, ValueError) as err:
        raise click.UsageError(str(err)) from None
    tables = []
    with result_folder(out_dir, force, resume, resumable=True) as folder:
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
                seed,
                runner_of(jobs, ray_address),
                folder.store,
            )
        except (TraceError, ValueError) as err:
            raise click.UsageError(str(err)) from None
        for stem, (_, report), (requests, metrics) in zip(stems, replays, results):
            where = folder.path if len(trace_paths) == 1 else folder.path / stem
            tables.append(_write_replay(where, report, requests, metrics, tpot_ms, ttft_ms, max_chunk, engine, cost))
    if not cost.is_analytic:
        for line in cost.summary_lines():
            click.echo(line)
    for stem, (_, report), table in zip(stems, replays, tables):
        where = out_dir if len(trace_paths) == 1 else out_dir / stem
        if len(trace_paths) > 1:
            click.echo(f"== {report.source}")
        columns = ["policy", "attainment", "goodput_rps", "p99_ttft_ms", "p99_tpot_ms", "num_pending"]
        click.echo(table[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        click.echo(f"wrote {where}/metrics.csv, replay.json, requests.csv, cdf_ttft.png, cdf_p99_tpot.png")


def _write_replay(
    out_dir: Path,
    report: ReplayReport,
    requests: pd.DataFrame,
    metrics: dict,
    tpot_ms,
    ttft_ms,
    max_chunk,
    engine,
    cost,
) -> pd.DataFrame:
    """One trace's files: metrics.csv, requests.csv, replay.json, the two CDF plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(
        [{"policy": name, "tpot_ms": tpot_ms, "ttft_ms": ttft_ms, **m.as_dict()} for name, m in metrics.items()]
    )
    table.to_csv(out_dir / "metrics.csv", index=False)
    requests.to_csv(out_dir / "requests.csv", index=False)
    payload = {
        "command": "replay",
        "settings": command_settings(),
        "replay": report.as_dict(),
        "tpot_ms": tpot_ms,
        "ttft_ms": ttft_ms,
        "max_chunk_tokens": max_chunk,
        "engine_options": engine.describe(),
        "cost": cost.description,
        "metrics": {name: m.as_dict() for name, m in metrics.items()},
    }
    write_result_json(out_dir / "replay.json", payload)
    by_policy = {name: frame for name, frame in requests.groupby("policy", sort=False)}
    arrivals_text = "generated arrivals" if report.arrivals_generated else f"x{report.rate_scale:g}"
    title = f"{Path(report.source).name} ({arrivals_text}, {report.offered_rate_rps:.1f} req/s)"
    plot_cdfs(
        {k: v["ttft_ms"].to_numpy() for k, v in by_policy.items()},
        out_dir / "cdf_ttft.png",
        "TTFT (ms)",
        title,
        ttft_ms,
        log_x=True,
    )
    plot_cdfs(
        {k: v["p99_tpot_ms"].to_numpy() for k, v in by_policy.items()},
        out_dir / "cdf_p99_tpot.png",
        "per-request P99 inter-token gap (ms)",
        title,
        tpot_ms,
    )
    return table
