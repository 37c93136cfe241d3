"""The ``sloweave`` command line.

Each sub-command lives next to the code it drives; this module only assembles them.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import click

from sloweave.core.costs.margins import ConstantMargin, RelativeMargin, ZeroMargin
from sloweave.core.costs.protocols import ContextAware
from sloweave.core.costs.resolve import cost_option
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS, SLOWeave, make_policy
from sloweave.sim.options import engine_options
from sloweave.sim.workloads import ALL_WORKLOADS, WorkloadError, get_workload_spec
from sloweave.core.validate import DURATION_MS, GIB, MARGIN_MS, REQUEST_COUNT, SCALE, SEED, TOKEN_COUNT, TOKENS
from sloweave.studies.inputs import REQUESTS
from sloweave.studies.outputs import check_writable, command_settings, strict_json, write_result_json
from sloweave.studies.result_folders import Interrupted, result_folder, result_folder_options


class _Commands(click.Group):
    def invoke(self, ctx):
        from sloweave.studies.parallel import TaskFailed

        try:
            return super().invoke(ctx)
        except TaskFailed as err:  # a study task failed in a worker: its inputs and cause, no traceback
            raise click.ClickException(str(err)) from err
        except KeyboardInterrupt:  # Ctrl-C outside a result folder (inside one, result_folder says what is left)
            raise Interrupted("interrupted") from None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sloweave")
def main() -> None:
    """sloweave: deadline-aware adaptive chunked prefill for LLM serving."""


def _margin(kind: str, value: float, cost):
    if kind == "none":
        return ZeroMargin()
    if kind == "constant":
        return ConstantMargin(value)
    return RelativeMargin(cost, value)


@main.command()
@click.option("--decodes", "n_decodes", type=REQUEST_COUNT.option(), required=True, help="running requests n")
@click.option(
    "--waiting-tokens",
    type=TOKEN_COUNT.option(),
    required=True,
    help="remaining prompt L of the oldest waiting request",
)
@click.option(
    "--budget-ms",
    type=MARGIN_MS.option(infinity=True),
    default=math.inf,
    show_default=True,
    help="time to the earliest next-token deadline",
)
@click.option("--max-chunk", type=TOKENS.option(), default=DEFAULT_MAX_CHUNK_TOKENS, show_default=True)
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


@main.command()
@click.option("--workload", type=click.Choice(list(ALL_WORKLOADS)), default="mixed", show_default=True)
@click.option(
    "--policy",
    "policy_name",
    default="sloweave",
    show_default=True,
    help="sloweave, sloweave-multi, full, orca, fixed-C, budget-B or sarathi-B",
)
@click.option("--tpot-ms", type=DURATION_MS.option(), default=25.0, show_default=True)
@click.option("--ttft-ms", type=DURATION_MS.option(), default=None, help="default: the workload's target")
@click.option("--requests", "num_requests", type=REQUESTS, default=2000, show_default=True)
@click.option("--seed", type=SEED.option(), default=0, show_default=True)
@click.option("--rate-scale", type=SCALE.option(), default=1.0, show_default=True, help="multiplies the arrival rate")
@click.option("--max-chunk", type=TOKENS.option(), default=DEFAULT_MAX_CHUNK_TOKENS, show_default=True)
@click.option(
    "--margin", "margin_kind", type=click.Choice(["none", "constant", "relative"]), default="none", show_default=True
)
@click.option(
    "--margin-value",
    type=MARGIN_MS.option(),
    default=0.0,
    show_default=True,
    help="ms (constant) or fraction of T (relative)",
)
@engine_options()
@cost_option()
@click.option(
    "--kv-memory-gib",
    type=GIB.option(),
    default=None,
    help="KV cache size in GiB (all GPUs): a capacity in tokens from the profiled model's KV bytes per token; needs a preset or profile folder as --cost",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="write requests.csv, iterations.csv, prefills.csv, metrics.json, decision_metrics.json",
)
@result_folder_options()
def simulate(
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
    engine,
    cost,
    kv_memory_gib,
    out_dir,
    force,
) -> None:
    """Simulate one workload under one policy and print its metrics."""
    from sloweave.core.decision_metrics import summarize_simulation
    from sloweave.studies.reproduce import write_single_run
    from sloweave.sim.metrics import evaluate, per_request_frame

    if out_dir is not None:
        check_writable(out_dir, "--out")
    spec = get_workload_spec(workload)
    resolved = cost
    cost = resolved.model
    if kv_memory_gib is not None:
        if engine.kv_capacity_tokens is not None:
            raise click.UsageError("give --kv-memory-gib or --kv-capacity-tokens, not both")
        try:
            engine = replace(engine, kv_capacity_tokens=resolved.kv_tokens_in(kv_memory_gib))
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--kv-memory-gib") from None
    kv_capacity_tokens = engine.kv_capacity_tokens
    try:
        margin = _margin(margin_kind, margin_value, cost)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--margin-value") from None
    try:
        policy = make_policy(policy_name, cost, margin, max_chunk)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--policy") from None
    try:
        wl = spec.generate(num_requests, seed, rate_scale)
    except WorkloadError as err:
        raise click.UsageError(str(err)) from None
    with result_folder(out_dir, force) if out_dir is not None else nullcontext() as folder:
        result = engine.simulate(wl, policy, tpot_ms, ttft_ms or spec.ttft_ms, cost, noise_seed=seed)
        metrics = evaluate(result, ttft_ms or spec.ttft_ms, tpot_ms)
        if not resolved.is_analytic:
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
        if kv_capacity_tokens is not None:
            printed["kv_capacity_tokens"] = kv_capacity_tokens
        click.echo(strict_json(printed), nl=False)
        if folder is not None:
            run_info = {
                "command": "simulate",
                "settings": command_settings(),
                "cost": resolved.description,
                "kv_memory_gib": kv_memory_gib,
                "kv_capacity_tokens": kv_capacity_tokens,
                "engine": engine.describe(),
            }
            if kv_capacity_tokens is not None:
                run_info["kv_bytes_per_token"] = resolved.profile_cost.shape.kv_bytes_per_token
            write_single_run(result, per_request_frame(result), metrics, folder.path, run_info)
            # the scheduler's decisions under the names the vLLM plug-in exports; a cost
            # that reads the KV context cannot be re-asked afterwards (the run records no context)
            reads_context = isinstance(cost, ContextAware)
            predicted_ms_of = None if reads_context else getattr(policy, "predicted_ms", cost)
            margin_ms_of = None if reads_context else getattr(policy, "margin", None)
            write_result_json(
                folder.path / "decision_metrics.json", summarize_simulation(result, predicted_ms_of, margin_ms_of)
            )
    if out_dir is not None:
        click.echo(
            f"wrote {out_dir}/requests.csv, iterations.csv, prefills.csv, metrics.json, decision_metrics.json", err=True
        )


def _register_optional_commands() -> None:
    """Commands of the other bodies register here (each module owns its command)."""
    from sloweave.studies.reproduce import reproduce

    main.add_command(reproduce)

    from sloweave.studies.capacity import capacity
    from sloweave.studies.replay import replay

    main.add_command(replay)
    main.add_command(capacity)

    # Operator tooling: the best fixed budget for engines that only have one.
    from sloweave.studies.tune import tune_command

    main.add_command(tune_command, name="tune")

    # The measured CPU runtime; torch is imported only when its commands run.
    from sloweave.runtime.commands import fit_command, profile, run_command

    main.add_command(profile)
    main.add_command(fit_command)
    main.add_command(run_command)

    # Options beyond the paper: the ablation study.
    from sloweave.studies.ablate import ablate

    main.add_command(ablate)

    from sloweave.observability.served_run import served_run_command

    main.add_command(served_run_command, name="served-run")

    from sloweave.observability.dashboard import dashboard_command

    main.add_command(dashboard_command, name="dashboard")


_register_optional_commands()
