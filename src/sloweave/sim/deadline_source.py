"""Where the simulator's next-token deadlines come from: the deadline source part.

Every running request emits at the same instant (the previous iteration's end), so the
earliest deadline needs no per-request update per iteration:

- ``SharedTarget``: one TPOT target D for everyone; the budget is D.
- ``PerRequestTargets``: request i's own D_i; the budget is the smallest D_i among the
  running requests (a lazy min-heap of (D_i, last iteration, i)).
- ``CumulativeTargets`` (QoServe): request i's k-th next token is due at t_first_i + k D_i,
  so a request running ahead banks slack. With j the iteration index,
  d_i = (t_first_i - j_first_i D_i) + j D_i: per distinct target a min-heap over those
  constant keys, plus j D.
- ``TrackedDeadlines``: a per-token source checked, every iteration, against the core's
  ``DeadlineTracker`` fed with every token (O(|A|) per iteration; for tests).
- ``AfterTheLoop``: a shared or per-request source on a clock with an engine loop between
  iterations (``EngineLoop``): the decision comes a loop after the tokens, and its budget is that
  much less.

A heap entry is live while the request still runs with the same last iteration (a
preempted request that comes back gets a new entry).
"""

from __future__ import annotations

import heapq
import math

from sloweave.core.deadlines import DeadlineTracker, budget_until

# A request counts as missing its deadline only past float noise of the clock.
LATE_TOLERANCE_MS = 1e-9


class SharedTarget:
    banked = False  # time spent now is not taken from the next iteration's budget
    per_token_updates = False  # wants ``emitted`` for every running request every iteration
    per_request = False  # ``started`` and ``left`` do nothing

    def __init__(self, tpot_ms: float) -> None:
        self.tpot_ms = tpot_ms
        self.fixed_budget_ms = tpot_ms  # the budget whenever something decodes (None: ask budget_ms)

    def target(self, request: int) -> float:
        return self.tpot_ms

    def budget_ms(self, now_ms: float, iteration: int, running: dict) -> float:
        return self.tpot_ms

    def started(self, request: int, end_ms: float, iteration: int, last_iter: int) -> None:
        pass

    def emitted(self, running: dict, end_ms: float) -> None:
        pass

    def left(self, request: int) -> None:
        pass

    def late(self, request: int, now_ms: float, iteration: int, predicted_ms: float) -> bool:
        """Predicted to miss its next deadline if this iteration lasts ``predicted_ms``."""
        return self.target(request) < predicted_ms - LATE_TOLERANCE_MS

    def next_fresh_budget_ms(self, budget_ms: float, head: int | None) -> float:
        """The next iteration's budget before this one's choice (for the lookahead policy)."""
        return budget_ms


class PerRequestTargets(SharedTarget):
    per_request = True

    def __init__(self, tpot_ms: float, targets: list[float]) -> None:
        super().__init__(tpot_ms)
        self.fixed_budget_ms = None
        self.targets = targets
        self._heap: list[tuple[float, int, int]] = []  # (target, last_iter, request)

    def target(self, request: int) -> float:
        return self.targets[request]

    def budget_ms(self, now_ms: float, iteration: int, running: dict) -> float:
        heap = self._heap
        while running.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][0]

    def started(self, request: int, end_ms: float, iteration: int, last_iter: int) -> None:
        heapq.heappush(self._heap, (self.targets[request], last_iter, request))

    def next_fresh_budget_ms(self, budget_ms: float, head: int | None) -> float:
        # The head joins the decodes when its prefill completes, with its own target.
        return budget_ms if head is None else min(budget_ms, self.targets[head])


class CumulativeTargets(SharedTarget):
    banked = True
    per_request = True

    def __init__(self, tpot_ms: float, targets: list[float] | None) -> None:
        super().__init__(tpot_ms)
        self.fixed_budget_ms = None
        self.targets = targets
        self._keys: dict[float, list[tuple[float, int, int]]] = {}  # target -> heap of (key, last_iter, request)
        self._key_of: dict[int, float] = {}

    def target(self, request: int) -> float:
        return self.tpot_ms if self.targets is None else self.targets[request]

    def budget_ms(self, now_ms: float, iteration: int, running: dict) -> float:
        earliest = math.inf
        for target, heap in self._keys.items():
            while heap and running.get(heap[0][2]) != heap[0][1]:
                heapq.heappop(heap)
            if heap:
                deadline_ms = heap[0][0] + iteration * target
                if deadline_ms < earliest:  # min() without a builtin call, every iteration
                    earliest = deadline_ms
        return budget_until(earliest, now_ms)

    def started(self, request: int, end_ms: float, iteration: int, last_iter: int) -> None:
        target = self.target(request)
        key = end_ms - iteration * target
        self._key_of[request] = key
        heapq.heappush(self._keys.setdefault(target, []), (key, last_iter, request))

    def late(self, request: int, now_ms: float, iteration: int, predicted_ms: float) -> bool:
        deadline = self._key_of[request] + iteration * self.target(request)
        return deadline - now_ms < predicted_ms - LATE_TOLERANCE_MS

    def next_fresh_budget_ms(self, budget_ms: float, head: int | None) -> float:
        # A fresh iteration adds one target to every request's deadline: the smallest target among
        # the requests that started and the head, which joins them when its prefill completes.
        if self.targets is None:
            return self.tpot_ms
        seen = [*self._keys, *([] if head is None else [self.targets[head]])]
        return min(seen) if seen else budget_ms


class AfterTheLoop:
    """A shared or per-request source on a clock with an engine loop between iterations: its budgets run
    from the last iteration's end, when every running request emitted, and the next decision comes a loop
    later, so the loop has already used that much of each budget (as a served engine's plug-in plans after
    its loop's work). The lookahead's next fresh budget does not count the next loop."""

    per_token_updates = True  # to be told each iteration's end

    def __init__(self, source: SharedTarget) -> None:
        self.source = source
        self.banked, self.per_request = source.banked, source.per_request
        self.fixed_budget_ms = None  # every budget is less the loop
        self._forwards_tokens = source.per_token_updates
        self._last_end_ms = 0.0

    def __getattr__(self, name):
        return getattr(self.source, name)  # target, started, left, next_fresh_budget_ms

    def emitted(self, running: dict, end_ms: float) -> None:
        self._last_end_ms = end_ms
        if self._forwards_tokens:
            self.source.emitted(running, end_ms)

    def budget_ms(self, now_ms: float, iteration: int, running: dict) -> float:
        return self.source.budget_ms(now_ms, iteration, running) - (now_ms - self._last_end_ms)

    def late(self, request: int, now_ms: float, iteration: int, predicted_ms: float) -> bool:
        return self.source.late(request, now_ms, iteration, predicted_ms + (now_ms - self._last_end_ms))


class TrackedDeadlines:
    """A per-token source whose every budget is checked against the core's DeadlineTracker."""

    def __init__(self, source: SharedTarget) -> None:
        if source.banked:
            raise ValueError(
                "check_deadlines compares with the per-token DeadlineTracker; use deadline_form='per-token'"
            )
        self.source = source
        self.banked = False
        self.per_token_updates = True
        self.per_request = True
        self.fixed_budget_ms = None  # every budget is checked
        self.tracker = DeadlineTracker(source.tpot_ms)
        self._own_targets = source.per_request  # its own targets (a per-request source, or one after the loop)

    def __getattr__(self, name):
        return getattr(self.source, name)  # target, late, next_fresh_budget_ms

    def budget_ms(self, now_ms: float, iteration: int, running: dict) -> float:
        budget = self.source.budget_ms(now_ms, iteration, running)
        reference = self.tracker.budget_ms(now_ms)
        # (l + D) - l is D only up to float rounding of the absolute clock
        assert reference == budget or abs(reference - budget) <= 1e-9 * max(1.0, now_ms), (
            f"iteration {iteration}: tracker budget {reference} != simulator budget {budget}"
        )
        return budget

    def started(self, request: int, end_ms: float, iteration: int, last_iter: int) -> None:
        self.source.started(request, end_ms, iteration, last_iter)
        self.tracker.add(request, end_ms, self.source.target(request) if self._own_targets else None)

    def emitted(self, running: dict, end_ms: float) -> None:
        for request in running:
            self.tracker.on_token(request, end_ms)
        if self.source.per_token_updates:  # a source after the loop keeps the iteration's end
            self.source.emitted(running, end_ms)

    def left(self, request: int) -> None:
        self.tracker.remove(request)
