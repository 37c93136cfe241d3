"""``sloweave served-run``: the pictures and summaries of a served run, from its step log.

The vLLM plug-in writes a step log (``sloweave.core.step_log``); this command reads it and
draws what the simulator draws (``sloweave.studies.pictures``), and writes the decision
summary under the simulator's names (``sloweave.core.decision_metrics.summarize_decisions``), so a
simulated and a served run can be compared side by side, key by key. It also measures the engine
loop between steps (each step's cycle, ``sloweave.core.step_log.cycle_ms``) and writes the cycles
as a step-time profile, the machine of a simulator that stands in for the engine.

The result folder is complete or absent: everything is written into a temporary folder
beside ``--out`` and renamed into place at the end (``sloweave.studies.result_folders.result_folder``,
as every command that writes a folder does).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.decision_metrics import UNDERPREDICTION_TOLERANCE_MS, summarize_decisions
from sloweave.core.costs.step_profiles import write_profile
from sloweave.core.step_log import StepLog, StepLogError, cycle_ms, profile_rows
from sloweave.studies.outputs import write_result_json
from sloweave.studies.pictures import plot_step_timeline, pyplot

# Above this many steps the decomposition shows means over equal runs of steps (a bar per
# step would be thinner than a pixel).
MAX_DECOMPOSITION_POINTS = 400
OVERRUN_QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
# the columns a step needs as finite numbers to be drawn at all
FINITE_COLUMNS = ("start_ms", "measured_ms", "predicted_ms", "margin_ms")


def derived_steps(log: StepLog) -> pd.DataFrame:
    """The log's steps plus t_s (since the first step), model_ms (T = predicted - margin),
    overrun_ms (measured - predicted; negative: the step finished early), underpredicted
    (it took longer than predicted, with the tolerance ``summarize_decisions`` uses), cycle_ms
    (to the next step's start, where the engine went straight on; NaN elsewhere) and loop_ms
    (the engine loop's part of the cycle: cycle - measured)."""
    steps = log.steps.copy()  # every field in its range: read_step_log checked them
    for column in FINITE_COLUMNS:
        steps[column] = steps[column].astype("float64")
    steps["t_s"] = (steps["start_ms"] - steps["start_ms"].iloc[0]) / 1000.0
    steps["model_ms"] = steps["predicted_ms"] - steps["margin_ms"]
    steps["overrun_ms"] = steps["measured_ms"] - steps["predicted_ms"]
    steps["underpredicted"] = steps["overrun_ms"] > UNDERPREDICTION_TOLERANCE_MS
    steps["cycle_ms"] = cycle_ms(log.steps)
    steps["loop_ms"] = steps["cycle_ms"] - steps["measured_ms"]
    return steps


def engine_loop(steps: pd.DataFrame) -> dict:
    """The engine loop's time between steps, over the steps whose cycle is known: its quantiles
    and its share of those steps' time (a simulator without it runs the engine that much fast)."""
    known = steps["cycle_ms"].notna()
    loop = steps.loc[known, "loop_ms"].to_numpy()
    if not loop.size:
        return {"steps_with_a_known_cycle": 0, "loop_ms": None, "share_of_cycle_time": None}
    return {
        "steps_with_a_known_cycle": int(loop.size),
        "loop_ms": {f"p{round(q * 100)}": float(np.quantile(loop, q)) for q in (0.5, 0.9, 0.99)}
        | {"max": float(loop.max())},
        "share_of_cycle_time": float(loop.sum() / steps.loc[known, "cycle_ms"].sum()),
    }


def decision_metrics(log: StepLog, steps: pd.DataFrame) -> dict:
    """The simulator's decision summary for the served steps (planned chunk and budgets)."""
    metrics = summarize_decisions(
        steps["chunk_tokens"].to_numpy(),
        steps["token_budget"].to_numpy(),
        steps["budget_ms"].to_numpy(),
        steps["infeasible"].to_numpy(dtype=bool),
        predicted_step_ms=steps["predicted_ms"].to_numpy(),
        measured_step_ms=steps["measured_ms"].to_numpy(),
        slo_exceptions=int(steps["aged"].astype(bool).sum()),
        slo_exception_requests=int(steps["late_requests"].sum()),
        margin_ms=steps["margin_ms"].to_numpy(),
    )
    return {"source": "served", "header": log.header, "metrics": metrics}


def run_summary(log: StepLog, steps: pd.DataFrame, settings: dict) -> dict:
    """Counts, the underpredicted share and the spread of measured - predicted."""
    # decode-only by what the engine ran: the measured time is the time of what ran
    with_chunk = steps["ran_prefill_tokens"] > 0
    budget = steps["budget_ms"].to_numpy(dtype=np.float64)
    overrun = steps["overrun_ms"].to_numpy()
    return {
        "command": "served-run",
        "settings": settings,
        "header": log.header,
        "steps": len(steps),
        "duration_s": float(steps["t_s"].iloc[-1] + steps["measured_ms"].iloc[-1] / 1000.0),
        "decode_only_steps": int((~with_chunk).sum()),
        "with_chunk_steps": int(with_chunk.sum()),
        "steps_without_deadline": int(np.isinf(budget).sum()),
        "over_budget_steps": int((steps["measured_ms"].to_numpy() > budget).sum()),
        "infeasible_steps": int(steps["infeasible"].astype(bool).sum()),
        "aged_steps": int(steps["aged"].astype(bool).sum()),
        "late_requests": int(steps["late_requests"].sum()),
        "underpredicted_steps": int(steps["underpredicted"].sum()),
        "underpredicted_share": float(steps["underpredicted"].mean()),
        "measured_minus_predicted_ms": {f"p{round(q * 100)}": float(np.quantile(overrun, q)) for q in OVERRUN_QUANTILES}
        | {"max": float(overrun.max())},
        "stopped_early": log.stopped is not None,
        "stopped_why": log.stopped,
        "engine_loop": engine_loop(steps),
    }


def plot_predicted_vs_measured(steps: pd.DataFrame, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    with_chunk = steps["ran_prefill_tokens"].to_numpy() > 0
    predicted, measured = steps["predicted_ms"].to_numpy(), steps["measured_ms"].to_numpy()
    ax.scatter(predicted[~with_chunk], measured[~with_chunk], s=6, alpha=0.6, label="decode only")
    ax.scatter(predicted[with_chunk], measured[with_chunk], s=6, alpha=0.6, label="with a chunk")
    top = float(max(predicted.max(), measured.max())) * 1.05
    ax.plot([0, top], [0, top], color="black", linewidth=0.8, label="measured = predicted")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("predicted step time T + margin (ms)")
    ax.set_ylabel("measured step time (ms)")
    ax.set_title(f"{steps['underpredicted'].mean():.1%} of {len(steps)} steps underpredicted")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def binned(steps: pd.DataFrame, max_points: int) -> tuple[pd.DataFrame, int]:
    """Means over equal runs of consecutive steps (at most ``max_points`` rows), and the run length."""
    parts = pd.DataFrame(
        {
            "step": steps["step"],
            "model_ms": steps["model_ms"],
            "margin_ms": steps["margin_ms"],
            "overrun_ms": steps["overrun_ms"].clip(lower=0.0),
            # no deadline (+inf) is no point on the budget line, not an infinite mean
            "budget_ms": steps["budget_ms"].replace(math.inf, np.nan),
        }
    )
    per_point = max(1, math.ceil(len(parts) / max_points))
    if per_point == 1:
        return parts.reset_index(drop=True), 1
    return parts.groupby(np.arange(len(parts)) // per_point).mean(), per_point


def plot_decomposition(steps: pd.DataFrame, path: Path, max_points: int = MAX_DECOMPOSITION_POINTS) -> None:
    """Per step: the model's time T, the margin and the overrun, stacked; the budget as a line.

    Drawn against the step number, not the clock: an area drawn over the clock would fill the
    idle time between two steps with a ramp that no step ran."""
    plt = pyplot()
    parts, per_point = binned(steps, max_points)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.stackplot(
        parts["step"],
        parts["model_ms"],
        parts["margin_ms"],
        parts["overrun_ms"],
        labels=("model T(n, c)", "margin", "overrun (measured - predicted > 0)"),
        alpha=0.8,
    )
    ax.plot(parts["step"], parts["budget_ms"], color="black", linestyle="--", linewidth=1.0, label="budget B_t")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    each = "each step" if per_point == 1 else f"mean of {per_point} steps per point"
    ax.set_title(f"step time decomposed ({each})")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_served_run(log: StepLog, out_dir: Path, window_s: float, settings: dict) -> dict:
    """Every output file into ``out_dir`` (an existing folder); returns the run summary."""
    if log.steps.empty:
        raise StepLogError("step log has no steps (did the server schedule anything before it stopped?)")
    steps = derived_steps(log)
    plot_step_timeline(
        steps["t_s"].to_numpy(),
        steps["chunk_tokens"].to_numpy(),
        steps["measured_ms"].to_numpy(),
        steps["budget_ms"].to_numpy(),
        title=f"served run, {len(steps)} steps (planned chunk; measured step time)",
        path=out_dir / "timeline.png",
        xlabel="time since the first step (s)",
        window_s=window_s,
        skip_warmup=False,  # a served run's start is part of what the operator looks at
    )
    plot_predicted_vs_measured(steps, out_dir / "predicted_vs_measured.png")
    plot_decomposition(steps, out_dir / "decomposition.png")
    steps.to_csv(out_dir / "steps.csv", index=False)
    write_result_json(out_dir / "decision_metrics.json", decision_metrics(log, steps))
    summary = run_summary(log, steps, settings)
    # the cycles as a profile: `--cost cycles.csv --step-noise-from cycles.csv` is the engine's twin
    cycles = summary["engine_loop"]["steps_with_a_known_cycle"] > 0
    if cycles:
        write_profile(profile_rows(log, step_time="cycle"), out_dir / "cycles.csv")
    summary["cycles_profile"] = "cycles.csv" if cycles else None
    write_result_json(out_dir / "served_run.json", summary)
    return summary
