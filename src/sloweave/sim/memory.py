"""KV memory: the running total every context-aware cost reads, and an optional capacity.

``KVLedger`` counts the KV tokens the decodes read next iteration (+1 per running request
per iteration, + the prompt when a prefill completes, - the context when a request
finishes) and the KV held by prompts whose prefill started but did not complete.

``KVCapacity`` is a KV cache of that many tokens: a prompt starts only when its KV fits,
and when the running requests' growth overflows it the newest running request is
preempted and recomputed later (prompt + tokens so far), as vLLM does. ``UnlimitedKV``
(the default) never refuses or preempts.
"""

from __future__ import annotations

import math

from sloweave.core.admission import EXCEEDS_KV_CAPACITY


class KVLedger:
    """The two counters. Their owners add and subtract in place, without a method around it
    (a call per prefill start, completion and finish otherwise): the queue reserves a prompt's
    KV when its prefill starts, the engine moves it to ``decode_kv`` when the prefill completes
    (prompt + the token just emitted) and releases a request's context when it finishes, and
    the memory releases a preempted request's."""

    def __init__(self) -> None:
        self.decode_kv = 0  # KV tokens the running decodes read in the next iteration
        self.reserved_kv = 0  # KV held by prompts whose prefill started but did not complete


class UnlimitedKV:
    limited = False
    preemptions = 0
    recompute_tokens = 0

    def refusal(self, prompt_tokens: int, output_tokens: int) -> str:
        return ""

    def free_tokens(self, ledger: KVLedger, n_running: int) -> float:
        return math.inf

    def make_room(self, engine) -> None:
        pass


class KVCapacity(UnlimitedKV):
    limited = True

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.preemptions = 0
        self.recompute_tokens = 0  # prompt + generated tokens prefilled again after preemptions

    def refusal(self, prompt_tokens: int, output_tokens: int) -> str:
        """A request that could never fit, even alone."""
        return EXCEEDS_KV_CAPACITY if prompt_tokens + output_tokens > self.capacity_tokens else ""

    def free_tokens(self, ledger: KVLedger, n_running: int) -> float:
        """Room for a new prompt's KV after this iteration's decodes write theirs."""
        return self.capacity_tokens - ledger.decode_kv - ledger.reserved_kv - n_running - 1

    def make_room(self, engine) -> None:
        """Preempt the newest running request until this iteration's decodes fit."""
        ledger, batch, requests = engine.kv, engine.batch, engine.requests
        while ledger.decode_kv + ledger.reserved_kv > self.capacity_tokens and batch.n:
            victim, held = batch.preempt_newest(engine.iteration)
            ledger.decode_kv -= held
            self.recompute_tokens += requests.prefill_total[victim]
            self.preemptions += 1
            requests.progress_ms[victim] = engine.now_ms
            engine.queue.put_back(victim)
            engine.deadlines.left(victim)
