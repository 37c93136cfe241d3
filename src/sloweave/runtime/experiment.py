"""Compare policies on one workload on the real engine, beside the simulator's prediction.

Shared by ``sloweave run`` and ``benchmarks/cpu_runtime.py``: scale a paper workload to
the CPU model's speed, build each policy with the fitted cost (and margin, and online
calibration for SLOWeave), run it through the same engine, and summarise measured and
simulated metrics side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sloweave.core.costs.fitted import ContextualCost, FixedContextCost, ResidualMargin
from sloweave.core.costs.profile_fit import FitResult
from sloweave.sim.metrics import evaluate
from sloweave.core.policy import Aging, SLOWeave, make_policy
from sloweave.core.costs.calibrated import (
    DEFAULT_MARGIN_FORM,
    OnlineCalibrator,
    ScaledCost,
    SelfCorrection,
    self_correcting,
)
from sloweave.runtime.engine import TransformersEngine
from sloweave.runtime.runner import MeasuredRun, RequestSpec, run_requests
from sloweave.sim.engine import simulate
from sloweave.sim.workloads import Workload, get_workload_spec, mean_context_tokens


def scaled_workload(
    name: str,
    num_requests: int,
    seed: int,
    rate_scale: float,
    prompt_scale: float,
    output_scale: float,
    max_prompt_tokens: int,
    max_output_tokens: int,
) -> Workload:
    """The paper's generator, with lengths scaled (and capped) to fit a CPU model."""
    base = get_workload_spec(name).generate(num_requests, seed, rate_scale)
    prompt = np.clip(np.round(base.prompt_tokens * prompt_scale), 1, max_prompt_tokens).astype(np.int64)
    output = np.clip(np.round(base.output_tokens * output_scale), 1, max_output_tokens).astype(np.int64)
    params = dict(
        base.params,
        prompt_scale=prompt_scale,
        output_scale=output_scale,
        max_prompt_tokens=max_prompt_tokens,
        max_output_tokens=max_output_tokens,
    )
    return Workload(
        name=f"{name}-cpu", arrival_s=base.arrival_s, prompt_tokens=prompt, output_tokens=output, params=params
    )


@dataclass
class PolicySetup:
    policy: object
    cost: ContextualCost | None
    margin: object | None
    calibrator: OnlineCalibrator | None
    # online correction (SLOWeave with ``calibrate``): the core's one piece, as the simulator
    # (``EngineOptions(correction=True)``) and the vLLM plug-in (``online_correction``) use it
    correction: SelfCorrection | None = None


def build_policy_setup(
    name: str,
    fit: FitResult,
    cost_kind: str = "regression",
    use_margin: bool = True,
    calibrate: bool = True,
    max_chunk_tokens: int = 1024,
    stale_factor: float = 1.0,
    margin_form: str = DEFAULT_MARGIN_FORM,
) -> PolicySetup:
    """A policy plus the cost objects the runner needs. Static policies still get the
    (uncalibrated) cost so their steps' predictions can be reported next to SLOWeave's.

    ``stale_factor`` != 1 scales the fitted cost on purpose (a profile taken on a faster or
    slower machine) to show what online calibration does against drift. ``margin_form``
    shapes the adaptive margin (``core.costs.calibrated.MARGIN_FORMS``; with ``calibrate``).
    """
    base: ContextualCost = fit.cost(cost_kind)
    if stale_factor != 1.0:
        base = ScaledCost(base, stale_factor)
    if name.strip().lower() != "sloweave":
        return PolicySetup(make_policy(name), base, None, None)
    if not calibrate:
        margin = fit.margin(base) if use_margin else None  # the profile's P99 table
        policy = SLOWeave(cost=base, margin=margin or _zero, max_chunk_tokens=max_chunk_tokens)
        return PolicySetup(policy, base, margin, None)
    # Recalibration on: the core's self-correction (``core.costs.calibrated.self_correcting``). The
    # margin is its AdaptiveMargin, the DEFAULT_MARGIN_QUANTILE of the corrected model's recent
    # residuals once enough steps are in, the profile's table (read through the corrected cost)
    # before that.
    fallback = fit.margin(base)
    correction = self_correcting(base, fallback=fallback, margin_form=margin_form)
    fallback.cost = correction.cost
    margin = correction.margin if use_margin else None
    policy = SLOWeave(cost=correction.cost, margin=margin or _zero, max_chunk_tokens=max_chunk_tokens)
    return PolicySetup(policy, correction.cost, margin, correction.calibrator, correction)


def _zero(n_decodes: int, chunk_tokens: int) -> float:
    return 0.0


def simulated_metrics(
    workload: Workload,
    name: str,
    fit: FitResult,
    tpot_ms: float,
    ttft_ms: float,
    cost_kind: str = "regression",
    use_margin: bool = True,
    max_chunk_tokens: int = 1024,
    aging: Aging | None = None,
    step_grid_tokens: int = 1,
) -> dict:
    """The simulator's prediction of the same run, on the fitted cost at the workload's mean context."""
    cost = FixedContextCost(fit.cost(cost_kind), mean_context_tokens(workload))
    margin = ResidualMargin(cost, fit.margin_fractions) if use_margin else None
    policy = make_policy(name, cost, margin if make_policy(name).uses_deadlines else None, max_chunk_tokens)
    result = simulate(
        workload, policy, tpot_ms=tpot_ms, actual_cost=cost, aging=aging, step_grid_tokens=step_grid_tokens
    )
    return evaluate(result, ttft_ms, tpot_ms).as_dict()


def measure_policy(
    engine: TransformersEngine,
    workload: Workload,
    name: str,
    fit: FitResult,
    tpot_ms: float,
    ttft_ms: float,
    cost_kind: str = "regression",
    use_margin: bool = True,
    calibrate: bool = True,
    max_chunk_tokens: int = 1024,
    stale_factor: float = 1.0,
    seed: int = 0,
    horizon_s: float | None = None,
    progress: bool = True,
    aging_ms: float | None = None,
    aging_chunk_tokens: int = 256,
    margin_form: str = DEFAULT_MARGIN_FORM,
    step_grid_tokens: int = 1,
) -> tuple[dict, MeasuredRun]:
    """One measured run; returns a flat summary row and the full run.

    ``aging_ms`` (None: off) applies to every policy, in the run and in the simulated one;
    ``step_grid_tokens`` (1: off) to the deadline-aware ones, in both too."""
    setup = build_policy_setup(name, fit, cost_kind, use_margin, calibrate, max_chunk_tokens, stale_factor, margin_form)
    run = run_requests(
        engine,
        RequestSpec.from_workload(workload),
        setup.policy,
        tpot_ms,
        cost=setup.cost,
        calibrator=setup.calibrator,
        seed=seed,
        horizon_s=horizon_s,
        progress=progress,
        label=name,
        aging_ms=aging_ms,
        aging_chunk_tokens=aging_chunk_tokens,
        step_grid_tokens=step_grid_tokens,
    )
    measured = run.metrics(ttft_ms).as_dict()
    row = {"policy": setup.policy.name if name != "sloweave" else _sloweave_label(use_margin, calibrate, stale_factor)}
    row.update({f"measured_{k}": v for k, v in measured.items()})
    row.update(run.overrun_stats())
    row["chunk_mismatch_steps"] = int((run.steps["ran_chunk_tokens"] != run.steps["chunk_tokens"]).sum())
    row["aged_steps"] = len(run.slo_exceptions)
    if math.isfinite(tpot_ms):
        aging = Aging(aging_ms, aging_chunk_tokens) if aging_ms is not None else None
        sim = simulated_metrics(
            workload, name, fit, tpot_ms, ttft_ms, cost_kind, use_margin, max_chunk_tokens, aging, step_grid_tokens
        )
        row.update({f"simulated_{k}": sim[k] for k in ("goodput_rps", "attainment", "p99_tpot_ms", "p99_ttft_ms")})
    return row, run


def _sloweave_label(use_margin: bool, calibrate: bool, stale_factor: float) -> str:
    label = "sloweave"
    label += "+margin" if use_margin else ""
    label += "+calib" if calibrate else ""
    if stale_factor != 1.0:
        label += f"(stale x{stale_factor:g})"
    return label


def add_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """Goodput of each policy relative to the best fixed chunk measured in the same run."""
    fixed = frame[frame["policy"].str.startswith("fixed-")]
    best = float(fixed["measured_goodput_rps"].max()) if len(fixed) else float("nan")
    frame = frame.copy()
    frame["goodput_vs_best_fixed"] = frame["measured_goodput_rps"] / best if best > 0 else float("nan")
    return frame
