"""Drive a real vLLM V1 scheduler offline on CPU, without a model: tests and benchmarks.

vLLM's scheduler only needs configs and a KV cache layout to run. Steps are played by
hand: ``schedule()``, a ``ModelRunnerOutput`` with one sampled token per request that
finished computing, a simulated step time on a controllable clock, then
``update_from_output()``. Nothing is downloaded: the model config is a local
``config.json`` (a tiny Llama shipped with the package) and no tokenizer is loaded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
SAMPLED_TOKEN = 7  # any id: nothing is decoded into text


def tiny_model_dir() -> Path:
    return Path(str(resources.files("sloweave.vllm_plugin").joinpath("models/tiny-llama")))


def offline_vllm_config(
    *,
    async_scheduling: bool,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    additional_config: dict | None,
    model_dir: Path | None,
    prefix_caching: bool,
    data_parallel: tuple[int, int],
    kv_transfer_config,
) -> VllmConfig:
    """vLLM's configuration of an engine on CPU with chunked prefill, for the tiny model (or ``model_dir``)."""
    model_config = ModelConfig(
        model=str(model_dir or tiny_model_dir()),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=prefix_caching
    )
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(data_parallel_rank=data_parallel[0], data_parallel_size=data_parallel[1]),
        additional_config=additional_config or {},
        kv_transfer_config=kv_transfer_config,
    )


def offline_kv_cache(num_blocks: int) -> KVCacheConfig:
    """A KV cache layout of ``num_blocks`` blocks and no tensors: the scheduler only counts blocks."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
            )
        ],
    )


def build_scheduler(
    scheduler_cls: type,
    max_num_batched_tokens: int = 4096,
    max_num_seqs: int = 128,
    max_model_len: int = 16384,
    num_blocks: int = 40_000,
    additional_config: dict | None = None,
    model_dir: Path | None = None,
    prefix_caching: bool = False,
    data_parallel: tuple[int, int] = (0, 1),
    kv_transfer_config=None,
):
    """A real scheduler of class ``scheduler_cls`` (vLLM's or ours), on CPU, offline.

    ``data_parallel`` = (rank, size): the replica this scheduler is, as vLLM's data
    parallelism runs one scheduler per replica.

    Prefix caching is off unless asked for: the harness's prompts repeat one token, so
    cached blocks would hide the prefill work the tests count. With it on (vLLM's
    default), requests need ``block_hasher()`` (vLLM 0.32 fails on requests without one).
    """
    vllm_config = offline_vllm_config(
        async_scheduling=issubclass(scheduler_cls, AsyncScheduler),
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        additional_config=additional_config,
        model_dir=model_dir,
        prefix_caching=prefix_caching,
        data_parallel=data_parallel,
        kv_transfer_config=kv_transfer_config,
    )
    register_all_kvcache_specs(vllm_config)
    kv_cache_config = offline_kv_cache(num_blocks)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )


_ids = itertools.count()


def block_hasher():
    """The prefix-caching block hasher vLLM's engine core gives every request (same algorithm)."""
    hash_fn = get_hash_fn_by_name(CacheConfig().prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn)


def make_request(
    prompt_tokens: int,
    output_tokens: int,
    tpot_ms: float | None = None,
    request_id: str | None = None,
    prompt_token_ids: list[int] | None = None,
    hasher=None,
    extra_args: dict | None = None,
    stop_on_sampled_token: bool = False,
) -> Request:
    """A request of ``prompt_tokens`` (one repeated token unless ``prompt_token_ids``);
    ``stop_on_sampled_token``: it stops at its first token, as on a stop token, which no
    scheduler can see coming (``output_tokens`` is then only its limit)."""
    extra = dict(extra_args or {})
    if tpot_ms is not None:
        extra["sloweave_tpot_ms"] = tpot_ms
    params = SamplingParams(
        max_tokens=output_tokens,
        ignore_eos=True,
        stop_token_ids=[SAMPLED_TOKEN] if stop_on_sampled_token else None,
        extra_args=extra or None,
    )
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=prompt_token_ids if prompt_token_ids is not None else [SAMPLED_TOKEN] * prompt_tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=hasher,
    )


def decoding_request_ids(scheduler) -> set[str]:
    """The running requests past their prompt, taken before ``schedule()``: what it gives them is decode."""
    return {
        r.request_id
        for r in scheduler.running
        if r.num_output_tokens > 0 or r.num_computed_tokens >= r.num_prompt_tokens
    }


def split_step_tokens(output, decoding: set[str]) -> tuple[int, int]:
    """(decode, prefill) tokens of a scheduled step, ``decoding`` from ``decoding_request_ids``."""
    decode = sum(n for request_id, n in output.num_scheduled_tokens.items() if request_id in decoding)
    return decode, output.total_num_scheduled_tokens - decode


@dataclass
class ManualClock:
    """The plug-in's clock under test control (milliseconds)."""

    now_ms: float = 0.0

    def __call__(self) -> float:
        return self.now_ms


@dataclass
class OfflineStep:
    start_ms: float
    end_ms: float
    num_scheduled_tokens: dict[str, int]
    token_budget: int | None  # the plug-in's budget (None for vLLM's own scheduler)
    prefill_tokens: int
    decode_tokens: int


@dataclass
class _InFlight:
    output: object
    runner_output: ModelRunnerOutput
    record: OfflineStep


@dataclass
class OfflineEngine:
    """Plays steps of a scheduler against a step-time function on a manual clock.

    ``overlap=False``: schedule, run, process the output, repeat (vLLM's synchronous
    loop). ``overlap=True``: step N+1 is scheduled while step N runs and starts when it
    ends, and step N's output is processed after that (vLLM's async scheduling).
    ``in_flight`` (with ``overlap``) is how many scheduled steps may wait for their output:
    1 for async scheduling, the number of stages for pipeline parallelism (vLLM's batch
    queue holds that many batches, each scheduled before the oldest one's output is back).
    """

    scheduler: object
    step_ms: Callable[[int, int], float]  # (decode tokens, prefill tokens) -> ms
    clock: ManualClock = field(default_factory=ManualClock)
    overlap: bool = False
    in_flight: int = 1
    deepest_queue: int = 0  # the most steps that were waiting for their output at once
    steps: list[OfflineStep] = field(default_factory=list)
    token_times_ms: dict[str, list[float]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    _in_flight: list[_InFlight] = field(default_factory=list)

    def __post_init__(self) -> None:
        if hasattr(self.scheduler, "sloweave_clock_ms"):
            self.scheduler.sloweave_clock_ms = self.clock

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def _schedule(self) -> _InFlight | None:
        scheduler = self.scheduler
        was_decoding = decoding_request_ids(scheduler)
        output = scheduler.schedule()
        if not output.total_num_scheduled_tokens:
            return None
        decode_tokens, prefill_tokens = split_step_tokens(output, was_decoding)
        # A step starts when the one in flight ends.
        start = self._in_flight[-1].record.end_ms if self._in_flight else self.clock.now_ms
        end = start + self.step_ms(decode_tokens, prefill_tokens)
        req_ids = list(output.num_scheduled_tokens)
        # vLLM advanced num_computed_tokens in schedule(): a request not left mid-prompt samples.
        sampled = [[] if scheduler.requests[rid].is_prefill_chunk else [SAMPLED_TOKEN] for rid in req_ids]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        plan = getattr(scheduler, "last_plan", None)
        record = OfflineStep(
            start,
            end,
            dict(output.num_scheduled_tokens),
            plan.token_budget if plan else None,
            prefill_tokens,
            decode_tokens,
        )
        self.steps.append(record)
        return _InFlight(output, runner_output, record)

    def _finish(self, step: _InFlight) -> None:
        self.clock.now_ms = max(self.clock.now_ms, step.record.end_ms)
        engine_outputs = self.scheduler.update_from_output(step.output, step.runner_output)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                if out.new_token_ids:
                    self.token_times_ms.setdefault(out.request_id, []).extend(
                        [self.clock.now_ms] * len(out.new_token_ids)
                    )
                if out.finish_reason is not None:
                    self.finished.add(out.request_id)

    def step(self) -> OfflineStep | None:
        """Schedule one step; returns its record (None when nothing could be scheduled)."""
        scheduled = self._schedule()
        if scheduled is not None:
            self._in_flight.append(scheduled)
            self.deepest_queue = max(self.deepest_queue, len(self._in_flight))
        # Synchronous: finish it now. Overlapped: keep up to ``in_flight`` steps, finish the oldest.
        while self._in_flight and (not self.overlap or len(self._in_flight) > self.in_flight or scheduled is None):
            self._finish(self._in_flight.pop(0))
        return None if scheduled is None else scheduled.record

    def advance_to(self, now_ms: float) -> None:
        """Let time pass with no step running (e.g. until the next arrival)."""
        while self._in_flight:
            self._finish(self._in_flight.pop(0))
        self.clock.now_ms = max(self.clock.now_ms, now_ms)

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self._in_flight:
                return
            self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")
