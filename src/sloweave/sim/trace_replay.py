"""A loaded trace turned into a simulator workload: a time window, a request cap, a prompt cap
and a time scale (or generated arrivals for a file without its own), with a report of each."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from sloweave.core.validate import DURATION_S, MAX_TOKENS, RATE_RPS, SCALE, SEED, TIME_S, TOKENS, Range
from sloweave.sim.traces import Trace, TraceError
from sloweave.sim.workloads import Workload, poisson_arrivals

ARRIVALS = ("trace", "poisson")


@dataclass(frozen=True)
class ReplayOptions:
    """How to turn a trace into a simulator workload.

    Order of operations: time window (in the trace's own seconds) -> first
    ``max_requests`` -> prompt cap -> rate scaling. ``rate_scale`` is the time-scale
    factor: arrival times are divided by it, so 2 replays the window twice as fast with
    the same burst structure (the same relative gaps).
    """

    start_s: float = 0.0
    end_s: float | None = None  # None: to the end of the trace; the window is [start_s, end_s)
    rate_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_requests: int | None = None
    # "trace" uses the file's arrivals; "poisson" generates them (required for length-only files).
    arrivals: str = "trace"
    poisson_rate_rps: float | None = None  # at rate_scale 1; the offered rate is this x rate_scale
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            TIME_S.check(self.start_s, "window start")
            if self.end_s is not None and DURATION_S.check(self.end_s, "window end") <= self.start_s:
                raise ValueError(f"window end must be after its start ({self.start_s!r} s), got {self.end_s!r}")
            SCALE.check(self.rate_scale, "rate scale (time-scale factor)")
            if self.max_prompt_tokens is not None:
                TOKENS.check(self.max_prompt_tokens, "prompt cap")
            if self.max_requests is not None:
                Range(1, MAX_TOKENS, " of requests", whole=True).check(self.max_requests, "max_requests")
            if self.poisson_rate_rps is not None:
                RATE_RPS.check(self.poisson_rate_rps, "poisson_rate_rps")
            SEED.check(self.seed, "seed")
        except ValueError as err:
            raise TraceError(str(err)) from None
        if self.arrivals not in ARRIVALS:
            raise TraceError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        if self.arrivals == "poisson":
            rate = self.poisson_rate_rps
            if rate is None or not (math.isfinite(rate) and rate > 0):
                raise TraceError(
                    "generated Poisson arrivals need a rate in requests/s > 0 (poisson_rate_rps / --rate-rps)"
                )


@dataclass(frozen=True)
class ReplayReport:
    """What a replay actually ran, so outputs can say it (and nothing changes unreported)."""

    source: str
    fmt: str
    arrivals: str  # "trace" or e.g. "generated: Poisson 5 req/s x 2 (seed 0); the file has no arrival times"
    arrivals_generated: bool
    num_requests_in_file: int
    num_requests: int
    window_start_s: float | None
    window_end_s: float | None
    window_duration_s: float | None
    rate_scale: float
    base_rate_rps: float  # requests per second at rate_scale 1
    offered_rate_rps: float  # base_rate_rps x rate_scale
    max_prompt_tokens: int | None
    num_prompts_capped: int
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _trace_window(trace: Trace, options: ReplayOptions, notes: list[str]):
    """The trace's own arrivals in the options' window: (arrival, prompt, output, base rate, text, window)."""
    prompt, output = trace.prompt_tokens, trace.output_tokens
    if not trace.has_arrivals:
        raise TraceError(
            f"{trace.path}: has no arrival times (a length-only distribution, {trace.fmt} format), so it cannot "
            "be replayed as a trace; ask for generated arrivals explicitly (arrivals='poisson' with a rate, "
            "CLI: --arrivals poisson --rate-rps R)"
        )
    t = trace.arrival_s
    start = options.start_s
    last = float(t[-1])
    end = last if options.end_s is None else options.end_s
    if start > last:
        raise TraceError(f"{trace.path}: window starts at {start} s, after the last arrival ({last:.3f} s)")
    # Half-open [start, end) so consecutive windows never share a request; a window
    # without an end runs to the end of the trace and keeps the last request.
    keep = (t >= start) & ((t < end) | (options.end_s is None))
    if not keep.any():
        raise TraceError(f"{trace.path}: no requests arrive in the window [{start}, {end}) s")
    duration = end - start
    arrival = t[keep] - start
    prompt, output = prompt[keep], output[keep]
    if options.max_requests is not None and options.max_requests < arrival.shape[0]:
        arrival = arrival[: options.max_requests]
        prompt, output = prompt[: options.max_requests], output[: options.max_requests]
        # The window shrinks to where the kept requests stop, so the rate stays honest.
        duration = float(arrival[-1])
        end = start + duration
        notes.append(f"kept the first {options.max_requests} requests of the window")
    base_rate = arrival.shape[0] / duration if duration > 0 else float("nan")
    arrival = arrival / options.rate_scale
    arrivals_text = "trace"
    window = (start, end, duration)
    return arrival, prompt, output, base_rate, arrivals_text, window


def _generated_arrivals(trace: Trace, options: ReplayOptions, notes: list[str]):
    """Poisson arrivals for the trace's lengths: (arrival, prompt, output, base rate, text, window)."""
    prompt, output = trace.prompt_tokens, trace.output_tokens
    if options.start_s != 0.0 or options.end_s is not None:
        raise TraceError(f"{trace.path}: a time window needs the trace's own arrivals, not generated ones")
    if options.max_requests is not None:
        prompt, output = prompt[: options.max_requests], output[: options.max_requests]
    base_rate = float(options.poisson_rate_rps)
    rng = np.random.default_rng(options.seed)
    arrival = poisson_arrivals(base_rate * options.rate_scale, prompt.shape[0], rng)
    reason = "the file has no arrival times" if not trace.has_arrivals else "the file's arrival times were replaced"
    arrivals_text = (
        f"generated: Poisson at {base_rate:g} req/s x {options.rate_scale:g} (seed {options.seed}); {reason}"
    )
    notes.append(f"arrivals {arrivals_text}")
    window = (None, None, None)
    return arrival, prompt, output, base_rate, arrivals_text, window


def replay_workload(trace: Trace, options: ReplayOptions = ReplayOptions()) -> tuple[Workload, ReplayReport]:
    """Select, cap and time-scale a trace into a :class:`Workload`, with a report of what was done."""
    notes: list[str] = []
    select = _trace_window if options.arrivals == "trace" else _generated_arrivals
    arrival, prompt, output, base_rate, arrivals_text, window = select(trace, options, notes)

    capped = 0
    if options.max_prompt_tokens is not None:
        over = prompt > options.max_prompt_tokens
        capped = int(over.sum())
        if capped:
            prompt = np.minimum(prompt, options.max_prompt_tokens)
            notes.append(f"{capped} prompt(s) longer than {options.max_prompt_tokens} tokens were capped to it")

    report = ReplayReport(
        source=trace.path,
        fmt=trace.fmt,
        arrivals=arrivals_text,
        arrivals_generated=options.arrivals != "trace",
        num_requests_in_file=len(trace),
        num_requests=int(prompt.shape[0]),
        window_start_s=window[0],
        window_end_s=window[1],
        window_duration_s=window[2],
        rate_scale=options.rate_scale,
        base_rate_rps=float(base_rate),
        offered_rate_rps=float(base_rate * options.rate_scale),
        max_prompt_tokens=options.max_prompt_tokens,
        num_prompts_capped=capped,
        notes=notes,
    )
    workload = Workload(
        name=trace.name,
        arrival_s=arrival,
        prompt_tokens=prompt,
        output_tokens=output,
        params={"trace": report.as_dict()},
        max_model_len_tokens=trace.max_model_len_tokens,
    )
    return workload, report


def split_windows(trace: Trace, num_windows: int, window_s: float | None = None) -> list[tuple[float, float | None]]:
    """Disjoint replay windows ``(start_s, end_s)`` over the trace.

    Without ``window_s`` the trace's span is cut into ``num_windows`` equal consecutive
    windows (every request used exactly once; the last runs to the end). With it, the
    windows have that length and their starts are spread evenly over the span.
    """
    if num_windows < 1:
        raise TraceError(f"need at least one window, got {num_windows!r}")
    if not trace.has_arrivals:
        raise TraceError(f"{trace.path}: has no arrival times, so it cannot be cut into time windows")
    span = trace.span_s
    if window_s is None:
        # Each window ends exactly where the next starts (same float), so no request is lost or shared.
        starts = [span * i / num_windows for i in range(num_windows)]
        return [(starts[i], starts[i + 1] if i + 1 < num_windows else None) for i in range(num_windows)]
    if not (math.isfinite(window_s) and window_s > 0):
        raise TraceError(f"window length must be > 0 s, got {window_s!r}")
    if num_windows * window_s > span + 1e-9:
        raise TraceError(
            f"{trace.path}: {num_windows} disjoint windows of {window_s:g} s do not fit in the trace's {span:.1f} s"
        )
    if num_windows == 1:
        return [(0.0, window_s)]
    stride = (span - window_s) / (num_windows - 1)
    windows: list[tuple[float, float | None]] = [(i * stride, i * stride + window_s) for i in range(num_windows - 1)]
    # The last window ends at the last arrival; an open end keeps that request in it.
    return windows + [((num_windows - 1) * stride, None)]
