"""Per-step token budgets for a real engine, from the decision core (no engine imports).

An engine such as vLLM hands each step a token budget shared by the decodes and the
prefill. `BudgetController` turns the SLOWeave decision into that budget:

    budget_tokens = decode tokens of the running requests + SLOWeave chunk c*

so decodes are never starved (the budget always covers them) and the prefill gets exactly
the deadline-safe chunk. It owns the deadline tracker, fed with real token times, and
knows when the step being scheduled will start: with asynchronous scheduling the engine
schedules step N+1 while step N is still running, so step N+1 starts when step N is
predicted to end, and the requests in step N will have emitted their token by then.

Aging: when the policy keeps choosing decode-only while a prompt waits, the oldest prompt
would starve under sustained load. After it has waited ``aging_ms`` without progress it gets
a chunk of ``aging_chunk_tokens`` anyway; every such step is recorded as an SLO exception
naming the requests whose deadlines the step is predicted to miss.

One adapter for every real engine (the vLLM plug-in, the CPU runtime): an engine is a state
builder and the hand-offs, in the manner of vLLM's ``SchedulerInterface``. Before a step it
builds a ``StepState`` and asks ``plan_step`` for the ``StepPlan``; then it reports what it
scheduled (``on_scheduled``), when the step came back and who emitted (``on_step_done``), and
which requests finished (``on_finished``). Deadlines, per-request targets, aging, the cost's
KV context, the margin, online correction and the decision metrics all live here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from sloweave.core.costs.calibrated import OnlineCalibrator
from sloweave.core.costs.margins import ZeroMargin
from sloweave.core.costs.protocols import Calibrated, ContextFeed, CostModel, Margin
from sloweave.core.deadlines import DeadlineTracker, budget_until
from sloweave.core.policy import Aging, SLOWeave, decide_step
from sloweave.core.slo import SLOException
from sloweave.core.size_grid import size_grid
from sloweave.core.validate import whole_number


# StepState and StepPlan are made every engine step: plain slotted dataclasses, read-only by
# convention (a frozen dataclass's __init__ costs about six times as much, and inside a real
# engine every microsecond of a step's bookkeeping is a microsecond of its schedule()).
@dataclass(slots=True)
class StepState:
    """What the engine knows when it schedules a step (plain data, engine-independent)."""

    now_ms: float
    decode_tokens: int  # tokens the running decodes need this step (one each without drafts)
    pending_prompt_tokens: int  # prompt tokens that could be prefilled (bounded by C_max)
    oldest_prompt_id: Hashable | None = None
    oldest_prompt_waiting_ms: float = 0.0  # since it arrived or last made progress
    decoding_ids: tuple[Hashable, ...] = ()
    # KV context, for fitted cost models whose step time grows with the KV read
    decode_kv_tokens: int = 0
    prefill_prefix_tokens: int = 0
    # the prompts the chunk would come from, in the engine's order: (remaining tokens, prefix)
    prompts_on_offer: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class StepPlan:
    token_budget: int  # what the engine may schedule this step: decodes + chunk
    chunk_tokens: int
    start_ms: float  # when the step is expected to start (after any step in flight)
    scheduled_ms: float  # when it was planned (it cannot start before)
    budget_ms: float  # time to the earliest deadline from start_ms (+inf: no decodes)
    predicted_ms: float  # T(n, c) + delta(n, c)
    infeasible: bool  # even decode-only is predicted to miss the earliest deadline
    aged: bool  # the chunk was forced by aging (an SLO exception)
    decode_tokens: int = 0
    base_predicted_ms: float = math.nan  # the uncorrected model's T(n, c) (online correction only)
    # the step's KV context, to price the step the engine really ran if it differs from the plan
    decode_kv_tokens: int = 0
    prefill_prefix_tokens: int = 0
    margin_ms: float = 0.0  # delta(n, c), included in predicted_ms
    pending_prompt_tokens: int = 0  # prompt tokens on offer (what the chunk could have been)
    policy_chunk_tokens: int = 0  # the decision's chunk (policy, aging, size grid) before the engine's cap
    deadline_ms: float = math.inf  # the earliest next-token deadline budget_ms counts to (+inf: none)
    # (prompt tokens on offer, tokens of it already computed) per prompt, in the engine's order
    offer: tuple[tuple[int, int], ...] = ()

    @property
    def prompts_on_offer(self) -> int:
        return len(self.offer)


@dataclass
class ControllerStats:
    steps: int = 0
    infeasible_steps: int = 0
    slo_exceptions: list[SLOException] = field(default_factory=list)
    # recent (chunk, budget_ms, predicted_ms, measured_ms) per finished step
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))


@dataclass
class _InFlightStep:
    start_ms: float
    end_ms: float  # predicted, re-timed when an earlier step returns
    plan: StepPlan
    emitting: list[Hashable]  # requests that emit a token at its end
    applied: bool = False  # their predicted token time is in the deadline tracker
    # requests finished or preempted after it was scheduled: they emit nothing at its end
    gone: set[Hashable] | None = None
    # online correction: (decode tokens, chunk tokens, base prediction) of the step that ran
    observed: tuple[int, int, float] | None = None


class BudgetController:
    def __init__(
        self,
        policy: SLOWeave,
        default_tpot_ms: float,
        max_budget_tokens: int,
        aging_ms: float | None = None,
        aging_chunk_tokens: int = 256,
        tpot_ms_of: Callable[[Hashable], float | None] | None = None,
        correction: OnlineCalibrator | None = None,
        step_grid_tokens: int = 1,
    ) -> None:
        whole_number(max_budget_tokens, "max_budget_tokens")
        if correction is not None and not (
            isinstance(policy.cost, Calibrated) and policy.cost.calibrator is correction
        ):
            raise ValueError(
                "online correction needs the policy's cost to be a CalibratedCost built on that calibrator"
            )
        # Measured step times correct the cost model online (core calibration, as in the
        # CPU runtime and the simulator's clock).
        self.correction = correction
        # The simulator's starvation rule, so both bodies age prompts the same way.
        self.aging = None if aging_ms is None else Aging(aging_ms, aging_chunk_tokens)
        self.policy = policy
        self.tracker = DeadlineTracker(default_tpot_ms)
        self.max_budget_tokens = max_budget_tokens
        # the engine's own cap is a size it is given as it is (core/size_grid.py)
        self.grid = size_grid(step_grid_tokens, policy, max_budget_tokens)
        self.stats = ControllerStats()
        # a request's own TPOT target (None: the default), asked once, when tracking starts
        self._tpot_ms_of = tpot_ms_of or (lambda request_id: None)
        # steps scheduled whose output has not come back yet, oldest first
        self._in_flight: deque[_InFlightStep] = deque()
        # Optional metrics hooks (sloweave.core.decision_metrics.DecisionRecorder), e.g. the
        # vLLM plug-in's Prometheus exporter; None costs one attribute test per step.
        self.recorder = None
        # (delta, T + delta) of a step: SLOWeave's own; a static rule (the CPU runtime runs the
        # baselines through here too) has no margin and predicts with the machine's model it
        # carries, or not at all (NaN)
        cost = getattr(policy, "cost", None)
        self._price = getattr(policy, "margin_and_predicted_ms", None) or _static_price(cost)
        # A cost that reads the KV context (or the prompts on offer) is told them before each
        # decision; which costs do is asked here, once, not per step.
        self._feed = ContextFeed(cost)

    # ---- deadlines, fed with real token times -------------------------------------------

    def on_token(self, request_id: Hashable, emitted_ms: float) -> None:
        """A request emitted a token (its first one starts tracking it)."""
        self.tracker.emit((request_id,), emitted_ms, self._tpot_ms_of)

    def on_tokens(self, request_ids: Sequence[Hashable], emitted_ms: float) -> None:
        """Requests emitted a token each at the same time (one step's output)."""
        if request_ids:
            self.tracker.emit(request_ids, emitted_ms, self._tpot_ms_of)

    def on_finished(self, request_id: Hashable) -> None:
        """A request finished (or was preempted): its deadline goes, now and in the steps in flight.

        With asynchronous scheduling a step already scheduled may still hold it (a stop token
        is seen only when the previous step's output comes back); that step's predicted token
        must not start tracking it again, or its deadline would pass and pin every budget at 0."""
        self.tracker.remove(request_id)
        for step in self._in_flight:
            if step.gone is None:
                step.gone = {request_id}
            else:
                step.gone.add(request_id)

    def _emit_predicted(self, step: _InFlightStep) -> None:
        """The tokens a step in flight is predicted to emit at its end, from the requests still there."""
        emitting = step.emitting if step.gone is None else [r for r in step.emitting if r not in step.gone]
        self.on_tokens(emitting, step.end_ms)

    # ---- one step ----------------------------------------------------------------------

    def plan_step(self, state: StepState) -> StepPlan:
        # A clock glitch (NaN, inf) is refused before anything changes: a plan timed from it
        # would compare False with every deadline and run with no deadline and no margin.
        check_clock_ms(state.now_ms)
        start_ms = self._start_after_in_flight_ms(state.now_ms)
        deadline_ms = self.tracker.earliest_deadline_ms() if state.decode_tokens else math.inf
        budget_ms = budget_until(deadline_ms, start_ms)  # +inf with no deadline
        self._feed_step(state)
        # The simulator's decision path: the policy, then the aging rule.
        chunk, infeasible, aged = decide_step(
            self.policy,
            state.decode_tokens,
            state.pending_prompt_tokens,
            budget_ms,
            self.aging,
            state.oldest_prompt_waiting_ms,
            grid=self.grid,
        )
        # The budget always covers the decodes' demand (up to the engine's own cap): a budget
        # that starves decodes is a bug, not a choice. The prefill gets the chunk on top.
        token_budget = min(self.max_budget_tokens, state.decode_tokens + chunk)
        decided, chunk = chunk, max(0, token_budget - state.decode_tokens)
        margin_ms, predicted_ms = self._price(state.decode_tokens, chunk)
        base_ms = math.nan
        if self.correction is not None:
            base_ms = self.policy.cost.base.predict(
                state.decode_tokens, chunk, state.decode_kv_tokens, state.prefill_prefix_tokens
            )
        plan = StepPlan(
            token_budget,
            chunk,
            start_ms,
            state.now_ms,
            budget_ms,
            predicted_ms,
            infeasible,
            aged,
            state.decode_tokens,
            base_ms,
            state.decode_kv_tokens,
            state.prefill_prefix_tokens,
            margin_ms,
            state.pending_prompt_tokens,
            decided,
            deadline_ms,
            state.prompts_on_offer,
        )
        self.stats.steps += 1
        self.stats.infeasible_steps += infeasible
        if aged:
            affected = tuple(rid for rid in state.decoding_ids if self._misses(rid, start_ms + predicted_ms))
            self.stats.slo_exceptions.append(
                SLOException(start_ms, state.oldest_prompt_id, chunk, predicted_ms, budget_ms, affected)
            )
        return plan

    def _start_after_in_flight_ms(self, now_ms: float) -> float:
        """When the step planned now starts: after the steps still in flight.

        Their requests will have emitted by then: their next deadlines count from the predicted
        ends. (In a synchronous loop nothing is in flight here and this costs nothing.)"""
        for step in self._in_flight:
            if not step.applied:
                self._emit_predicted(step)
                step.applied = True
        return max(now_ms, self._in_flight[-1].end_ms) if self._in_flight else now_ms

    def _feed_step(self, state: StepState) -> None:
        """Tell a cost that reads them the step's KV context and the prompts on offer."""
        feed = self._feed
        if feed.reads_context:
            feed.set_context(state.decode_kv_tokens, state.prefill_prefix_tokens)
            if feed.reads_offer:
                feed.set_offer(list(state.prompts_on_offer) or None)

    def on_scheduled(self, plan: StepPlan, emitting: list[Hashable], ran_tokens: tuple[int, int] | None = None) -> None:
        """The engine scheduled the step; ``emitting`` emit a token at its end.

        Until its output returns the step is assumed to end as predicted. ``ran_tokens``:
        the (decode, prefill) tokens the engine really scheduled, when known. The budget is an
        upper bound and an engine may schedule less (a cap on running requests, KV blocks);
        online correction then learns from the step that ran, not from the plan (a short step
        measured against a long plan's prediction would teach it that the model is too slow).
        """
        observed = None
        if self.correction is not None:
            observed = (plan.decode_tokens, plan.chunk_tokens, plan.base_predicted_ms)
            if ran_tokens is not None and tuple(ran_tokens) != observed[:2]:
                n, c = (int(t) for t in ran_tokens)
                observed = (
                    n,
                    c,
                    self.policy.cost.base.predict(n, c, plan.decode_kv_tokens, plan.prefill_prefix_tokens),
                )
        self._in_flight.append(
            _InFlightStep(plan.start_ms, plan.start_ms + plan.predicted_ms, plan, emitting, observed=observed)
        )
        if self.recorder is not None:
            # Recorded here, not in plan_step: only steps the engine really ran count. An
            # aged plan's SLO exception is the one plan_step just appended.
            late = len(self.stats.slo_exceptions[-1].affected_ids) if plan.aged else 0
            self.recorder.on_plan(plan, late, ran_tokens)

    def on_step_done(self, now_ms: float, emitted: list[Hashable]) -> None:
        """The oldest step in flight returned at ``now_ms`` with tokens for ``emitted``.

        Its real end re-times the steps still in flight (each starts when the previous
        ends). A request that also emits in a later step in flight keeps that later
        (predicted) time as its last token; the others take the real time.
        """
        if not math.isfinite(now_ms):
            # The step did come back: drop it, so that the next return is paired with the next
            # step, and refuse its time (nothing learns from it, no token is timed by it).
            if self._in_flight:
                self._in_flight.popleft()
            check_clock_ms(now_ms)
        self.on_tokens(emitted, now_ms)
        if not self._in_flight:
            return
        done = self._in_flight.popleft()
        measured_ms = now_ms - done.start_ms
        self.stats.recent.append((done.plan.chunk_tokens, done.plan.budget_ms, done.plan.predicted_ms, measured_ms))
        if done.observed is not None:
            # the BASE model's prediction of the step that ran (the calibrator corrects it)
            n, c, base_ms = done.observed
            self.correction.observe(n, c, base_ms, measured_ms)
        if self.recorder is not None:
            self.recorder.on_step_done(done.plan, measured_ms, done.start_ms)
        previous_end = now_ms
        for step in self._in_flight:
            # It starts when the previous step really ends, earlier or later than planned,
            # but not before it was scheduled.
            step.start_ms = max(step.plan.scheduled_ms, previous_end)
            step.end_ms = previous_end = step.start_ms + step.plan.predicted_ms
            if step.applied:
                self._emit_predicted(step)

    def _misses(self, request_id: Hashable, end_ms: float) -> bool:
        return request_id in self.tracker and self.tracker.deadline_of(request_id) < end_ms


def _static_price(cost: CostModel | None) -> Callable[[int, int], tuple[float, float]]:
    """A static rule's (margin, prediction): no margin; its machine's model, or NaN without one."""
    if cost is None:
        return lambda n_decodes, chunk_tokens: (0.0, math.nan)
    return lambda n_decodes, chunk_tokens: (0.0, cost(n_decodes, chunk_tokens))


def check_clock_ms(now_ms: float) -> float:
    """A reading of an engine's clock, refused when it glitches (NaN, inf)."""
    if not math.isfinite(now_ms):
        raise ValueError(f"the engine's clock read {now_ms!r} ms; a time must be a finite number of milliseconds")
    return now_ms


def make_policy_for_engine(
    cost: CostModel, margin: Margin | None, max_chunk_tokens: int, chunk_choice: str = "fastest"
) -> SLOWeave:
    """SLOWeave spreading its chunk over several prompts, as engines batch (vLLM, Sarathi)."""
    margin = margin or ZeroMargin()
    return SLOWeave(
        cost=cost, margin=margin, max_chunk_tokens=max_chunk_tokens, max_prefills=None, chunk_choice=chunk_choice
    )
