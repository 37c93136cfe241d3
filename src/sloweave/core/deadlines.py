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
from collections.abc import Callable, Hashable, Sequence

from sloweave.core.validate import positive_ms


class DeadlineTracker:
    """Earliest next-token deadline over the active requests, times in milliseconds.

    An engine step emits one token for every running request at once, so tokens come in
    batches that share a time: ``emit`` takes a whole batch and pushes one heap entry per
    distinct target among it, not one per request. That is what keeps a step with hundreds
    of decodes cheap (the vLLM plug-in records every step's tokens here).
    """

    def __init__(self, default_tpot_ms: float) -> None:
        positive_ms(default_tpot_ms, "default_tpot_ms")
        self.default_tpot_ms = float(default_tpot_ms)
        # request id -> (deadline_ms, version of the batch that set it)
        self._current: dict[Hashable, tuple[float, int]] = {}
        self._targets: dict[Hashable, float] = {}
        # [deadline_ms, version, ids, first id not known dead]: one entry per batch and target;
        # an entry lives while one of its ids still has that version (lazy deletion)
        self._heap: list[list] = []
        self._version = 0

    def __len__(self) -> int:
        return len(self._current)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._current

    def add(self, request_id: Hashable, last_token_ms: float, tpot_ms: float | None = None) -> None:
        """Start tracking a request whose prefill completed (first token) at ``last_token_ms``."""
        if request_id in self._current:
            raise ValueError(f"request {request_id!r} is already tracked")
        _check_time(last_token_ms, "last_token_ms", request_id)
        self.emit((request_id,), last_token_ms, lambda _: tpot_ms)

    def on_token(self, request_id: Hashable, emitted_ms: float) -> None:
        """Record that ``request_id`` emitted a token at ``emitted_ms``."""
        if request_id not in self._current:
            raise KeyError(f"request {request_id!r} is not tracked")
        self.emit((request_id,), emitted_ms)

    def emit(
        self,
        request_ids: Sequence[Hashable],
        emitted_ms: float,
        tpot_ms_of: Callable[[Hashable], float | None] | None = None,
    ) -> None:
        """Record that every one of ``request_ids`` emitted a token at ``emitted_ms``.

        A request not tracked yet starts being tracked (this is its first token), with the
        target ``tpot_ms_of`` gives it (None: the default). Targets are checked before any
        deadline changes, so a bad one leaves the tracker as it was.
        """
        # a NaN time would sit in the heap comparing False with everything: the earliest
        # deadline would then depend on the order requests were added
        _check_time(emitted_ms, "emitted_ms", request_ids[0] if len(request_ids) == 1 else None)
        targets = self._targets
        new = [rid for rid in request_ids if rid not in targets]
        if new:
            self._start(new, tpot_ms_of)
        self._version += 1
        version = self._version
        current = self._current
        by_deadline: dict[float, list[Hashable]] = {}
        for request_id in request_ids:
            deadline_ms = emitted_ms + targets[request_id]
            current[request_id] = (deadline_ms, version)
            ids = by_deadline.get(deadline_ms)
            if ids is None:
                by_deadline[deadline_ms] = [request_id]
            else:
                ids.append(request_id)
        for deadline_ms, ids in by_deadline.items():
            heapq.heappush(self._heap, [deadline_ms, version, ids, 0])
        # Lazy deletion lets stale entries pile up when few requests emit many tokens;
        # rebuild once they outnumber live ones, which keeps the heap O(|A|).
        if len(self._heap) > 4 * len(current) + 64:
            self._rebuild()

    def _start(self, request_ids: list[Hashable], tpot_ms_of) -> None:
        targets = {}
        for request_id in request_ids:
            tpot_ms = tpot_ms_of(request_id) if tpot_ms_of is not None else None
            target = self.default_tpot_ms if tpot_ms is None else tpot_ms
            targets[request_id] = positive_ms(target, f"tpot_ms of request {request_id!r}")
        self._targets.update(targets)

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
        heap, current = self._heap, self._current
        while heap:
            entry = heap[0]
            _, version, ids, first = entry
            for position in range(first, len(ids)):
                if current.get(ids[position], _GONE)[1] == version:
                    entry[3] = position  # the ids before it are dead for good (versions only grow)
                    return entry[0]
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

    def _rebuild(self) -> None:
        entries: dict[tuple[float, int], list[Hashable]] = {}
        for request_id, key in self._current.items():
            entries.setdefault(key, []).append(request_id)
        self._heap = [[deadline, version, ids, 0] for (deadline, version), ids in entries.items()]
        heapq.heapify(self._heap)


_GONE = (math.nan, -1)


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
