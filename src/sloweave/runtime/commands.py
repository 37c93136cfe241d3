"""``sloweave profile``, ``sloweave fit`` and ``sloweave run``: the measured CPU runtime's commands.

This module imports neither torch nor transformers at import time (``sloweave --help`` and
``sloweave fit`` work without them); the commands that need the engine import it inside.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from sloweave.core.costs.fitted import HOLDOUT_ERROR, MAX_HOLDOUT_ERROR
from sloweave.sim.workloads import WORKLOADS
from sloweave.core.validate import (
    DURATION_MS,
    DURATION_S,
    MARGIN_MS,
    MAX_REPEATS,
    REPEATS,
    REQUEST_COUNT,
    SCALE,
    TOKEN_COUNT,
    TOKENS,
    Range,
)
from sloweave.core.validate import SEED
from sloweave.studies.inputs import REQUESTS
from sloweave.studies.outputs import check_writable, command_settings, strict_json, write_result_json
from sloweave.studies.result_folders import result_folder, result_folder_options


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
    from sloweave.core.costs.fitted import ProfileError, fit_profile_file

    try:
        result = fit_profile_file(
            profile, monotone_tolerance_ms=monotone_tolerance_ms, max_holdout_error=max_holdout_error
        )
    except ProfileError as err:
        raise click.ClickException(str(err)) from None
    for note in result.report["notes"]:  # a kind refused, an error not measured: never silent
        click.echo(f"{profile}: {note}", err=True)
    return result


@click.command()
@click.option(
    "--model", default="small", show_default=True, help="packaged model (tiny, small) or a local model directory"
)
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
@click.option("--repeats", type=REPEATS.option(), default=3, show_default=True)
@click.option(
    "--holdout",
    "holdout_per_state",
    type=Range(0, MAX_REPEATS, whole=True).option(),
    default=3,
    show_default=True,
    help="off-grid held-out steps per (context, n)",
)
@click.option("--threads", type=REPEATS.option(), default=1, show_default=True, help="torch threads")
@click.option("--seed", type=SEED.option(), default=0, show_default=True)
def profile(model, out_path, decodes, chunks, contexts, repeats, holdout_per_state, threads, seed) -> None:
    """Measure step times of the real CPU engine over a (decodes, chunk, context) grid."""
    check_writable(out_path, "--out", is_file=True)
    _need_runtime("profile")
    import torch
    import transformers

    from sloweave.core.costs.fitted import ProfileError, fit_profile, write_profile
    from sloweave.runtime.engine import DEFAULT_PAGE_TOKENS, Engine
    from sloweave.runtime.model import load_model, model_label
    from sloweave.runtime.profiler import profile_blocks, run_profile

    started = time.time()
    engine = Engine(
        load_model(model, seed),
        max_batch_tokens=max(decodes) + 2 * max(chunks),
        num_blocks=profile_blocks(decodes, chunks, contexts, repeats, DEFAULT_PAGE_TOKENS),
        threads=threads,
    )
    frame = run_profile(engine, decodes, chunks, contexts, repeats, holdout_per_state, seed)
    meta = {
        "model": model_label(model),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": threads,
        "grid": {"decodes": decodes, "chunks": chunks, "contexts": contexts, "repeats": repeats},
        "seconds": round(time.time() - started, 1),
    }
    write_profile(frame, out_path, meta)
    click.echo(f"wrote {len(frame)} steps to {out_path} in {meta['seconds']} s")
    try:
        report = fit_profile(frame, seed=seed, where=f"profile {out_path}").report
    except ProfileError as err:
        raise click.ClickException(f"the profile is written, but no fit of it can be used: {err}") from None
    click.echo(strict_json(report), nl=False)


@click.command(name="fit")
@click.argument("profile_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="write the fitted models as JSON",
)
@click.option(
    "--monotone-tolerance-ms",
    type=MARGIN_MS.option(),
    default=5.0,
    show_default=True,
    help="a drop along c or n smaller than this (or than 25 %) is noise, not a broken profile",
)
@click.option(
    "--max-holdout-error",
    type=HOLDOUT_ERROR.option(),
    default=MAX_HOLDOUT_ERROR,
    show_default=True,
    help="refuse a fitted kind whose median relative error on held-out steps is above this (0.5: 50 %)",
)
def fit_command(
    profile_path: Path, out_path: Path | None, monotone_tolerance_ms: float, max_holdout_error: float
) -> None:
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


@click.command(name="run")
@click.option(
    "--model", default="small", show_default=True, help="packaged model (tiny, small) or a local model directory"
)
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="profile from `sloweave profile`",
)
@click.option("--workload", type=click.Choice(list(WORKLOADS)), default="mixed", show_default=True)
@click.option("--requests", "num_requests", type=REQUESTS, default=80, show_default=True)
@click.option(
    "--rate-scale", type=SCALE.option(), default=0.25, show_default=True, help="multiplies the workload's arrival rate"
)
@click.option("--prompt-scale", type=SCALE.option(), default=0.25, show_default=True, help="multiplies prompt lengths")
@click.option("--output-scale", type=SCALE.option(), default=0.1, show_default=True, help="multiplies output lengths")
@click.option("--max-prompt", type=TOKENS.option(), default=1536, show_default=True)
@click.option("--max-output", type=TOKENS.option(), default=48, show_default=True)
@click.option("--policies", default="sloweave,fixed-32,fixed-64,fixed-128,fixed-256,fixed-512,full", show_default=True)
@click.option(
    "--tpot-ms",
    type=DURATION_MS.option(),
    default=100.0,
    show_default=True,
    help="TPOT target; 100 ms suits the small model on one CPU thread",
)
@click.option("--ttft-ms", type=DURATION_MS.option(), default=None, help="TTFT target; default: the workload's own")
@click.option(
    "--cost", "cost_kind", type=click.Choice(["regression", "table"]), default="regression", show_default=True
)
@click.option("--margin/--no-margin", default=True, show_default=True)
@click.option("--calibrate/--no-calibrate", default=True, show_default=True, help="online recalibration (SLOWeave)")
@click.option(
    "--stale-factor",
    type=SCALE.option(),
    default=1.0,
    show_default=True,
    help="scale the fitted cost (drift experiment)",
)
@click.option("--max-chunk", type=TOKENS.option(), default=1024, show_default=True, help="SLOWeave's C_max")
@click.option(
    "--aging-ms",
    type=DURATION_MS.option(),
    default=None,
    help="starvation control for every policy, as the vLLM plug-in's aging_ms (2000 there): after this wait without "
    "progress the oldest prompt gets a chunk (an SLO exception); off by default, as in `sloweave simulate`",
)
@click.option(
    "--aging-chunk-tokens", type=TOKENS.option(), default=256, show_default=True, help="the chunk aging forces"
)
@click.option("--seeds", default="0", show_default=True, callback=_whole_numbers(SEED))
@click.option("--horizon-s", type=DURATION_S.option(), default=None, help="stop a run after this long")
@click.option("--threads", type=REPEATS.option(), default=1, show_default=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("results/cpu-run"),
    show_default=True,
)
@result_folder_options()
@click.option(
    "--monotone-tolerance-ms",
    type=MARGIN_MS.option(),
    default=5.0,
    show_default=True,
    help="a drop along c or n smaller than this (or than 25 %) is noise, not a broken profile",
)
def run_command(
    model,
    profile_path,
    workload,
    num_requests,
    rate_scale,
    prompt_scale,
    output_scale,
    max_prompt,
    max_output,
    policies,
    tpot_ms,
    ttft_ms,
    cost_kind,
    margin,
    calibrate,
    stale_factor,
    max_chunk,
    aging_ms,
    aging_chunk_tokens,
    seeds,
    horizon_s,
    threads,
    out_dir,
    monotone_tolerance_ms,
    force,
) -> None:
    """Serve a workload on the real CPU model under each policy; report measured and simulated metrics."""
    check_writable(out_dir, "--out")
    _need_runtime("run")
    import pandas as pd

    from sloweave.runtime.engine import Engine, blocks_needed
    from sloweave.runtime.experiment import add_ratios, run_policy, scaled_workload
    from sloweave.runtime.model import load_model
    from sloweave.sim.workloads import get_workload_spec

    fit = _fit_or_fail(profile_path, monotone_tolerance_ms)
    ttft_ms = ttft_ms or get_workload_spec(workload).ttft_ms
    names = [p.strip() for p in policies.split(",") if p.strip()]
    try:
        model_obj = load_model(model)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--model") from None
    # A request longer than the model's positions is not servable (RoPE past its range).
    context = getattr(model_obj.config, "max_position_embeddings", None)
    if context is not None and max_prompt + max_output > context:
        raise click.BadParameter(
            f"--max-prompt {max_prompt} + --max-output {max_output} tokens exceed the model's context of {context} tokens "
            "(max_position_embeddings)",
            param_hint="--max-prompt",
        )
    with result_folder(out_dir, force) as folder:  # the folder is complete or absent
        rows = []
        for seed in seeds:
            wl = scaled_workload(
                workload, num_requests, seed, rate_scale, prompt_scale, output_scale, max_prompt, max_output
            )
            engine = Engine(
                model_obj,
                max_batch_tokens=int(wl.prompt_tokens.max()) + 128,
                num_blocks=blocks_needed(int((wl.prompt_tokens + wl.output_tokens).sum()), len(wl)),
                threads=threads,
            )
            for name in names:
                row, run = run_policy(
                    engine,
                    wl,
                    name,
                    fit,
                    tpot_ms,
                    ttft_ms,
                    cost_kind,
                    margin,
                    calibrate,
                    max_chunk,
                    stale_factor if name == "sloweave" else 1.0,
                    seed,
                    horizon_s,
                    aging_ms=aging_ms,
                    aging_chunk_tokens=aging_chunk_tokens,
                )
                row.update(seed=seed, workload=wl.name, tpot_target_ms=tpot_ms, ttft_target_ms=ttft_ms)
                rows.append(row)
                tag = (
                    f"{row['policy']}-seed{seed}".replace("+", "_").replace("(", "_").replace(")", "").replace(" ", "")
                )
                run.requests.to_csv(folder.path / f"requests-{tag}.csv", index=False)
                run.steps.to_csv(folder.path / f"steps-{tag}.csv", index=False)
                # the controller's decisions under the names the simulator and the vLLM plug-in use
                decisions = {
                    "source": "cpu-runtime",
                    "policy": row["policy"],
                    "seed": seed,
                    "tpot_ms": tpot_ms,
                    "metrics": run.decision_metrics,
                }
                write_result_json(folder.path / f"decision_metrics-{tag}.json", decisions)
                click.echo(
                    f"{row['policy']:>28s} seed {seed}: goodput {row['measured_goodput_rps']:.3f} req/s, "
                    f"attainment {row['measured_attainment']:.2f}, P99 TPOT {row['measured_p99_tpot_ms']:.1f} ms, "
                    f"P99 TTFT {row['measured_p99_ttft_ms']:.0f} ms, overran {row['overran_prediction_plus_margin_share']:.1%} of steps"
                )
        frame = pd.concat(
            [add_ratios(pd.DataFrame([r for r in rows if r["seed"] == s])) for s in seeds], ignore_index=True
        )
        frame.to_csv(folder.path / "summary.csv", index=False)
        write_result_json(
            folder.path / "summary.json",
            {"command": "run", "settings": command_settings(), "runs": frame.to_dict(orient="records")},
        )
        _plot(frame, folder.path / "summary.png", tpot_ms)
    click.echo(
        f"wrote {out_dir}/summary.csv, summary.json, summary.png (per run: requests-, steps-, decision_metrics-*)"
    )


def _plot(frame, path: Path, tpot_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = frame.groupby("policy", sort=False).median(numeric_only=True)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    x = range(len(med))
    axes[0].bar(x, med["measured_goodput_rps"], label="measured")
    if "simulated_goodput_rps" in med:
        axes[0].plot(x, med["simulated_goodput_rps"], "k_", markersize=22, label="simulated")
    axes[0].set_title("goodput (req/s)")
    axes[0].legend()
    axes[1].bar(x, med["measured_p99_tpot_ms"])
    axes[1].axhline(tpot_ms, color="r", ls="--", label="TPOT target")
    axes[1].set_title("P99 TPOT (ms)")
    axes[1].legend()
    axes[2].bar(x, med["measured_p99_ttft_ms"] / 1000.0)
    axes[2].set_title("P99 TTFT (s)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(med.index, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
