"""Run a workload on the real engine under one policy and measure what each request saw.

Requests are added when the engine clock passes their arrival; each step the policy picks
the chunk from the running requests' real last-token times (``DeadlineTracker``) and, for
a context-aware cost, the step's KV context. A token's time is the end of the step that
produced it (the moment ``update_batch`` returns). While nothing runs or waits, the clock
jumps to the next arrival instead of sleeping (no work is skipped, only idle time).

The per-request frame has the columns of ``sloweave.sim.metrics.per_request_frame`` so the
metrics come from the same ``summarize`` as the simulator's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from tqdm import tqdm

from sloweave.core.deadlines import DeadlineTracker
from sloweave.core.fit import ContextualCost
from sloweave.core.policy import decide_step
from sloweave.sim.metrics import RunMetrics, frame_from_token_times, summarize
from sloweave.core.calibration import CalibratedCost, OnlineCalibrator
from sloweave.runtime.engine import Engine
from sloweave.runtime.scheduler import StepShape


@dataclass
class RequestSpec:
    """Requests of one run, sorted by arrival; times in ms from the run's start."""

    arrival_ms: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    @classmethod
    def from_workload(cls, workload) -> RequestSpec:
        return cls(workload.arrival_s * 1000.0, workload.prompt_tokens.copy(), workload.output_tokens.copy())

    def __len__(self) -> int:
        return int(len(self.arrival_ms))


@dataclass
class MeasuredRun:
    policy: str
    tpot_ms: float
    requests: pd.DataFrame  # per request, columns of metrics.per_request_frame
    steps: pd.DataFrame  # per step: shape, chunk asked/ran, predicted and measured ms
    duration_ms: float
    calibration: dict | None = None
    token_counts: dict = field(default_factory=dict)  # request -> tokens it generated

    def metrics(self, ttft_ms: float) -> RunMetrics:
        return summarize(self.requests, self.duration_ms, ttft_ms, self.tpot_ms)

    def overrun_stats(self) -> dict:
        """How often a step took longer than the time the policy budgeted for it, and by how much."""
        s = self.steps
        over = s["step_ms"] - (s["predicted_ms"] + s["margin_ms"])
        over_pred = s["step_ms"] - s["predicted_ms"]
        decided = np.isfinite(s["budget_ms"])
        late = decided & (s["end_ms"] > s["deadline_ms"] + 1e-9)
        return {
            "steps": int(len(s)),
            "overran_prediction_share": float(np.mean(over_pred > 0)) if len(s) else float("nan"),
            "overran_prediction_plus_margin_share": float(np.mean(over > 0)) if len(s) else float("nan"),
            "p50_overrun_ms": float(np.percentile(over[over > 0], 50)) if np.any(over > 0) else 0.0,
            "p99_overrun_ms": float(np.percentile(over[over > 0], 99)) if np.any(over > 0) else 0.0,
            "max_overrun_ms": float(over.max()) if len(s) else float("nan"),
            "median_abs_rel_prediction_error": float(np.median(np.abs(s["predicted_ms"] / s["step_ms"] - 1))) if len(s) else float("nan"),
            "steps_with_deadline": int(decided.sum()),
            "deadline_missed_share": float(late.sum() / max(1, decided.sum())),
            "infeasible_steps": int(s["infeasible"].sum()),
            "mean_chunk_tokens": float(s.loc[s["chunk_tokens"] > 0, "chunk_tokens"].mean()) if (s["chunk_tokens"] > 0).any() else 0.0,
        }


def synthetic_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, int(length)).tolist()


def run_requests(
    engine: Engine,
    spec: RequestSpec,
    policy,
    tpot_ms: float,
    cost: ContextualCost | None = None,
    margin=None,
    calibrator: OnlineCalibrator | None = None,
    seed: int = 0,
    horizon_s: float | None = None,
    progress: bool = True,
    label: str | None = None,
) -> MeasuredRun:
    """Serve ``spec`` on ``engine`` under ``policy``; ``cost`` (and ``margin``) are the ones the
    policy was built with (None for static policies: then no prediction is recorded).

    With ``calibrator``, ``cost`` must be the ``CalibratedCost`` wrapping it; every step's
    measured time is folded into the calibrator (against the base prediction).
    """
    if not (math.isfinite(tpot_ms) and tpot_ms > 0):
        raise ValueError(f"tpot_ms must be > 0, got {tpot_ms!r}")
    if calibrator is not None and not isinstance(cost, CalibratedCost):
        raise ValueError("online calibration needs the policy's cost to be a CalibratedCost")
    rng = np.random.default_rng(seed)
    n_req = len(spec)
    ids = [f"r{i}" for i in range(n_req)]
    index = {rid: i for i, rid in enumerate(ids)}
    token_times: list[list[float]] = [[] for _ in range(n_req)]
    tracker = DeadlineTracker(tpot_ms)
    rows: list[dict] = []
    decision: dict = {}

    def decide(shape: StepShape, start_ms: float) -> int:
        n, waiting = shape.n_decodes, shape.waiting_tokens
        budget = tracker.budget_ms(start_ms) if n else math.inf
        if cost is not None:
            cost.set_context(shape.decode_kv_tokens, shape.prefill_prefix_tokens)
        choice = decide_step(policy, n, waiting, budget)  # the decision path of every body
        # The engine's static buffers cap a step at max_batch_tokens (full prefill of a very
        # long prompt next to many decodes); the cap is recorded as the asked chunk.
        chunk = min(choice.chunk_tokens, shape.token_capacity - n)
        decision.update(
            policy_chunk=choice.chunk_tokens,
            chunk=chunk,
            infeasible=choice.infeasible,
            budget=budget,
            deadline=tracker.earliest_deadline_ms() if n else math.inf,
            predicted=cost(n, chunk) if cost is not None else math.nan,
            base=cost.base.predict(n, chunk, shape.decode_kv_tokens, shape.prefill_prefix_tokens) if calibrator else math.nan,
            margin=margin(n, chunk) if margin is not None else 0.0,
        )
        return chunk

    arrivals = spec.arrival_ms
    engine.reset()
    engine.reset_clock()
    engine.skip_to(float(arrivals[0]))
    horizon_ms = math.inf if horizon_s is None else float(arrivals[0]) + horizon_s * 1000.0
    next_arrival, done = 0, 0
    bar = tqdm(total=n_req, desc=label or getattr(policy, "name", "run"), unit="req", disable=not progress, leave=False)
    while done < n_req:
        now = engine.now_ms()
        if now >= horizon_ms:
            break
        while next_arrival < n_req and arrivals[next_arrival] <= now:
            i = next_arrival
            engine.add(ids[i], synthetic_prompt(rng, spec.prompt_tokens[i], engine.vocab_size), int(spec.output_tokens[i]))
            next_arrival += 1
        record = engine.step(decide)
        if record is None:
            if next_arrival >= n_req:
                raise RuntimeError(f"engine went idle with {n_req - done} request(s) unfinished")
            engine.skip_to(float(arrivals[next_arrival]))
            continue
        if record.asked_chunk_tokens != decision["chunk"]:
            raise RuntimeError(f"scheduler asked {record.asked_chunk_tokens} tokens, the policy decided {decision['chunk']}")
        end = record.end_ms
        finished = set(record.finished)
        for rid in record.emitted:
            i = index[rid]
            first = not token_times[i]
            token_times[i].append(end)
            if rid in finished:
                if not first:
                    tracker.remove(rid)
            elif first:
                tracker.add(rid, end)
            else:
                tracker.on_token(rid, end)
        done += len(finished)
        bar.update(len(finished))
        if calibrator is not None:
            calibrator.observe(record.n_decodes, record.ran_chunk_tokens, decision["base"], record.step_ms)
        rows.append(
            {
                "start_ms": record.start_ms,
                "end_ms": end,
                "step_ms": record.step_ms,
                "n_decodes": record.n_decodes,
                "waiting_tokens": record.waiting_tokens,
                "decode_kv_tokens": record.decode_kv_tokens,
                "prefill_prefix_tokens": record.prefill_prefix_tokens,
                "policy_chunk_tokens": decision["policy_chunk"],
                "chunk_tokens": record.asked_chunk_tokens,
                "ran_chunk_tokens": record.ran_chunk_tokens,
                "engine_query_tokens": record.engine_query_tokens,
                "budget_ms": decision["budget"],
                "deadline_ms": decision["deadline"],
                "predicted_ms": decision["predicted"],
                "margin_ms": decision["margin"],
                "infeasible": decision["infeasible"],
            }
        )
    bar.close()

    steps = pd.DataFrame(rows)
    requests = frame_from_token_times(spec.arrival_ms, spec.prompt_tokens, spec.output_tokens, token_times)
    end_ms = float(steps["end_ms"].max()) if len(steps) else float(arrivals[0])
    return MeasuredRun(
        policy=getattr(policy, "name", str(policy)),
        tpot_ms=float(tpot_ms),
        requests=requests,
        steps=steps,
        duration_ms=min(end_ms, horizon_ms) - float(arrivals[0]),
        calibration=calibrator.as_dict() if calibrator is not None else None,
        token_counts=dict(engine.generated),
    )
