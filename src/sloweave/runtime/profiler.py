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

import numpy as np
import pandas as pd
from tqdm import tqdm

from sloweave.runtime.engine import Engine, blocks_needed
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


def run_profile(
    engine: Engine,
    decodes=DEFAULT_DECODES,
    chunks=DEFAULT_CHUNKS,
    contexts=DEFAULT_CONTEXTS,
    repeats: int = 3,
    holdout_per_state: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    decodes, chunks, contexts = sorted(set(decodes)), sorted(set(chunks)), sorted(set(contexts))
    if max(decodes) + max(chunks) > engine.max_batch_tokens:
        raise ValueError(
            f"the grid needs max_batch_tokens >= {max(decodes) + max(chunks)}, engine has {engine.max_batch_tokens}"
        )
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    counter = iter(range(10**9))
    total = len(contexts) * len(decodes)
    bar = tqdm(total=total, desc="profile", unit="state", disable=not progress)

    def fresh_id() -> str:
        return f"p{next(counter)}"

    def run_step(chunk: int):
        record = engine.step(
            lambda shape, start_ms: min(chunk, shape.waiting_tokens, shape.token_capacity - shape.n_decodes)
        )
        if record is None or record.ran_chunk_tokens != record.asked_chunk_tokens:
            raise RuntimeError(f"profiling step did not run the requested chunk {chunk}: {record}")
        return record

    def measure(chunk: int, context: int, repeat: int, split: str, prefix: int = 0) -> None:
        if chunk > 0:
            rid = fresh_id()
            engine.add(rid, synthetic_prompt(rng, prefix + chunk, engine.vocab_size), 1)
            if prefix:
                run_step(prefix)  # bring the prompt to its prefix, unmeasured
        record = run_step(chunk)
        rows.append(
            {
                "n_decodes": record.n_decodes,
                "chunk_tokens": record.ran_chunk_tokens,
                "decode_kv_tokens": record.decode_kv_tokens,
                "prefill_prefix_tokens": record.prefill_prefix_tokens,
                "step_ms": record.step_ms,
                "context_tokens": context,
                "repeat": repeat,
                "split": split,
            }
        )

    # Unrecorded warm-up: the first steps pay for allocations and lazy initialisation.
    engine.reset()
    for _ in range(WARMUP_STEPS):
        engine.add(fresh_id(), synthetic_prompt(rng, max(chunks), engine.vocab_size), 1)
        run_step(max(chunks))
    for context in contexts:
        engine.reset()
        running = 0
        for n in decodes:
            # Grow the running set to n requests of `context` prompt tokens (unmeasured).
            while running < n:
                engine.add(fresh_id(), synthetic_prompt(rng, context, engine.vocab_size), 10**6)
                running += 1
                while True:
                    record = run_step(engine.max_batch_tokens)
                    if record.waiting_tokens == record.ran_chunk_tokens:
                        break
            for repeat in range(repeats):
                for chunk in rng.permutation(chunks):
                    if n == 0 and chunk == 0:
                        continue
                    measure(int(chunk), context, repeat, "fit")
            for _ in range(holdout_per_state):
                chunk = int(rng.integers(1, max(chunks) + 1))
                prefix = int(rng.integers(1, max(chunks) + 1)) if rng.random() < 0.5 else 0
                prefix = min(prefix, engine.max_batch_tokens - n)
                measure(chunk, context, 0, "holdout", prefix)
            bar.update(1)
    bar.close()
    engine.reset()
    return pd.DataFrame(rows)
