"""Iteration-level, event-driven serving simulator.

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

Speed: because every running request emits a token at every iteration end, request i's
tokens are emitted at the ends of iterations first_iter[i] .. first_iter[i] + out_i - 1.
The loop therefore keeps only counters (how many decode, how many finish at which
iteration) and does O(1) Python work per iteration plus the policy's decision; per-token
times and gaps are recovered afterwards from the iteration end times with numpy.

Deadlines: all running requests emit at the same instant (the end of the previous
iteration), so the earliest next-token deadline is that instant plus the smallest TPOT
target among them. The per-request DeadlineTracker gives the same answer in O(|A|) per
iteration; ``check_deadlines=True`` runs it alongside and asserts they agree.

Options beyond the paper (all off by default; docs/beyond-paper.md):
- ``deadline_form="cumulative"``: request i's k-th next token is due at t_first_i + k D_i
  (QoServe), so a request running ahead banks slack. As every running request emits once
  per iteration, with j the iteration index d_i = (t_first_i - j_first_i D_i) + j D_i: the
  earliest is a min-heap over constant keys per distinct target, plus j D.
- ``aging``: starvation control (policy.Aging); forced iterations are SLO exceptions.
- ``admission``: reject or defer arrivals that decode load or their TTFT target make
  hopeless (admission.AdmissionControl); each rejected request keeps its reason.
- context-aware cost: a cost with ``set_context(decode_kv_tokens, prefill_prefix_tokens)``
  gets the KV read by the decodes and the head prompt's prefix before every decision;
  the decodes' KV total is kept in O(1) per iteration (+1 per running request, + prompt
  when a prefill completes, - context when a request finishes).
- ``kv_capacity_tokens``: a KV cache of that many tokens. A prompt starts only when its
  KV fits; when the running requests' growth overflows it, the newest running request is
  preempted and recomputed later (prompt + tokens so far), as vLLM does.
Running requests are kept in an insertion-ordered dict (per request O(1)), which only the
rare events (an SLO exception, a preemption) walk.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import islice
from dataclasses import dataclass, field

import numpy as np

from sloweave.admission import DECODE_SATURATED, EXCEEDS_KV_CAPACITY, TTFT_EXPIRED, TTFT_UNREACHABLE, AdmissionControl, predicted_ttft_ms
from sloweave.cost import AnalyticCost, CostModel
from sloweave.deadlines import DeadlineTracker
from sloweave.policy import Aging, Policy
from sloweave.workloads import Workload

NOT_STARTED = -1
DEADLINE_FORMS = ("per-token", "cumulative")


@dataclass(frozen=True)
class SLOException:
    """An iteration whose chunk was forced by aging although it breaks deadlines."""

    iteration: int
    request: int  # the starving prompt that got the forced chunk
    chunk_tokens: int
    predicted_ms: float
    budget_ms: float
    affected: tuple[int, ...]  # running requests predicted to miss their next-token deadline


@dataclass(frozen=True)
class SimResult:
    """What one simulated run produced. Times are milliseconds from the workload's t = 0."""

    workload: Workload
    policy_name: str
    tpot_ms: float
    # per iteration
    iter_start_ms: np.ndarray
    iter_end_ms: np.ndarray
    iter_decodes: np.ndarray
    iter_chunk_tokens: np.ndarray
    iter_budget_ms: np.ndarray  # +inf when nothing was decoding
    iter_infeasible: np.ndarray
    # prefill pieces: in iteration prefill_iter[k], request prefill_request[k] got prefill_tokens[k]
    prefill_iter: np.ndarray
    prefill_request: np.ndarray
    prefill_tokens: np.ndarray
    # per request
    first_token_iter: np.ndarray  # iteration that completed the prefill, -1 if never
    finished: np.ndarray  # bool: emitted all its output tokens
    horizon_ms: float  # simulation stopped here (inf when it ran until every request finished)
    # ---- options beyond the paper (defaults: nothing happened) ----
    # per request: why admission refused it ("" = not rejected); deferred ones are served later
    rejected_reason: np.ndarray | None = None
    deferred_reason: np.ndarray | None = None
    slo_exceptions: tuple[SLOException, ...] = ()
    preemptions: int = 0
    recompute_tokens: int = 0  # prompt + generated tokens prefilled again after preemptions
    # preempted requests only: the (first, last) iterations of each run of tokens, in order
    token_segments: dict = field(default_factory=dict)
    deadline_form: str = "per-token"

    @property
    def num_iterations(self) -> int:
        return int(self.iter_end_ms.shape[0])

    @property
    def makespan_ms(self) -> float:
        return float(self.iter_end_ms[-1]) if self.num_iterations else 0.0

    def token_iterations(self, request: int) -> np.ndarray:
        """Iterations at whose end ``request`` emitted its tokens (first token first)."""
        segments = self.token_segments.get(request)
        if segments is not None:
            return np.concatenate([np.arange(a, b + 1) for a, b in segments]) if segments else np.empty(0, dtype=np.int64)
        first = int(self.first_token_iter[request])
        if first == NOT_STARTED:
            return np.empty(0, dtype=np.int64)
        out = int(self.workload.output_tokens[request])
        return np.arange(first, min(first + out, self.num_iterations))

    def token_times_ms(self, request: int) -> np.ndarray:
        """Emission times of the tokens request ``request`` emitted (first token first)."""
        return self.iter_end_ms[self.token_iterations(request)]

    def status(self) -> np.ndarray:
        """'finished', 'rejected' (by admission control) or 'pending' (queued or running at the horizon)."""
        status = np.where(self.finished, "finished", "pending")
        if self.rejected_reason is not None:
            status = np.where(self.rejected_reason != "", "rejected", status)
        return status


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
) -> SimResult:
    """Run ``workload`` under ``policy`` until every request finished (or ``horizon_s``).

    ``tpot_ms`` is the shared TPOT target that defines deadlines for requests without
    their own (``workload.tpot_ms``). ``actual_cost`` gives iteration durations; by default
    the policy's own cost model (exact prediction) or the paper's analytic model.
    ``max_batch_size`` caps the requests that have started (decoding or part-prefilled):
    a new prompt is admitted to prefill only below the cap (Sarathi-Serve's and vLLM's
    ``max_num_seqs``); None means no cap.

    Beyond the paper (module docstring): ``deadline_form``, ``aging``, ``admission`` (its
    TTFT check needs ``ttft_ms``, one target or one per request) and ``kv_capacity_tokens``.
    """
    if not (isinstance(tpot_ms, (int, float)) and math.isfinite(tpot_ms) and tpot_ms > 0):
        raise ValueError(f"tpot_ms must be a finite number of milliseconds > 0, got {tpot_ms!r}")
    if horizon_s is not None and not horizon_s > 0:
        raise ValueError(f"horizon_s must be > 0, got {horizon_s!r}")
    if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1):
        raise ValueError(f"max_batch_size must be a whole number >= 1, got {max_batch_size!r}")
    if deadline_form not in DEADLINE_FORMS:
        raise ValueError(f"deadline_form must be one of {', '.join(DEADLINE_FORMS)}, got {deadline_form!r}")
    if check_deadlines and deadline_form != "per-token":
        raise ValueError("check_deadlines compares with the per-token DeadlineTracker; use deadline_form='per-token'")
    if aging is not None and not isinstance(aging, Aging):
        raise TypeError(f"aging must be a sloweave.policy.Aging, got {type(aging).__name__}")
    if admission is not None and not isinstance(admission, AdmissionControl):
        raise TypeError(f"admission must be a sloweave.admission.AdmissionControl, got {type(admission).__name__}")
    if kv_capacity_tokens is not None and (
        isinstance(kv_capacity_tokens, bool) or not isinstance(kv_capacity_tokens, (int, np.integer)) or kv_capacity_tokens < 1
    ):
        raise ValueError(f"kv_capacity_tokens must be a whole number of tokens >= 1, got {kv_capacity_tokens!r}")
    num_requests = len(workload)
    ttft_of = _per_request_ttft(ttft_ms, num_requests)
    if admission is not None and admission.ttft_slack is not None and ttft_of is None:
        raise ValueError("admission control with a TTFT check needs ttft_ms (one target or one per request)")
    batch_cap = math.inf if max_batch_size is None else max_batch_size
    # One prefill per iteration (the paper) or several, first-fit in FCFS order (Sarathi-Serve).
    single_prefill = getattr(policy, "max_prefills", 1) == 1
    duration = actual_cost or getattr(policy, "cost", None) or AnalyticCost()
    predicted = getattr(policy, "predicted_ms", None) or getattr(policy, "cost", None) or duration
    horizon_ms = math.inf if horizon_s is None else horizon_s * 1000.0
    cumulative = deadline_form == "cumulative"
    lookahead = getattr(policy, "lookahead", False)
    limit_kv = kv_capacity_tokens is not None
    kv_capacity = math.inf if kv_capacity_tokens is None else int(kv_capacity_tokens)
    # Costs that read the KV context get it before every decision (the policy's and the actual one).
    context_setters, context_models = [], []
    for model in (getattr(policy, "cost", None), duration, getattr(duration, "cost", None)):
        setter = getattr(model, "set_context", None)
        if setter is not None and not any(model is seen for seen in context_models):
            context_models.append(model)
            context_setters.append(setter)

    arrival_ms = (workload.arrival_s * 1000.0).tolist()
    prompt = workload.prompt_tokens.tolist()
    output = workload.output_tokens.tolist()
    per_request_tpot = None if workload.tpot_ms is None else workload.tpot_ms.tolist()

    first_token_iter = [NOT_STARTED] * num_requests
    finish_iter = [NOT_STARTED] * num_requests
    remaining_prompt = list(prompt)
    # tokens the current prefill must process: the prompt, or prompt + generated after a preemption
    prefill_total = list(prompt)
    # iteration of the first token of the current run of tokens (differs from first_token_iter after a preemption)
    segment_first = [NOT_STARTED] * num_requests
    emitted_before: dict[int, int] = {}  # preempted requests: tokens emitted before their current run
    closed_segments: dict[int, list[tuple[int, int]]] = {}
    progress_ms = list(arrival_ms)  # when a prompt arrived or last got tokens (aging)
    waiting: deque[int] = deque()
    deferred: deque[int] = deque()  # best-effort lane of admission control's "defer"
    rejected_reason = [""] * num_requests
    deferred_reason = [""] * num_requests
    queued_tokens = 0  # prompt tokens still to prefill in `waiting`
    # iteration index -> running requests that emit their last token in it
    finishing_at: dict[int, list[int]] = {}
    running: dict[int, int] = {}  # request -> last iteration, in the order they started decoding
    # Per-token form: smallest TPOT target among running requests, lazy min-heap of (target, last_iter, request).
    targets: list[tuple[float, int, int]] = []
    # Cumulative form: per distinct target D, a lazy min-heap of (t_first - j_first D, last_iter, request).
    cumulative_keys: dict[float, list[tuple[float, int, int]]] = {}
    cumulative_key_of: dict[int, float] = {}
    tracker = DeadlineTracker(tpot_ms) if check_deadlines else None
    exceptions: list[SLOException] = []
    decode_kv = 0  # KV tokens the running decodes read in the next iteration
    reserved_kv = 0  # KV held by prompts whose prefill started but did not complete
    preemptions = 0
    recompute_tokens = 0

    starts: list[float] = []
    ends: list[float] = []
    decodes: list[int] = []
    chunks: list[int] = []
    budgets: list[float] = []
    infeasible: list[bool] = []
    # one row per (iteration, request) prefill piece: several prompts can share an iteration
    piece_iter: list[int] = []
    piece_request: list[int] = []
    piece_tokens: list[int] = []

    def target_of(request: int) -> float:
        return tpot_ms if per_request_tpot is None else per_request_tpot[request]

    def admit_or_refuse(request: int, now_ms: float, n_running: int, queued: int) -> str:
        """'' to queue the request, else the reason admission control refuses it."""
        tpot = target_of(request)
        n_committed = n_running + len(waiting)
        if not admission.decode_room(predicted(n_committed + 1, 0), tpot):
            return DECODE_SATURATED
        if admission.ttft_slack is not None:
            # The chunk the policy would take per iteration at this load, if the budget were
            # the request's own target: the queue ahead drains at that pace (FCFS).
            chunk = policy.decide(n_committed, queued + prompt[request], tpot).chunk_tokens
            estimate = predicted_ttft_ms(now_ms - arrival_ms[request], queued + prompt[request], chunk, predicted(n_committed, chunk))
            if not admission.ttft_reachable(estimate, ttft_of[request]):
                return TTFT_UNREACHABLE
        return ""

    def refuse(request: int, reason: str) -> None:
        nonlocal n_rejected
        if admission is not None and admission.action == "defer" and reason != EXCEEDS_KV_CAPACITY:
            deferred_reason[request] = reason
            deferred.append(request)
        else:
            rejected_reason[request] = reason
            n_rejected += 1

    decide = policy.decide
    n_rejected = 0
    now = arrival_ms[0]
    next_arrival = 0
    n_running = 0
    finished = 0
    it = 0
    while finished + n_rejected < num_requests and now < horizon_ms:
        while next_arrival < num_requests and arrival_ms[next_arrival] <= now:
            request = next_arrival
            next_arrival += 1
            if prompt[request] + output[request] > kv_capacity:
                refuse(request, EXCEEDS_KV_CAPACITY)  # could never fit, even alone
                continue
            if admission is not None:
                reason = admit_or_refuse(request, now, n_running, queued_tokens)
                if reason:
                    refuse(request, reason)
                    continue
            waiting.append(request)
            queued_tokens += prompt[request]
        if admission is not None:
            # A queued prompt that has not started and already waited past its TTFT target
            # can no longer meet its SLO; serving it first would only make later ones late too.
            while admission.ttft_slack is not None and waiting:
                head = waiting[0]
                started = remaining_prompt[head] < prefill_total[head]
                best_effort = deferred_reason[head] != ""  # came from the deferred lane: served anyway
                if started or best_effort or now - arrival_ms[head] <= ttft_of[head] * admission.ttft_slack:
                    break
                waiting.popleft()
                queued_tokens -= remaining_prompt[head]
                refuse(head, TTFT_EXPIRED)
            # The best-effort lane runs only when nothing else waits and decodes have room.
            if deferred and not waiting and (n_running == 0 or admission.decode_room(predicted(n_running + 1, 0), target_of(deferred[0]))):
                request = deferred.popleft()
                waiting.append(request)
                queued_tokens += remaining_prompt[request]
        if n_running == 0 and not waiting:
            if next_arrival >= num_requests:
                break  # only rejected requests are left
            now = arrival_ms[next_arrival]  # idle until the next arrival
            continue

        # KV memory: the decodes of this iteration must fit; preempt the newest running
        # request (recompute later) until they do.
        while limit_kv and decode_kv + reserved_kv > kv_capacity and n_running:
            victim = next(reversed(running))
            del running[victim]
            n_running -= 1
            held = prefill_total[victim] + (it - segment_first[victim])
            decode_kv -= held
            emitted = emitted_before.get(victim, 0) + it - segment_first[victim]
            emitted_before[victim] = emitted
            closed_segments.setdefault(victim, []).append((segment_first[victim], it - 1))
            segment_first[victim] = NOT_STARTED
            prefill_total[victim] = remaining_prompt[victim] = prompt[victim] + emitted
            recompute_tokens += prefill_total[victim]
            preemptions += 1
            progress_ms[victim] = now
            queued_tokens += prefill_total[victim]
            # back to the front of the queue (behind a prompt whose prefill is under way)
            if waiting and remaining_prompt[waiting[0]] < prefill_total[waiting[0]]:
                waiting.insert(1, victim)
            else:
                waiting.appendleft(victim)
            if tracker is not None:
                tracker.remove(victim)

        # Earliest deadline: every running request last emitted at `now` (previous iteration end).
        if n_running:
            if cumulative:
                earliest = math.inf
                for target, heap in cumulative_keys.items():
                    while heap and running.get(heap[0][2]) != heap[0][1]:
                        heapq.heappop(heap)
                    if heap:
                        earliest = min(earliest, heap[0][0] + it * target)
                budget = max(0.0, round(earliest - now, 6))
            elif per_request_tpot is None:
                budget = tpot_ms
            else:
                while running.get(targets[0][2]) != targets[0][1]:
                    heapq.heappop(targets)
                budget = targets[0][0]
        else:
            budget = math.inf
        if tracker is not None:
            reference = tracker.budget_ms(now)
            # (l + D) - l is D only up to float rounding of the absolute clock
            assert reference == budget or abs(reference - budget) <= 1e-9 * max(1.0, now), (
                f"iteration {it}: tracker budget {reference} != simulator budget {budget}"
            )

        # Prompt tokens the policy may take: the head's remainder (a part-prefilled head has
        # already been admitted), then, for multi-prefill policies, further prompts in FCFS
        # order while the batch cap admits new requests and the policy could still use more.
        # A prompt whose prefill has not started also needs room for its KV.
        waiting_tokens = 0
        if waiting:
            head = waiting[0]
            head_started = remaining_prompt[head] < prefill_total[head]
            free_slots = batch_cap - n_running - head_started
            kv_free = kv_capacity - decode_kv - reserved_kv - n_running - 1 if limit_kv else math.inf
            if head_started or (free_slots > 0 and prefill_total[head] <= kv_free):
                waiting_tokens = remaining_prompt[head]
                if not single_prefill:
                    limit = policy.max_prefill_tokens(n_running)
                    free_slots -= not head_started
                    kv_free -= 0 if head_started else prefill_total[head]
                    for request in islice(waiting, 1, None):
                        if free_slots <= 0 or waiting_tokens >= limit or prefill_total[request] > kv_free:
                            break
                        waiting_tokens += remaining_prompt[request]
                        free_slots -= 1
                        kv_free -= prefill_total[request]
        if context_setters:
            head_prefix = prefill_total[waiting[0]] - remaining_prompt[waiting[0]] if waiting_tokens else 0
            for setter in context_setters:
                setter(decode_kv, head_prefix)
        if lookahead:
            head_remaining = remaining_prompt[waiting[0]] if waiting_tokens else 0
            next_fresh = budget if not cumulative else tpot_ms if per_request_tpot is None else min(cumulative_keys)
            if waiting_tokens and not cumulative and per_request_tpot is not None:
                next_fresh = min(next_fresh, per_request_tpot[waiting[0]])
            chunk, is_infeasible = policy.decide_lookahead(n_running, waiting_tokens, budget, head_remaining, next_fresh, cumulative)
        else:
            chunk, is_infeasible = decide(n_running, waiting_tokens, budget)
        if aging is not None and waiting_tokens:
            chunk, forced = aging.apply(chunk, waiting_tokens, now - progress_ms[waiting[0]])
            if forced:
                predicted_end_ms = predicted(n_running, chunk)
                if cumulative:
                    affected = tuple(
                        r for r in running if cumulative_key_of[r] + it * target_of(r) - now < predicted_end_ms - 1e-9
                    )
                else:
                    affected = tuple(r for r in running if target_of(r) < predicted_end_ms - 1e-9)
                exceptions.append(SLOException(it, waiting[0], chunk, predicted_end_ms, budget, affected))
        if chunk < 0 or chunk > waiting_tokens:
            raise RuntimeError(
                f"policy {policy.name} chose chunk {chunk} with {waiting_tokens} prompt tokens waiting"
            )
        end = now + duration(n_running, chunk)

        starts.append(now)
        ends.append(end)
        decodes.append(n_running)
        chunks.append(chunk)
        budgets.append(budget)
        infeasible.append(is_infeasible)

        done_now = finishing_at.pop(it, None)
        if done_now:
            for request in done_now:
                if running.get(request) != it:
                    continue  # preempted since; it finishes later
                del running[request]
                n_running -= 1
                finished += 1
                finish_iter[request] = it
                decode_kv -= prefill_total[request] + (it - segment_first[request])
                if tracker is not None:
                    tracker.remove(request)
        decode_kv += n_running  # every continuing decode wrote one more token of KV
        if tracker is not None:
            for request in running:
                tracker.on_token(request, end)

        left = chunk
        queued_tokens -= chunk
        while left:
            head = waiting[0]
            if remaining_prompt[head] == prefill_total[head]:
                reserved_kv += prefill_total[head]  # its prefill starts: the prompt's KV is held
            take = min(left, remaining_prompt[head])
            left -= take
            remaining_prompt[head] -= take
            progress_ms[head] = end
            piece_iter.append(it)
            piece_request.append(head)
            piece_tokens.append(take)
            if remaining_prompt[head]:
                break
            waiting.popleft()  # prefill complete: its (next) token comes out of this iteration
            reserved_kv -= prefill_total[head]
            if first_token_iter[head] == NOT_STARTED:
                first_token_iter[head] = it
            segment_first[head] = it
            last_iter = it + output[head] - emitted_before.get(head, 0) - 1
            if last_iter == it:
                finished += 1
                finish_iter[head] = it
                continue
            finishing_at.setdefault(last_iter, []).append(head)
            running[head] = last_iter
            n_running += 1
            decode_kv += prefill_total[head] + 1
            target = target_of(head)
            if cumulative:
                key = end - it * target
                cumulative_key_of[head] = key
                heapq.heappush(cumulative_keys.setdefault(target, []), (key, last_iter, head))
            elif per_request_tpot is not None:
                heapq.heappush(targets, (target, last_iter, head))
            if tracker is not None:
                tracker.add(head, end, None if per_request_tpot is None else per_request_tpot[head])
        now = end
        it += 1

    segments: dict[int, list[tuple[int, int]]] = {}
    for request, closed in closed_segments.items():
        runs = list(closed)
        if segment_first[request] != NOT_STARTED:
            left_tokens = output[request] - emitted_before[request]
            runs.append((segment_first[request], min(segment_first[request] + left_tokens, it) - 1))
        segments[request] = runs
    any_refused = admission is not None or kv_capacity_tokens is not None
    return SimResult(
        workload=workload,
        policy_name=policy.name,
        tpot_ms=float(tpot_ms),
        iter_start_ms=np.asarray(starts, dtype=np.float64),
        iter_end_ms=np.asarray(ends, dtype=np.float64),
        iter_decodes=np.asarray(decodes, dtype=np.int64),
        iter_chunk_tokens=np.asarray(chunks, dtype=np.int64),
        iter_budget_ms=np.asarray(budgets, dtype=np.float64),
        iter_infeasible=np.asarray(infeasible, dtype=bool),
        prefill_iter=np.asarray(piece_iter, dtype=np.int64),
        prefill_request=np.asarray(piece_request, dtype=np.int64),
        prefill_tokens=np.asarray(piece_tokens, dtype=np.int64),
        first_token_iter=np.asarray(first_token_iter, dtype=np.int64),
        finished=np.asarray(finish_iter, dtype=np.int64) != NOT_STARTED,
        horizon_ms=horizon_ms,
        rejected_reason=np.asarray(rejected_reason, dtype=object) if any_refused else None,
        deferred_reason=np.asarray(deferred_reason, dtype=object) if admission is not None else None,
        slo_exceptions=tuple(exceptions),
        preemptions=preemptions,
        recompute_tokens=recompute_tokens,
        token_segments=segments,
        deadline_form=deadline_form,
    )


def _per_request_ttft(ttft_ms, num_requests: int) -> list[float] | None:
    if ttft_ms is None:
        return None
    values = np.broadcast_to(np.asarray(ttft_ms, dtype=np.float64), (num_requests,)) if np.ndim(ttft_ms) == 0 else np.asarray(ttft_ms, dtype=np.float64)
    if values.shape != (num_requests,) or not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"ttft_ms must be one finite target > 0 ms or one per request ({num_requests}), got {ttft_ms!r}")
    return values.tolist()
