"""``sloweave profile``, ``sloweave fit`` and ``sloweave run``: the measured CPU runtime's commands
(``sloweave.runtime.commands``). torch and transformers are imported only when a command needs them."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import click

from sloweave.cli.command import command
from sloweave.cli.options import (
    OutFolder,
    gathered,
    max_chunk_option,
    out_folder_options,
    ranged,
    stacked,
    requests_option,
    tpot_ms_option,
    ttft_ms_option,
)
from sloweave.core.costs.calibrated import DEFAULT_MARGIN_FORM, MARGIN_FORMS
from sloweave.core.costs.fit_acceptance import HOLDOUT_ERROR, MAX_HOLDOUT_ERROR
from sloweave.core.validate import (
    DURATION_MS,
    DURATION_S,
    MARGIN_MS,
    MAX_REPEATS,
    REPEATS,
    REQUEST_COUNT,
    SCALE,
    SEED,
    TOKEN_COUNT,
    TOKENS,
    Range,
)
from sloweave.runtime.commands import (
    ControllerSettings,
    CpuWorkload,
    load_servable_model,
    measure_profile,
    serve_policies,
)
from sloweave.sim.workloads import WORKLOADS
from sloweave.studies.outputs import check_writable, command_settings, strict_json, write_result_json

MONOTONE_TOLERANCE_HELP = "a drop along c or n smaller than this (or than 25 %) is noise, not a broken profile"


def _whole_numbers(limits: Range):
    """A callback reading a comma-separated list of whole numbers, each within ``limits``."""

    def read(ctx, param, value: str) -> tuple[int, ...]:
        try:
            items = tuple(int(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise click.BadParameter(f"expected comma-separated whole numbers, got {value!r}") from None
        if not items:
            raise click.BadParameter(f"expected comma-separated whole numbers, got {value!r}")
        try:
            return tuple(limits.check(item, "each value") for item in items)
        except ValueError as err:
            raise click.BadParameter(str(err)) from None

    return read


def _need_runtime(command: str) -> None:
    """Say how to install the runtime extra instead of an ImportError traceback."""
    for module in ("torch", "transformers"):
        try:
            __import__(module)
        except ImportError as err:
            raise click.ClickException(
                f"`sloweave {command}` drives a real model and needs the CPU runtime ({module} cannot be imported: {err}); "
                "install it with `pip install 'sloweave[runtime]'` (`make setup` does)"
            ) from None


def _fit_or_fail(profile: Path, monotone_tolerance_ms: float = 5.0, max_holdout_error: float = MAX_HOLDOUT_ERROR):
    from sloweave.core.costs.profile_fit import fit_profile_file
    from sloweave.core.costs.step_profiles import ProfileError

    try:
        result = fit_profile_file(
            profile, monotone_tolerance_ms=monotone_tolerance_ms, max_holdout_error=max_holdout_error
        )
    except ProfileError as err:
        raise click.ClickException(str(err)) from None
    for note in result.report["notes"]:  # a kind refused, an error not measured: never silent
        click.echo(f"{profile}: {note}", err=True)
    return result


def model_option():
    return click.option(
        "--model", default="small", show_default=True, help="packaged model (tiny, small) or a local model directory"
    )


@command()
@model_option()
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="profile file (.csv or .json)",
)
@click.option(
    "--decodes",
    default="0,1,4,8,16,32",
    show_default=True,
    callback=_whole_numbers(REQUEST_COUNT),
    help="decode batch sizes n",
)
@click.option(
    "--chunks",
    default="0,16,64,128,256,512,1024",
    show_default=True,
    callback=_whole_numbers(TOKEN_COUNT),
    help="prefill chunk sizes c",
)
@click.option(
    "--contexts",
    default="64,256,1024",
    show_default=True,
    callback=_whole_numbers(TOKEN_COUNT),
    help="per-decode KV contexts (tokens)",
)
@click.option("--repeats", type=ranged(REPEATS), default=3, show_default=True)
@click.option(
    "--holdout",
    "holdout_per_state",
    type=ranged(Range(0, MAX_REPEATS, whole=True)),
    default=3,
    show_default=True,
    help="off-grid held-out steps per (context, n)",
)
@click.option("--threads", type=ranged(REPEATS), default=1, show_default=True, help="torch threads")
@click.option("--seed", type=ranged(SEED), default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="where the model runs (cuda: a GPU profile of transformers' kernels, not vLLM's)",
)
def profile(
    model, out_path, decodes, chunks, contexts, repeats, holdout_per_state, threads, seed, dtype, device
) -> None:
    """Measure step times of the real engine over a (decodes, chunk, context) grid."""
    check_writable(out_path, "--out", is_file=True)
    _need_runtime("profile")
    from sloweave.core.costs.profile_fit import fit_profile
    from sloweave.core.costs.step_profiles import ProfileError, write_profile

    frame, meta = measure_profile(
        model, decodes, chunks, contexts, repeats, holdout_per_state, threads, seed, dtype, device
    )
    write_profile(frame, out_path, meta)
    click.echo(f"wrote {len(frame)} steps to {out_path} in {meta['seconds']} s")
    try:
        report = fit_profile(frame, seed=seed, where=f"profile {out_path}").report
    except ProfileError as err:
        raise click.ClickException(f"the profile is written, but no fit of it can be used: {err}") from None
    click.echo(strict_json(report), nl=False)


@command("fit")
@click.argument("profile_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="write the fitted models as JSON",
)
@click.option(
    "--monotone-tolerance-ms", type=ranged(MARGIN_MS), default=5.0, show_default=True, help=MONOTONE_TOLERANCE_HELP
)
@click.option(
    "--max-holdout-error",
    type=ranged(HOLDOUT_ERROR),
    default=MAX_HOLDOUT_ERROR,
    show_default=True,
    help="refuse a fitted kind whose median relative error on held-out steps is above this (0.5: 50 %)",
)
def fit(profile_path: Path, out_path: Path | None, monotone_tolerance_ms: float, max_holdout_error: float) -> None:
    """Fit the lookup table, the context-aware regression and the P99 margin from a profile."""
    if out_path is not None:
        check_writable(out_path, "--out", is_file=True)
    result = _fit_or_fail(profile_path, monotone_tolerance_ms, max_holdout_error)
    doc = result.as_dict()
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        write_result_json(out_path, {"settings": {"command": "fit", **command_settings()}, **doc})
        click.echo(f"wrote {out_path}", err=True)
    click.echo(strict_json({"regression": doc["regression"], "report": doc["report"]}), nl=False)


# The workload ``sloweave run`` serves, scaled to a CPU model, in the order the help shows them.
served_workload_options = stacked(
    click.option("--workload", type=click.Choice(list(WORKLOADS)), default="mixed", show_default=True),
    requests_option(80),
    click.option(
        "--rate-scale",
        type=ranged(SCALE),
        default=0.25,
        show_default=True,
        help="multiplies the workload's arrival rate",
    ),
    click.option(
        "--prompt-scale",
        type=ranged(SCALE),
        default=0.25,
        show_default=True,
        help="multiplies prompt lengths",
    ),
    click.option(
        "--output-scale",
        type=ranged(SCALE),
        default=0.1,
        show_default=True,
        help="multiplies output lengths",
    ),
    click.option("--max-prompt", type=ranged(TOKENS), default=1536, show_default=True),
    click.option("--max-output", type=ranged(TOKENS), default=48, show_default=True),
)


# How ``sloweave run`` runs each policy (with ``--horizon-s``: a ``ControllerSettings``), in the order the help shows them.
controller_options = stacked(
    tpot_ms_option(100.0, help="TPOT target; 100 ms suits the small model on one CPU thread"),
    ttft_ms_option(help="TTFT target; default: the workload's own"),
    click.option(
        "--cost",
        "cost_kind",
        type=click.Choice(["regression", "table"]),
        default="regression",
        show_default=True,
    ),
    click.option("--margin/--no-margin", default=True, show_default=True),
    click.option(
        "--calibrate/--no-calibrate",
        default=True,
        show_default=True,
        help="online recalibration (SLOWeave)",
    ),
    click.option(
        "--margin-form",
        type=click.Choice(MARGIN_FORMS),
        default=DEFAULT_MARGIN_FORM,
        show_default=True,
        help="with --calibrate, SLOWeave's adaptive margin: relative (one quantile of measured / predicted - 1, "
        "times the prediction) or per-step (milliseconds, the quantile of steps of the same kind and predicted time)",
    ),
    click.option(
        "--stale-factor",
        type=ranged(SCALE),
        default=1.0,
        show_default=True,
        help="scale the fitted cost (drift experiment)",
    ),
    max_chunk_option(1024, help="SLOWeave's C_max"),
    click.option(
        "--aging-ms",
        type=ranged(DURATION_MS),
        default=None,
        help="starvation control for every policy, as the vLLM plug-in's aging_ms (2000 there): after "
        "this wait without progress the oldest prompt gets a chunk (an SLO exception); off by default, "
        "as in `sloweave simulate`",
    ),
    click.option(
        "--aging-chunk-tokens",
        type=ranged(TOKENS),
        default=256,
        show_default=True,
        help="the chunk aging forces",
    ),
    click.option(
        "--step-grid",
        "step_grid_tokens",
        type=ranged(TOKENS),
        default=1,
        show_default=True,
        help="SLOWeave rounds a step (decodes + chunk) the deadline cut short down to a multiple of this, as "
        "the vLLM plug-in's step_grid_tokens (32 there): an engine that pays for each new step size runs few "
        "(transformers on a GPU with cuDNN attention: 70-80 ms a size); 1: no rounding",
    ),
)


@command("run")
@model_option()
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="profile from `sloweave profile`",
)
@served_workload_options
@gathered("served", CpuWorkload, tuple(f.name for f in fields(CpuWorkload)))
@click.option("--policies", default="sloweave,fixed-32,fixed-64,fixed-128,fixed-256,fixed-512,full", show_default=True)
@controller_options
@click.option("--seeds", default="0", show_default=True, callback=_whole_numbers(SEED))
@click.option("--horizon-s", type=ranged(DURATION_S), default=None, help="stop a run after this long")
@gathered("controller", ControllerSettings, tuple(f.name for f in fields(ControllerSettings)))
@click.option("--threads", type=ranged(REPEATS), default=1, show_default=True)
@out_folder_options(default=Path("results/cpu-run"))
@click.option(
    "--monotone-tolerance-ms", type=ranged(MARGIN_MS), default=5.0, show_default=True, help=MONOTONE_TOLERANCE_HELP
)
def run(
    model,
    profile_path,
    served: CpuWorkload,
    policies,
    controller: ControllerSettings,
    seeds,
    threads,
    out: OutFolder,
    monotone_tolerance_ms,
) -> None:
    """Serve a workload on the real CPU model under each policy; report measured and simulated metrics."""
    check_writable(out.path, "--out")
    _need_runtime("run")
    fit_result = _fit_or_fail(profile_path, monotone_tolerance_ms)
    model_obj = load_servable_model(model, served)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    with out.open() as folder:  # the folder is complete or absent
        serve_policies(model_obj, fit_result, served, names, seeds, controller, threads, folder.path, click.echo)
    click.echo(
        f"wrote {out.path}/summary.csv, summary.json, summary.png (per run: requests-, steps-, decision_metrics-*)"
    )
