"""A transformers continuous-batching scheduler whose prefill chunk is decided per step.

``PerStepChunkScheduler`` schedules every decoding request (one token each) plus one chunk of
the oldest unfinished prompt, the paper's iteration shape. The chunk size comes from a
callback (``chunk_decider``) that the driver installs: it receives the step's shape
(``StepShape``) and returns how many prompt tokens to run, or a plan that says it
(``chunk_tokens``: the core's ``StepPlan``, kept with the step as ``ScheduledStep.decision``). The scheduler then hands the
base class exactly ``n_decodes + chunk`` tokens of budget, so its splitting code cuts the
prompt at that chunk, and it records what it asked for and what was scheduled.

Built against transformers 5.20.2 (pinned in pyproject): it uses the private helpers
``Scheduler._process_candidates``, ``_get_waiting_candidates`` and ``_cleanup_waiting_queue``.
Importing this module registers the class as ``scheduler_type="sloweave"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, Scheduler

SCHEDULER_NAME = "sloweave"


@dataclass(frozen=True)
class StepShape:
    """What the decider sees before a step: the inputs of the policy plus the KV context."""

    n_decodes: int
    waiting_tokens: int  # remaining prompt of the oldest unfinished prefill (0 if none)
    decode_kv_tokens: int  # KV tokens the decodes read: sum of (context + 1)
    prefill_prefix_tokens: int  # tokens of that prompt already in the KV cache
    token_capacity: int  # the engine's static max_batch_tokens
    prompt_id: str | None = None  # that prompt's request (None: no prompt waits)
    decoding_ids: tuple[str, ...] = ()  # the decoding requests


@dataclass(frozen=True)
class ScheduledStep:
    """What the scheduler did for one step."""

    shape: StepShape
    asked_chunk_tokens: int
    ran_chunk_tokens: int
    ran_decodes: int
    prefill_request: str | None
    scheduled: list  # transformers FutureRequestState objects of the step
    decision: object = None  # what the decider returned, when it was a plan rather than a number


class KVCacheFullError(RuntimeError):
    """A running request could not get a KV block: the pool is too small for the workload."""


class PerStepChunkScheduler(Scheduler):
    """All decodes first, then one prefill chunk of the size ``chunk_decider`` returns."""

    def __init__(self, cache, safety_margin: float | None, max_requests_per_batch: int):
        # No free-block safety margin: admission is the driver's business, and a margin
        # would silently drop the chunk the policy asked for.
        super().__init__(cache, 0.0 if safety_margin is None else safety_margin, max_requests_per_batch)
        self.chunk_decider: Callable[[StepShape], object] | None = None
        self.last_plan: ScheduledStep | None = None

    def _oldest_prompt(self):
        prefilling = [s for s in self.active_requests.values() if s.status == RequestStatus.PREFILLING]
        if len(prefilling) > 1:
            raise RuntimeError(
                f"{len(prefilling)} prompts are half-prefilled; this scheduler runs one prefill at a time"
            )
        if prefilling:
            return prefilling[0]
        if self.block_new_requests or not self.waiting_requests_order:
            return None
        return self._get_waiting_candidates()[0]

    def schedule_batch(self, token_budget: int, cache_budget: int):
        decoding = [s for s in self.active_requests.values() if s.status == RequestStatus.DECODING]
        head = self._oldest_prompt()
        shape = StepShape(
            n_decodes=len(decoding),
            waiting_tokens=len(head.remaining_prefill_tokens) if head is not None else 0,
            decode_kv_tokens=sum(s.current_len() + 1 for s in decoding),
            prefill_prefix_tokens=head.position_offset if head is not None else 0,
            token_capacity=token_budget,
            prompt_id=head.request_id if head is not None else None,
            decoding_ids=tuple(s.request_id for s in decoding),
        )
        decision = None
        if self.chunk_decider is None:
            chunk = min(shape.waiting_tokens, token_budget - shape.n_decodes)
        else:
            decision = self.chunk_decider(shape)
            # a number of tokens, or a plan that carries one
            chunk = int(getattr(decision, "chunk_tokens", decision))
        if not 0 <= chunk <= shape.waiting_tokens:
            raise ValueError(f"chunk_decider returned {chunk} with {shape.waiting_tokens} prompt tokens waiting")
        if shape.n_decodes + chunk > token_budget:
            raise ValueError(
                f"{shape.n_decodes} decodes + a {chunk}-token chunk exceed the engine's max_batch_tokens={token_budget}"
            )

        candidates = decoding + ([head] if chunk > 0 else [])
        removed_from_waiting: set[str] = set()
        scheduled, allocation_failed, decode_fast_path, num_q_tokens, max_kv_read = self._process_candidates(
            candidates, shape.n_decodes + chunk, cache_budget, removed_from_waiting
        )
        self._cleanup_waiting_queue(removed_from_waiting)

        ran_chunk = sum(f.query_length for f in scheduled if head is not None and f.state is head)
        ran_decodes = sum(1 for f in scheduled if f.state is not head)
        if ran_decodes < shape.n_decodes:
            raise KVCacheFullError(
                f"only {ran_decodes} of {shape.n_decodes} decoding requests got KV cache blocks; "
                "raise num_blocks (the KV pool is too small for this workload)"
            )
        prefill_request = head.request_id if chunk else None
        self.last_plan = ScheduledStep(shape, chunk, ran_chunk, ran_decodes, prefill_request, scheduled, decision)
        if not scheduled and allocation_failed:
            return None, decode_fast_path, 0, 0
        return scheduled, decode_fast_path, num_q_tokens, max_kv_read


SCHEDULER_MAPPING[SCHEDULER_NAME] = PerStepChunkScheduler
