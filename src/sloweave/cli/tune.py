"""``sloweave tune``: the best fixed token budget for engines that only have one (``sloweave.studies.tune``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path

import click

from sloweave.cli.command import command
from sloweave.cli.options import (
    OutFolder,
    cost_kind_option,
    cost_option,
    engine_options,
    gathered,
    given_on_command_line,
    max_chunk_option,
    max_model_len_option,
    once_each,
    out_folder_options,
    parallel_options,
    ranged,
    refuse_step_profile_options,
    requests_option,
    tier_mix,
    tier_option,
    tpot_ms_option,
    trace_format_option,
    ttft_ms_option,
)
from sloweave.core.costs.resolve import KIND_STEP_PROFILE, ResolvedCost
from sloweave.core.validate import ATTAINMENT, DURATION_S, MAX_TOKENS, REPEATS, SCALE, TOKENS, Range
from sloweave.sim.options import EngineOptions
from sloweave.sim.tiers import Tier
from sloweave.sim.traces import TraceError, load_trace
from sloweave.sim.workloads import ALL_WORKLOADS, WorkloadError, mean_context_tokens
from sloweave.studies.inputs import model_len_or_default
from sloweave.studies.outputs import check_writable, command_settings
from sloweave.studies.parallel import Runner
from sloweave.studies.replay import DEFAULT_TRACE_TTFT_MS
from sloweave.studies.search import DEFAULT_ATTAINMENT, SearchLattice
from sloweave.studies.sources import DEFAULT_WINDOW_S, LoadSource, SpecSource, trace_source
from sloweave.studies.tune import RULES, tune
from sloweave.studies.tune_report import ENGINES, tune_table, write_outputs
from sloweave.studies.tune_tiers import check_every_tier_draws, mix_note

# options that only a step-time profile file as --cost reads
STEP_PROFILE_OPTIONS = (("cost_kind", "--cost-kind"), ("context_tokens", "--context-tokens"))


@dataclass(frozen=True)
class TuneLoad:
    """The operator's load: a workload or a trace, cut into seeds."""

    workload: str | None
    trace_path: Path | None
    fmt: str
    seeds: int | None
    num_requests: int | None
    window_s: float
    max_model_len_tokens: int | None


def _load_source(load: TuneLoad, quick: bool, ttft_ms: float | None):
    """The load source, and the TTFT target (the source's default unless given)."""
    seeds = load.seeds or (3 if quick else 5)
    if load.trace_path is not None:
        trace = load_trace(load.trace_path, load.fmt, model_len_or_default(load.max_model_len_tokens))
        window_s = load.window_s if trace.has_arrivals else None
        return trace_source(
            trace, seeds, window_s, requests_per_seed=load.num_requests
        ), ttft_ms or DEFAULT_TRACE_TTFT_MS
    spec = ALL_WORKLOADS[load.workload]
    return SpecSource(spec, load.num_requests or (800 if quick else 2000), tuple(range(seeds))), ttft_ms or spec.ttft_ms


def step_profile_cost(
    resolved: ResolvedCost, kind: str, context_tokens: float | None, source: LoadSource
) -> ResolvedCost:
    """A step-time profile as the sweep uses it: the fitted ``kind`` at a fixed KV context per
    decode (by default the workload's mean context, the advice in sloweave.core.costs.fitted)."""
    if context_tokens is None:
        context_tokens = mean_context_tokens(*(source.workload(seed, 1.0) for seed in range(source.num_seeds)))
    return resolved.step_profile(kind, context_tokens)


def _check_inputs(load: TuneLoad) -> None:
    if (load.trace_path is None) == (load.workload is None):
        raise click.UsageError("give exactly one of --workload NAME or --trace PATH")
    if load.workload is not None and load.max_model_len_tokens is not None:
        raise click.UsageError("--max-model-len applies to --trace only")


def _tier_mix_alone(specs: tuple[str, ...], ttft_ms: float | None) -> tuple[Tier, ...]:
    """The ``--tier`` mix (empty: none). With one, each request's targets are its tier's: a single
    target given as well would be ignored, so it is refused, naming the option (``--tpot-ms`` has
    a default: refused only when typed)."""
    tiers = tier_mix(specs)
    if not tiers:
        return tiers
    if given_on_command_line("tpot_ms"):
        raise click.UsageError(
            "--tpot-ms cannot go with --tier: each tier names its own TPOT target (NAME:TPOT_MS:TTFT_MS:SHARE), "
            "and every budget is searched once for the whole mix; give the targets in the tiers"
        )
    if ttft_ms is not None:
        raise click.UsageError("--ttft-ms cannot go with --tier: each tier names its own TTFT target")
    return tiers


def _notes(cost: ResolvedCost, engine_opts: EngineOptions, tiers: tuple[Tier, ...], attainment: float) -> list[str]:
    """The lines that head the report: the cost model's (a measured one), the engine options, the tier mix."""
    notes = cost.summary_lines() if not cost.is_analytic or cost.kv_memory is not None else []
    return [*notes, f"engine options: {engine_opts.label()}", *mix_note(tiers, attainment)]


def _settings(tiers: tuple[Tier, ...]) -> dict:
    """The command's options as the result files record them; with tiers, no single TPOT target
    (``--tpot-ms`` only has its default then, which no request is held to)."""
    options = command_settings()
    return {**options, "tpot_ms": None} if tiers else options


def _print_advice(result, payload: dict, notes: list[str], out_dir: Path) -> None:
    for line in notes:
        click.echo(line)
    click.echo(tune_table(result))
    for line in payload["advice"]:
        click.echo(line)
    click.echo(f"wrote {out_dir}/tune.csv, tune.md, tune.json, tune.png ({result.simulations} simulations)", err=True)
    sys.stdout.flush()


@command("tune")
@click.option("--workload", type=click.Choice(list(ALL_WORKLOADS)), default=None, help="synthetic workload or scenario")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="request trace file instead",
)
@trace_format_option()
@click.option(
    "--engine", type=click.Choice(list(ENGINES)), default="vllm", show_default=True, help="whose flag to print"
)
@click.option(
    "--rule",
    type=click.Choice(RULES),
    default=None,
    help="the engine's budget rule [default: the engine's: vllm/trtllm sarathi, sglang fixed]",
)
@tpot_ms_option()
@ttft_ms_option(help=f"TTFT target [default: the workload's; {DEFAULT_TRACE_TTFT_MS:g} for a trace]")
@tier_option(
    "a budget's capacity is the highest load at which every tier keeps the attainment target, and the advice the "
    "budget with the highest capacity for the mix, against SLOWeave with per-request targets (not with --tpot-ms "
    "or --ttft-ms)"
)
@click.option("--attainment", type=ranged(ATTAINMENT), default=DEFAULT_ATTAINMENT, show_default=True)
@click.option(
    "--budget",
    "budgets",
    type=ranged(TOKENS),
    multiple=True,
    callback=once_each,
    help="repeat for a custom sweep, swept exactly [default: from the cost model and the targets: powers of two "
    "and 1.5x between, from the decode batch that fills a TPOT step to the largest prompt prefilled within TTFT, "
    "extended past an edge that holds the best]",
)
@click.option(
    "--load-scale",
    type=ranged(SCALE),
    default=None,
    help="load for the goodput comparison, as a rate scale [default: the best budget's capacity]",
)
@cost_option()
@cost_kind_option(help="model fitted from a step-time profile file")
@click.option(
    "--context-tokens",
    type=ranged(Range(0, MAX_TOKENS, " of tokens", low_open=True)),
    default=None,
    help="KV context per decode for a step-time profile file [default: mean prompt + half the mean output]",
)
@click.option("--seeds", type=ranged(REPEATS), default=None, help="seeds / trace windows [default: 5; --quick 3]")
@requests_option(help="requests per seed of a workload [default: 2000; --quick 800]")
@click.option(
    "--window-s", type=ranged(DURATION_S), default=DEFAULT_WINDOW_S, show_default=True, help="trace window length"
)
@click.option(
    "--min-scale",
    type=ranged(SCALE),
    default=1.0 / 16.0,
    show_default=True,
    help="lowest load searched (rate scale); lower it for slow cost models",
)
@max_chunk_option(help="SLOWeave's C_max")
@click.option(
    "--refine/--no-refine",
    default=True,
    show_default=True,
    help="one more round between the best budget and its neighbours",
)
@click.option("--quick", is_flag=True, help="3 seeds, 800 requests, budgets on powers of two only, lattice step 9 %")
@parallel_options()
@max_model_len_option()
@gathered("load", TuneLoad, tuple(f.name for f in fields(TuneLoad)))
@engine_options(dest="engine_opts")
@out_folder_options(default=Path("results/tune"), resumable=True)
def tune_command(
    load: TuneLoad,
    engine,
    rule,
    tpot_ms,
    ttft_ms,
    tiers: tuple[str, ...],
    attainment,
    budgets,
    load_scale,
    cost: ResolvedCost,
    cost_kind,
    context_tokens,
    min_scale,
    max_chunk,
    refine,
    quick,
    runner: Runner,
    engine_opts: EngineOptions,
    out: OutFolder,
) -> None:
    """Sweep the fixed token budget of an engine and print the value to set."""
    _check_inputs(load)
    check_writable(out.path, "--out")
    tiers = _tier_mix_alone(tiers, ttft_ms)
    refuse_step_profile_options(cost, STEP_PROFILE_OPTIONS)
    try:
        source, ttft_ms = _load_source(load, quick, ttft_ms)
        check_every_tier_draws(source, tiers)
        if cost.kind == KIND_STEP_PROFILE:
            cost = step_profile_cost(cost, cost_kind, context_tokens, source)
        lattice = SearchLattice(attainment, 8 if quick else 16, min_scale)
    except (TraceError, WorkloadError, ValueError) as err:
        raise click.UsageError(str(err)) from None
    with out.open(resumable=True) as folder:
        try:
            result = tune(
                source,
                rule or ENGINES[engine][1],
                tuple(budgets) or None,
                None if tiers else tpot_ms,
                None if tiers else ttft_ms,
                cost.model,
                load_scale,
                refine,
                lattice,
                max_chunk_tokens=max_chunk,
                options=engine_opts,
                runner=runner,
                progress=True,
                store=folder.store,
                coarse_grid=quick,
                tiers=tiers,
            )
        except (TraceError, WorkloadError, ValueError) as err:
            raise click.UsageError(str(err)) from None
        notes = _notes(cost, engine_opts, tiers, attainment)
        meta = {"command": "tune", "options": _settings(tiers), "cost": cost.description}
        payload = write_outputs(result, engine, folder.path, meta, notes)
    _print_advice(result, payload, notes, out.path)
