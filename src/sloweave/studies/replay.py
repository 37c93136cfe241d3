"""Replay a trace under several policies: per-request outcomes, metrics and CDF plots.

Also holds what the capacity search shares with it: running one policy and the plots.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.protocols import CostModel
from sloweave.sim.metrics import RunMetrics, per_request_frame, run_duration_ms, slo_met, summarize
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS, Policy, make_policy
from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions
from sloweave.studies.outputs import command_settings, write_result_json
from sloweave.studies.parallel import SERIAL, Runner, run_tasks
from sloweave.studies.pictures import pyplot
from sloweave.sim.trace_replay import ReplayReport
from sloweave.sim.workloads import Workload

DEFAULT_REPLAY_POLICIES = ("sloweave", "full", "fixed-256", "fixed-1024", "fixed-2048")
# The conversation trace is an interactive chat service: SPEC.md's chat TTFT target (see docs/capacity.md).
DEFAULT_TRACE_TTFT_MS = 1000.0


def build_policy(name: str, cost: CostModel, max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS) -> Policy:
    return make_policy(name, cost=cost, max_chunk_tokens=max_chunk_tokens)


def run_policy(
    workload: Workload,
    policy: Policy,
    tpot_ms: float,
    cost: CostModel,
    options: EngineOptions = DEFAULT_OPTIONS,
    ttft_ms: float | None = None,
    noise_seed: int = 0,
) -> tuple[pd.DataFrame, float]:
    """Simulate and return (per-request frame, run duration in ms).

    ``cost`` is the machine's model for every policy (times ``options``' prediction error),
    so static and deadline policies run on the same machine, with the same engine options.
    """
    result = options.simulate(workload, policy, tpot_ms, ttft_ms, cost, noise_seed)
    return per_request_frame(result), run_duration_ms(result)


# --------------------------------------------------------------------------- plots


def policy_style(policy: str, index: int) -> dict:
    """SLOWeave thick, black and on top; the other policies in the default colour cycle, by list order."""
    if policy == "sloweave":
        return {"color": "black", "linewidth": 2.4, "zorder": 10}
    return {"color": f"C{index % 10}", "linewidth": 1.3, "zorder": 2}


def plot_cdfs(
    series: dict[str, np.ndarray], path: Path, xlabel: str, title: str, target: float | None = None, log_x: bool = False
) -> None:
    """Empirical CDFs, one line per label. Unfinished requests (nan) are left out of the
    curve but counted in the denominator, so a curve that stops below 1 shows them."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, (label, values) in enumerate(series.items()):
        values = np.asarray(values, dtype=float)
        finite = np.sort(values[np.isfinite(values)])
        if values.size == 0 or finite.size == 0:
            continue
        ax.step(
            finite, np.arange(1, finite.size + 1) / values.size, where="post", label=label, **policy_style(label, index)
        )
    if target is not None:
        ax.axvline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:g}", zorder=1)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- replay command


def replay_many(
    workloads: list[Workload],
    policies: list[str],
    tpot_ms: float,
    ttft_ms: float,
    cost: CostModel | None = None,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
    progress: bool = False,
    options: EngineOptions = DEFAULT_OPTIONS,
    noise_seed: int = 0,
    runner: Runner = SERIAL,
    store=None,
) -> list[tuple[pd.DataFrame, dict[str, RunMetrics]]]:
    """Run every policy on each workload (each trace), each with the same engine ``options``;
    per workload, all per-request rows and the metrics by policy. A policy named twice is
    refused. One batch of tasks, one per (workload, policy), run where ``runner`` says."""
    cost = cost or AnalyticCost()
    built = [build_policy(name, cost, max_chunk_tokens) for name in policies]
    twice = sorted(name for name, count in Counter(p.name for p in built).items() if count > 1)
    if twice:
        raise ValueError(f"policy given more than once: {', '.join(twice)} (each policy is replayed once)")
    context = (tuple(workloads), tpot_ms, ttft_ms, cost, options, noise_seed)
    tasks = [(w, policy) for w in range(len(workloads)) for policy in built]
    outcomes = iter(run_tasks(_replayed, tasks, context, runner, "replay", progress, store))
    replayed = []
    for _ in workloads:
        runs = [next(outcomes) for _ in built]
        metrics = {policy.name: m for policy, (_, m) in zip(built, runs)}
        replayed.append((pd.concat([frame for frame, _ in runs], ignore_index=True), metrics))
    return replayed


def _replayed(context, workload_index: int, policy) -> tuple[pd.DataFrame, RunMetrics]:
    workloads, tpot_ms, ttft_ms, cost, options, noise_seed = context
    frame, duration_ms = run_policy(workloads[workload_index], policy, tpot_ms, cost, options, ttft_ms, noise_seed)
    metrics = summarize(frame, duration_ms, ttft_ms, tpot_ms)
    frame.insert(0, "policy", policy.name)
    frame["slo_met"] = slo_met(frame, ttft_ms, tpot_ms)
    return frame, metrics


def describe_report(report: ReplayReport) -> str:
    lines = [f"trace {report.source} ({report.fmt}): {report.num_requests} of {report.num_requests_in_file} requests"]
    if report.arrivals_generated:
        lines.append(f"ARRIVALS {report.arrivals}")
    else:
        lines.append(
            f"window [{report.window_start_s:g}, {report.window_end_s:g}) s of the trace, "
            f"replayed x{report.rate_scale:g}: {report.base_rate_rps:.3f} -> {report.offered_rate_rps:.3f} req/s"
        )
    if report.max_prompt_tokens is not None:
        lines.append(f"prompt cap {report.max_prompt_tokens} tokens: {report.num_prompts_capped} prompt(s) capped")
    return "\n".join(lines)


def _write_replay(
    out_dir: Path,
    report: ReplayReport,
    requests: pd.DataFrame,
    metrics: dict,
    tpot_ms,
    ttft_ms,
    max_chunk,
    engine,
    cost,
) -> pd.DataFrame:
    """One trace's files: metrics.csv, requests.csv, replay.json, the two CDF plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(
        [{"policy": name, "tpot_ms": tpot_ms, "ttft_ms": ttft_ms, **m.as_dict()} for name, m in metrics.items()]
    )
    table.to_csv(out_dir / "metrics.csv", index=False)
    requests.to_csv(out_dir / "requests.csv", index=False)
    payload = {
        "command": "replay",
        "settings": command_settings(),
        "replay": report.as_dict(),
        "tpot_ms": tpot_ms,
        "ttft_ms": ttft_ms,
        "max_chunk_tokens": max_chunk,
        "engine_options": engine.describe(),
        "cost": cost.description,
        "metrics": {name: m.as_dict() for name, m in metrics.items()},
    }
    write_result_json(out_dir / "replay.json", payload)
    by_policy = {name: frame for name, frame in requests.groupby("policy", sort=False)}
    arrivals_text = "generated arrivals" if report.arrivals_generated else f"x{report.rate_scale:g}"
    title = f"{Path(report.source).name} ({arrivals_text}, {report.offered_rate_rps:.1f} req/s)"
    plot_cdfs(
        {k: v["ttft_ms"].to_numpy() for k, v in by_policy.items()},
        out_dir / "cdf_ttft.png",
        "TTFT (ms)",
        title,
        ttft_ms,
        log_x=True,
    )
    plot_cdfs(
        {k: v["p99_tpot_ms"].to_numpy() for k, v in by_policy.items()},
        out_dir / "cdf_p99_tpot.png",
        "per-request P99 inter-token gap (ms)",
        title,
        tpot_ms,
    )
    return table
