"""Next-token deadlines of the running (decoding) requests.

Request i has a last-token time l_i (its prefill completion time right after prefill)
and a TPOT target D_i, so its next token is due at d_i = l_i + D_i. The policy only
needs the earliest of them, so deadlines live in a min-heap with lazy deletion: an
update pushes a new entry and leaves the old one to be discarded when it surfaces.
Each update costs O(log |A|); the earliest deadline is amortised O(log |A|).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable

from sloweave.core.validate import positive_ms


class DeadlineTracker:
    """Earliest next-token deadline over the active requests, times in milliseconds."""

    def __init__(self, default_tpot_ms: float) -> None:
        positive_ms(default_tpot_ms, "default_tpot_ms")
        self.default_tpot_ms = float(default_tpot_ms)
        # request id -> (deadline_ms, version); the heap holds (deadline_ms, version, id).
        self._current: dict[Hashable, tuple[float, int]] = {}
        self._targets: dict[Hashable, float] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._version = 0

    def __len__(self) -> int:
        return len(self._current)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._current

    def add(self, request_id: Hashable, last_token_ms: float, tpot_ms: float | None = None) -> None:
        """Start tracking a request whose prefill completed (first token) at ``last_token_ms``."""
        if request_id in self._current:
            raise ValueError(f"request {request_id!r} is already tracked")
        target = self.default_tpot_ms if tpot_ms is None else tpot_ms
        target = positive_ms(target, f"tpot_ms of request {request_id!r}")
        # a NaN time would sit in the heap comparing False with everything: the earliest
        # deadline would then depend on the order requests were added
        _check_time(last_token_ms, "last_token_ms", request_id)
        self._targets[request_id] = target
        self._push(request_id, last_token_ms + target)

    def on_token(self, request_id: Hashable, emitted_ms: float) -> None:
        """Record that ``request_id`` emitted a token at ``emitted_ms``."""
        if request_id not in self._current:
            raise KeyError(f"request {request_id!r} is not tracked")
        try:  # inlined _check_time: this runs for every token
            finite = -math.inf < emitted_ms < math.inf
        except TypeError:
            finite = False
        if not finite:
            _check_time(emitted_ms, "emitted_ms", request_id)
        self._push(request_id, emitted_ms + self._targets[request_id])

    def remove(self, request_id: Hashable) -> None:
        """Stop tracking a finished (or preempted) request; its heap entry dies lazily."""
        self._current.pop(request_id, None)
        self._targets.pop(request_id, None)
        if not self._current:
            self._heap.clear()

    def deadline_of(self, request_id: Hashable) -> float:
        return self._current[request_id][0]

    def earliest_deadline_ms(self) -> float:
        """min_i d_i over tracked requests, or +inf when nothing is decoding."""
        heap = self._heap
        while heap:
            deadline, version, request_id = heap[0]
            if self._current.get(request_id, (None, -1))[1] == version:
                return deadline
            heapq.heappop(heap)
        return math.inf

    def budget_ms(self, now_ms: float) -> float:
        """B_t = max(0, min_i d_i - s_t); +inf when there is no active request.

        Rounded to the nanosecond: (l + D) - l differs from D in the last bits of a float,
        which would make a chunk whose cost ties the budget flip by a token.
        """
        try:  # inlined _check_time: this runs every iteration
            finite = -math.inf < now_ms < math.inf
        except TypeError:
            finite = False
        if not finite:
            _check_time(now_ms, "now_ms")
        return budget_until(self.earliest_deadline_ms(), now_ms)

    def _push(self, request_id: Hashable, deadline_ms: float) -> None:
        self._version += 1
        self._current[request_id] = (deadline_ms, self._version)
        heapq.heappush(self._heap, (deadline_ms, self._version, request_id))
        # Lazy deletion lets stale entries pile up when few requests emit many tokens;
        # rebuild once they outnumber live ones, which keeps the heap O(|A|).
        if len(self._heap) > 4 * len(self._current) + 64:
            self._heap = [(d, v, r) for r, (d, v) in self._current.items()]
            heapq.heapify(self._heap)


def _check_time(value: float, name: str, request_id: Hashable = None) -> None:
    # the hot path (every token): one comparison, the message only when it fails
    try:
        if -math.inf < value < math.inf:
            return
    except TypeError:
        pass
    of = "" if request_id is None else f" of request {request_id!r}"
    raise ValueError(f"{name}{of} must be a finite time in milliseconds, got {value!r}")


def budget_until(deadline_ms: float, now_ms: float) -> float:
    """The time budget from ``now_ms`` to a deadline: max(0, d - s), rounded to the nanosecond."""
    return max(0.0, round(deadline_ms - now_ms, 6))
