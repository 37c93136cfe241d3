"""``sloweave capacity``: the highest load at which each policy keeps SLO attainment at or above a target.

The study comes in three parts:
- ``sloweave.studies.sources``: the load sources (a workload per seed and load scale);
- ``sloweave.studies.search``: the capacity search on the load lattice (``CapacityStudy``);
- this module: the report (tables, like-for-like ratios, load curves, CDFs, JSON) and the
  ``capacity`` command.

Its earlier names stay importable from here.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import click
import numpy as np
import pandas as pd

from sloweave.core.costs.resolve import ResolvedCost, cost_option, describe_cost
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS
from sloweave.core.validate import ATTAINMENT, DURATION_MS, DURATION_S, RATE_RPS, REPEATS, SCALE, TOKENS
from sloweave.sim.options import EngineOptions, engine_options
from sloweave.sim.traces import FORMATS, TraceError, load_trace
from sloweave.sim.workloads import ALL_WORKLOADS, WorkloadError
from sloweave.studies.inputs import REQUESTS, max_model_len_option, model_len_or_default, once_each, parallel_options
from sloweave.studies.outputs import check_writable, command_settings, write_result_json
from sloweave.studies.parallel import Runner, local_cores
from sloweave.studies.pictures import pyplot
from sloweave.studies.replay import DEFAULT_TRACE_TTFT_MS, plot_cdfs, policy_style
from sloweave.studies.result_folders import result_folder, result_folder_options
from sloweave.studies.search import (  # noqa: F401  (re-exported: the names' earlier home)
    ATTAINMENT_TOLERANCE,
    DEFAULT_ATTAINMENT,
    TOO_SHORT,
    TUNED_RULES,
    TUNING_GRID_TOKENS,
    Capacity,
    CapacityStudy,
    SearchLattice,
    SeedCapacity,
    _study_task,
    best_of_rule,
    budget_of,
    refined_budgets,
    round_to_64,
)
from sloweave.studies.sources import (  # noqa: F401  (re-exported: the names' earlier home)
    DEFAULT_WINDOW_S,
    LoadSource,
    ScaledWorkloads,
    SpecSource,
    back_to_back,
    check_scalable,
    trace_source,
)

# Fixed chunks from 256 to C_max = 4096 bracket the best static chunk on every target we
# measured (Fixed-64 is never close and is the slowest to simulate; pass --policy fixed-64 to add it).
DEFAULT_POLICIES = ("sloweave", "full", "fixed-256", "fixed-512", "fixed-1024", "fixed-2048", "fixed-4096")
DEFAULT_TPOT_TARGETS_MS = (10.0, 25.0, 50.0)
CAPACITY_COLUMNS = [
    "source",
    "policy",
    "tpot_ms",
    "ttft_ms",
    "attainment_target",
    "capacity_scale",
    "capacity_rps",
    "tuned_to",
]

# The comparisons made like for like: SLOWeave with one prompt per iteration against the
# fixed chunk (and the one-prompt token budget); with several prompts, against vLLM's rule.
PAIRS = (("sloweave", "fixed"), ("sloweave", "budget"), ("sloweave-multi", "sarathi"))


def capacity_frame(capacities: list[Capacity]) -> pd.DataFrame:
    return pd.DataFrame([c.row() for c in capacities])


def seeds_frame(capacities: list[Capacity]) -> pd.DataFrame:
    rows = []
    for c in capacities:
        for s in c.seeds:
            rows.append({"source": c.source, "policy": c.policy, "tpot_ms": c.tpot_ms, **asdict(s)})
    return pd.DataFrame(rows)


def pairwise_ratios(capacities: list[Capacity]) -> pd.DataFrame:
    """Each SLOWeave variant over the best of its like-for-like rule, per TPOT target (``PAIRS``).

    The best budget of a rule is chosen per target by mean capacity in req/s (what a user
    who tunes the budget offline would do; a ``<rule>-tuned`` row is that choice already);
    ``ratio`` is the ratio of the two means. Its spread uses the per-seed ratios (same seeds
    or windows, so paired), skipping seeds where the baseline's capacity is 0; a per-seed
    ratio is only known to about one lattice step (``step_pct``). A cell whose run was too
    short to build queues has no ratio (empty), and says so in ``note``.
    """
    rows = []
    for tpot in sorted({c.tpot_ms for c in capacities}):
        at = {c.policy: c for c in capacities if c.tpot_ms == tpot}
        for ours_name, rule in PAIRS:
            best = best_of_rule(list(at.values()), rule)
            if ours_name not in at or best is None:
                continue
            swept = sum(budget_of(name, rule) is not None for name in at)
            rows.append(_pair_row(at[ours_name], best, rule, swept))
    return pd.DataFrame(rows)


def _pair_row(ours: Capacity, best: Capacity, rule: str, swept: int) -> dict:
    measurable = ours.measurable and best.measurable
    paired = [a.scale / b.scale for a, b in zip(ours.seeds, best.seeds) if b.scale > 0] if measurable else []
    return {
        "source": ours.source,
        "tpot_ms": ours.tpot_ms,
        "ttft_ms": ours.ttft_ms,
        "policy": ours.policy,
        "capacity_rps": ours.capacity_rps,
        "capacity_rps_std": ours.row()["capacity_rps_std"],
        "baseline_rule": rule,
        "budgets_swept": swept,
        "best_baseline": best.policy,
        "best_baseline_capacity_rps": best.capacity_rps,
        "best_baseline_capacity_rps_std": best.row()["capacity_rps_std"],
        "ratio": ours.capacity_rps / best.capacity_rps if measurable and best.capacity_rps > 0 else math.nan,
        "ratio_seed_mean": float(np.mean(paired)) if paired else math.nan,
        "ratio_seed_min": float(np.min(paired)) if paired else math.nan,
        "ratio_seed_max": float(np.max(paired)) if paired else math.nan,
        "step_pct": 100.0 * (ours.step_ratio - 1.0),
        # the best budget at the grid's end: the true best may lie beyond what was swept
        "edge_of_sweep": budget_of(best.policy, rule) in (min(TUNING_GRID_TOKENS), max(TUNING_GRID_TOKENS)),
        "note": "" if measurable else "run too short to build queues: no capacity (lengthen the run)",
    }


# --------------------------------------------------------------------------- plots


def plot_curves(
    curves: pd.DataFrame,
    column: str,
    ylabel: str,
    path: Path,
    target: float | None = None,
    upper_bound: float | None = None,
) -> None:
    plt = pyplot()
    targets = sorted(curves["tpot_ms"].unique())
    fig, axes = plt.subplots(1, len(targets), figsize=(4.6 * len(targets), 3.8), squeeze=False)
    for ax, tpot in zip(axes[0], targets):
        at = curves[curves["tpot_ms"] == tpot]
        for index, (policy, rows) in enumerate(at.groupby("policy", sort=False)):
            mean, std = rows[column].to_numpy(), rows[f"{column}_std"].to_numpy()
            # +-1 std over seeds, clipped to the range the quantity can take.
            upper = np.minimum(std, upper_bound - mean) if upper_bound is not None else std
            lower = np.minimum(std, mean)
            ax.errorbar(
                rows["rate_rps"],
                mean,
                yerr=[lower, upper],
                marker="o",
                markersize=3,
                capsize=2,
                label=policy,
                **policy_style(policy, index),
            )
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"TPOT {tpot:g} ms, TTFT {at['ttft_ms'].iloc[0]:g} ms", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(str(curves["source"].iloc[0]), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- command


def run_capacity(
    study: CapacityStudy, out_dir: Path, meta: dict, cost: ResolvedCost | None = None, curves: bool = True
) -> dict:
    """Search (and, unless ``curves`` is off, load curves and CDFs); write every output file
    under ``out_dir``; return the JSON payload.

    ``cost`` is what ``study.cost`` was resolved from; its description is read after the
    simulations (a profile cost's out-of-range counts). None: the study's analytic model.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    capacities = study.capacities()
    table = capacity_frame(capacities)
    table[CAPACITY_COLUMNS].to_csv(out_dir / "capacity.csv", index=False)
    table.to_csv(out_dir / "capacity_detail.csv", index=False)
    seeds_frame(capacities).to_csv(out_dir / "capacity_seeds.csv", index=False)
    relative = pairwise_ratios(capacities)
    relative.to_csv(out_dir / "relative.csv", index=False)
    cdf_loads = _write_curves(study, capacities, out_dir) if curves else {}
    payload = {
        **meta,
        "source": study.source.describe(),
        "engine_options": study.options.describe(),
        "ttft_ms": study.ttft_ms,
        "tpot_targets_ms": list(study.tpot_targets_ms),
        "attainment_target": study.attainment_target,
        "lattice": study.lattice.describe(),
        "simulations": study.simulations,
        "parallel": study.runner.describe(),
        "cost": cost.description if cost is not None else describe_cost(study.cost),
        "cdf_rate_scale": {f"{t:g}": s for t, s in cdf_loads.items()},
        "capacity": table.to_dict(orient="records"),
        "pairwise": relative.to_dict(orient="records"),
        "null_means": "a capacity or ratio the run was too short to measure (see 'censored' and 'note')",
    }
    write_result_json(out_dir / "capacity.json", payload)
    return payload


def _write_curves(study: CapacityStudy, capacities: list[Capacity], out_dir: Path) -> dict[float, float]:
    """Load curves of the searched policies (a tuned rule's grid only at its best budgets),
    and CDFs at SLOWeave's capacity per target; return the CDFs' load per target."""
    shown = [p for p in study.policies if not any(budget_of(p, r) is not None for r in study.tuned_rules)]
    shown += list(dict.fromkeys(c.tuned_to for c in capacities if c.tuned_to))
    curves = study.curves(study.curve_lattice(capacities), shown)
    curves.to_csv(out_dir / "curves.csv", index=False)
    plot_curves(
        curves,
        "attainment",
        "SLO attainment",
        out_dir / "attainment_vs_load.png",
        study.attainment_target,
        upper_bound=1.0,
    )
    plot_curves(curves, "goodput_rps", "goodput (req/s)", out_dir / "goodput_vs_load.png")
    # CDFs at SLOWeave's capacity for each target (or the middle of the curve without it):
    # the load where the comparison matters. Requests of all seeds are pooled for the plot.
    cdf_frames, cdf_loads = [], {}
    for tpot in study.tpot_targets_ms:
        ours = [c for c in capacities if c.tpot_ms == tpot and c.policy.startswith("sloweave")]
        ks = [s.k for s in ours[0].seeds if s.k is not None] if ours else []
        k = int(np.median(ks)) if ks else int(np.median(study.curve_lattice(capacities)))
        cdf_loads[tpot] = study.scale(k)
        study.prefetch([(p, k, tpot) for p in shown])
        for policy in shown:
            frame = study.requests_at(policy, k, tpot)
            frame.insert(0, "policy", policy)
            frame.insert(1, "tpot_ms", tpot)
            frame.insert(2, "rate_scale", study.scale(k))
            cdf_frames.append(frame)
        per_policy = {p: f for p, f in pd.concat(cdf_frames).query("tpot_ms == @tpot").groupby("policy", sort=False)}
        title = f"{study.source.name}, load x{study.scale(k):.3g}, TPOT {tpot:g} ms"
        plot_cdfs(
            {p: f["ttft_ms"].to_numpy() for p, f in per_policy.items()},
            out_dir / f"cdf_ttft_tpot{tpot:g}.png",
            "TTFT (ms)",
            title,
            study.ttft_ms,
            log_x=True,
        )
        plot_cdfs(
            {p: f["p99_tpot_ms"].to_numpy() for p, f in per_policy.items()},
            out_dir / f"cdf_p99_tpot_tpot{tpot:g}.png",
            "per-request P99 inter-token gap (ms)",
            title,
            tpot,
        )
    pd.concat(cdf_frames, ignore_index=True).to_csv(out_dir / "cdf_requests.csv", index=False)
    return cdf_loads


@click.command()
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
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    callback=once_each,
    help=f"repeat for several; fixed-tuned / budget-tuned / sarathi-tuned: that rule at its best budget per target, from a refined sweep [default: {', '.join(DEFAULT_POLICIES)}]",
)
@click.option(
    "--tpot-ms",
    "tpot_targets",
    type=DURATION_MS.option(),
    multiple=True,
    callback=once_each,
    help="repeat for several [default: 10, 25, 50]",
)
@click.option(
    "--tpot-change-ms",
    type=DURATION_MS.option(),
    default=None,
    help="the TPOT target changes to this for requests arriving in the second half of each run",
)
@click.option(
    "--ttft-ms",
    type=DURATION_MS.option(),
    default=None,
    help=f"TTFT target [default: the workload's; {DEFAULT_TRACE_TTFT_MS:g} for a trace]",
)
@click.option("--attainment", type=ATTAINMENT.option(), default=DEFAULT_ATTAINMENT, show_default=True)
@click.option("--seeds", type=REPEATS.option(), default=None, help="seeds / trace windows [default: 5; --quick 3]")
@click.option(
    "--window-s",
    type=DURATION_S.option(),
    default=DEFAULT_WINDOW_S,
    show_default=True,
    help="trace window length; windows are spread evenly over the trace",
)
@click.option("--whole-trace", is_flag=True, help="cut the whole trace into --seeds equal consecutive windows instead")
@click.option(
    "--requests",
    "num_requests",
    type=REQUESTS,
    default=None,
    help="requests per seed for workloads and length-only files [default: 2000; --quick 800]",
)
@click.option("--max-prompt-tokens", type=TOKENS.option(), default=None, help="cap prompts (the count is reported)")
@click.option(
    "--arrivals",
    type=click.Choice(["trace", "poisson"]),
    default="trace",
    show_default=True,
    help="poisson: generate arrivals (length-only files)",
)
@click.option("--rate-rps", type=RATE_RPS.option(), default=None, help="base rate of generated arrivals (load scale 1)")
@click.option(
    "--steps-per-doubling",
    type=REPEATS.option(),
    default=None,
    help="load lattice resolution [default: 16 (4.4%); --quick 8 (9%)]",
)
@click.option("--min-scale", type=SCALE.option(), default=1.0 / 16.0, show_default=True)
@click.option("--max-scale", type=SCALE.option(), default=256.0, show_default=True)
@click.option("--max-chunk", type=TOKENS.option(), default=DEFAULT_MAX_CHUNK_TOKENS, show_default=True)
@click.option(
    "--quick",
    is_flag=True,
    help="3 seeds instead of 5, a lattice of 8 instead of 16 steps per doubling, fewer curve points",
)
@parallel_options()
@click.option("--no-curves", is_flag=True, help="capacities only: skip the load curves and CDFs")
@max_model_len_option()
@engine_options()
@cost_option()
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("results/capacity"),
    show_default=True,
)
@result_folder_options(resumable=True)
def capacity(
    trace_paths,
    workload,
    fmt,
    policies,
    tpot_targets,
    tpot_change_ms,
    ttft_ms,
    attainment,
    seeds,
    window_s,
    whole_trace,
    num_requests,
    max_prompt_tokens,
    arrivals,
    rate_rps,
    max_model_len_tokens,
    steps_per_doubling,
    min_scale,
    max_scale,
    max_chunk,
    quick,
    jobs,
    ray_address,
    no_curves,
    engine: EngineOptions,
    cost: ResolvedCost,
    out_dir,
    force,
    resume,
) -> None:
    """Highest load (arrival-rate scale) at which each policy keeps SLO attainment >= the target."""
    if bool(trace_paths) == (workload is not None):
        raise click.UsageError("give --trace PATH (one or more) or --workload NAME, not both and not neither")
    check_writable(out_dir, "--out")
    policies = list(policies) or list(DEFAULT_POLICIES)
    seeds = seeds or (3 if quick else 5)
    try:
        source, ttft_ms = _cli_source(
            trace_paths,
            workload,
            fmt,
            seeds,
            window_s,
            whole_trace,
            num_requests,
            max_prompt_tokens,
            arrivals,
            rate_rps,
            quick,
            ttft_ms,
            max_model_len_tokens,
        )
        lattice = SearchLattice(
            attainment, steps_per_doubling or (8 if quick else 16), min_scale, max_scale, 2 if quick else 4
        )
        study = CapacityStudy(
            source,
            policies,
            list(tpot_targets) or list(DEFAULT_TPOT_TARGETS_MS),
            ttft_ms,
            lattice,
            cost=cost.model,
            max_chunk_tokens=max_chunk,
            options=engine,
            tpot_change_ms=tpot_change_ms,
            runner=Runner(jobs or default_jobs(), ray_address),
            progress=True,
        )
    except (TraceError, WorkloadError, ValueError) as err:
        raise click.UsageError(str(err)) from None
    _print_notes(source.describe(), rate_rps, trace_paths, max_prompt_tokens)
    meta = {"command": "capacity", "options": command_settings(), "policies": policies, "max_chunk_tokens": max_chunk}
    with result_folder(out_dir, force, resume, resumable=True) as folder:
        study.store = folder.store  # every finished search and curve point is kept for --resume
        payload = run_capacity(study, folder.path, meta, cost, curves=not no_curves)
    _print_results(payload, cost, out_dir, study)


default_jobs = local_cores  # the name tune and the benchmarks import


def _cli_source(
    trace_paths,
    workload,
    fmt,
    seeds,
    window_s,
    whole_trace,
    num_requests,
    max_prompt_tokens,
    arrivals,
    rate_rps,
    quick,
    ttft_ms,
    max_model_len_tokens=None,
):
    """The load source the options describe, and the TTFT target (the source's default unless given)."""
    if workload is not None:
        if (
            whole_trace
            or max_prompt_tokens is not None
            or arrivals != "trace"
            or rate_rps is not None
            or max_model_len_tokens is not None
        ):
            raise click.UsageError(
                "--whole-trace, --max-prompt-tokens, --arrivals, --rate-rps and --max-model-len apply to --trace only"
            )
        spec = ALL_WORKLOADS[workload]
        return SpecSource(spec, num_requests or (800 if quick else 2000), tuple(range(seeds))), ttft_ms or spec.ttft_ms
    if arrivals == "trace" and rate_rps is not None:
        raise click.UsageError("--rate-rps only applies with --arrivals poisson")
    sources = []
    for path in trace_paths:
        trace = load_trace(path, fmt, model_len_or_default(max_model_len_tokens))
        window = None if whole_trace else window_s
        if window is not None and trace.has_arrivals and arrivals == "trace" and window * seeds > trace.span_s:
            raise click.UsageError(
                f"{path}: {seeds} windows of {window:g} s do not fit in the trace's {trace.span_s:.1f} s: "
                "lower --window-s or --seeds, or use --whole-trace"
            )
        # Generated arrivals subsample the lengths; trace windows keep every request unless told.
        requests_per_seed = num_requests
        if arrivals == "poisson" and num_requests is None:
            requests_per_seed = 800 if quick else 2000
        sources.append(trace_source(trace, seeds, window, max_prompt_tokens, arrivals, rate_rps, requests_per_seed))
    return (sources[0] if len(sources) == 1 else back_to_back(sources)), ttft_ms or DEFAULT_TRACE_TTFT_MS


def _print_notes(description: dict, rate_rps, trace_paths, max_prompt_tokens) -> None:
    if "GENERATED" in str(description.get("kind", "")):
        click.echo(
            f"NOTE: arrivals are GENERATED (Poisson, {rate_rps:g} req/s at scale 1), not read from {', '.join(map(str, trace_paths))}",
            err=True,
        )
    if description.get("num_prompts_capped"):
        click.echo(
            f"NOTE: {description['num_prompts_capped']} prompt(s) capped at {max_prompt_tokens} tokens", err=True
        )


def _print_results(payload: dict, cost: ResolvedCost, out_dir: Path, study: CapacityStudy) -> None:
    table = pd.DataFrame(payload["capacity"])
    if not cost.is_analytic:
        for line in cost.summary_lines():
            click.echo(line)
    shown = table[~table["policy"].map(lambda p: any(budget_of(p, r) is not None for r in study.tuned_rules))]
    columns = [
        "policy",
        "tuned_to",
        "tpot_ms",
        "capacity_scale",
        "capacity_scale_std",
        "capacity_rps",
        "capacity_rps_std",
        "censored",
    ]
    click.echo(shown[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    short = sorted(
        {f"{r['policy']} at TPOT {r['tpot_ms']:g} ms" for r in payload["capacity"] if TOO_SHORT in r["censored"]}
    )
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
        click.echo(
            relative[
                [
                    "tpot_ms",
                    "policy",
                    "capacity_rps",
                    "best_baseline",
                    "best_baseline_capacity_rps",
                    "ratio",
                    "ratio_seed_min",
                    "ratio_seed_max",
                ]
            ].to_string(index=False, float_format=lambda v: f"{v:.3f}")
        )
    curves = "curves.csv, cdf_requests.csv, PNG plots, " if payload["cdf_rate_scale"] else ""
    click.echo(
        f"wrote {out_dir}/capacity.csv (+ capacity_detail.csv, capacity_seeds.csv, relative.csv, {curves}capacity.json) from {study.simulations} simulations"
    )
