"""A synchronous driver of transformers' continuous batching (on CPU; a GPU for profiling).

The manager's own background thread would own the clock and the loop; here the caller
does: it adds requests when they arrive, and each ``step()`` runs one iteration
(``prepare_next_batch`` -> forward -> ``update_batch``) with the chunk decided by a
callback (a number of tokens, or a plan carrying one, kept in the step's record), timed from
before scheduling to after the new tokens are out. This uses the
private ``ContinuousBatchingManager._create_batch_processor`` and ``_generation_step``
(transformers pinned to 5.20.2 in pyproject).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from sloweave.runtime.scheduler import SCHEDULER_NAME, PerStepChunkScheduler, StepShape

DEFAULT_PAGE_TOKENS = 64


@dataclass
class StepRecord:
    """One measured iteration. Times are ms on the engine clock."""

    start_ms: float
    end_ms: float
    n_decodes: int
    waiting_tokens: int
    decode_kv_tokens: int
    prefill_prefix_tokens: int
    asked_chunk_tokens: int
    ran_chunk_tokens: int
    engine_query_tokens: int  # query tokens in the tensors the model actually ran
    prefill_request: str | None
    emitted: list[str] = field(default_factory=list)  # requests that got a token at end_ms
    finished: list[str] = field(default_factory=list)
    decision: object = None  # the plan the decider returned (None when it returned a number)

    @property
    def step_ms(self) -> float:
        return self.end_ms - self.start_ms


class TransformersEngine:
    """One model, one paged KV pool, the ``sloweave`` scheduler, stepped by the caller."""

    def __init__(
        self,
        model,
        max_batch_tokens: int,
        num_blocks: int,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        threads: int | None = 1,
    ):
        if threads is not None:
            # One thread by default: on a shared 2-core machine two threads were slower and
            # far noisier (INTEGRATION-NOTES), and a cost model needs repeatable steps.
            torch.set_num_threads(threads)
        generation = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
        config = ContinuousBatchingConfig(
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            page_size=page_tokens,
            scheduler_type=SCHEDULER_NAME,
            safety_margin=0.0,
            allow_block_sharing=False,  # no prefix cache hits: every chunk costs what it says
            auto_switch_to_flash=False,
            use_async_batching=False,
            use_cuda_graph=False,
            max_blocks_per_request=0,
            max_requests_per_batch=max_batch_tokens,
        )
        self.model = model
        # A GPU runs the step's kernels asynchronously: its time ends when the device is done.
        self._synchronize = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
        self.manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        self.processor = self.manager._create_batch_processor()
        self.manager.batch_processor = self.processor
        self.scheduler: PerStepChunkScheduler = self.processor.scheduler
        if not isinstance(self.scheduler, PerStepChunkScheduler):
            raise RuntimeError(f"transformers built a {type(self.scheduler).__name__}, not the sloweave scheduler")
        self.max_batch_tokens = int(self.processor.max_batch_tokens)
        self.vocab_size = int(model.config.vocab_size)
        self._origin_s = time.perf_counter()
        self._skipped_ms = 0.0
        self.generated: dict[str, int] = {}  # finished request -> tokens it generated

    # ------------------------------------------------------------------ clock

    def now_ms(self) -> float:
        """Engine clock: wall time since creation plus idle time skipped with ``skip_to``."""
        return (time.perf_counter() - self._origin_s) * 1000.0 + self._skipped_ms

    def reset_clock(self) -> None:
        self._origin_s = time.perf_counter()
        self._skipped_ms = 0.0

    def skip_to(self, t_ms: float) -> None:
        """Jump an idle engine forward to ``t_ms`` instead of sleeping (nothing runs meanwhile)."""
        gap = t_ms - self.now_ms()
        if gap > 0:
            self._skipped_ms += gap

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"request {request_id}: max_new_tokens must be >= 1")
        if len(prompt_ids) < 1:
            raise ValueError(f"request {request_id}: empty prompt")
        added = self.manager.add_request(prompt_ids, request_id=request_id, max_new_tokens=max_new_tokens)
        if added is None:
            raise RuntimeError(f"the continuous batching manager refused request {request_id}")

    def has_work(self) -> bool:
        return self.processor.has_pending_requests() or not self.manager.input_queue.empty()

    def reset(self) -> None:
        """Drop every request and free the KV pool (between profiling points)."""
        self.processor.reset()
        self.generated.clear()

    # ------------------------------------------------------------------ stepping

    @torch.no_grad()
    def step(self, decide: Callable[[StepShape, float], object]) -> StepRecord | None:
        """Run one iteration; ``decide(shape, start_ms)`` returns the prefill chunk, or a plan
        whose ``chunk_tokens`` it is (returned in the record's ``decision``).

        Returns None when there was nothing to run.
        """
        start_ms = self.now_ms()
        self.scheduler.chunk_decider = lambda shape: decide(shape, start_ms)
        self.scheduler.last_plan = None
        if not self.processor.prepare_next_batch():
            return None
        plan = self.scheduler.last_plan
        engine_query_tokens = int(self.processor.inputs_and_outputs.total_seqlen_q)
        self.manager._generation_step()
        self.processor.update_batch()
        self._synchronize()
        end_ms = self.now_ms()

        emitted, finished = [], []
        for future in plan.scheduled:
            if future.has_new_token:
                emitted.append(future.state.request_id)
                if future.state.status == RequestStatus.FINISHED:
                    finished.append(future.state.request_id)
        queue = self.manager.output_router.output_queue
        while not queue.empty():
            output = queue.get_nowait()
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed in the engine: {output.error}")
            self.generated[output.request_id] = len(output.generated_tokens)
        shape = plan.shape
        return StepRecord(
            start_ms=start_ms,
            end_ms=end_ms,
            n_decodes=shape.n_decodes,
            waiting_tokens=shape.waiting_tokens,
            decode_kv_tokens=shape.decode_kv_tokens,
            prefill_prefix_tokens=shape.prefill_prefix_tokens,
            asked_chunk_tokens=plan.asked_chunk_tokens,
            ran_chunk_tokens=plan.ran_chunk_tokens,
            engine_query_tokens=engine_query_tokens,
            prefill_request=plan.prefill_request,
            emitted=emitted,
            finished=finished,
            decision=plan.decision,
        )


def blocks_needed(
    max_tokens_in_flight: int, max_requests_in_flight: int, page_tokens: int = DEFAULT_PAGE_TOKENS
) -> int:
    """KV blocks for a workload: its peak KV tokens plus one partly filled page per request."""
    return -(-max_tokens_in_flight // page_tokens) + max_requests_in_flight + 4
