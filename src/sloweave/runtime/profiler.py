"""Measure step times of the real engine over a grid of (decodes, chunk, KV context).

For each nominal per-decode context L and each decode count n (ascending), the profiler
brings the engine to n running requests of about L tokens each (prefilling the new ones,
unmeasured), then times steps of those n decodes plus a fresh prompt of exactly c tokens
(``max_new_tokens=1``, so it finishes in that step and leaves the cache), for every c of
the grid, ``repeats`` times in shuffled order (so slow drift does not line up with c).
Held-out steps (``split=holdout``) are measured at the same states with off-grid chunks and
non-zero prefixes (a chunk of a partly prefilled prompt), to score the fit where it
interpolates. Every row records the real context the step read, not only the nominal one.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
from tqdm import tqdm

from sloweave.runtime.engine import StepRecord, TransformersEngine, blocks_needed
from sloweave.runtime.runner import synthetic_prompt

DEFAULT_DECODES = (0, 1, 4, 8, 16, 32)
DEFAULT_CHUNKS = (0, 16, 64, 128, 256, 512, 1024)
DEFAULT_CONTEXTS = (64, 256, 1024)
WARMUP_STEPS = 5


def profile_blocks(decodes, chunks, contexts, repeats: int, page_tokens: int) -> int:
    """KV blocks the grid needs at its largest point (contexts grow a little while measuring)."""
    steps_per_state = repeats * (len(chunks) + 4) + 4
    peak = max(decodes) * (max(contexts) + steps_per_state * len(decodes)) + 2 * max(chunks)
    return blocks_needed(peak, max(decodes) + 2, page_tokens)


class _ProfileSession:
    """One profiling run: the engine, the seeded prompts, and the rows measured so far."""

    def __init__(self, engine: TransformersEngine, seed: int) -> None:
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.rows: list[dict] = []
        self._request_ids = itertools.count()

    def add_prompt(self, prompt_tokens: int, max_new_tokens: int) -> None:
        prompt = synthetic_prompt(self.rng, prompt_tokens, self.engine.vocab_size)
        self.engine.add(f"p{next(self._request_ids)}", prompt, max_new_tokens)

    def run_step(self, chunk_tokens: int) -> StepRecord:
        """One step with a chunk of ``chunk_tokens`` (fewer if less waits or fits)."""
        record = self.engine.step(
            lambda shape, start_ms: min(chunk_tokens, shape.waiting_tokens, shape.token_capacity - shape.n_decodes)
        )
        if record is None or record.ran_chunk_tokens != record.asked_chunk_tokens:
            raise RuntimeError(f"profiling step did not run the requested chunk {chunk_tokens}: {record}")
        return record

    def warm_up(self, chunk_tokens: int) -> None:
        """Unrecorded steps first: the first steps pay for allocations and lazy initialisation."""
        self.engine.reset()
        for _ in range(WARMUP_STEPS):
            self.add_prompt(chunk_tokens, 1)
            self.run_step(chunk_tokens)

    def grow_decodes(self, running: int, n_decodes: int, context_tokens: int) -> int:
        """Add requests of ``context_tokens`` prompt tokens, prefilled unmeasured, until
        ``n_decodes`` are decoding; returns how many are."""
        while running < n_decodes:
            self.add_prompt(context_tokens, 10**6)
            running += 1
            while True:
                record = self.run_step(self.engine.max_batch_tokens)
                if record.waiting_tokens == record.ran_chunk_tokens:
                    break
        return running

    def measure(self, chunk_tokens: int, context_tokens: int, repeat: int, split: str, prefix_tokens: int = 0) -> None:
        """Time one step of the running decodes plus a fresh prompt's chunk (after its prefix)."""
        if chunk_tokens > 0:
            self.add_prompt(prefix_tokens + chunk_tokens, 1)
            if prefix_tokens:
                self.run_step(prefix_tokens)  # bring the prompt to its prefix, unmeasured
        record = self.run_step(chunk_tokens)
        self.rows.append(
            {
                "n_decodes": record.n_decodes,
                "chunk_tokens": record.ran_chunk_tokens,
                "decode_kv_tokens": record.decode_kv_tokens,
                "prefill_prefix_tokens": record.prefill_prefix_tokens,
                "step_ms": record.step_ms,
                "context_tokens": context_tokens,
                "repeat": repeat,
                "split": split,
            }
        )

    def measure_grid(self, n_decodes: int, chunks: list[int], context_tokens: int, repeats: int) -> None:
        """Every chunk of the grid, ``repeats`` times, each round in shuffled order."""
        for repeat in range(repeats):
            for chunk in self.rng.permutation(chunks):
                if n_decodes == 0 and chunk == 0:
                    continue
                self.measure(int(chunk), context_tokens, repeat, "fit")

    def measure_holdout(self, n_decodes: int, max_chunk_tokens: int, context_tokens: int, steps: int) -> None:
        """Off-grid chunks, half of them after a prefix, to score the fit where it interpolates."""
        for _ in range(steps):
            chunk = int(self.rng.integers(1, max_chunk_tokens + 1))
            prefix = int(self.rng.integers(1, max_chunk_tokens + 1)) if self.rng.random() < 0.5 else 0
            prefix = min(prefix, self.engine.max_batch_tokens - n_decodes)
            self.measure(chunk, context_tokens, 0, "holdout", prefix)


def run_profile(
    engine: TransformersEngine,
    decodes=DEFAULT_DECODES,
    chunks=DEFAULT_CHUNKS,
    contexts=DEFAULT_CONTEXTS,
    repeats: int = 3,
    holdout_per_state: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """One row per measured step of the grid (see the module's docstring)."""
    decodes, chunks, contexts = sorted(set(decodes)), sorted(set(chunks)), sorted(set(contexts))
    if max(decodes) + max(chunks) > engine.max_batch_tokens:
        raise ValueError(
            f"the grid needs max_batch_tokens >= {max(decodes) + max(chunks)}, engine has {engine.max_batch_tokens}"
        )
    session = _ProfileSession(engine, seed)
    session.warm_up(max(chunks))
    with tqdm(total=len(contexts) * len(decodes), desc="profile", unit="state", disable=not progress) as bar:
        for context in contexts:
            engine.reset()
            running = 0
            for n in decodes:
                running = session.grow_decodes(running, n, context)
                session.measure_grid(n, chunks, context, repeats)
                session.measure_holdout(n, max(chunks), context, holdout_per_state)
                bar.update(1)
    engine.reset()
    return pd.DataFrame(session.rows)
