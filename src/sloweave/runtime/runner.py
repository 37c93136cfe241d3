"""Run a workload on the real engine under one policy and measure what each request saw.

The runtime talks to the decision core as the vLLM plug-in does, through the core's
``BudgetController``: a state builder (``step_state``: the engine's ``StepShape`` as a
``StepState``) and the controller's hand-offs. ``run_requests`` loops over ``RuntimeRun.step``:

1. admit the requests whose arrival the engine clock has passed (``admit``);
2. run one engine step; when the scheduler asks for its chunk, the controller plans it from
   the state (deadline budget from the requests' real token times and their own targets,
   aging, the cost's KV context, the margin, online correction) (``plan``);
3. report what ran (``report``): ``on_scheduled`` with the tokens the engine really ran,
   ``on_step_done`` with the step's measured end and the requests that emitted a token,
   ``on_finished``; and keep the step's row, from the plan and the engine's record.

A token's time is the end of the step that produced it (the moment ``update_batch``
returns). While nothing runs or waits, the clock jumps to the next arrival instead of
sleeping (no work is skipped, only idle time).

The per-request frame has the columns of ``sloweave.sim.metrics.per_request_frame`` so the
metrics come from the same ``summarize`` as the simulator's; the decision metrics come from
a ``DecisionSummary`` on the controller, under the names the plug-in exports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from tqdm import tqdm

from sloweave.core.budget import BudgetController, StepPlan, StepState
from sloweave.core.costs.calibrated import OnlineCalibrator
from sloweave.core.decision_metrics import DecisionRecorder, DecisionSummary, Recorders
from sloweave.core.costs.fitted import ContextualCost
from sloweave.core.slo import SLOException
from sloweave.core.validate import MAX_MS, positive_ms
from sloweave.runtime.engine import TransformersEngine, StepRecord
from sloweave.runtime.scheduler import StepShape
from sloweave.sim.metrics import RunMetrics, frame_from_token_times, summarize


@dataclass
class RequestSpec:
    """Requests of one run, sorted by arrival; times in ms from the run's start."""

    arrival_ms: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    # each request's own TPOT target (ms); None: every request has the run's target
    tpot_ms: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.tpot_ms is not None:
            tpot = np.asarray(self.tpot_ms, dtype=np.float64)
            if tpot.shape != (len(self),) or not np.all(np.isfinite(tpot) & (tpot > 0) & (tpot <= MAX_MS)):
                raise ValueError(f"tpot_ms must hold one finite target > 0 and <= {MAX_MS:g} ms per request")
            self.tpot_ms = tpot

    @classmethod
    def from_workload(cls, workload) -> RequestSpec:
        tpot = None if workload.tpot_ms is None else workload.tpot_ms.copy()
        return cls(workload.arrival_s * 1000.0, workload.prompt_tokens.copy(), workload.output_tokens.copy(), tpot)

    def __len__(self) -> int:
        return int(len(self.arrival_ms))

    def target_of(self) -> Callable[[str], float | None] | None:
        """A request's own target by its id (``request_id``), for the controller; None: none has one."""
        if self.tpot_ms is None:
            return None
        return {request_id(i): float(t) for i, t in enumerate(self.tpot_ms)}.get


def request_id(index: int) -> str:
    return f"r{index}"


@dataclass
class MeasuredRun:
    policy: str
    tpot_ms: float
    requests: pd.DataFrame  # per request, columns of metrics.per_request_frame
    steps: pd.DataFrame  # per step: shape, chunk asked/ran, predicted and measured ms
    duration_ms: float
    calibration: dict | None = None
    token_counts: dict = field(default_factory=dict)  # request -> tokens it generated
    request_tpot_ms: np.ndarray | None = None  # each request's own target, when they have one
    slo_exceptions: list[SLOException] = field(default_factory=list)  # steps aging forced
    decision_metrics: dict = field(default_factory=dict)  # core.decision_metrics.summarize_decisions of the steps

    def metrics(self, ttft_ms: float) -> RunMetrics:
        targets = self.tpot_ms if self.request_tpot_ms is None else self.request_tpot_ms
        return summarize(self.requests, self.duration_ms, ttft_ms, targets)

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
            "median_abs_rel_prediction_error": float(np.median(np.abs(s["predicted_ms"] / s["step_ms"] - 1)))
            if len(s)
            else float("nan"),
            "steps_with_deadline": int(decided.sum()),
            "deadline_missed_share": float(late.sum() / max(1, decided.sum())),
            "infeasible_steps": int(s["infeasible"].sum()),
            "mean_chunk_tokens": float(s.loc[s["chunk_tokens"] > 0, "chunk_tokens"].mean())
            if (s["chunk_tokens"] > 0).any()
            else 0.0,
        }


def synthetic_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, int(length)).tolist()


def run_requests(
    engine: TransformersEngine,
    spec: RequestSpec,
    policy,
    tpot_ms: float,
    cost: ContextualCost | None = None,
    calibrator: OnlineCalibrator | None = None,
    seed: int = 0,
    horizon_s: float | None = None,
    progress: bool = True,
    label: str | None = None,
    aging_ms: float | None = None,
    aging_chunk_tokens: int = 256,
    recorder: DecisionRecorder | None = None,
    step_grid_tokens: int = 1,
) -> MeasuredRun:
    """Serve ``spec`` on ``engine`` under ``policy``, each step planned by a ``BudgetController``.

    ``tpot_ms`` is the target of requests without their own (``spec.tpot_ms``). ``cost``: for a
    static policy, the model of the machine its steps are priced with (it decides nothing;
    None: the one it carries, if any, else no prediction is recorded); SLOWeave plans with its
    own cost and margin. ``calibrator``: online
    correction, the calibrator of the policy's ``CalibratedCost``; the controller feeds it every
    step's measured time. ``aging_ms`` (None: off): after this wait without progress the
    oldest prompt gets ``aging_chunk_tokens``. ``recorder`` gets the controller's decisions too.
    ``step_grid_tokens``: SLOWeave's size grid, as the plug-in's (1: none).
    """
    positive_ms(tpot_ms, "tpot_ms")
    controller = runtime_controller(
        engine, spec, policy, tpot_ms, cost, calibrator, aging_ms, aging_chunk_tokens, step_grid_tokens
    )
    summary = DecisionSummary()
    controller.recorder = summary if recorder is None else Recorders(summary, recorder)
    run = RuntimeRun(engine, spec, controller, np.random.default_rng(seed))
    horizon_ms = math.inf if horizon_s is None else float(spec.arrival_ms[0]) + horizon_s * 1000.0
    bar = tqdm(
        total=len(spec), desc=label or getattr(policy, "name", "run"), unit="req", disable=not progress, leave=False
    )
    while run.unfinished:
        now_ms = engine.now_ms()
        if now_ms >= horizon_ms:
            break
        bar.update(run.step(now_ms))
    bar.close()
    return run.result(getattr(policy, "name", str(policy)), tpot_ms, horizon_ms, summary)


def runtime_controller(
    engine: TransformersEngine,
    spec: RequestSpec,
    policy,
    tpot_ms: float,
    cost: ContextualCost | None = None,
    calibrator: OnlineCalibrator | None = None,
    aging_ms: float | None = None,
    aging_chunk_tokens: int = 256,
    step_grid_tokens: int = 1,
) -> BudgetController:
    """The plug-in's controller for this engine: the budget capped at its ``max_batch_tokens``."""
    if cost is not None and not getattr(policy, "uses_deadlines", True) and getattr(policy, "cost", None) is not cost:
        policy = dataclasses.replace(policy, cost=cost)  # a static rule priced with the machine's model
    return BudgetController(
        policy,
        default_tpot_ms=tpot_ms,
        max_budget_tokens=engine.max_batch_tokens,
        aging_ms=aging_ms,
        aging_chunk_tokens=aging_chunk_tokens,
        tpot_ms_of=spec.target_of(),
        correction=calibrator,
        step_grid_tokens=step_grid_tokens,
    )


def step_state(shape: StepShape, start_ms: float, prompt_progress_ms: Mapping[str, float]) -> StepState:
    """The state builder: the engine's view of a step as the core's ``StepState``.

    One prompt is on offer, the oldest unfinished one (the scheduler prefills one at a time);
    it has waited since it arrived or last got a chunk (``prompt_progress_ms``).
    """
    head = shape.prompt_id if shape.waiting_tokens else None
    waited_ms = start_ms - prompt_progress_ms.get(head, start_ms) if head is not None else 0.0
    return StepState(
        now_ms=start_ms,
        decode_tokens=shape.n_decodes,
        pending_prompt_tokens=shape.waiting_tokens,
        oldest_prompt_id=head,
        oldest_prompt_waiting_ms=waited_ms,
        decoding_ids=shape.decoding_ids,
        decode_kv_tokens=shape.decode_kv_tokens,
        prefill_prefix_tokens=shape.prefill_prefix_tokens,
        prompts_on_offer=((shape.waiting_tokens, shape.prefill_prefix_tokens),) if head is not None else (),
    )


def step_row(record: StepRecord, plan: StepPlan) -> dict:
    """A step's row: the engine's record of what ran, the controller's plan of what was decided."""
    return {
        "start_ms": record.start_ms,
        "end_ms": record.end_ms,
        "step_ms": record.step_ms,
        "n_decodes": record.n_decodes,
        "waiting_tokens": record.waiting_tokens,
        "decode_kv_tokens": record.decode_kv_tokens,
        "prefill_prefix_tokens": record.prefill_prefix_tokens,
        "policy_chunk_tokens": plan.policy_chunk_tokens,
        "chunk_tokens": record.asked_chunk_tokens,
        "ran_chunk_tokens": record.ran_chunk_tokens,
        "engine_query_tokens": record.engine_query_tokens,
        "budget_ms": plan.budget_ms,
        "deadline_ms": plan.deadline_ms,
        "predicted_ms": plan.predicted_ms - plan.margin_ms,  # the model alone; the margin beside it
        "margin_ms": plan.margin_ms,
        "infeasible": plan.infeasible,
        "aged": plan.aged,
    }


class RuntimeRun:
    """One run's state: the requests admitted, their token times, the steps' rows."""

    def __init__(
        self, engine: TransformersEngine, spec: RequestSpec, controller: BudgetController, rng: np.random.Generator
    ) -> None:
        self.engine, self.spec, self.controller, self.rng = engine, spec, controller, rng
        self.ids = [request_id(i) for i in range(len(spec))]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.token_times: list[list[float]] = [[] for _ in self.ids]
        self.rows: list[dict] = []
        # request -> when its prompt arrived or last got a chunk (aging); dropped once prefilled
        self.prompt_progress_ms: dict[str, float] = {}
        self.admitted = self.finished = 0
        engine.reset()
        engine.reset_clock()
        engine.skip_to(float(spec.arrival_ms[0]))

    @property
    def unfinished(self) -> bool:
        return self.finished < len(self.ids)

    def step(self, now_ms: float) -> int:
        """Admit what has arrived, run one planned step and report it; the requests it finished."""
        self.admit(now_ms)
        record = self.engine.step(self.plan)
        if record is None:
            self.skip_idle()
            return 0
        self.report(record)
        return len(record.finished)

    def admit(self, now_ms: float) -> None:
        spec = self.spec
        while self.admitted < len(spec) and spec.arrival_ms[self.admitted] <= now_ms:
            i, rid = self.admitted, self.ids[self.admitted]
            prompt = synthetic_prompt(self.rng, spec.prompt_tokens[i], self.engine.vocab_size)
            self.engine.add(rid, prompt, int(spec.output_tokens[i]))
            self.prompt_progress_ms[rid] = float(spec.arrival_ms[i])
            self.admitted += 1

    def plan(self, shape: StepShape, start_ms: float) -> StepPlan:
        """The scheduler's chunk callback: the controller's plan for the step about to run."""
        return self.controller.plan_step(step_state(shape, start_ms, self.prompt_progress_ms))

    def skip_idle(self) -> None:
        if self.admitted >= len(self.spec):
            raise RuntimeError(f"engine went idle with {len(self.ids) - self.finished} request(s) unfinished")
        self.engine.skip_to(float(self.spec.arrival_ms[self.admitted]))

    def report(self, record: StepRecord) -> None:
        """The hand-offs after a step: what ran, when it ended and who emitted, who finished."""
        plan: StepPlan = record.decision
        controller = self.controller
        controller.on_scheduled(plan, record.emitted, (record.n_decodes, record.ran_chunk_tokens))
        controller.on_step_done(record.end_ms, record.emitted)
        for rid in record.finished:
            controller.on_finished(rid)
        self._prompt_progress(record, plan)
        for rid in record.emitted:
            self.token_times[self.index[rid]].append(record.end_ms)
        self.finished += len(record.finished)
        self.rows.append(step_row(record, plan))

    def _prompt_progress(self, record: StepRecord, plan: StepPlan) -> None:
        prompt = record.prefill_request
        if prompt is None or not record.ran_chunk_tokens:
            return
        if prompt in record.emitted:  # prefilled: its first token is out, it decodes from here
            self.prompt_progress_ms.pop(prompt, None)
        else:
            self.prompt_progress_ms[prompt] = plan.scheduled_ms  # when the chunk was planned, as the plug-in

    def result(self, policy_name: str, tpot_ms: float, horizon_ms: float, summary: DecisionSummary) -> MeasuredRun:
        spec, steps = self.spec, pd.DataFrame(self.rows)
        first_ms = float(spec.arrival_ms[0])
        end_ms = float(steps["end_ms"].max()) if len(steps) else first_ms
        correction = self.controller.correction
        return MeasuredRun(
            policy=policy_name,
            tpot_ms=float(tpot_ms),
            requests=frame_from_token_times(spec.arrival_ms, spec.prompt_tokens, spec.output_tokens, self.token_times),
            steps=steps,
            duration_ms=min(end_ms, horizon_ms) - first_ms,
            calibration=correction.as_dict() if correction is not None else None,
            token_counts=dict(self.engine.generated),
            request_tpot_ms=spec.tpot_ms,
            slo_exceptions=list(self.controller.stats.slo_exceptions),
            decision_metrics=summary.summary(),
        )
