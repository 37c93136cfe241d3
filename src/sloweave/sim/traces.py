"""Real request traces: loading and validation (``sim.trace_replay`` turns one into a workload).

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
:func:`sloweave.sim.trace_replay.replay_workload` refuses them unless the caller asks for generated arrivals
(``arrivals="poisson"`` at a given rate); the replay report then says so.

Every problem in a file raises :class:`TraceError` naming the file, the line and the
problem. Nothing is dropped, sorted or repaired silently: a trace that needs fixing is
the user's call, not the loader's.

All arrival times are rebased so that the first request arrives at 0 s.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.csv_shape import check_csv_shape, located, not_text
from sloweave.core.validate import (
    DEFAULT_MAX_MODEL_LEN_TOKENS,
    MAX_SECONDS,
    RepeatedKeyError,
    max_model_len,
    one_value_per_key,
    over_context,
)
from sloweave.sim.workloads import WorkloadError

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
