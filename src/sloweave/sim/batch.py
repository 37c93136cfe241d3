"""The decode batch: requests whose prefill is complete and that emit one token per iteration.

Every running request emits at every iteration end, so a request that starts decoding in
iteration j with k tokens to go emits its last token in iteration j + k - 1: the batch
keeps that last iteration per request and an index from iteration to the requests that
finish in it (O(1) per request, nothing per iteration).
"""

from __future__ import annotations

from sloweave.sim.requests import NOT_STARTED, Requests


_NONE: tuple[int, ...] = ()


class DecodeBatch:
    def __init__(self, requests: Requests) -> None:
        self.requests = requests
        self.running: dict[int, int] = {}  # request -> last iteration, in the order they started decoding
        self.n = 0
        self.finished = 0  # requests that emitted all their tokens
        # iteration -> the requests whose last token comes out of it (a preempted one stays listed)
        self.finishing_at: dict[int, list[int]] = {}

    def start(self, request: int, iteration: int) -> int | None:
        """Its prefill completed in ``iteration`` (whose end emits its next token).

        Returns its last iteration, or None when that token was its last (finished at once).
        """
        r = self.requests
        if r.first_token_iter[request] == NOT_STARTED:
            r.first_token_iter[request] = iteration
        r.segment_first[request] = iteration
        last_iter = iteration + r.output[request] - r.emitted_before.get(request, 0) - 1
        if last_iter == iteration:
            self.finished += 1
            r.finish_iter[request] = iteration
            return None
        self.finishing_at.setdefault(last_iter, []).append(request)
        self.running[request] = last_iter
        self.n += 1
        return last_iter

    def finish_due(self, iteration: int) -> list[int] | tuple[int, ...]:
        """Remove and return the requests whose last token comes out of ``iteration``."""
        due = self.finishing_at.pop(iteration, None)
        if not due:
            return _NONE
        running, finish_iter, done = self.running, self.requests.finish_iter, []
        for request in due:
            if running.get(request) == iteration:  # else preempted since: it finishes later
                del running[request]
                finish_iter[request] = iteration
                done.append(request)
        self.n -= len(done)
        self.finished += len(done)
        return done

    def preempt_newest(self, iteration: int) -> tuple[int, int]:
        """Take the newest running request out (to be recomputed); returns it and the KV it held."""
        r = self.requests
        victim = next(reversed(self.running))
        del self.running[victim]
        self.n -= 1
        ran = iteration - r.segment_first[victim]
        held = r.prefill_total[victim] + ran
        emitted = r.emitted_before.get(victim, 0) + ran
        r.emitted_before[victim] = emitted
        r.closed_segments.setdefault(victim, []).append((r.segment_first[victim], iteration - 1))
        r.segment_first[victim] = NOT_STARTED
        r.prefill_total[victim] = r.remaining_prompt[victim] = r.prompt[victim] + emitted
        return victim, held
