"""SLOWeave as a vLLM V1 scheduler (``--scheduler-cls``).

    vllm serve MODEL --scheduler-cls sloweave.vllm_plugin.SLOWeaveAsyncScheduler \\
        --logits-processors sloweave.vllm_plugin.request_check:RequestTargetCheck \\
        --additional-config '{"sloweave": {"tpot_ms": 25, "online_correction": true}}'

(on vLLM's CPU build: ``sloweave-vllm serve ...`` with ``SLOWeaveScheduler``; see ``cli``).

The plug-in changes one number per step: the token budget vLLM's own scheduler hands
out (``max_num_batched_tokens`` becomes an upper bound). Before each ``schedule()`` it
computes ``decode tokens + SLOWeave chunk`` with the decision core, lowers
``self.max_num_scheduled_tokens`` to that for this one call, and restores it. vLLM then
schedules exactly as usual (KV cache manager, preemption, prefix caching untouched).
Running decodes are moved ahead of partial prefills so the chunk never displaces them.
Token times come from ``update_from_output`` (when the step's new tokens come back).

One request's data never takes the engine down: a bad per-request target is refused at the
API by ``RequestTargetCheck`` (HTTP 400) or, if it gets past, served with the default target
(logged, counted); any failure of the plug-in's own bookkeeping in ``schedule()``,
``add_request()`` or ``update_from_output()`` is logged and counted, and that step runs on
vLLM's own budget (``sloweave_fault``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import repeat

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from sloweave.core.budget import BudgetController, StepPlan, StepState, check_clock_ms
from sloweave.core.decision_metrics import Recorders, flush_recorder
from sloweave.core.policy import TokenBudget
from sloweave.core.step_log import StepLogWriter
from sloweave.vllm_plugin.config import PluginConfig, PluginConfigError, request_tpot_ms, step_log_path
from sloweave.vllm_plugin.metrics import default_recorder
from sloweave.vllm_plugin.request_check import REQUEST_TARGET_CHECK, RequestTargetCheck

logger = logging.getLogger(__name__)


def _is_prefilling(request: Request) -> bool:
    """Prompt tokens (or, after preemption, prompt and output tokens) still to compute.

    A decode has exactly one known token not yet computed (the one it just sampled), or
    none while its step is in flight under async scheduling.
    """
    return request.num_computed_tokens + 1 < request.num_tokens or (
        request.num_output_tokens == 0 and request.num_computed_tokens < request.num_prompt_tokens
    )


def _uncomputed_prompt_tokens(request: Request) -> int:
    return max(0, request.num_tokens - request.num_computed_tokens)


@dataclass(slots=True)  # made every step: not frozen (see StepPlan)
class _RunningSplit:
    """vLLM's running list seen by one plan: its decodes and partial prefills, in its order,
    and what the decodes ask of the step."""

    decodes: list[Request]
    partial: list[Request]
    decode_ids: tuple[str, ...]
    decode_tokens: int  # 1 per decode, plus drafts with speculative decoding
    decode_kv_tokens: int  # the KV context the decodes read

    @classmethod
    def of(cls, running: list[Request]) -> _RunningSplit:
        # One pass, no call per request: this runs every step over every running request
        # (_is_prefilling and the decode demand inlined).
        decodes, partial, decode_ids = [], [], []
        demand = kv = 0
        for request in running:
            computed = request.num_computed_tokens
            tokens = request.num_tokens
            # the prompt-length test first: a decode is past its prompt, so the property is not read
            if computed + 1 < tokens or (computed < request.num_prompt_tokens and request.num_output_tokens == 0):
                partial.append(request)
                continue
            decodes.append(request)
            decode_ids.append(request.request_id)
            kv += computed + 1
            # the sampled token, plus drafts and (async scheduling) tokens still in flight
            ahead = tokens + len(request.spec_token_ids) + request.num_output_placeholders - computed
            demand += ahead if ahead > 1 else 1
        return cls(decodes, partial, tuple(decode_ids), demand, kv)


def extra_args_of(request: Request):
    params = request.sampling_params
    return getattr(params, "extra_args", None) if params is not None else None


class SLOWeaveSchedulerMixin:
    """The SLOWeave budget on top of vLLM's scheduler; mixed into Scheduler and AsyncScheduler."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._request_tpot_ms: dict[str, float] = {}  # requests with their own TPOT target
        try:
            config = PluginConfig.from_sources(getattr(self.vllm_config, "additional_config", None))
            decision = config.build_decision()
        except PluginConfigError as err:
            raise PluginConfigError(f"sloweave vLLM plug-in: {err}") from None
        self.sloweave_config = config
        self._configured_budget = self.max_num_scheduled_tokens
        max_chunk = min(config.max_chunk_tokens, self._configured_budget)
        # the most prompt tokens a step could take: what the offer to the policy is counted up to
        self._offer_limit_tokens = max_chunk if config.budget_rule == "deadline" else self._configured_budget
        self.sloweave = BudgetController(
            self._policy(config, decision, max_chunk),
            default_tpot_ms=config.tpot_ms,
            max_budget_tokens=self._configured_budget,
            aging_ms=(config.aging_ms or None) if config.budget_rule == "deadline" else None,
            aging_chunk_tokens=config.aging_chunk_tokens,
            tpot_ms_of=self._request_tpot_ms.get,
            # online_correction: the core's SelfCorrection (its cost and adaptive margin decide,
            # its calibrator learns from the measured step times)
            correction=decision.correction.calibrator if decision.correction is not None else None,
            # budget_rule fixed: a static rule, whose steps the size grid never rounds (core/size_grid.py)
            step_grid_tokens=config.step_grid_tokens,
        )
        self.sloweave_correction = decision.correction
        # Decisions as Prometheus metrics on the default registry (vLLM's /metrics), and in
        # the step log when the configuration names one.
        rank = self.vllm_config.parallel_config.data_parallel_rank
        # The Prometheus recorder is also kept apart: the plug-in's health counters live on it alone.
        self.sloweave_metrics = metrics = default_recorder(engine=str(rank))
        metrics.set_targets(config.tpot_ms, decision.coverage)
        self.sloweave_step_log = self._open_step_log(config, rank)
        self.sloweave.recorder = (
            metrics if self.sloweave_step_log is None else Recorders(metrics, self.sloweave_step_log)
        )
        # request id -> clock time its prompt last made progress (arrival or a chunk)
        self._prompt_progress_ms: dict[str, float] = {}
        self.last_plan: StepPlan | None = None
        # One flag per step scheduled and not yet back: did it run on a SLOWeave plan?
        self._planned_in_flight: deque[bool] = deque()
        self._faults_logged: set[str] = set()
        registered = getattr(self.vllm_config.model_config, "logits_processors", None) or ()
        if not any(p is RequestTargetCheck or p == REQUEST_TARGET_CHECK for p in registered):  # a class or its name
            logger.info(
                "sloweave: per-request targets are checked in the engine only (a bad one is logged and served with the "
                "default target); add --logits-processors %s to refuse it at the API with HTTP 400",
                REQUEST_TARGET_CHECK,
            )

    def _policy(self, config: PluginConfig, decision, max_chunk: int):
        """SLOWeave, or with ``budget_rule: fixed`` vLLM's own budget every step: the engine then
        schedules as vanilla vLLM does, and its steps are still planned, priced and logged."""
        if config.budget_rule == "fixed":
            return TokenBudget(self._configured_budget, max_prefills=None, cost=decision.cost)
        return config.deadline_policy(decision, max_chunk)

    def _open_step_log(self, config: PluginConfig, rank: int) -> StepLogWriter | None:
        if not config.step_log:
            return None
        header = {"engine": str(rank), "config": asdict(config), "max_num_batched_tokens": self._configured_budget}
        path = step_log_path(config.step_log, rank)
        try:
            return StepLogWriter(path, header, config.step_log_max_steps, clock_ms=self.sloweave_clock_ms)
        except OSError as err:
            raise PluginConfigError(f"sloweave vLLM plug-in: step_log {path}: {err}") from None

    # A test can replace the clock; vLLM's own timestamps are not used.
    def sloweave_clock_ms(self) -> float:
        return time.monotonic() * 1000.0

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        # From here on nothing about one request may raise: the engine core would die with it
        # and take every other request down (see sloweave_fault).
        try:
            tpot_ms = request_tpot_ms(extra_args_of(request), request.request_id)
        except (TypeError, ValueError) as err:  # e.g. extra_args that are not an object
            # It got past the front end (no RequestTargetCheck registered): serve it with the
            # default target rather than fail it, and say so.
            logger.warning("sloweave: %s; serving it with the default target %g ms", err, self.sloweave_config.tpot_ms)
            self.sloweave_metrics.request_target_errors.inc()
            tpot_ms = None
        if tpot_ms is not None:
            self._request_tpot_ms[request.request_id] = tpot_ms
        try:
            self._prompt_progress_ms[request.request_id] = self._now_ms()
        except ValueError as err:  # a clock glitch: it starts aging when first offered instead
            self.sloweave_fault("add_request", err)

    def sloweave_fault(self, where: str, err: Exception) -> None:
        """The plug-in's own bookkeeping failed: count it, log it (in full the first time per
        place), and let vLLM go on. The caller falls back to vLLM's own behaviour for this step
        (its configured token budget), so a defect here costs a step's budget, not the server."""
        self.sloweave_metrics.plugin_error(where)
        if where not in self._faults_logged:
            self._faults_logged.add(where)
            logger.exception("sloweave: %s failed (%s); this step runs on vLLM's own token budget", where, err)
        else:
            logger.warning("sloweave: %s failed again: %r", where, err)

    def _now_ms(self) -> float:
        """The clock, refused when it glitches (NaN, inf): a time stored from it would stop a
        prompt from ever aging, and a plan timed from it would have no deadline and no margin."""
        return check_clock_ms(self.sloweave_clock_ms())

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        try:
            split, plan = self._plan(self._now_ms())
        except Exception as err:  # noqa: BLE001 - see sloweave_fault
            self.sloweave_fault("schedule", err)
            split, plan = None, None
        self.last_plan = plan
        if plan is not None:
            self.max_num_scheduled_tokens = plan.token_budget
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = self._configured_budget
        if output.total_num_scheduled_tokens:
            if plan is not None:
                try:
                    self._scheduled(output, plan, split)
                except Exception as err:  # noqa: BLE001
                    self.sloweave_fault("schedule", err)
                    plan = None
            self._planned_in_flight.append(plan is not None)
        return output

    def _plan(self, now_ms: float) -> tuple[_RunningSplit, StepPlan]:
        running = self.running
        split = _RunningSplit.of(running)
        # Decodes first, then partial prefills: vLLM serves `running` in order from one budget.
        partial = split.partial
        if partial and running[-len(partial) :] != partial:
            running[:] = split.decodes + partial
        return split, self.sloweave.plan_step(self._step_state(now_ms, split))

    def _scheduled(self, output: SchedulerOutput, plan: StepPlan, split: _RunningSplit) -> None:
        # Requests done computing after this step emit a token at its end: decodes and
        # prompts whose last chunk is in it (vLLM advanced num_computed_tokens already).
        scheduled = output.num_scheduled_tokens
        progress, requests = self._prompt_progress_ms, self.requests
        emitting = []
        for request_id in scheduled:
            if request_id in progress and _is_prefilling(requests[request_id]):
                progress[request_id] = plan.scheduled_ms  # when it was planned: this call's clock
            else:
                emitting.append(request_id)
        # What vLLM really scheduled (it may take less than the budget: max_num_seqs, KV
        # blocks); online correction learns from that step.
        decode_ran = sum(map(scheduled.get, split.decode_ids, repeat(0)))
        self.sloweave.on_scheduled(plan, emitting, (decode_ran, output.total_num_scheduled_tokens - decode_ran))

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        # Taken first, so that a failure below cannot shift later steps' flags.
        ran = bool(scheduler_output.total_num_scheduled_tokens and self._planned_in_flight)
        planned = ran and self._planned_in_flight.popleft()
        try:
            self._outputs_back(outputs, planned)
            if not self.requests:  # the engine runs dry and waits: what it did shows before it does
                flush_recorder(self.sloweave.recorder)
        except Exception as err:  # noqa: BLE001 - see sloweave_fault
            self.sloweave_fault("update_from_output", err)
        return outputs

    def _outputs_back(self, outputs, planned: bool) -> None:
        now_ms = self.sloweave_clock_ms()
        emitted, finished = [], []
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                if out.new_token_ids:
                    emitted.append(out.request_id)
                if out.finish_reason is not None:
                    finished.append(out.request_id)
        for request_id in emitted:
            self._prompt_progress_ms.pop(request_id, None)  # its prefill is done
        try:
            if planned:
                self.sloweave.on_step_done(now_ms, emitted)
            else:  # an empty step, or one that ran on vLLM's own budget: only token times to record
                self.sloweave.on_tokens(emitted, now_ms)
        finally:  # a finished request's deadline must go even when the step's time was refused
            for request_id in finished:
                self._forget(request_id)

    def _preempt_request(self, request: Request, *args, **kwargs) -> None:
        super()._preempt_request(request, *args, **kwargs)
        # Its next token waits for a recompute: drop its deadline (it would pin the budget at
        # zero) and let aging count from now.
        try:
            self.sloweave.on_finished(request.request_id)
            self._prompt_progress_ms[request.request_id] = self._now_ms()
        except Exception as err:  # noqa: BLE001 - see sloweave_fault
            self.sloweave_fault("preemption", err)

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus):
        finished = super().finish_requests(request_ids, finished_status)
        try:
            for request in finished:
                self._forget(request.request_id)
        except Exception as err:  # noqa: BLE001 - see sloweave_fault
            self.sloweave_fault("finish_requests", err)
        return finished

    def shutdown(self) -> None:
        flush_recorder(self.sloweave.recorder)
        if self.sloweave_step_log is not None:
            self.sloweave_step_log.close()
        super().shutdown()

    def _forget(self, request_id: str) -> None:
        self.sloweave.on_finished(request_id)
        self._prompt_progress_ms.pop(request_id, None)
        self._request_tpot_ms.pop(request_id, None)

    def _step_state(self, now_ms: float, split: _RunningSplit) -> StepState:
        limit = self._offer_limit_tokens
        pending, oldest, offer = 0, None, []
        # Prompts in the order vLLM will spend the budget on them: partial chunks in `running`,
        # then the waiting requests that already hold KV blocks, then the rest (see _admission_order).
        for request, tokens in self._prompt_demand(split.partial):
            if pending >= limit:
                break
            if tokens <= 0:
                continue
            pending += tokens
            offer.append((tokens, request.num_computed_tokens))
            if oldest is None:
                oldest = request
        prefix_tokens = oldest.num_computed_tokens if oldest is not None else 0
        waited_ms = 0.0
        if oldest is not None:  # a request seen waiting for the first time starts aging now
            waited_ms = now_ms - self._prompt_progress_ms.setdefault(oldest.request_id, now_ms)
        return StepState(
            now_ms=now_ms,
            decode_tokens=split.decode_tokens,
            pending_prompt_tokens=pending,
            oldest_prompt_id=None if oldest is None else oldest.request_id,
            oldest_prompt_waiting_ms=waited_ms,
            decoding_ids=split.decode_ids,
            decode_kv_tokens=split.decode_kv_tokens,
            prefill_prefix_tokens=prefix_tokens,
            prompts_on_offer=tuple(offer),
        )

    def _prompt_demand(self, partial: list[Request]) -> Iterator[tuple[Request, int]]:
        """(request, tokens vLLM would schedule for it with budget to spare), in vLLM's order."""
        for request in partial:
            yield request, _uncomputed_prompt_tokens(request)
        for request in self._admission_order():
            yield request, self._admission_tokens(request)

    def _admission_order(self) -> Iterator[Request]:
        """The waiting requests in the order vLLM's ``schedule()`` admits them: those holding KV
        blocks first (a finished remote KV load, a resumed or streaming session, any waiting
        request with computed tokens), then the others; only the former while new requests
        are paused."""
        yield from self.kv_holding_waiting
        if self._pause_state == PauseState.UNPAUSED:
            yield from self.waiting

    def _admission_tokens(self, request: Request) -> int:
        """The most tokens vLLM schedules for a waiting request when admitting it this step; 0
        while it is blocked (a KV load still arriving, a grammar compiling, a streaming session
        waiting for input). An upper bound on purpose: a budget counted too high is spent on
        the prompts behind, one counted too low stalls the request."""
        status = request.status
        computed = request.num_computed_tokens
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if request.request_id not in self.finished_recving_kv_req_ids:
                return 0
            # the load's last window may be recomputed (sliding-window replay)
            computed -= min(self.prefix_replay_tokens, computed)
        elif status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            # still compiling (a failed compile must be visited: vLLM finishes it with the error)
            compiling = request.structured_output_request
            if compiling is None or compiling.grammar is None:
                return 0
        elif status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            return 0
        # A prompt already wholly in KV (a full remote load or prefix hit) recomputes its
        # last token to sample the next one.
        tokens = max(1, request.num_tokens - computed)
        if tokens == 1 and self._pads_drafts(request):
            # vLLM pads a one-token admission to the drafts' size, or schedules nothing
            tokens += self.num_spec_tokens
        return tokens

    def _pads_drafts(self, request: Request) -> bool:
        """Speculative decoding pads a one-token admission to 1 + drafts when it fits the model length."""
        if not self.num_spec_tokens or self.dynamic_sd_lookup is not None:
            return False
        # its last prompt token, the drafts, and room for the tokens sampled after them
        return request.num_tokens + self.num_spec_tokens + self.num_sampled_tokens_per_step <= self.max_model_len


class SLOWeaveScheduler(SLOWeaveSchedulerMixin, Scheduler):
    """For synchronous scheduling (``--no-async-scheduling``)."""


class SLOWeaveAsyncScheduler(SLOWeaveSchedulerMixin, AsyncScheduler):
    """For asynchronous scheduling (vLLM's default on GPU)."""
