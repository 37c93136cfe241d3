"""The FCFS prefill queue, and how a chunk is packed over the prompts in it.

The policy decides how many prompt tokens run this iteration; the packing says which
prompts it may draw from. ``OnePrompt`` (the paper's setting) offers the oldest prompt's
remainder; ``FcfsPrompts`` (Sarathi-Serve's rule, vLLM) offers further prompts in FCFS
order while the batch cap admits new requests and the policy could still use more. A
part-prefilled head has already been admitted; any other prompt also needs a free batch
slot and room for its KV. The chunk is then taken from the head onwards.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from sloweave.sim.requests import Requests


class PrefillQueue:
    def __init__(self, requests: Requests) -> None:
        self.requests = requests
        self.waiting: deque[int] = deque()
        self.queued_tokens = 0  # prompt tokens still to prefill in `waiting`
        # the request lists every chunk reads and writes
        self._remaining, self._total, self._progress_ms = (
            requests.remaining_prompt,
            requests.prefill_total,
            requests.progress_ms,
        )

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def __len__(self) -> int:
        return len(self.waiting)

    def append(self, request: int) -> None:
        self.waiting.append(request)
        self.queued_tokens += self.requests.remaining_prompt[request]

    def pop_head(self) -> int:
        """Remove the head before its prefill started (admission gave up on it)."""
        head = self.waiting.popleft()
        self.queued_tokens -= self.requests.remaining_prompt[head]
        return head

    def put_back(self, request: int) -> None:
        """A preempted request goes back to the front, behind a prompt whose prefill is under way."""
        self.queued_tokens += self.requests.prefill_total[request]
        waiting = self.waiting
        if waiting and self.requests.started(waiting[0]):
            waiting.insert(1, request)
        else:
            waiting.appendleft(request)

    def head_prefix_tokens(self) -> int:
        """Tokens of the head's prefill already in the KV cache (what its next chunk attends to)."""
        head = self.waiting[0]
        return self.requests.prefill_total[head] - self.requests.remaining_prompt[head]

    def offer(self, prompt_tokens: int) -> list[tuple[int, int]]:
        """The prompts ``prompt_tokens`` (what the packing offers) come from, FCFS:
        (remaining tokens, prefix already in the KV cache) each. O(prompts on offer)."""
        r, out, left = self.requests, [], prompt_tokens
        for request in self.waiting:
            if left <= 0:
                break
            remaining = r.remaining_prompt[request]
            out.append((remaining, r.prefill_total[request] - remaining))
            left -= remaining
        return out

    def take(self, chunk_tokens: int, engine) -> None:
        """Prefill ``chunk_tokens`` from the head onwards in iteration ``engine.iteration``.

        A prompt whose prefill completes leaves the queue and starts decoding
        (``engine.prefill_completed``): its next token comes out of this iteration.
        """
        # Mostly one piece: what is read once is read where it is used, not bound first.
        remaining, waiting, recorder = self._remaining, self.waiting, engine.recorder
        left = chunk_tokens
        self.queued_tokens -= chunk_tokens
        while left:
            head = waiting[0]
            head_left = remaining[head]
            if head_left == self._total[head]:
                engine.kv.reserved_kv += head_left  # its prefill starts: the prompt's KV is held
            take = left if left < head_left else head_left
            left -= take
            remaining[head] = head_left = head_left - take
            self._progress_ms[head] = engine.end_ms
            recorder.piece_iter.append(engine.iteration)
            recorder.piece_request.append(head)
            recorder.piece_tokens.append(take)
            if head_left:
                break
            waiting.popleft()
            engine.prefill_completed(head)


class OnePrompt:
    """The paper's setting: the chunk comes from the oldest waiting prompt only."""

    def __init__(self, queue: PrefillQueue) -> None:
        self.queue = queue
        # read every iteration: the queue's deque and the request lists, bound once
        r = queue.requests
        self._waiting, self._remaining, self._total = queue.waiting, r.remaining_prompt, r.prefill_total

    def prompt_tokens(self, n_running: int, free_slots: float, kv_free: float) -> int:
        """Prompt tokens the policy may take this iteration, given free batch slots and KV."""
        waiting = self._waiting
        if not waiting:
            return 0
        head = waiting[0]
        head_left = self._remaining[head]
        if head_left < self._total[head]:
            return head_left  # its prefill is under way: admitted already
        return head_left if free_slots > 0 and head_left <= kv_free else 0

    def _head(self, free_slots: float, kv_free: float) -> tuple[int, float, float]:
        """(the head's tokens on offer, slots and KV left after it)."""
        waiting = self.queue.waiting
        if not waiting:
            return 0, free_slots, kv_free
        r = self.queue.requests
        head = waiting[0]
        head_started = r.remaining_prompt[head] < r.prefill_total[head]
        free_slots -= head_started
        if head_started:
            return r.remaining_prompt[head], free_slots, kv_free
        if free_slots > 0 and r.prefill_total[head] <= kv_free:
            return r.remaining_prompt[head], free_slots - 1, kv_free - r.prefill_total[head]
        return 0, free_slots, kv_free


class FcfsPrompts(OnePrompt):
    """Sarathi-Serve's rule: after the head, further prompts in FCFS order, several per iteration."""

    def __init__(self, queue: PrefillQueue, max_prefill_tokens) -> None:
        super().__init__(queue)
        self.max_prefill_tokens = max_prefill_tokens  # policy.max_prefill_tokens(n): bounds the scan

    def prompt_tokens(self, n_running: int, free_slots: float, kv_free: float) -> int:
        tokens, free_slots, kv_free = self._head(free_slots, kv_free)
        if not tokens:
            return tokens
        r = self.queue.requests
        limit = self.max_prefill_tokens(n_running)
        for request in islice(self.queue.waiting, 1, None):
            if free_slots <= 0 or tokens >= limit or r.prefill_total[request] > kv_free:
                break
            tokens += r.remaining_prompt[request]
            free_slots -= 1
            kv_free -= r.prefill_total[request]
        return tokens
