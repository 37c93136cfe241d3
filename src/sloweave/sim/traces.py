"""Real request traces: loading, validation and replay options.

Formats read (detected from the header, or forced with ``fmt``):

- ``normalised``: CSV ``arrival_s,prompt_tokens,output_tokens`` (seconds since the first
  request), the form of ``shared/traces/azure2023_conv.csv``.
- ``azure``: the Azure LLM inference trace's original CSV
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` with wall-clock timestamps such as
  ``2023-11-16 18:15:46.6805900``.
- ``mooncake``: JSON lines, one object per request with ``timestamp`` (milliseconds),
  ``input_length`` and ``output_length`` (other keys such as ``hash_ids`` are ignored).
- ``vidur``: Vidur's processed length files ``num_prefill_tokens,num_decode_tokens,...``
  (lengths only).

A normalised CSV whose ``arrival_s`` column is empty in every row is a *length
distribution*, not a trace. Such files (and Vidur files) carry no arrival times, so
:func:`replay_workload` refuses them unless the caller asks for generated arrivals
(``arrivals="poisson"`` at a given rate); the replay report then says so.

Every problem in a file raises :class:`TraceError` naming the file, the line and the
problem. Nothing is dropped, sorted or repaired silently: a trace that needs fixing is
the user's call, not the loader's.

All arrival times are rebased so that the first request arrives at 0 s.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.csv_shape import check_csv_shape, located, not_text
from sloweave.core.validate import (
    DEFAULT_MAX_MODEL_LEN_TOKENS,
    DURATION_S,
    MAX_SECONDS,
    MAX_TOKENS,
    RATE_RPS,
    SCALE,
    SEED,
    TIME_S,
    TOKENS,
    Range,
    RepeatedKeyError,
    max_model_len,
    one_value_per_key,
    over_context,
)
from sloweave.sim.workloads import Workload, WorkloadError, poisson_arrivals

# Columns that identify each CSV format, in the order they are tried.
NORMALISED_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
VIDUR_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
CSV_FORMATS = {"normalised": NORMALISED_COLUMNS, "azure": AZURE_COLUMNS, "vidur": VIDUR_COLUMNS}
# (prompt, output) length columns of each format
LENGTH_COLUMNS = {
    "normalised": ("prompt_tokens", "output_tokens"),
    "azure": ("ContextTokens", "GeneratedTokens"),
    "vidur": ("num_prefill_tokens", "num_decode_tokens"),
    "mooncake": ("input_length", "output_length"),
}
FORMATS = ("auto", "normalised", "azure", "mooncake", "vidur")
ARRIVALS = ("trace", "poisson")


class TraceError(WorkloadError):
    """A trace file or replay request that cannot be used; the message names file, line and problem."""


@dataclass(frozen=True)
class Trace:
    """Requests read from one file. ``arrival_s`` is None for a length-only distribution."""

    name: str
    path: str
    fmt: str
    arrival_s: np.ndarray | None
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    # the limit the file was read under (every request's prompt + output fits it)
    max_model_len_tokens: int = DEFAULT_MAX_MODEL_LEN_TOKENS

    @property
    def has_arrivals(self) -> bool:
        return self.arrival_s is not None

    def __len__(self) -> int:
        return int(self.prompt_tokens.shape[0])

    @property
    def span_s(self) -> float:
        """First to last arrival in seconds (0 for a length-only file)."""
        return float(self.arrival_s[-1] - self.arrival_s[0]) if self.has_arrivals else 0.0

    @property
    def mean_rate_rps(self) -> float:
        """Requests per second over the trace's span (nan without arrivals or with a zero span)."""
        return len(self) / self.span_s if self.span_s > 0 else float("nan")


# --------------------------------------------------------------------------- parsing helpers


def _fail(path: Path, line: int | None, problem: str) -> TraceError:
    return TraceError(f"{located(path, line)}: {problem}")


def _parse_lengths(path: Path, raw: pd.Series, column: str, lines: np.ndarray) -> np.ndarray:
    """Whole numbers >= 1; the first bad row raises with its line and value."""
    text = raw.astype(str).str.strip()
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values != np.round(values)) | (values <= 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        value, shown = values[i], text.iloc[i]
        if shown == "":
            problem = f"{column} is missing"
        elif not math.isfinite(value):
            problem = f"{column} is not a finite number: {shown!r}"
        elif value != round(value):
            problem = f"{column} must be a whole number of tokens, got {shown!r}"
        else:
            problem = f"{column} is {shown}; token lengths must be >= 1"
        raise _fail(path, int(lines[i]), problem)
    return values  # float64 until the context check, so lengths beyond int64 cannot wrap


def _lengths_within(path: Path, prompt: np.ndarray, output: np.ndarray, lines: np.ndarray, limit: int):
    """Both length columns as int64, once every request fits the model's context."""
    long = np.flatnonzero(prompt + output > limit)
    if long.size:
        i = int(long[0])
        raise _fail(path, int(lines[i]), over_context(f"{prompt[i]:.0f}", f"{output[i]:.0f}", limit))
    # the limit is at most MAX_TOKENS, so both fit int64 without wrapping
    return prompt.astype(np.int64), output.astype(np.int64)


def _check_sorted(path: Path, arrival_s: np.ndarray, lines: np.ndarray, column: str) -> None:
    back = np.flatnonzero(np.diff(arrival_s) < 0)
    if back.size:
        i = int(back[0]) + 1
        raise _fail(
            path,
            lines[i],
            f"{column} goes backwards ({arrival_s[i]:.6f} s after {arrival_s[i - 1]:.6f} s on line {lines[i - 1]}); "
            "a trace must be sorted by arrival",
        )


def _parse_seconds(path: Path, raw: pd.Series, column: str, lines: np.ndarray, per_second: float = 1.0) -> np.ndarray:
    """Arrival times in the column's unit (``per_second`` of them make a second), in TIME_S's range."""
    text = raw.astype(str).str.strip()
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64)
    for i in np.flatnonzero(~np.isfinite(values)):
        what = "is missing" if text.iloc[i] == "" else f"is not a finite number: {text.iloc[i]!r}"
        raise _fail(path, lines[i], f"{column} {what}")
    # refused, not shifted: a trace's clock starts at 0 or later (rebasing is for its first arrival)
    for i in np.flatnonzero(values < 0):
        raise _fail(path, lines[i], f"{column} is {text.iloc[i]}; arrival times must be >= 0")
    for i in np.flatnonzero(values > MAX_SECONDS * per_second):  # a float clock there cannot add a millisecond
        raise _fail(
            path,
            lines[i],
            f"{column} is {text.iloc[i]}; arrival times must be <= {MAX_SECONDS * per_second:g} ({MAX_SECONDS:g} s)",
        )
    return values


# A wall-clock stamp as the Azure trace writes it: a date and a time of day, optionally a
# fraction and a zone. pandas' ISO 8601 parser alone also takes "2023" (1 January), "-1" (the
# year -1) and "now" (the clock at load time): silent misreads, so the shape is checked first.
STAMP = r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2})?"
ZONE = r"(?:Z|[+-]\d{2}:?\d{2})$"


def _parse_timestamps(path: Path, raw: pd.Series, column: str, lines: np.ndarray) -> np.ndarray:
    """Wall-clock timestamps to seconds since the first one."""
    text = raw.astype(str).str.strip()
    shaped = text.str.fullmatch(STAMP).to_numpy(dtype=bool)
    # utc=True: stamps in different zones are compared as instants (naive ones all read alike)
    stamps = pd.to_datetime(text.where(shaped), format="ISO8601", errors="coerce", utc=True)
    for i in np.flatnonzero(stamps.isna().to_numpy()):
        what = "is missing" if text.iloc[i] == "" else f"is not a timestamp: {text.iloc[i]!r}"
        raise _fail(path, lines[i], f"{column} {what}")
    # A zone on some stamps only: the others' zone is unknown, so their order is too.
    zoned = text.str.contains(ZONE).to_numpy(dtype=bool)
    mixed = np.flatnonzero(zoned != zoned[0])
    if mixed.size:
        i = int(mixed[0])
        has = "has a time zone" if zoned[i] else "has no time zone"
        raise _fail(path, lines[i], f"{column} {has}, unlike line {lines[0]}; write every stamp with a zone or none")
    return (stamps - stamps.iloc[0]).dt.total_seconds().to_numpy(dtype=np.float64)


def _read_csv(path: Path) -> pd.DataFrame:
    """All cells as stripped-later strings; blank lines kept so line numbers stay exact."""
    check_csv_shape(path, lambda line, problem: _fail(path, line, problem))
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, skip_blank_lines=False, index_col=False)
    except pd.errors.EmptyDataError:
        raise _fail(path, None, "file is empty (no header, no requests)") from None
    except pd.errors.ParserError as err:
        raise _fail(path, None, f"not a readable CSV file ({str(err).strip()})") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    return frame


def _rebased(arrival_s: np.ndarray) -> np.ndarray:
    return arrival_s - arrival_s[0]


def _load_csv(path: Path, fmt: str, limit: int) -> Trace:
    frame = _read_csv(path)
    columns = set(frame.columns)
    if fmt == "auto":
        # The format sharing the most columns with the header; its missing columns are reported below.
        overlap = {name: len(set(needed) & columns) for name, needed in CSV_FORMATS.items()}
        fmt = max(overlap, key=overlap.get)
        if overlap[fmt] == 0:
            raise _fail(
                path,
                1,
                f"unrecognised columns {list(frame.columns)}; expected {','.join(NORMALISED_COLUMNS)} (normalised), "
                f"{','.join(AZURE_COLUMNS)} (Azure original), {','.join(VIDUR_COLUMNS)} (Vidur lengths) "
                "or a .jsonl file with timestamp,input_length,output_length (Mooncake)",
            )
    needed = CSV_FORMATS[fmt]
    missing = [c for c in needed if c not in columns]
    if missing:
        raise _fail(
            path, 1, f"missing column(s) {', '.join(missing)} for the {fmt} format (found {list(frame.columns)})"
        )
    if len(frame) == 0:
        raise _fail(path, None, "no requests (the file has a header only)")
    # Line 1 is the header, so data row i (0-based) sits on line i + 2.
    lines = np.arange(len(frame)) + 2
    blank = np.logical_and.reduce([frame[c].astype(str).str.strip().to_numpy() == "" for c in frame.columns])
    # Blank lines after the last request hold no request (editors add them); drop only those.
    filled = np.flatnonzero(~blank)
    keep = int(filled[-1]) + 1 if filled.size else 0  # up to the last non-blank row
    frame, lines, blank = frame.iloc[:keep], lines[:keep], blank[:keep]
    if len(frame) == 0:
        raise _fail(path, None, "no requests (the file has a header and blank lines only)")
    if blank.any():
        raise _fail(path, int(lines[np.flatnonzero(blank)[0]]), "blank line inside the trace")

    prompt, output = _lengths_within(
        path, *(_parse_lengths(path, frame[c], c, lines) for c in LENGTH_COLUMNS[fmt]), lines, limit
    )
    if fmt == "normalised":
        arrival_text = frame["arrival_s"].astype(str).str.strip()
        empty = (arrival_text == "").to_numpy()
        if empty.all():
            # A length distribution published in the normalised layout (shared/traces/lengths_only).
            return Trace(path.stem, str(path), "normalised", None, prompt, output, limit)
        if empty.any():
            raise _fail(
                path,
                int(lines[np.flatnonzero(empty)[0]]),
                "arrival_s is missing (it is empty in some rows only; a length-only file leaves it empty in every row)",
            )
        arrival = _parse_seconds(path, frame["arrival_s"], "arrival_s", lines)
        _check_sorted(path, arrival, lines, "arrival_s")
        return Trace(path.stem, str(path), "normalised", _rebased(arrival), prompt, output, limit)
    if fmt == "azure":
        arrival = _parse_timestamps(path, frame["TIMESTAMP"], "TIMESTAMP", lines)
        _check_sorted(path, arrival, lines, "TIMESTAMP")
        return Trace(path.stem, str(path), "azure", _rebased(arrival), prompt, output, limit)
    return Trace(path.stem, str(path), "vidur", None, prompt, output, limit)


def _load_jsonl(path: Path, limit: int) -> Trace:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise _fail(path, None, not_text(err)) from None
    if text.strip() == "":
        raise _fail(path, None, "file is empty (no requests)")
    rows = text.split("\n")
    while rows and rows[-1].strip() == "":
        rows.pop()  # the newline that ends the last record, and blank lines after it
    records = []
    for number, row in enumerate(rows, start=1):
        if row.strip() == "":
            raise _fail(path, number, "blank line inside the trace")
        try:
            record = json.loads(row, object_pairs_hook=one_value_per_key)
        except RepeatedKeyError as err:
            raise _fail(path, number, str(err)) from None
        except json.JSONDecodeError as err:
            raise _fail(path, number, f"not valid JSON ({err.msg})") from None
        except RecursionError:  # "[[[[..." a few thousand deep: the parser gives up
            raise _fail(path, number, "not valid JSON (nested too deeply)") from None
        if not isinstance(record, dict):
            raise _fail(path, number, f"expected a JSON object, got {type(record).__name__}")
        missing = [k for k in MOONCAKE_KEYS if k not in record]
        if missing:
            raise _fail(path, number, f"missing key(s) {', '.join(missing)} (found {sorted(record)})")
        records.append([str(record[k]) if record[k] is not None else "" for k in MOONCAKE_KEYS])
    frame = pd.DataFrame(records, columns=list(MOONCAKE_KEYS))
    lines = np.arange(len(frame)) + 1
    prompt, output = _lengths_within(
        path, *(_parse_lengths(path, frame[c], c, lines) for c in LENGTH_COLUMNS["mooncake"]), lines, limit
    )
    arrival = (
        _parse_seconds(path, frame["timestamp"], "timestamp", lines, per_second=1000.0) / 1000.0
    )  # Mooncake stamps are ms
    _check_sorted(path, arrival, lines, "timestamp")
    return Trace(path.stem, str(path), "mooncake", _rebased(arrival), prompt, output, limit)


def load_trace(path: str | Path, fmt: str = "auto", max_model_len_tokens: int = DEFAULT_MAX_MODEL_LEN_TOKENS) -> Trace:
    """Read one trace file (format detected from its header unless ``fmt`` says otherwise).

    A request whose prompt + output tokens exceed ``max_model_len_tokens`` (the served
    model's context) is refused with its line."""
    path = Path(path)
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}: choose one of {', '.join(FORMATS)}")
    try:
        limit = max_model_len(max_model_len_tokens)
    except ValueError as err:
        raise TraceError(str(err)) from None
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise _fail(path, None, "file is empty (no header, no requests)")
    if fmt == "mooncake" or (fmt == "auto" and _looks_like_jsonl(path)):
        return _load_jsonl(path, limit)
    return _load_csv(path, fmt, limit)


def _looks_like_jsonl(path: Path) -> bool:
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return True
    with path.open("rb") as f:  # bytes: a binary file is refused by the reader, with its path
        head = f.read(256).lstrip()
    return head.startswith(b"{")


# --------------------------------------------------------------------------- replay


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
