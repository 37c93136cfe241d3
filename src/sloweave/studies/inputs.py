"""What every study reads, with one rule each: how many requests a run may generate, the
longest request a trace may hold, and where the simulations run."""

from __future__ import annotations

from sloweave.core.validate import DEFAULT_MAX_MODEL_LEN_TOKENS, Range

# Requests one run generates: a run keeps per-request arrays and per-iteration records in
# memory, and 1e11 requests ended in a 745 GiB allocation error; 10 million simulate in
# about an hour here and fit in a few GB. (A trace's own size is its limit.)
MAX_REQUESTS = 10_000_000
REQUESTS = Range(1, MAX_REQUESTS, " of requests", whole=True)


def model_len_or_default(max_model_len_tokens: int | None) -> int:
    return DEFAULT_MAX_MODEL_LEN_TOKENS if max_model_len_tokens is None else max_model_len_tokens


def runner_of(jobs: int | None, ray_address: str | None):
    from sloweave.studies.parallel import Runner, local_cores

    return Runner(jobs or local_cores(), ray_address)
