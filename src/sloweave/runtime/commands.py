"""What ``sloweave profile`` and ``sloweave run`` do on the measured CPU runtime (their options
are ``sloweave.cli.runtime``'s): measure a step-time profile, and serve a workload under each policy.

This module imports neither torch nor transformers at import time (``sloweave --help`` and
``sloweave fit`` work without them); the functions that need the engine import it inside.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sloweave.core.costs.calibrated import DEFAULT_MARGIN_FORM
from sloweave.core.validate import OptionError
from sloweave.sim.workloads import get_workload_spec
from sloweave.studies.outputs import command_settings, write_result_json


def measure_profile(
    model: str,
    decodes,
    chunks,
    contexts,
    repeats: int,
    holdout_per_state: int,
    threads: int,
    seed: int,
    dtype: str = "float32",
    device: str = "cpu",
):
    """Step times of the real engine over a (decodes, chunk, context) grid, and what made them."""
    import torch
    import transformers

    from sloweave.runtime.engine import DEFAULT_PAGE_TOKENS, TransformersEngine
    from sloweave.runtime.model import load_model, model_label
    from sloweave.runtime.profiler import profile_blocks, run_profile

    if device == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"no GPU is visible to torch {torch.__version__}", "--device")
    started = time.time()
    engine = TransformersEngine(
        load_model(model, seed, dtype, device),
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
        "dtype": dtype,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "grid": {"decodes": decodes, "chunks": chunks, "contexts": contexts, "repeats": repeats},
        "seconds": round(time.time() - started, 1),
    }
    return frame, meta


@dataclass(frozen=True)
class CpuWorkload:
    """The workload served: the paper's generator with lengths scaled (and capped) to fit a CPU model."""

    workload: str
    num_requests: int
    rate_scale: float
    prompt_scale: float
    output_scale: float
    max_prompt: int
    max_output: int

    def generate(self, seed: int):
        from sloweave.runtime.experiment import scaled_workload

        return scaled_workload(
            self.workload,
            self.num_requests,
            seed,
            self.rate_scale,
            self.prompt_scale,
            self.output_scale,
            self.max_prompt,
            self.max_output,
        )


@dataclass(frozen=True)
class ControllerSettings:
    """How every policy is run: targets, the fitted cost and margin, correction, aging, a time limit."""

    tpot_ms: float
    ttft_ms: float | None  # None: the workload's own
    cost_kind: str
    margin: bool
    calibrate: bool
    stale_factor: float  # SLOWeave's fitted cost scaled by this (a drift experiment)
    max_chunk: int
    aging_ms: float | None
    aging_chunk_tokens: int
    horizon_s: float | None
    margin_form: str = DEFAULT_MARGIN_FORM  # SLOWeave's adaptive margin (core.costs.calibrated.MARGIN_FORMS)
    step_grid_tokens: int = 1  # SLOWeave's size grid (core/size_grid.py; 1: none)

    def __post_init__(self) -> None:
        if self.margin_form != DEFAULT_MARGIN_FORM and not self.calibrate:
            raise OptionError(
                f"--margin-form {self.margin_form} needs --calibrate (it shapes the adaptive margin)", "--margin-form"
            )


def load_servable_model(model: str, served: CpuWorkload):
    """The model; refused, naming the option, when unknown or when a request would not fit its positions."""
    from sloweave.runtime.model import load_model

    try:
        model_obj = load_model(model)
    except ValueError as err:
        raise OptionError(str(err), "--model") from None
    # A request longer than the model's positions is not servable (RoPE past its range).
    context = getattr(model_obj.config, "max_position_embeddings", None)
    if context is not None and served.max_prompt + served.max_output > context:
        raise OptionError(
            f"--max-prompt {served.max_prompt} + --max-output {served.max_output} tokens exceed the model's context "
            f"of {context} tokens (max_position_embeddings)",
            "--max-prompt",
        )
    return model_obj


def serve_policies(
    model_obj,
    fit,
    served: CpuWorkload,
    policies: list[str],
    seeds: tuple[int, ...],
    settings: ControllerSettings,
    threads: int,
    out_dir: Path,
    report: Callable[[str], None] = print,
):
    """Serve each seed's workload under each policy into ``out_dir``: per run its requests, steps
    and decision metrics, then the summary (CSV, JSON, plot). ``report`` gets a line per run."""
    import pandas as pd

    from sloweave.runtime.experiment import add_ratios

    ttft_ms = settings.ttft_ms or get_workload_spec(served.workload).ttft_ms
    rows = []
    for seed in seeds:
        workload = served.generate(seed)
        rows += _serve_seed(model_obj, fit, workload, policies, seed, settings, ttft_ms, threads, out_dir, report)
    frame = pd.concat([add_ratios(pd.DataFrame([r for r in rows if r["seed"] == s])) for s in seeds], ignore_index=True)
    frame.to_csv(out_dir / "summary.csv", index=False)
    write_result_json(
        out_dir / "summary.json",
        {"command": "run", "settings": command_settings(), "runs": frame.to_dict(orient="records")},
    )
    _plot(frame, out_dir / "summary.png", settings.tpot_ms)
    return frame


def _serve_seed(model_obj, fit, workload, policies, seed, settings, ttft_ms, threads, out_dir, report) -> list[dict]:
    from sloweave.runtime.engine import TransformersEngine, blocks_needed
    from sloweave.runtime.experiment import measure_policy

    engine = TransformersEngine(
        model_obj,
        max_batch_tokens=int(workload.prompt_tokens.max()) + 128,
        num_blocks=blocks_needed(int((workload.prompt_tokens + workload.output_tokens).sum()), len(workload)),
        threads=threads,
    )
    rows = []
    for name in policies:
        row, run = measure_policy(
            engine,
            workload,
            name,
            fit,
            settings.tpot_ms,
            ttft_ms,
            settings.cost_kind,
            settings.margin,
            settings.calibrate,
            settings.max_chunk,
            settings.stale_factor if name == "sloweave" else 1.0,
            seed,
            settings.horizon_s,
            aging_ms=settings.aging_ms,
            aging_chunk_tokens=settings.aging_chunk_tokens,
            margin_form=settings.margin_form,
            step_grid_tokens=settings.step_grid_tokens,
        )
        row.update(seed=seed, workload=workload.name, tpot_target_ms=settings.tpot_ms, ttft_target_ms=ttft_ms)
        rows.append(row)
        _write_run(out_dir, row, run, seed, settings.tpot_ms)
        report(
            f"{row['policy']:>28s} seed {seed}: goodput {row['measured_goodput_rps']:.3f} req/s, "
            f"attainment {row['measured_attainment']:.2f}, P99 TPOT {row['measured_p99_tpot_ms']:.1f} ms, "
            f"P99 TTFT {row['measured_p99_ttft_ms']:.0f} ms, overran {row['overran_prediction_plus_margin_share']:.1%} of steps"
        )
    return rows


def _write_run(out_dir: Path, row: dict, run, seed: int, tpot_ms: float) -> None:
    """One run's requests, steps, and the controller's decisions under the names the simulator and the vLLM plug-in use."""
    tag = f"{row['policy']}-seed{seed}".replace("+", "_").replace("(", "_").replace(")", "").replace(" ", "")
    run.requests.to_csv(out_dir / f"requests-{tag}.csv", index=False)
    run.steps.to_csv(out_dir / f"steps-{tag}.csv", index=False)
    decisions = {
        "source": "cpu-runtime",
        "policy": row["policy"],
        "seed": seed,
        "tpot_ms": tpot_ms,
        "metrics": run.decision_metrics,
    }
    write_result_json(out_dir / f"decision_metrics-{tag}.json", decisions)


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
