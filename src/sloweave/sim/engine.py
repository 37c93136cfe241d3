"""Iteration-level, event-driven serving simulator: an engine state and a step, made of parts.

The model (the paper's setting):
- requests arrive over time and wait in an FCFS prefill queue; the oldest is prefilled first;
- each iteration decodes every running request (one token each) and prefills the number
  of prompt tokens the policy chooses: from the oldest waiting prompt only (the paper's
  setting), or spread over the waiting prompts in FCFS order for multi-prefill policies
  (Sarathi-Serve's rule), optionally under a cap on started requests;
- a request's first token is emitted at the end of the iteration that completes its
  prefill; it then emits one token per iteration until it has ``output_tokens`` tokens;
- an iteration lasts ``actual_cost(n, c)`` ms (the policy's cost model unless a separate
  "actual" cost is given, e.g. with seeded noise);
- a request that arrives at or before an iteration's start can be prefilled in it.

The parts (docs/simulator.md says how to add one); each option is a part, not a branch:
- arrivals and admission (``arrivals``: admit all, or the core's ``AdmissionControl``);
- the prefill queue and how a chunk is packed over prompts (``queue``: one or several);
- the decode batch (``batch``) and KV memory (``memory``: unlimited, or a capacity with
  admission when short and preemption with recompute);
- the deadline source (``deadline_source``: shared, per-request or cumulative targets,
  optionally checked against the core's ``DeadlineTracker``);
- the decision (``decide``: the policy, lookahead, aging with SLO exceptions);
- the iteration clock (``clock``: cost model, context handed to it, actual time with noise,
  online correction);
- the recorder (``recorder``).

Speed: every running request emits a token at every iteration end, so request i's tokens
come out at the ends of iterations first_i .. first_i + out_i - 1. The loop keeps only
counters and does O(1) Python work per iteration plus the policy's decision; per-token
times and gaps are recovered afterwards from the iteration end times with numpy. Running
requests are kept in an insertion-ordered dict, which only rare events (an SLO exception,
a preemption) walk.
"""

from __future__ import annotations

import math
from math import inf

import numpy as np

from sloweave.core.admission import AdmissionControl
from sloweave.core.costs.calibrated import OnlineCalibrator
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.empirical_noise import EmpiricalNoiseCost
from sloweave.core.costs.engine_loop import DrawnLoop, EngineLoop
from sloweave.core.costs.noisy import NoisyCost
from sloweave.core.costs.protocols import CostModel
from sloweave.core.policy import Aging, Policy
from sloweave.core.size_grid import size_grid
from sloweave.core.slo import SLOException
from sloweave.core.validate import positive_ms, whole_number
from sloweave.sim.arrivals import AdmissionGate, AdmitAll, Arrivals
from sloweave.sim.batch import DecodeBatch
from sloweave.sim.clock import IterationClock
from sloweave.sim.deadline_source import (
    AfterTheLoop,
    CumulativeTargets,
    PerRequestTargets,
    SharedTarget,
    TrackedDeadlines,
)
from sloweave.sim.decide import chunk_decider
from sloweave.sim.memory import KVCapacity, KVLedger, UnlimitedKV
from sloweave.sim.queue import FcfsPrompts, OnePrompt, PrefillQueue
from sloweave.sim.recorder import Recorder
from sloweave.sim.requests import Requests
from sloweave.sim.result import NOT_STARTED, SimResult
from sloweave.sim.workloads import Workload

__all__ = ["DEADLINE_FORMS", "NOT_STARTED", "Engine", "SLOException", "SimResult", "simulate"]

DEADLINE_FORMS = ("per-token", "cumulative")


class Engine:
    """The engine state and its step. Build it with ``build_engine`` (or ``simulate``)."""

    def __init__(
        self,
        workload,
        policy,
        requests,
        arrivals,
        queue,
        packing,
        batch,
        memory,
        deadlines,
        clock,
        decide,
        batch_cap,
        horizon_ms,
    ) -> None:
        self.workload, self.policy, self.requests = workload, policy, requests
        self.arrivals, self.queue, self.packing, self.batch = arrivals, queue, packing, batch
        self.memory, self.kv, self.deadlines, self.clock = memory, KVLedger(), deadlines, clock
        self.decide, self.batch_cap, self.horizon_ms = decide, batch_cap, horizon_ms
        self.recorder = Recorder()
        self.now_ms = requests.arrival_ms[0] if len(requests) else 0.0
        self.end_ms = self.now_ms
        self.iteration = 0
        if hasattr(decide, "attach"):
            decide.attach(self)
        self._per_request_deadlines = deadlines.per_request  # read per request: kept on the engine
        self._steps = self._iterations(pause=True)

    def run(self) -> SimResult:
        """Step until every request finished or was rejected (or the horizon)."""
        for _ in self._iterations(pause=False):
            pass
        return self.result()

    def step(self) -> bool:
        """One iteration (or a jump to the next arrival when idle); False when nothing can happen.

        Nothing can happen once every request finished or was rejected (nothing runs, nothing
        waits, nothing is left to arrive), or past the horizon.
        """
        return next(self._steps, False)

    def _iterations(self, pause: bool):
        """The iterations from the engine's state on: with ``pause`` one per ``next()`` (True after each, an idle
        jump too), else all in one go. A generator, so that the parts, which of them act every iteration and their
        methods are bound to locals once: the body runs once per simulated iteration."""
        arrivals, batch, queue, waiting = self.arrivals, self.batch, self.queue, self.queue.waiting
        kv, memory, deadlines, clock = self.kv, self.memory, self.deadlines, self.clock
        decide, iteration_ms, offered = self.decide, clock.iteration_ms, self.packing.prompt_tokens
        gate_acts, kv_limited, reads_context = arrivals.gate.acts_each_iteration, memory.limited, clock.reads_context
        fixed_budget_ms, per_token_updates = deadlines.fixed_budget_ms, deadlines.per_token_updates
        set_time_ms, loop_ms = clock.set_time_ms, clock.loop_ms
        finishing_at, batch_cap, horizon_ms = batch.finishing_at, self.batch_cap, self.horizon_ms
        starts, ends, decodes, chunks, budgets, infeasibles = self.recorder.iteration_writers()
        # `while True`: CPython 3.11 specializes a generator's bytecode after a few backward jumps
        # or resumptions, and the conditional jump that closes a `while <test>` loop is not one.
        while True:
            now_ms = self.now_ms
            if not now_ms < horizon_ms:
                return
            if arrivals.next_ms <= now_ms or gate_acts:
                arrivals.admit(self)
            if not batch.n and not waiting:  # idle: jump to the next arrival
                if arrivals.next_ms == inf:
                    return
                self.now_ms = arrivals.next_ms
                if pause:
                    yield True
                continue
            if kv_limited:
                memory.make_room(self)  # may preempt, so before the batch size is read
            n, it = batch.n, self.iteration
            # no decodes: no deadline; a shared target: the same budget every iteration
            budget_ms = (fixed_budget_ms or deadlines.budget_ms(now_ms, it, batch.running)) if n else inf
            kv_free = memory.free_tokens(kv, n) if kv_limited else inf
            waiting_tokens = offered(n, batch_cap - n, kv_free) if waiting else 0
            if reads_context:
                self._tell_clock(waiting_tokens)
            chunk, infeasible = decide(n, waiting_tokens, budget_ms)
            if chunk < 0 or chunk > waiting_tokens:
                raise self._bad_chunk(chunk, waiting_tokens)
            if set_time_ms is not None:  # the machine's time depends on the clock (its pace)
                set_time_ms(now_ms)
            self.end_ms = end_ms = now_ms + iteration_ms(n, chunk)
            starts(now_ms)
            ends(end_ms)
            decodes(n)
            chunks(chunk)
            budgets(budget_ms)
            infeasibles(infeasible)
            # Every running request emits at the iteration's end; those at their last token leave.
            if it in finishing_at:
                self._finish(it)
            kv.decode_kv += batch.n  # every continuing decode wrote one more token of KV
            if per_token_updates:
                deadlines.emitted(batch.running, end_ms)
            if chunk:
                queue.take(chunk, self)
            self.now_ms = end_ms if loop_ms is None else end_ms + loop_ms(n)  # the engine's loop after the step
            self.iteration = it + 1
            if pause:
                yield True

    def _bad_chunk(self, chunk: int, waiting_tokens: int) -> RuntimeError:
        return RuntimeError(
            f"policy {self.policy.name} chose chunk {chunk} with {waiting_tokens} prompt tokens waiting"
        )

    def _tell_clock(self, waiting_tokens: int) -> None:
        """The KV context (and the prompts on offer) for the cost models that read them."""
        clock, queue = self.clock, self.queue
        clock.set_context(self.kv.decode_kv, queue.head_prefix_tokens() if waiting_tokens else 0)
        if clock.reads_offer:
            clock.set_offer(queue.offer(waiting_tokens))

    def _finish(self, iteration: int) -> None:
        """The requests whose last token came out of ``iteration`` leave: their KV and deadline go."""
        done, r, released_kv = self.batch.finish_due(iteration), self.requests, 0
        for request in done:
            released_kv += r.prefill_total[request] + (iteration - r.segment_first[request])  # its context
        self.kv.decode_kv -= released_kv
        if self._per_request_deadlines:
            for request in done:
                self.deadlines.left(request)

    def prefill_completed(self, request: int) -> None:
        """Its prefill completed this iteration: its (next) token comes out at the iteration's end."""
        iteration = self.iteration
        last_iter = self.batch.start(request, iteration)
        kv, prompt_kv = self.kv, self.requests.prefill_total[request]
        kv.reserved_kv -= prompt_kv
        if last_iter is not None:
            kv.decode_kv += prompt_kv + 1  # its context and the token it just emitted
            if self._per_request_deadlines:
                self.deadlines.started(request, self.end_ms, iteration, last_iter)

    def result(self) -> SimResult:
        r, gated = self.requests, isinstance(self.arrivals.gate, AdmissionGate)
        return SimResult(
            workload=self.workload,
            policy_name=self.policy.name,
            tpot_ms=float(self.deadlines.tpot_ms),
            **self.recorder.arrays(),
            first_token_iter=np.asarray(r.first_token_iter, dtype=np.int64),
            finished=np.asarray(r.finish_iter, dtype=np.int64) != NOT_STARTED,
            horizon_ms=self.horizon_ms,
            rejected_reason=np.asarray(r.rejected_reason, dtype=object) if gated or self.memory.limited else None,
            deferred_reason=np.asarray(r.deferred_reason, dtype=object) if gated else None,
            slo_exceptions=tuple(getattr(self.decide, "exceptions", ())),
            preemptions=self.memory.preemptions,
            recompute_tokens=self.memory.recompute_tokens,
            token_segments=r.token_segments(self.iteration),
            deadline_form="cumulative" if self.deadlines.banked else "per-token",
        )


def simulate(
    workload: Workload,
    policy: Policy,
    tpot_ms: float = 25.0,
    actual_cost: CostModel | None = None,
    horizon_s: float | None = None,
    max_batch_size: int | None = None,
    check_deadlines: bool = False,
    *,
    deadline_form: str = "per-token",
    aging: Aging | None = None,
    admission: AdmissionControl | None = None,
    ttft_ms: float | np.ndarray | None = None,
    kv_capacity_tokens: int | None = None,
    correction: OnlineCalibrator | None = None,
    step_grid_tokens: int = 1,
    engine_loop: EngineLoop | DrawnLoop | None = None,
) -> SimResult:
    """Run ``workload`` under ``policy`` until every request finished (or ``horizon_s``).

    ``tpot_ms`` is the shared TPOT target that defines deadlines for requests without
    their own (``workload.tpot_ms``). ``actual_cost`` gives iteration durations; by default
    the policy's own cost model (exact prediction) or the paper's analytic model.
    ``max_batch_size`` caps the requests that have started (decoding or part-prefilled):
    a new prompt is admitted to prefill only below the cap (Sarathi-Serve's and vLLM's
    ``max_num_seqs``); None means no cap. ``check_deadlines`` checks every budget against
    the core's per-request ``DeadlineTracker`` (slow; for tests).

    Beyond the paper (docs/beyond-paper.md): ``deadline_form``, ``aging``, ``admission``
    (its TTFT check needs ``ttft_ms``, one target or one per request),
    ``kv_capacity_tokens``, ``correction`` (online correction of a ``CalibratedCost``), and
    ``step_grid_tokens`` (a deadline-aware policy's steps rounded to a size grid where the deadline
    cut them short, as the vLLM plug-in's; ``core/size_grid.py``) and ``engine_loop`` (a real engine's time between
    steps, ``core/costs/engine_loop.py``). Every option works with every policy.
    """
    return build_engine(
        workload,
        policy,
        tpot_ms,
        actual_cost,
        horizon_s,
        max_batch_size,
        check_deadlines,
        deadline_form=deadline_form,
        aging=aging,
        admission=admission,
        ttft_ms=ttft_ms,
        kv_capacity_tokens=kv_capacity_tokens,
        correction=correction,
        step_grid_tokens=step_grid_tokens,
        engine_loop=engine_loop,
    ).run()


def build_engine(
    workload,
    policy,
    tpot_ms=25.0,
    actual_cost=None,
    horizon_s=None,
    max_batch_size=None,
    check_deadlines=False,
    *,
    deadline_form="per-token",
    aging=None,
    admission=None,
    ttft_ms=None,
    kv_capacity_tokens=None,
    correction=None,
    step_grid_tokens=1,
    engine_loop=None,
) -> Engine:
    """The engine for ``simulate``'s options, each option turned into its part."""
    tpot_ms = positive_ms(tpot_ms, "tpot_ms")
    _check_options(
        workload, actual_cost, horizon_s, max_batch_size, deadline_form, aging, admission, kv_capacity_tokens
    )
    requests = Requests.from_workload(workload)
    ttft_of = _per_request_ttft(ttft_ms, len(requests))
    if admission is not None and admission.ttft_slack is not None and ttft_of is None:
        raise ValueError("admission control with a TTFT check needs ttft_ms (one target or one per request)")
    duration = actual_cost or getattr(policy, "cost", None) or AnalyticCost()
    # A static rule has no model of its own: its admission check predicts with the machine's
    # model (never with the noisy clock, which would also draw from the noise stream).
    model = duration.cost if isinstance(duration, (NoisyCost, EmpiricalNoiseCost)) else duration
    predicted = getattr(policy, "predicted_ms", None) or getattr(policy, "cost", None) or model
    deadlines = _deadline_source(tpot_ms, requests.tpot_ms, deadline_form, check_deadlines, engine_loop is not None)
    queue = PrefillQueue(requests)
    # One prefill per iteration (the paper) or several, first-fit in FCFS order (Sarathi-Serve).
    packing = (
        OnePrompt(queue) if getattr(policy, "max_prefills", 1) == 1 else FcfsPrompts(queue, policy.max_prefill_tokens)
    )
    gate = AdmitAll() if admission is None else AdmissionGate(admission, policy, predicted, ttft_of)
    memory = UnlimitedKV() if kv_capacity_tokens is None else KVCapacity(int(kv_capacity_tokens))
    clock = IterationClock(duration, getattr(policy, "cost", None), correction, engine_loop)
    return Engine(
        workload,
        policy,
        requests,
        Arrivals(requests.arrival_ms, gate),
        queue,
        packing,
        DecodeBatch(requests),
        memory,
        deadlines,
        clock,
        chunk_decider(policy, aging, predicted, size_grid(step_grid_tokens, policy)),
        math.inf if max_batch_size is None else max_batch_size,
        math.inf if horizon_s is None else horizon_s * 1000.0,
    )


def _check_options(
    workload, actual_cost, horizon_s, max_batch_size, deadline_form, aging, admission, kv_capacity_tokens
) -> None:
    """The options' types and ranges, checked before anything is built."""
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a sloweave.sim.workloads.Workload, got {type(workload).__name__}")
    if actual_cost is not None and not callable(actual_cost):
        # a target passed in its place (the 4th argument) would otherwise fail mid-run
        raise TypeError(f"actual_cost must be a cost model, (n_decodes, chunk_tokens) -> ms, got {actual_cost!r}")
    if horizon_s is not None and not horizon_s > 0:
        raise ValueError(f"horizon_s must be > 0, got {horizon_s!r}")
    if max_batch_size is not None:
        whole_number(max_batch_size, "max_batch_size")
    if deadline_form not in DEADLINE_FORMS:
        raise ValueError(f"deadline_form must be one of {', '.join(DEADLINE_FORMS)}, got {deadline_form!r}")
    if aging is not None and not isinstance(aging, Aging):
        raise TypeError(f"aging must be a sloweave.core.policy.Aging, got {type(aging).__name__}")
    if admission is not None and not isinstance(admission, AdmissionControl):
        raise TypeError(f"admission must be a sloweave.core.admission.AdmissionControl, got {type(admission).__name__}")
    if kv_capacity_tokens is not None:
        whole_number(kv_capacity_tokens, "kv_capacity_tokens", unit=" of tokens")


def _deadline_source(tpot_ms: float, targets: list[float] | None, form: str, checked: bool, looped: bool):
    """``looped``: an engine loop passes between iterations (a cumulative source reads the clock already)."""
    if form == "cumulative":
        if checked:
            raise ValueError(
                "check_deadlines compares with the per-token DeadlineTracker; use deadline_form='per-token'"
            )
        return CumulativeTargets(tpot_ms, targets)
    source = SharedTarget(tpot_ms) if targets is None else PerRequestTargets(tpot_ms, targets)
    source = AfterTheLoop(source) if looped else source
    return TrackedDeadlines(source) if checked else source


def _per_request_ttft(ttft_ms, num_requests: int) -> list[float] | None:
    if ttft_ms is None:
        return None
    values = (
        np.broadcast_to(np.asarray(ttft_ms, dtype=np.float64), (num_requests,))
        if np.ndim(ttft_ms) == 0
        else np.asarray(ttft_ms, dtype=np.float64)
    )
    if values.shape != (num_requests,) or not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(
            f"ttft_ms must be one finite target > 0 ms or one per request ({num_requests}), got {ttft_ms!r}"
        )
    return values.tolist()
