"""``sloweave ablate``: what each option beyond the paper changes (``sloweave.studies.ablate``)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from sloweave.cli.command import command
from sloweave.cli.options import (
    OutFolder,
    cost_option,
    given_on_command_line,
    gpu_memory_utilization_option,
    once_each,
    out_folder_options,
    parallel_options,
    ranged,
    requests_option,
)
from sloweave.core.costs.resolve import ResolvedCost
from sloweave.core.validate import DURATION_S, REPEATS, SCALE
from sloweave.sim.traces import TraceError
from sloweave.sim.workloads import WORKLOADS
from sloweave.studies.ablate import (
    CONFIG_NAMES,
    CONFIGS,
    DEFAULT_TRACE,
    QUICK_TRACE_WINDOW_S,
    TRACE_RATE_SCALE,
    TRACE_WINDOW_S,
    Config,
    kv_rows,
    run_ablation,
    synthetic_source,
    trace_windows_source,
    write_ablation,
)
from sloweave.studies.markdown import markdown_table
from sloweave.studies.outputs import check_writable, command_settings
from sloweave.studies.parallel import Runner
from sloweave.studies.reproduce import DEFAULT_REQUESTS, DEFAULT_SEEDS, QUICK_REQUESTS, TPOT_TARGETS_MS


def _chosen_configs(config_names: tuple[str, ...]) -> tuple[Config, ...]:
    """The configurations asked for (all when none), greedy, and the reference each is compared with."""
    names = set(config_names) | {"greedy"} if config_names else set(CONFIG_NAMES)
    for config in CONFIGS:
        if config.name in names:
            names.add(config.reference)
    return tuple(c for c in CONFIGS if c.name in names)


def _with_kv_rows(
    configs: tuple[Config, ...], cost: ResolvedCost, gpu_memory_utilization: float
) -> tuple[tuple[Config, ...], ResolvedCost]:
    """The KV rows at the cost model's KV capacity (``kv_rows``), and the cost stating it when they run."""
    if not any(c.kv_capacity_tokens is not None for c in configs):
        if given_on_command_line("gpu_memory_utilization"):
            raise click.BadParameter(
                "sizes the kv rows' KV cache; no kv row is run", param_hint="--gpu-memory-utilization"
            )
        return configs, cost
    try:
        configs, kv = kv_rows(configs, cost, gpu_memory_utilization)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--gpu-memory-utilization") from None
    if given_on_command_line("gpu_memory_utilization") and kv.source != "model":
        raise click.BadParameter(cost.no_kv_memory_reason(), param_hint="--gpu-memory-utilization")
    return configs, cost.with_kv_memory(kv)


def _print_ablation(out: dict, cost: ResolvedCost, out_dir: Path, elapsed_s: float) -> None:
    if not cost.is_analytic:
        for line in cost.summary_lines():
            click.echo(line)
    click.echo(markdown_table(out["wide"]))
    for row in out["goal"]:
        click.echo(
            f"goal {row['source']} {row['tpot_ms']:g} ms: best/greedy = {row['ratio']:.2f}x (need >= {row['needed']:.2f}x): {'met' if row['met'] else 'NOT met'}"
        )
    click.echo(f"wrote {out_dir}/ablation.csv, ablation.md, ablation.json, ablation.png ({elapsed_s:.0f} s)")


@command()
@out_folder_options(default=Path("results/ablation"), resumable=True)
@click.option(
    "--seeds",
    type=ranged(REPEATS),
    default=DEFAULT_SEEDS,
    show_default=True,
    help="seeds per workload (trace: disjoint windows)",
)
@requests_option(help=f"requests per synthetic seed [default: {DEFAULT_REQUESTS}, --quick: {QUICK_REQUESTS}]")
@click.option(
    "--quick", is_flag=True, help=f"{QUICK_REQUESTS} requests per seed, {QUICK_TRACE_WINDOW_S:g} s trace windows"
)
@click.option(
    "--workload",
    "workloads",
    multiple=True,
    type=click.Choice(list(WORKLOADS)),
    callback=once_each,
    help="repeatable; default: all four",
)
@click.option(
    "--config",
    "config_names",
    multiple=True,
    type=click.Choice(list(CONFIG_NAMES)),
    callback=once_each,
    help="repeatable; default: all (greedy is always run)",
)
@click.option(
    "--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_TRACE, show_default=True
)
@click.option("--no-trace", is_flag=True, help="skip the real trace")
@click.option("--trace-rate-scale", type=ranged(SCALE), default=TRACE_RATE_SCALE, show_default=True)
@click.option(
    "--trace-window-s",
    type=ranged(DURATION_S),
    default=None,
    help=f"[default: {TRACE_WINDOW_S:g}, --quick: {QUICK_TRACE_WINDOW_S:g}]",
)
@cost_option()
@gpu_memory_utilization_option()
@parallel_options()
def ablate(
    out: OutFolder,
    seeds,
    num_requests,
    quick,
    workloads,
    config_names,
    trace_path,
    no_trace,
    trace_rate_scale,
    trace_window_s,
    cost: ResolvedCost,
    gpu_memory_utilization: float,
    runner: Runner,
) -> None:
    """Ablation of the options beyond the paper: CSV, Markdown, JSON and a plot under --out."""
    check_writable(out.path, "--out")
    if num_requests is None:
        num_requests = QUICK_REQUESTS if quick else DEFAULT_REQUESTS
    if trace_window_s is None:
        trace_window_s = QUICK_TRACE_WINDOW_S if quick else TRACE_WINDOW_S
    configs, cost = _with_kv_rows(_chosen_configs(config_names), cost, gpu_memory_utilization)
    started = time.perf_counter()
    sources = [synthetic_source(name, seeds, num_requests) for name in (workloads or tuple(WORKLOADS))]
    if not no_trace:
        try:
            sources.append(trace_windows_source(trace_path, seeds, trace_window_s, trace_rate_scale))
        except TraceError as err:
            raise click.UsageError(f"{err} (pass --no-trace to run without the real trace)") from None
    with out.open(resumable=True) as folder:
        runs, tiers = run_ablation(sources, configs, TPOT_TARGETS_MS, cost=cost, runner=runner, store=folder.store)
        trace = f"{trace_path} x{trace_rate_scale:g}, {seeds} windows of {trace_window_s:g} s"
        meta = {
            "command": "ablate",
            "settings": command_settings(),
            "seeds": seeds,
            "num_requests": num_requests,
            "trace": None if no_trace else trace,
            "tpot_targets_ms": list(TPOT_TARGETS_MS),
            "elapsed_s": time.perf_counter() - started,
        }
        written = write_ablation(runs, tiers, configs, folder.path, meta, cost)
    _print_ablation(written, cost, out.path, meta["elapsed_s"])
