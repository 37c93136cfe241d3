"""Arrivals and admission: which arrived requests join the prefill queue.

``Arrivals`` moves every request that arrived by an iteration's start into the queue,
unless the KV memory could never hold it or the admission gate refuses it. Gates:
``AdmitAll`` (the default) and ``AdmissionGate`` (the core's ``AdmissionControl``: reject,
or defer to a best-effort lane served only when nothing else waits and decodes have
room). Every refused request keeps its reason; a deferred one is still served later.
"""

from __future__ import annotations

from collections import deque

from sloweave.core.admission import EXCEEDS_KV_CAPACITY, TTFT_EXPIRED, AdmissionControl


class AdmitAll:
    acts_each_iteration = False  # before_iteration does nothing

    def refusal(self, engine, request: int) -> str:
        return ""

    def refuse(self, engine, request: int, reason: str) -> None:
        engine.requests.rejected_reason[request] = reason
        engine.arrivals.rejected += 1

    def before_iteration(self, engine) -> None:
        pass


class AdmissionGate(AdmitAll):
    acts_each_iteration = True

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
        self.rejected = 0

    def admit(self, engine) -> None:
        """Queue (or refuse) every request that arrived by ``engine.now_ms``."""
        if self.next < len(self.arrival_ms) and self.arrival_ms[self.next] <= engine.now_ms:
            self._admit_arrived(engine)
        if self.gate.acts_each_iteration:
            self.gate.before_iteration(engine)

    def _admit_arrived(self, engine) -> None:
        arrival_ms, now_ms, gate, memory = self.arrival_ms, engine.now_ms, self.gate, engine.memory
        r = engine.requests
        while self.next < len(arrival_ms) and arrival_ms[self.next] <= now_ms:
            request = self.next
            self.next += 1
            reason = memory.refusal(r.prompt[request], r.output[request]) or gate.refusal(engine, request)
            if reason:
                gate.refuse(engine, request, reason)
            else:
                engine.queue.append(request)

    def next_arrival_ms(self) -> float | None:
        return self.arrival_ms[self.next] if self.next < len(self.arrival_ms) else None
