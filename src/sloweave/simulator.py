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
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import islice
from dataclasses import dataclass

import numpy as np

from sloweave.cost import AnalyticCost, CostModel
from sloweave.deadlines import DeadlineTracker
from sloweave.policy import Policy
from sloweave.workloads import Workload

NOT_STARTED = -1


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

    @property
    def num_iterations(self) -> int:
        return int(self.iter_end_ms.shape[0])

    @property
    def makespan_ms(self) -> float:
        return float(self.iter_end_ms[-1]) if self.num_iterations else 0.0

    def token_times_ms(self, request: int) -> np.ndarray:
        """Emission times of the tokens request ``request`` emitted (first token first)."""
        first = int(self.first_token_iter[request])
        if first == NOT_STARTED:
            return np.empty(0)
        out = int(self.workload.output_tokens[request])
        return self.iter_end_ms[first : min(first + out, self.num_iterations)]

    def status(self) -> np.ndarray:
        """'finished' or 'pending' (still queued or running when the horizon was reached)."""
        return np.where(self.finished, "finished", "pending")


def simulate(
    workload: Workload,
    policy: Policy,
    tpot_ms: float = 25.0,
    actual_cost: CostModel | None = None,
    horizon_s: float | None = None,
    max_batch_size: int | None = None,
    check_deadlines: bool = False,
) -> SimResult:
    """Run ``workload`` under ``policy`` until every request finished (or ``horizon_s``).

    ``tpot_ms`` is the shared TPOT target that defines deadlines for requests without
    their own (``workload.tpot_ms``). ``actual_cost`` gives iteration durations; by default
    the policy's own cost model (exact prediction) or the paper's analytic model.
    ``max_batch_size`` caps the requests that have started (decoding or part-prefilled):
    a new prompt is admitted to prefill only below the cap (Sarathi-Serve's and vLLM's
    ``max_num_seqs``); None means no cap.
    """
    if not (isinstance(tpot_ms, (int, float)) and math.isfinite(tpot_ms) and tpot_ms > 0):
        raise ValueError(f"tpot_ms must be a finite number of milliseconds > 0, got {tpot_ms!r}")
    if horizon_s is not None and not horizon_s > 0:
        raise ValueError(f"horizon_s must be > 0, got {horizon_s!r}")
    if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1):
        raise ValueError(f"max_batch_size must be a whole number >= 1, got {max_batch_size!r}")
    batch_cap = math.inf if max_batch_size is None else max_batch_size
    # One prefill per iteration (the paper) or several, first-fit in FCFS order (Sarathi-Serve).
    single_prefill = getattr(policy, "max_prefills", 1) == 1
    duration = actual_cost or getattr(policy, "cost", None) or AnalyticCost()
    horizon_ms = math.inf if horizon_s is None else horizon_s * 1000.0

    arrival_ms = (workload.arrival_s * 1000.0).tolist()
    prompt = workload.prompt_tokens.tolist()
    output = workload.output_tokens.tolist()
    per_request_tpot = None if workload.tpot_ms is None else workload.tpot_ms.tolist()
    num_requests = len(prompt)

    first_token_iter = [NOT_STARTED] * num_requests
    remaining_prompt = list(prompt)
    waiting: deque[int] = deque()
    # iteration index -> number of running requests that emit their last token in it
    finishing_at: dict[int, int] = {}
    # Smallest TPOT target among running requests: a lazy min-heap of (target, finish_iter).
    targets: list[tuple[float, int]] = []
    tracker = DeadlineTracker(tpot_ms) if check_deadlines else None
    running: dict[int, int] = {}  # only kept for check_deadlines: request -> finish iteration

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

    decide = policy.decide
    now = arrival_ms[0]
    next_arrival = 0
    n_running = 0
    finished = 0
    it = 0
    while finished < num_requests and now < horizon_ms:
        while next_arrival < num_requests and arrival_ms[next_arrival] <= now:
            waiting.append(next_arrival)
            next_arrival += 1
        if n_running == 0 and not waiting:
            now = arrival_ms[next_arrival]  # idle until the next arrival
            continue

        # Earliest deadline: every running request last emitted at `now` (previous iteration end).
        if n_running:
            if per_request_tpot is None:
                min_target = tpot_ms
            else:
                while targets[0][1] < it:
                    heapq.heappop(targets)
                min_target = targets[0][0]
            budget = min_target
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
        waiting_tokens = 0
        if waiting:
            head = waiting[0]
            head_started = remaining_prompt[head] < prompt[head]
            free_slots = batch_cap - n_running - head_started
            if head_started or free_slots > 0:
                waiting_tokens = remaining_prompt[head]
                if not single_prefill:
                    limit = policy.max_prefill_tokens(n_running)
                    free_slots -= not head_started
                    for request in islice(waiting, 1, None):
                        if free_slots <= 0 or waiting_tokens >= limit:
                            break
                        waiting_tokens += remaining_prompt[request]
                        free_slots -= 1
        chunk, is_infeasible = decide(n_running, waiting_tokens, budget)
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

        done_now = finishing_at.pop(it, 0)
        n_running -= done_now
        finished += done_now
        if tracker is not None:
            for request, last in list(running.items()):
                if last == it:
                    tracker.remove(request)
                    del running[request]
                else:
                    tracker.on_token(request, end)

        left = chunk
        while left:
            head = waiting[0]
            take = min(left, remaining_prompt[head])
            left -= take
            remaining_prompt[head] -= take
            piece_iter.append(it)
            piece_request.append(head)
            piece_tokens.append(take)
            if remaining_prompt[head]:
                break
            waiting.popleft()  # prefill complete: its first token comes out of this iteration
            first_token_iter[head] = it
            last_iter = it + output[head] - 1
            if last_iter == it:
                finished += 1
                continue
            finishing_at[last_iter] = finishing_at.get(last_iter, 0) + 1
            n_running += 1
            if per_request_tpot is not None:
                heapq.heappush(targets, (per_request_tpot[head], last_iter))
            if tracker is not None:
                tracker.add(head, end, None if per_request_tpot is None else per_request_tpot[head])
                running[head] = last_iter
        now = end
        it += 1

    first = np.asarray(first_token_iter, dtype=np.int64)
    out = workload.output_tokens
    is_finished = (first != NOT_STARTED) & (first + out - 1 < it)
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
        first_token_iter=first,
        finished=is_finished,
        horizon_ms=horizon_ms,
    )
