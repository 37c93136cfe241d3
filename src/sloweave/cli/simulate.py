"""``sloweave decide`` (one decision) and ``sloweave simulate`` (one workload under one policy)."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import click

from sloweave.cli.command import command
from sloweave.cli.options import (
    OutFolder,
    cost_option,
    engine_options,
    given_on_command_line,
    max_chunk_option,
    out_folder_options,
    ranged,
    requests_option,
    tpot_ms_option,
    ttft_ms_option,
)
from sloweave.core.costs.kv_memory import given_kv_memory
from sloweave.core.costs.margins import ConstantMargin, RelativeMargin, ZeroMargin
from sloweave.core.costs.protocols import ContextAware
from sloweave.core.costs.resolve import ResolvedCost
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS, SLOWeave, make_policy
from sloweave.core.validate import GIB, MARGIN_MS, REQUEST_COUNT, SCALE, SEED, TOKEN_COUNT, TOKENS
from sloweave.sim.options import EngineOptions
from sloweave.sim.workloads import ALL_WORKLOADS, WorkloadError, get_workload_spec
from sloweave.studies.outputs import check_writable, command_settings, strict_json, write_result_json


@command()
@click.option("--decodes", "n_decodes", type=ranged(REQUEST_COUNT), required=True, help="running requests n")
@click.option(
    "--waiting-tokens",
    type=ranged(TOKEN_COUNT),
    required=True,
    help="remaining prompt L of the oldest waiting request",
)
@click.option(
    "--budget-ms",
    type=ranged(MARGIN_MS, infinity=True),
    default=math.inf,
    show_default=True,
    help="time to the earliest next-token deadline",
)
@click.option("--max-chunk", type=ranged(TOKENS), default=DEFAULT_MAX_CHUNK_TOKENS, show_default=True)
def decide(n_decodes: int, waiting_tokens: int, budget_ms: float, max_chunk: int) -> None:
    """One SLOWeave decision on the paper's analytic cost model (e.g. --decodes 4 --budget-ms 10).

    Prints strict JSON; the default budget (no deadline, +inf) is printed as null."""
    if budget_ms < 0 or math.isnan(budget_ms):
        raise click.BadParameter(f"must be >= 0, got {budget_ms!r}", param_hint="--budget-ms")
    policy = SLOWeave(max_chunk_tokens=max_chunk)
    decision = policy.decide(n_decodes, waiting_tokens, budget_ms)
    printed = {
        "chunk_tokens": decision.chunk_tokens,
        "infeasible": decision.infeasible,
        "predicted_ms": policy.predicted_ms(n_decodes, decision.chunk_tokens),
        "budget_ms": budget_ms,
    }
    click.echo(strict_json(printed), nl=False)


def _margin(kind: str, value: float, cost):
    if kind == "none":
        return ZeroMargin()
    if kind == "constant":
        return ConstantMargin(value)
    return RelativeMargin(cost, value)


def _with_kv_memory(
    engine: EngineOptions, cost: ResolvedCost, kv_memory_gib: float | None
) -> tuple[EngineOptions, ResolvedCost]:
    """The engine with the KV capacity that ``kv_memory_gib`` holds on the profiled model (it
    replaces the capacity of the model's memory figures), and the cost stating it."""
    if kv_memory_gib is None:
        return engine, cost
    if given_on_command_line("kv_capacity_tokens") or given_on_command_line("unlimited_kv"):
        raise click.UsageError("give --kv-memory-gib, --kv-capacity-tokens or --unlimited-kv, one of them")
    if given_on_command_line("gpu_memory_utilization"):
        raise click.BadParameter(
            "sizes the model's KV cache, which --kv-memory-gib replaces: give one of them",
            param_hint="--gpu-memory-utilization",
        )
    try:
        tokens = cost.kv_tokens_in(kv_memory_gib)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--kv-memory-gib") from None
    per_token = cost.profile_cost.shape.kv_bytes_per_token
    kv = given_kv_memory(
        tokens, f"given: --kv-memory-gib {kv_memory_gib:g} GiB (all GPUs) at {per_token / 1024:g} KiB per token"
    )
    return replace(engine, kv_capacity_tokens=tokens, kv_memory=kv), cost.with_kv_memory(kv)


def _policy(name: str, margin_kind: str, margin_value: float, cost, max_chunk: int):
    try:
        margin = _margin(margin_kind, margin_value, cost)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--margin-value") from None
    try:
        return make_policy(name, cost, margin, max_chunk)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--policy") from None


def _write_run(folder: Path, result, metrics, policy, resolved: ResolvedCost, engine, kv_memory_gib) -> None:
    """The run's files, with what made it, and the scheduler's decisions under the names the vLLM plug-in exports."""
    from sloweave.core.decision_metrics import summarize_simulation
    from sloweave.sim.metrics import per_request_frame
    from sloweave.studies.reproduce import write_single_run

    run_info = {
        "command": "simulate",
        "settings": command_settings(),
        "cost": resolved.description,
        "kv_memory_gib": kv_memory_gib,
        "kv_capacity_tokens": engine.kv_capacity_tokens,
        "engine": engine.describe(),
    }
    if engine.kv_capacity_tokens is not None and resolved.profile_cost is not None:
        run_info["kv_bytes_per_token"] = resolved.profile_cost.shape.kv_bytes_per_token
    write_single_run(result, per_request_frame(result), metrics, folder, run_info)
    # a cost that reads the KV context cannot be re-asked afterwards (the run records no context)
    cost = resolved.model
    reads_context = isinstance(cost, ContextAware)
    predicted_ms_of = None if reads_context else getattr(policy, "predicted_ms", cost)
    margin_ms_of = None if reads_context else getattr(policy, "margin", None)
    write_result_json(folder / "decision_metrics.json", summarize_simulation(result, predicted_ms_of, margin_ms_of))


def _print_metrics(workload: str, policy, tpot_ms: float, resolved: ResolvedCost, engine, metrics) -> None:
    if not resolved.is_analytic or resolved.kv_memory is not None:
        for line in resolved.summary_lines():
            click.echo(line, err=True)
    printed = {
        "workload": workload,
        "policy": policy.name,
        "tpot_ms": tpot_ms,
        "cost": resolved.label,
        "engine": engine.describe(),
        **metrics.as_dict(),
    }
    if engine.kv_capacity_tokens is not None:
        printed["kv_capacity_tokens"] = engine.kv_capacity_tokens
    click.echo(strict_json(printed), nl=False)


@command(name="simulate")
@click.option("--workload", type=click.Choice(list(ALL_WORKLOADS)), default="mixed", show_default=True)
@click.option(
    "--policy",
    "policy_name",
    default="sloweave",
    show_default=True,
    help="sloweave, sloweave-multi, full, orca, fixed-C, budget-B or sarathi-B",
)
@tpot_ms_option()
@ttft_ms_option(help="default: the workload's target")
@requests_option(2000)
@click.option("--seed", type=ranged(SEED), default=0, show_default=True)
@click.option("--rate-scale", type=ranged(SCALE), default=1.0, show_default=True, help="multiplies the arrival rate")
@max_chunk_option()
@click.option(
    "--margin", "margin_kind", type=click.Choice(["none", "constant", "relative"]), default="none", show_default=True
)
@click.option(
    "--margin-value",
    type=ranged(MARGIN_MS),
    default=0.0,
    show_default=True,
    help="ms (constant) or fraction of T (relative)",
)
@engine_options()
@cost_option()
@click.option(
    "--kv-memory-gib",
    type=ranged(GIB),
    default=None,
    help="KV cache size in GiB (all GPUs): a capacity in tokens from the profiled model's KV bytes per token, "
    "instead of the one its memory figures give; needs a preset or profile folder as --cost",
)
@out_folder_options(
    default=None,
    help="write requests.csv, iterations.csv, prefills.csv, metrics.json, decision_metrics.json",
)
def simulate_command(
    workload,
    policy_name,
    tpot_ms,
    ttft_ms,
    num_requests,
    seed,
    rate_scale,
    max_chunk,
    margin_kind,
    margin_value,
    engine: EngineOptions,
    cost: ResolvedCost,
    kv_memory_gib,
    out: OutFolder,
) -> None:
    """Simulate one workload under one policy and print its metrics."""
    from sloweave.sim.metrics import evaluate

    if out.path is not None:
        check_writable(out.path, "--out")
    spec = get_workload_spec(workload)
    engine, cost = _with_kv_memory(engine, cost, kv_memory_gib)
    policy = _policy(policy_name, margin_kind, margin_value, cost.model, max_chunk)
    try:
        wl = spec.generate(num_requests, seed, rate_scale)
    except WorkloadError as err:
        raise click.UsageError(str(err)) from None
    with out.open() if out.path is not None else nullcontext() as folder:
        result = engine.simulate(wl, policy, tpot_ms, ttft_ms or spec.ttft_ms, cost.model, noise_seed=seed)
        metrics = evaluate(result, ttft_ms or spec.ttft_ms, tpot_ms)
        _print_metrics(workload, policy, tpot_ms, cost, engine, metrics)
        if folder is not None:
            _write_run(folder.path, result, metrics, policy, cost, engine, kv_memory_gib)
    if out.path is not None:
        click.echo(
            f"wrote {out.path}/requests.csv, iterations.csv, prefills.csv, metrics.json, decision_metrics.json",
            err=True,
        )
