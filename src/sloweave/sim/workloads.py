"""Request workloads: the paper's four synthetic families, seeded.

A workload is a set of requests, each with an arrival time, a prompt length and an
output length (and optionally its own TPOT target). Lengths are drawn by inverse-CDF
sampling from quantiles of real data shipped with the package
(``data/length_quantiles.csv``, built by ``scripts/make_length_data.py`` from the Azure
2023 conversation trace and the arXiv-summarisation length distribution in shared/traces).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources

import numpy as np
import pandas as pd

from sloweave.core.validate import DEFAULT_MAX_MODEL_LEN_TOKENS, MAX_MS, MAX_SECONDS, SCALE, max_model_len, over_context


class WorkloadError(ValueError):
    """A workload the simulator cannot run (empty, negative lengths, unsorted arrivals, ...)."""


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival. Lengths are in tokens, arrivals in seconds from 0."""

    name: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    # Per-request TPOT targets in ms; None means every request uses the run's shared target.
    tpot_ms: np.ndarray | None = None
    params: dict = field(default_factory=dict)
    # The longest request (prompt + output tokens) the served model's context allows.
    max_model_len_tokens: int = DEFAULT_MAX_MODEL_LEN_TOKENS

    def __post_init__(self) -> None:
        arrival = np.asarray(self.arrival_s, dtype=np.float64)
        prompt = np.asarray(self.prompt_tokens)
        output = np.asarray(self.output_tokens)
        n = arrival.shape[0]
        if n == 0:
            raise WorkloadError(f"workload {self.name!r} has no requests")
        if prompt.shape != (n,) or output.shape != (n,):
            raise WorkloadError(
                f"workload {self.name!r}: arrival_s, prompt_tokens and output_tokens must be 1-D arrays of one length "
                f"(got {arrival.shape}, {prompt.shape}, {output.shape})"
            )
        for label, values in (("prompt_tokens", prompt), ("output_tokens", output)):
            # booleans and strings are not lengths (True would silently read as 1 token)
            if values.dtype == np.bool_ or not np.issubdtype(values.dtype, np.number):
                raise WorkloadError(
                    f"workload {self.name!r}: {label} must be numbers of tokens, got dtype {values.dtype}"
                )
            if not np.issubdtype(values.dtype, np.integer):
                if not np.all(np.isfinite(values)) or not np.all(values == np.round(values)):
                    raise WorkloadError(f"workload {self.name!r}: {label} must be whole numbers")
            bad = np.flatnonzero(values <= 0)
            if bad.size:
                raise WorkloadError(
                    f"workload {self.name!r}: request {int(bad[0])} has {label}={values[bad[0]]}; lengths must be >= 1"
                )
        try:
            limit = max_model_len(self.max_model_len_tokens)
        except ValueError as err:
            raise WorkloadError(f"workload {self.name!r}: {err}") from None
        # Compared in floating point, so lengths beyond int64 are refused before any cast.
        long = np.flatnonzero(prompt.astype(np.float64) + output.astype(np.float64) > limit)
        if long.size:
            i = int(long[0])
            raise WorkloadError(f"workload {self.name!r}: request {i}: {over_context(prompt[i], output[i], limit)}")
        if not np.all(np.isfinite(arrival)) or np.any(arrival < 0) or np.any(arrival > MAX_SECONDS):
            # beyond 1e10 s a float clock in ms can no longer add a millisecond
            raise WorkloadError(f"workload {self.name!r}: arrival_s must be finite, >= 0 and <= {MAX_SECONDS:g} s")
        unsorted = np.flatnonzero(np.diff(arrival) < 0)
        if unsorted.size:
            raise WorkloadError(
                f"workload {self.name!r}: arrivals are not sorted (request {int(unsorted[0]) + 1} arrives before "
                f"request {int(unsorted[0])})"
            )
        object.__setattr__(self, "arrival_s", arrival)
        object.__setattr__(self, "prompt_tokens", prompt.astype(np.int64))
        object.__setattr__(self, "output_tokens", output.astype(np.int64))
        if self.tpot_ms is not None:
            tpot = np.asarray(self.tpot_ms, dtype=np.float64)
            if tpot.shape != (n,) or not np.all(np.isfinite(tpot)) or np.any(tpot <= 0) or np.any(tpot > MAX_MS):
                raise WorkloadError(
                    f"workload {self.name!r}: tpot_ms must hold one finite target > 0 and <= {MAX_MS:g} ms per request"
                )
            object.__setattr__(self, "tpot_ms", tpot)

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    @property
    def span_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0])

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            {"arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}
        )


def _check_seed(name: str, seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise WorkloadError(f"workload {name!r}: seed must be a whole number >= 0, got {seed!r}")


@lru_cache(maxsize=1)
def length_quantiles() -> pd.DataFrame:
    with resources.files("sloweave.data").joinpath("length_quantiles.csv").open() as f:
        return pd.read_csv(f)


def sample_lengths(column: str, size: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Draw ``size`` lengths from the empirical distribution ``column``, times ``scale``."""
    table = length_quantiles()
    values = np.interp(rng.random(size), table["quantile"].to_numpy(), table[column].to_numpy())
    return np.maximum(1, np.round(values * scale)).astype(np.int64)


def poisson_arrivals(rate_rps: float, size: int, rng: np.random.Generator) -> np.ndarray:
    gaps = rng.exponential(1.0 / rate_rps, size)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def gamma_arrivals(rate_rps: float, cv: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Renewal process with gamma gaps: mean 1/rate, coefficient of variation ``cv``.

    cv = 1 is Poisson; cv > 1 clusters requests into bursts separated by quiet spells
    at the same mean rate.
    """
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (rate_rps * shape), size)
    gaps[0] = 0.0
    return np.cumsum(gaps)


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of one synthetic workload family (documented in the README)."""

    name: str
    rate_rps: float
    ttft_ms: float
    long_share: float = 0.0  # fraction of requests that are long documents (arXiv lengths)
    chat_prompt_scale: float = 256.0 / 1020.0  # scales the Azure prompt median 1020 to 256
    long_docs_per_prompt: int = 1  # long-context prompts concatenate this many documents
    burst_cv: float = 1.0  # 1 = Poisson arrivals
    description: str = ""

    def __post_init__(self) -> None:
        if not (self.rate_rps > 0 and np.isfinite(self.rate_rps)):
            raise WorkloadError(f"workload {self.name!r}: rate_rps must be > 0, got {self.rate_rps!r}")
        if not (self.ttft_ms > 0 and np.isfinite(self.ttft_ms)):
            raise WorkloadError(f"workload {self.name!r}: ttft_ms must be > 0, got {self.ttft_ms!r}")
        if not 0.0 <= self.long_share <= 1.0:
            raise WorkloadError(f"workload {self.name!r}: long_share must be in [0, 1], got {self.long_share!r}")
        if self.burst_cv <= 0:
            raise WorkloadError(f"workload {self.name!r}: burst_cv must be > 0, got {self.burst_cv!r}")

    def generate(self, num_requests: int, seed: int, rate_scale: float = 1.0) -> Workload:
        if num_requests <= 0:
            raise WorkloadError(f"workload {self.name!r}: num_requests must be >= 1, got {num_requests!r}")
        _check_seed(self.name, seed)
        try:
            SCALE.check(rate_scale, "rate_scale")
        except ValueError as err:
            raise WorkloadError(f"workload {self.name!r}: {err}") from None
        rng = np.random.default_rng(seed)
        rate = self.rate_rps * rate_scale
        if self.burst_cv == 1.0:
            arrivals = poisson_arrivals(rate, num_requests, rng)
        else:
            arrivals = gamma_arrivals(rate, self.burst_cv, num_requests, rng)
        is_long = rng.random(num_requests) < self.long_share
        prompt = sample_lengths("azure_conv_prompt", num_requests, rng, self.chat_prompt_scale)
        output = sample_lengths("azure_conv_output", num_requests, rng)
        n_long = int(is_long.sum())
        if n_long:
            docs = sum(sample_lengths("arxiv_prompt", n_long, rng) for _ in range(self.long_docs_per_prompt))
            prompt[is_long] = docs
            output[is_long] = sample_lengths("arxiv_output", n_long, rng)
        return Workload(
            name=self.name,
            arrival_s=arrivals,
            prompt_tokens=prompt,
            output_tokens=output,
            params={"seed": seed, "rate_rps": rate, "num_requests": num_requests},
        )


# Arrival rates are set so that the strongest static chunk (Fixed-1024) attains about what
# the paper reports at 25 ms TPOT (see README, "Workloads"); SLOWeave is never tuned to them.
WORKLOADS: dict[str, WorkloadSpec] = {
    "chat": WorkloadSpec(
        name="chat",
        rate_rps=60.0,
        ttft_ms=1000.0,
        description="short conversation prompts (Azure conv shape, median 256), Azure outputs, Poisson",
    ),
    "mixed": WorkloadSpec(
        name="mixed",
        rate_rps=60.0,
        ttft_ms=2000.0,
        long_share=0.2,
        description="chat plus 20% arXiv-length documents, Poisson",
    ),
    "long": WorkloadSpec(
        name="long",
        rate_rps=20.0,
        ttft_ms=5000.0,
        long_share=1.0,
        long_docs_per_prompt=2,
        description="long-context prompts (two arXiv documents each, median about 5.5k tokens), Poisson",
    ),
    "bursty": WorkloadSpec(
        name="bursty",
        rate_rps=58.0,
        ttft_ms=2000.0,
        long_share=0.2,
        burst_cv=3.0,
        description="the mixed lengths with gamma-renewal arrivals (CV 3): bursts and quiet spells",
    ),
}


def get_workload_spec(name: str):
    """A workload family or scenario by name (``ALL_WORKLOADS``)."""
    try:
        return ALL_WORKLOADS[name]
    except KeyError:
        raise WorkloadError(f"unknown workload {name!r}: choose one of {', '.join(ALL_WORKLOADS)}") from None


# --------------------------------------------------------------------------- scenarios


def mean_context_tokens(*workloads: Workload) -> float:
    """The mean KV context a decode reads over the workloads' requests: the mean prompt plus half
    the mean output (the context half-way through a request's decode)."""
    prompts = np.concatenate([w.prompt_tokens for w in workloads])
    outputs = np.concatenate([w.output_tokens for w in workloads])
    return float(prompts.mean() + outputs.mean() / 2)


def back_to_back_workloads(parts: list[Workload], name: str) -> Workload:
    """``parts`` replayed one after another: each starts one mean gap after the previous ends.

    Per-request TPOT targets are kept only when every part has them.
    """
    if not parts:
        raise WorkloadError(f"{name}: nothing to put back to back")
    arrivals, start = [], 0.0
    for part in parts:
        gap = part.span_s / max(1, len(part) - 1)
        shifted = part.arrival_s - part.arrival_s[0] + start
        arrivals.append(shifted)
        start = float(shifted[-1]) + gap
    has_targets = all(p.tpot_ms is not None for p in parts)
    return Workload(
        name=name,
        arrival_s=np.concatenate(arrivals),
        prompt_tokens=np.concatenate([p.prompt_tokens for p in parts]),
        output_tokens=np.concatenate([p.output_tokens for p in parts]),
        tpot_ms=np.concatenate([p.tpot_ms for p in parts]) if has_targets else None,
        params={"parts": [p.name for p in parts], "requests_per_part": [len(p) for p in parts]},
        max_model_len_tokens=max(p.max_model_len_tokens for p in parts),
    )


@dataclass(frozen=True)
class PhasedSpec:
    """A mix that changes over time: phases of the families above, back to back.

    Each phase runs for the same time at its family's own rate, so it gets requests in
    proportion to that rate; load scale s multiplies every phase's rate. One TTFT target
    for the whole run: the loosest of the phases', so no phase is judged tighter than its
    own family is. The operator's alternative is one fixed budget tuned once for it all.
    """

    name: str
    phases: tuple[WorkloadSpec, ...]
    description: str = ""

    @property
    def rate_rps(self) -> float:
        return float(np.mean([p.rate_rps for p in self.phases]))

    @property
    def ttft_ms(self) -> float:
        return max(p.ttft_ms for p in self.phases)

    def phase_sizes(self, num_requests: int) -> list[int]:
        rates = np.array([p.rate_rps for p in self.phases])
        sizes = np.floor(num_requests * rates / rates.sum()).astype(int)
        sizes[: num_requests - int(sizes.sum())] += 1  # the remainder to the first phases
        return [int(n) for n in sizes]

    def generate(self, num_requests: int, seed: int, rate_scale: float = 1.0) -> Workload:
        _check_seed(self.name, seed)
        if num_requests < len(self.phases):
            raise WorkloadError(
                f"workload {self.name!r}: needs at least one request per phase ({len(self.phases)}), got {num_requests!r}"
            )
        # Each phase draws from its own stream (seed, phase): phases do not share draws.
        parts = [
            spec.generate(n, int(np.random.SeedSequence([seed, i]).generate_state(1)[0]), rate_scale)
            for i, (spec, n) in enumerate(zip(self.phases, self.phase_sizes(num_requests)))
        ]
        wl = back_to_back_workloads(parts, self.name)
        return replace(wl, params={**wl.params, "seed": seed, "rate_scale": rate_scale})


SCENARIOS: dict[str, PhasedSpec] = {
    "drift": PhasedSpec(
        name="drift",
        phases=(WORKLOADS["chat"], WORKLOADS["long"], WORKLOADS["bursty"]),
        description="chat, then long documents, then bursts (the chat, long and bursty families back to back, equal time each)",
    ),
}
# Every workload a command can run: the paper's four families and the scenarios.
ALL_WORKLOADS: dict[str, WorkloadSpec | PhasedSpec] = {**WORKLOADS, **SCENARIOS}
