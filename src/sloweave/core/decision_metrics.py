"""What the adaptive scheduler decided, under one set of metric names for every body.

The vLLM plug-in exports these as Prometheus metrics (``sloweave.vllm_plugin.metrics``);
the simulator and the CPU runtime write a summary under the same names (``summarize_decisions``; the
runtime's through ``DecisionSummary``, a recorder on its ``BudgetController``), so
a dashboard, a simulated run and a measured run can be read side by side. Nothing here
imports an engine or ``prometheus_client``.

Per scheduling step:
- the prefill chunk chosen and the token budget handed to the engine (decodes + chunk);
- the time budget to the earliest next-token deadline (only when something is decoding:
  with no decode there is no deadline and the budget is +inf);
- whether even a decode-only step was predicted to miss that deadline (infeasible);
- whether aging forced a chunk (an SLO exception), and how many running requests that
  step is predicted to make late;
- the predicted step time and, once the step is back, the measured one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Histogram bucket upper edges. Token buckets are powers of two (the values operators set);
# time buckets bracket the TPOT targets studied (10, 25, 50 ms) finely around them.
TOKEN_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TIME_BUCKETS_MS = (1, 2, 5, 7.5, 10, 12.5, 15, 20, 25, 30, 40, 50, 75, 100, 250, 1000)
# A measured time is a difference of absolute clock readings: differences below 1 ns are
# float noise, not an underprediction.
UNDERPREDICTION_TOLERANCE_MS = 1e-6


@dataclass(frozen=True)
class MetricSpec:
    name: str  # Prometheus name without the _total / _bucket suffixes
    kind: str  # "histogram", "counter" or "gauge"
    help: str
    buckets: tuple[float, ...] = ()


CHUNK = MetricSpec("sloweave_chunk_tokens", "histogram", "Prefill tokens chosen per scheduling step", TOKEN_BUCKETS)
TOKEN_BUDGET = MetricSpec(
    "sloweave_token_budget_tokens",
    "histogram",
    "Token budget handed to the engine per step (decode tokens + chunk)",
    TOKEN_BUCKETS,
)
TIME_BUDGET = MetricSpec(
    "sloweave_time_budget_ms",
    "histogram",
    "Time from step start to the earliest next-token deadline (steps with decodes)",
    TIME_BUCKETS_MS,
)
STEPS = MetricSpec("sloweave_steps", "counter", "Steps scheduled with a sloweave budget")
INFEASIBLE = MetricSpec(
    "sloweave_infeasible_steps", "counter", "Steps where even decode-only was predicted to miss the earliest deadline"
)
SLO_EXCEPTIONS = MetricSpec(
    "sloweave_slo_exceptions", "counter", "Steps where aging forced a chunk for a starving prompt"
)
SLO_EXCEPTION_REQUESTS = MetricSpec(
    "sloweave_slo_exception_requests",
    "counter",
    "Running requests predicted to miss a deadline because of an aging chunk",
)
PREDICTED_STEP = MetricSpec(
    "sloweave_predicted_step_ms", "histogram", "Predicted step time T(n, c) + margin", TIME_BUCKETS_MS
)
MEASURED_STEP = MetricSpec(
    "sloweave_measured_step_ms", "histogram", "Measured step time (start to output back)", TIME_BUCKETS_MS
)
UNDERPREDICTED = MetricSpec(
    "sloweave_underpredicted_steps", "counter", "Finished steps that took longer than predicted"
)
# a margin of 0 (none configured) has a bucket of its own: its quantiles are 0, not interpolated up to 1 ms
MARGIN_BUCKETS_MS = (0, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100)
MARGIN = MetricSpec(
    "sloweave_margin_ms",
    "histogram",
    "Safety margin delta(n, c) in the prediction of each step scheduled",
    MARGIN_BUCKETS_MS,
)

ALL_METRICS = (
    CHUNK,
    TOKEN_BUDGET,
    TIME_BUDGET,
    STEPS,
    INFEASIBLE,
    SLO_EXCEPTIONS,
    SLO_EXCEPTION_REQUESTS,
    PREDICTED_STEP,
    MEASURED_STEP,
    UNDERPREDICTED,
    MARGIN,
)

# The plug-in's own settings and health (no simulator counterpart), exported beside the above.
MARGIN_COVERAGE = MetricSpec(
    "sloweave_margin_coverage",
    "gauge",
    "Share of steps the margin is meant to cover (its residual quantile; 0.5 when the margin states none: "
    "the model alone is held to the median)",
)
TPOT_TARGET = MetricSpec("sloweave_tpot_target_ms", "gauge", "Default TPOT target (requests may carry their own)")
REQUEST_TARGET_ERRORS = MetricSpec(
    "sloweave_request_target_errors",
    "counter",
    "Requests whose sloweave_tpot_ms was refused and served with the default target",
)
PLUGIN_ERRORS = MetricSpec(
    "sloweave_plugin_errors", "counter", "Failures of the plug-in's bookkeeping (the step ran on vLLM's own budget)"
)
# the places in the plug-in whose failure falls back to vLLM's budget (label ``where``)
PLUGIN_ERROR_PLACES = ("schedule", "add_request", "update_from_output", "preemption", "finish_requests")
PLUGIN_METRICS = (MARGIN_COVERAGE, TPOT_TARGET, REQUEST_TARGET_ERRORS, PLUGIN_ERRORS)


class DecisionRecorder(Protocol):
    """Hooks a budget controller calls; an engine-specific recorder implements them.

    ``plan`` is a ``sloweave.core.budget.StepPlan``; ``late_requests`` is the number of
    running requests an aging chunk is predicted to make late (0 when the step is not an
    SLO exception); ``ran_tokens`` the (decode, prefill) tokens the engine really scheduled,
    when known (it may schedule less than the budget). ``on_step_done`` gets the plan of the
    step that came back, its measured duration and when it started (the engine's clock).
    """

    def on_plan(self, plan, late_requests: int, ran_tokens: tuple[int, int] | None = None) -> None: ...

    def on_step_done(self, plan, measured_ms: float, started_ms: float = math.nan) -> None: ...


class Recorders:
    """Several recorders behind one hook (the Prometheus exporter and the step log)."""

    def __init__(self, *recorders: DecisionRecorder) -> None:
        self.recorders = recorders

    def on_plan(self, plan, late_requests: int, ran_tokens: tuple[int, int] | None = None) -> None:
        for recorder in self.recorders:
            recorder.on_plan(plan, late_requests, ran_tokens)

    def on_step_done(self, plan, measured_ms: float, started_ms: float = math.nan) -> None:
        for recorder in self.recorders:
            recorder.on_step_done(plan, measured_ms, started_ms)

    def flush(self) -> None:
        """Let every recorder that batches its records write them out."""
        for recorder in self.recorders:
            flush_recorder(recorder)


def flush_recorder(recorder) -> None:
    """Write out what a recorder holds back, if it batches (a ``flush`` method); else nothing."""
    flush = getattr(recorder, "flush", None)
    if flush is not None:
        flush()


class DecisionSummary:
    """A ``DecisionRecorder`` that keeps every step that came back, summarised at the end.

    The CPU runtime's controller records into one: ``summary()`` is its run's decision
    metrics under the names above, as the simulator's ``summarize_simulation`` and the served
    run's step log give them. A step planned and never returned is left out (its measured
    time is unknown).
    """

    def __init__(self) -> None:
        self._planned: deque = deque()  # (plan, late requests) of steps scheduled, not back yet
        self.steps: list[tuple] = []  # (plan, late requests, measured ms) of steps back

    def on_plan(self, plan, late_requests: int, ran_tokens: tuple[int, int] | None = None) -> None:
        self._planned.append((plan, late_requests))

    def on_step_done(self, plan, measured_ms: float, started_ms: float = math.nan) -> None:
        while self._planned and self._planned[0][0] is not plan:  # a step the engine never returned
            self._planned.popleft()
        if self._planned:
            self.steps.append((*self._planned.popleft(), measured_ms))

    def summary(self) -> dict:
        plans = [plan for plan, _, _ in self.steps]

        def column(name: str, dtype=np.float64) -> np.ndarray:
            return np.array([getattr(plan, name) for plan in plans], dtype=dtype)

        predicted = column("predicted_ms")
        return summarize_decisions(
            column("chunk_tokens", np.int64),
            column("token_budget", np.int64),
            column("budget_ms"),
            column("infeasible", bool),
            # a static rule without a model of the machine predicts nothing
            predicted_step_ms=predicted if np.all(np.isfinite(predicted)) else None,
            measured_step_ms=np.array([measured for _, _, measured in self.steps], dtype=np.float64),
            slo_exceptions=int(column("aged", bool).sum()),
            slo_exception_requests=sum(late for plan, late, _ in self.steps if plan.aged),
            margin_ms=column("margin_ms"),
        )


# --------------------------------------------------------------------------- summaries


def _histogram(values: np.ndarray, buckets: tuple[float, ...]) -> dict:
    """Prometheus-style cumulative bucket counts, plus count, sum and a few quantiles."""
    values = np.asarray(values, dtype=np.float64)
    summary = {
        "count": int(values.size),
        "sum": float(values.sum()),
        "buckets": {f"{edge:g}": int(np.count_nonzero(values <= edge)) for edge in buckets},
    }
    summary["buckets"]["+Inf"] = int(values.size)
    for q in (50, 90, 99):
        # JSON has no NaN: an empty histogram has no quantiles (null)
        summary[f"p{q}"] = float(np.percentile(values, q)) if values.size else None
    return summary


def summarize_decisions(
    chunk_tokens,
    token_budget_tokens,
    time_budget_ms,
    infeasible,
    predicted_step_ms=None,
    measured_step_ms=None,
    slo_exceptions: int = 0,
    slo_exception_requests: int = 0,
    margin_ms=None,
) -> dict:
    """The metrics of a whole run, one entry per metric name, from per-step arrays.

    ``time_budget_ms`` may hold +inf for steps with nothing decoding; those steps have no
    deadline and are left out of its histogram (as the live exporter does).
    """
    chunk = np.asarray(chunk_tokens)
    budget_tokens = np.asarray(token_budget_tokens)
    time_budget = np.asarray(time_budget_ms, dtype=np.float64)
    flags = np.asarray(infeasible, dtype=bool)
    out = {
        CHUNK.name: _histogram(chunk, CHUNK.buckets),
        TOKEN_BUDGET.name: _histogram(budget_tokens, TOKEN_BUDGET.buckets),
        TIME_BUDGET.name: _histogram(time_budget[np.isfinite(time_budget)], TIME_BUDGET.buckets),
        STEPS.name + "_total": int(chunk.size),
        INFEASIBLE.name + "_total": int(flags.sum()),
        SLO_EXCEPTIONS.name + "_total": int(slo_exceptions),
        SLO_EXCEPTION_REQUESTS.name + "_total": int(slo_exception_requests),
    }
    if predicted_step_ms is not None:
        out[PREDICTED_STEP.name] = _histogram(predicted_step_ms, PREDICTED_STEP.buckets)
    if measured_step_ms is not None:
        out[MEASURED_STEP.name] = _histogram(measured_step_ms, MEASURED_STEP.buckets)
        if predicted_step_ms is not None:
            measured = np.asarray(measured_step_ms, dtype=np.float64)
            over = measured > np.asarray(predicted_step_ms, dtype=np.float64) + UNDERPREDICTION_TOLERANCE_MS
            out[UNDERPREDICTED.name + "_total"] = int(over.sum())
    if margin_ms is not None:
        out[MARGIN.name] = _histogram(margin_ms, MARGIN.buckets)
    return out


def summarize_simulation(result, predicted_ms_of=None, margin_ms_of=None) -> dict:
    """``summarize_decisions`` for a ``SimResult``: every iteration is one step.

    The simulator runs one-token-per-decode steps, so the token budget is decodes + chunk.
    ``predicted_ms_of(n, c)`` is the policy's prediction (cost + margin); the measured time
    is the iteration's simulated duration (the "actual" cost, noisy or not). The simulator
    has no aging, so it records no SLO exceptions. ``margin_ms_of(n, c)``: the policy's
    margin delta(n, c), when it has one.
    """
    decodes = result.iter_decodes
    chunks = result.iter_chunk_tokens

    def per_step(of):
        if of is None:
            return None
        return np.fromiter((of(int(n), int(c)) for n, c in zip(decodes, chunks)), dtype=np.float64, count=len(chunks))

    summary = summarize_decisions(
        chunks,
        decodes + chunks,
        result.iter_budget_ms,
        result.iter_infeasible,
        predicted_step_ms=per_step(predicted_ms_of),
        measured_step_ms=result.iter_end_ms - result.iter_start_ms,
        margin_ms=per_step(margin_ms_of),
    )
    return {"source": "simulator", "policy": result.policy_name, "tpot_ms": result.tpot_ms, "metrics": summary}
