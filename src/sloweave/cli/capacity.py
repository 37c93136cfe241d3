"""``sloweave capacity``: the highest load at which each policy keeps SLO attainment at the target
(``sloweave.studies.capacity``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import click
import pandas as pd

from sloweave.cli.command import command
from sloweave.cli.options import (
    OutFolder,
    cost_kind_option,
    config_options,
    cost_option,
    engine_options,
    gathered,
    max_chunk_option,
    max_model_len_option,
    once_each,
    out_folder_options,
    parallel_options,
    ranged,
    refuse_step_profile_options,
    stacked,
    requests_option,
    tier_mix,
    tier_option,
    trace_format_option,
)
from sloweave.core.costs.resolve import KIND_STEP_PROFILE, ResolvedCost
from sloweave.core.validate import ATTAINMENT, DURATION_MS, DURATION_S, RATE_RPS, REPEATS, SCALE, TOKENS, setting
from sloweave.sim.options import EngineOptions
from sloweave.sim.tiers import Tier, describe_tier_mix
from sloweave.sim.traces import TraceError, load_trace
from sloweave.sim.workloads import ALL_WORKLOADS, WorkloadError
from sloweave.studies.capacity import DEFAULT_POLICIES, DEFAULT_TPOT_TARGETS_MS, run_capacity
from sloweave.studies.inputs import model_len_or_default
from sloweave.studies.outputs import check_writable, command_settings
from sloweave.studies.parallel import Runner
from sloweave.studies.replay import DEFAULT_TRACE_TTFT_MS
from sloweave.studies.search import DEFAULT_ATTAINMENT, TOO_SHORT, CapacityStudy, SearchLattice, budget_of
from sloweave.studies.search_records import tier_columns_of
from sloweave.studies.sources import DEFAULT_WINDOW_S, SpecSource, back_to_back, trace_source


@dataclass(frozen=True)
class LoadOptions:
    """Where the load comes from: a workload, or traces and how each seed's window is cut."""

    trace_paths: tuple[Path, ...]
    workload: str | None
    fmt: str
    seeds: int | None
    window_s: float
    whole_trace: bool
    num_requests: int | None
    max_prompt_tokens: int | None
    arrivals: str
    rate_rps: float | None
    max_model_len_tokens: int | None


@dataclass(frozen=True)
class Targets:
    """The SLO every policy is held to: TPOT targets (one search each), TTFT and attainment."""

    tpot_targets: tuple[float, ...] = setting(
        (), "repeat for several [default: 10, 25, 50]", values=DURATION_MS, flag="--tpot-ms", repeat=True
    )
    tpot_change_ms: float | None = setting(
        None,
        "the TPOT target changes to this for requests arriving in the second half of each run",
        values=DURATION_MS,
    )
    ttft_ms: float | None = setting(
        None, f"TTFT target [default: the workload's; {DEFAULT_TRACE_TTFT_MS:g} for a trace]", values=DURATION_MS
    )
    attainment: float = setting(DEFAULT_ATTAINMENT, "SLO attainment every TPOT target is held to", values=ATTAINMENT)


@dataclass(frozen=True)
class Lattice:
    """The load lattice options (``quick`` gives the coarser defaults)."""

    steps_per_doubling: int | None = setting(
        None, "load lattice resolution [default: 16 (4.4%); --quick 8 (9%)]", values=REPEATS
    )
    min_scale: float = setting(1.0 / 16.0, "lowest load scale searched", values=SCALE)
    max_scale: float = setting(256.0, "highest load scale searched", values=SCALE)

    def search(self, attainment: float, quick: bool) -> SearchLattice:
        steps = self.steps_per_doubling or (8 if quick else 16)
        return SearchLattice(attainment, steps, self.min_scale, self.max_scale, 2 if quick else 4)


def load_source(load: LoadOptions, seeds: int, quick: bool, ttft_ms: float | None):
    """The load source the options describe, and the TTFT target (the source's default unless given)."""
    if load.workload is not None:
        if (
            load.whole_trace
            or load.max_prompt_tokens is not None
            or load.arrivals != "trace"
            or load.rate_rps is not None
            or load.max_model_len_tokens is not None
        ):
            raise click.UsageError(
                "--whole-trace, --max-prompt-tokens, --arrivals, --rate-rps and --max-model-len apply to --trace only"
            )
        spec = ALL_WORKLOADS[load.workload]
        return SpecSource(
            spec, load.num_requests or (800 if quick else 2000), tuple(range(seeds))
        ), ttft_ms or spec.ttft_ms
    if load.arrivals == "trace" and load.rate_rps is not None:
        raise click.UsageError("--rate-rps only applies with --arrivals poisson")
    sources = [_one_trace_source(load, path, seeds, quick) for path in load.trace_paths]
    return (sources[0] if len(sources) == 1 else back_to_back(sources)), ttft_ms or DEFAULT_TRACE_TTFT_MS


def _one_trace_source(load: LoadOptions, path: Path, seeds: int, quick: bool):
    trace = load_trace(path, load.fmt, model_len_or_default(load.max_model_len_tokens))
    window = None if load.whole_trace else load.window_s
    if window is not None and trace.has_arrivals and load.arrivals == "trace" and window * seeds > trace.span_s:
        raise click.UsageError(
            f"{path}: {seeds} windows of {window:g} s do not fit in the trace's {trace.span_s:.1f} s: "
            "lower --window-s or --seeds, or use --whole-trace"
        )
    # Generated arrivals subsample the lengths; trace windows keep every request unless told.
    requests_per_seed = load.num_requests
    if load.arrivals == "poisson" and load.num_requests is None:
        requests_per_seed = 800 if quick else 2000
    return trace_source(trace, seeds, window, load.max_prompt_tokens, load.arrivals, load.rate_rps, requests_per_seed)


def _print_notes(description: dict, load: LoadOptions) -> None:
    if "GENERATED" in str(description.get("kind", "")):
        click.echo(
            f"NOTE: arrivals are GENERATED (Poisson, {load.rate_rps:g} req/s at scale 1), not read from {', '.join(map(str, load.trace_paths))}",
            err=True,
        )
    if description.get("num_prompts_capped"):
        click.echo(
            f"NOTE: {description['num_prompts_capped']} prompt(s) capped at {load.max_prompt_tokens} tokens", err=True
        )


CAPACITY_SHOWN = [
    "policy",
    "tuned_to",
    "tpot_ms",
    "capacity_scale",
    "capacity_scale_std",
    "capacity_rps",
    "capacity_rps_std",
    "censored",
]
PAIRWISE_SHOWN = [
    "tpot_ms",
    "policy",
    "capacity_rps",
    "best_baseline",
    "best_baseline_capacity_rps",
    "ratio",
    "ratio_seed_min",
    "ratio_seed_max",
]


def _print_results(payload: dict, cost: ResolvedCost, out_dir: Path, study: CapacityStudy) -> None:
    table = pd.DataFrame(payload["capacity"])
    if not cost.is_analytic or cost.kv_memory is not None:  # the model, and the KV capacity the runs used
        for line in cost.summary_lines():
            click.echo(line)
    shown = table[~table["policy"].map(lambda p: any(budget_of(p, r) is not None for r in study.tuned_rules))]
    columns, pair_columns = CAPACITY_SHOWN, PAIRWISE_SHOWN
    if study.tiers:
        # one search for the whole mix: the tiers' attainment at the capacity replace the TPOT column
        click.echo(f"tier mix {describe_tier_mix(study.tiers)}: capacity = the highest load at which every tier keeps")
        click.echo(
            f"attainment >= {study.attainment_target:g}, each request judged against its own tier's TPOT and TTFT"
        )
        tier_columns = tier_columns_of(study.tiers)[1:]
        columns = [c for c in CAPACITY_SHOWN if c not in ("tpot_ms", "censored")] + tier_columns + ["censored"]
        pair_columns = [c for c in PAIRWISE_SHOWN if c != "tpot_ms"] + ["binding_tier", "best_baseline_binding_tier"]
    click.echo(shown[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    short = sorted({f"{r['policy']} at {_cell_name(r)}" for r in payload["capacity"] if TOO_SHORT in r["censored"]})
    if short:
        click.echo(
            f"WARNING: the run is too short to measure capacity for {len(short)} cell(s) ({'; '.join(short[:4])}"
            f"{'; ...' if len(short) > 4 else ''}): at the highest passing load every request arrives within one TTFT "
            "target, so no queue forms; use more --requests or a longer --window-s",
            err=True,
        )
    relative = pd.DataFrame(payload["pairwise"])
    if not relative.empty:
        click.echo("like for like (each with the same engine options):")
        click.echo(relative[pair_columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    curves = "curves.csv, cdf_requests.csv, PNG plots, " if payload["cdf_rate_scale"] else ""
    click.echo(
        f"wrote {out_dir}/capacity.csv (+ capacity_detail.csv, capacity_seeds.csv, relative.csv, {curves}capacity.json) from {study.simulations} simulations"
    )


def _cell_name(row: dict) -> str:
    return f"tier mix {row['tier_mix']}" if "tier_mix" in row else f"TPOT {row['tpot_ms']:g} ms"


def refuse_targets_with_tiers(tiers: tuple[Tier, ...], targets: Targets) -> None:
    """With ``--tier`` each request's targets are its tier's: a single target given as well
    would be ignored (``--tpot-ms``, ``--ttft-ms``) or is ambiguous (``--tpot-change-ms``: which
    tier's target changes?), so it is refused, naming the option."""
    if not tiers:
        return
    if targets.tpot_targets:
        raise click.UsageError(
            "--tpot-ms cannot go with --tier: each tier names its own TPOT target (NAME:TPOT_MS:TTFT_MS:SHARE), "
            "and the capacity of the mix is one search; give the targets in the tiers"
        )
    if targets.tpot_change_ms is not None:
        raise click.UsageError(
            "--tpot-change-ms cannot go with --tier: which tier's TPOT target would change is ambiguous; "
            "run the tier mixes before and after the change as two studies"
        )
    if targets.ttft_ms is not None:
        raise click.UsageError("--ttft-ms cannot go with --tier: each tier names its own TTFT target")


# how each seed's share of the load is cut, in the order the help shows them
seed_share_options = stacked(
    click.option("--seeds", type=ranged(REPEATS), default=None, help="seeds / trace windows [default: 5; --quick 3]"),
    click.option(
        "--window-s",
        type=ranged(DURATION_S),
        default=DEFAULT_WINDOW_S,
        show_default=True,
        help="trace window length; windows are spread evenly over the trace",
    ),
    click.option(
        "--whole-trace", is_flag=True, help="cut the whole trace into --seeds equal consecutive windows instead"
    ),
    requests_option(help="requests per seed for workloads and length-only files [default: 2000; --quick 800]"),
    click.option("--max-prompt-tokens", type=ranged(TOKENS), default=None, help="cap prompts (the count is reported)"),
    click.option(
        "--arrivals",
        type=click.Choice(["trace", "poisson"]),
        default="trace",
        show_default=True,
        help="poisson: generate arrivals (length-only files)",
    ),
    click.option(
        "--rate-rps", type=ranged(RATE_RPS), default=None, help="base rate of generated arrivals (load scale 1)"
    ),
)


@command()
@click.option(
    "--trace",
    "trace_paths",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="request trace file; repeat to replay several back to back (each seed: one window of each, in order)",
)
@click.option(
    "--workload",
    type=click.Choice(list(ALL_WORKLOADS)),
    default=None,
    help="synthetic workload or scenario instead of a trace",
)
@trace_format_option()
@click.option(
    "--policy",
    "policies",
    multiple=True,
    callback=once_each,
    help=f"repeat for several; fixed-tuned / budget-tuned / sarathi-tuned: that rule at its best budget per target, from a refined sweep [default: {', '.join(DEFAULT_POLICIES)}]",
)
@config_options(Targets, "targets")
@tier_option(
    "capacity is the highest load at which every tier keeps the attainment target (not with --tpot-ms, "
    "--ttft-ms or --tpot-change-ms)"
)
@seed_share_options
@config_options(Lattice, "lattice")
@max_chunk_option()
@click.option(
    "--quick",
    is_flag=True,
    help="3 seeds instead of 5, a lattice of 8 instead of 16 steps per doubling, fewer curve points",
)
@parallel_options()
@click.option("--no-curves", is_flag=True, help="capacities only: skip the load curves and CDFs")
@max_model_len_option()
@gathered("load", LoadOptions, tuple(f.name for f in fields(LoadOptions)))
@engine_options()
@cost_option()
@cost_kind_option(help="model fitted from a step-time profile file as --cost (each decode's KV context as simulated)")
@out_folder_options(default=Path("results/capacity"), resumable=True)
def capacity(
    policies,
    targets: Targets,
    tiers: tuple[str, ...],
    lattice: Lattice,
    max_chunk,
    quick,
    runner: Runner,
    no_curves,
    load: LoadOptions,
    engine: EngineOptions,
    cost: ResolvedCost,
    cost_kind: str,
    out: OutFolder,
) -> None:
    """Highest load (arrival-rate scale) at which each policy keeps SLO attainment >= the target."""
    if bool(load.trace_paths) == (load.workload is not None):
        raise click.UsageError("give --trace PATH (one or more) or --workload NAME, not both and not neither")
    check_writable(out.path, "--out")
    tiers = tier_mix(tiers)
    refuse_targets_with_tiers(tiers, targets)
    refuse_step_profile_options(cost, (("cost_kind", "--cost-kind"),))
    if cost.kind == KIND_STEP_PROFILE:
        cost = cost.step_profile(cost_kind)
    policies = list(policies) or list(DEFAULT_POLICIES)
    try:
        source, ttft_ms = load_source(load, load.seeds or (3 if quick else 5), quick, targets.ttft_ms)
        study = CapacityStudy(
            source,
            policies,
            () if tiers else (list(targets.tpot_targets) or list(DEFAULT_TPOT_TARGETS_MS)),
            None if tiers else ttft_ms,
            lattice.search(targets.attainment, quick),
            cost=cost.model,
            max_chunk_tokens=max_chunk,
            options=engine,
            tpot_change_ms=targets.tpot_change_ms,
            runner=runner,
            progress=True,
            tiers=tiers,
        )
    except (TraceError, WorkloadError, ValueError) as err:
        raise click.UsageError(str(err)) from None
    _print_notes(source.describe(), load)
    meta = {"command": "capacity", "options": command_settings(), "policies": policies, "max_chunk_tokens": max_chunk}
    with out.open(resumable=True) as folder:
        study.store = folder.store  # every finished search and curve point is kept for --resume
        payload = run_capacity(study, folder.path, meta, cost, curves=not no_curves)
    _print_results(payload, cost, out.path, study)
