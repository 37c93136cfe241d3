"""Arrivals and admission: which arrived requests join the prefill queue.

``Arrivals`` moves every request that arrived by an iteration's start into the queue,
unless the KV memory could never hold it or the admission gate refuses it. Gates:
``AdmitAll`` (the default) and ``AdmissionGate`` (the core's ``AdmissionControl``: reject,
or defer to a best-effort lane served only when nothing else waits and decodes have
room). Every refused request keeps its reason; a deferred one is still served later.
"""

from __future__ import annotations

import math
from collections import deque

from sloweave.core.admission import EXCEEDS_KV_CAPACITY, TTFT_EXPIRED, AdmissionControl


class AdmitAll:
    acts_each_iteration = False  # before_iteration does nothing
    refuses = False  # refusal always says ""

    def refusal(self, engine, request: int) -> str:
        return ""

    def refuse(self, engine, request: int, reason: str) -> None:
        engine.requests.rejected_reason[request] = reason
        engine.arrivals.rejected += 1

    def before_iteration(self, engine) -> None:
        pass


class AdmissionGate(AdmitAll):
    acts_each_iteration = True
    refuses = True

    def __init__(self, control: AdmissionControl, policy, predicted_ms, ttft_of: list[float] | None) -> None:
        self.control = control
        self.policy = policy
        self.predicted_ms = predicted_ms
        self.ttft_of = ttft_of
        self.deferred: deque[int] = deque()  # the best-effort lane of "defer"

    def refusal(self, engine, request: int) -> str:
        r = engine.requests
        ttft = None if self.ttft_of is None else self.ttft_of[request]
        return self.control.refusal(
            self.policy,
            self.predicted_ms,
            engine.batch.n + len(engine.queue),
            engine.queue.queued_tokens,
            r.prompt[request],
            engine.now_ms - r.arrival_ms[request],
            engine.deadlines.target(request),
            ttft,
        )

    def refuse(self, engine, request: int, reason: str) -> None:
        if self.control.action == "defer" and reason != EXCEEDS_KV_CAPACITY:
            engine.requests.deferred_reason[request] = reason
            self.deferred.append(request)
        else:
            super().refuse(engine, request, reason)

    def before_iteration(self, engine) -> None:
        # A queued prompt past its TTFT target can no longer meet its SLO; serving it first
        # would only make later ones late too (checked at the head: O(1) looks per request).
        r, queue, waiting = engine.requests, engine.queue, engine.queue.waiting
        while self.ttft_of is not None and waiting:
            head = waiting[0]
            best_effort = r.deferred_reason[head] != ""  # came from the deferred lane: served anyway
            if (
                r.started(head)
                or best_effort
                or not self.control.expired(engine.now_ms - r.arrival_ms[head], self.ttft_of[head])
            ):
                break
            self.refuse(engine, queue.pop_head(), TTFT_EXPIRED)
        # The best-effort lane runs only when nothing else waits and decodes have room.
        n = engine.batch.n
        if (
            self.deferred
            and not waiting
            and (
                n == 0
                or self.control.decode_room(self.predicted_ms(n + 1, 0), engine.deadlines.target(self.deferred[0]))
            )
        ):
            queue.append(self.deferred.popleft())


class Arrivals:
    def __init__(self, arrival_ms: list[float], gate: AdmitAll) -> None:
        self.arrival_ms = arrival_ms
        self.gate = gate
        self.next = 0  # the first request that has not arrived yet
        self.next_ms = arrival_ms[0] if arrival_ms else math.inf  # when it arrives
        self.rejected = 0

    def admit(self, engine) -> None:
        """Queue (or refuse) every request that arrived by ``engine.now_ms``."""
        arrival_ms, now_ms, gate = self.arrival_ms, engine.now_ms, self.gate
        request, end = self.next, len(arrival_ms)
        if request < end and arrival_ms[request] <= now_ms:
            if engine.memory.limited or gate.refuses:
                request = self._admit_checked(engine, request, now_ms)
            else:  # nothing to check: ``queue.append`` inlined, a call less per arriving request
                queue, remaining, queued_tokens = engine.queue, engine.requests.remaining_prompt, 0
                waiting = queue.waiting
                while request < end and arrival_ms[request] <= now_ms:
                    waiting.append(request)
                    queued_tokens += remaining[request]
                    request += 1
                queue.queued_tokens += queued_tokens
            self.next = request
            self.next_ms = arrival_ms[request] if request < end else math.inf
        if gate.acts_each_iteration:
            gate.before_iteration(engine)

    def _admit_checked(self, engine, request: int, now_ms: float) -> int:
        """Queue or refuse, one at a time, the requests from ``request`` on that arrived by
        ``now_ms`` (a refusal reads the queue as it is); returns the first that has not arrived."""
        arrival_ms, end, gate = self.arrival_ms, len(self.arrival_ms), self.gate
        memory, queue, r = engine.memory, engine.queue, engine.requests
        while request < end and arrival_ms[request] <= now_ms:
            reason = memory.refusal(r.prompt[request], r.output[request]) or gate.refusal(engine, request)
            if reason:
                gate.refuse(engine, request, reason)
            else:
                queue.append(request)
            request += 1
        return request

    def next_arrival_ms(self) -> float | None:
        return self.arrival_ms[self.next] if self.next < len(self.arrival_ms) else None
