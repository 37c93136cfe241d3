"""Step-time profiles: their format, and reading, checking and writing them (no torch: the GPU plug-in reuses this).

A profile is a table of measured serving steps. Each row is one step of a real engine:

==========================  =====  =============================================================
column                      type   meaning
==========================  =====  =============================================================
``n_decodes``               int    running requests that decoded one token in the step (n >= 0)
``chunk_tokens``            int    prompt tokens of the one prefill chunk in the step (c >= 0)
``decode_kv_tokens``        int    KV tokens the decodes read: sum over them of (context + 1)
``prefill_prefix_tokens``   int    tokens of the chunk's prompt already in the KV cache (0 if c=0)
``step_ms``                 float  measured wall time of the step, schedule to tokens out (> 0)
``context_tokens``          int    optional: the grid's nominal per-decode context (lookup table)
``split``                   str    optional: ``fit`` (default) or ``holdout`` (scored, not fitted)
``offer``                   str    optional: where the chunk spans several prompts, the prompts it
                                   was taken from, FCFS, as ``tokens:computed;...`` (the first
                                   one's computed tokens are ``prefill_prefix_tokens``); empty:
                                   one prompt
``start_ms``                float  optional: the step's start on the engine's clock (a step log's),
                                   for the machine's pace over time (``machine_pace``)
==========================  =====  =============================================================

Other columns (``repeat``, ...) are kept but ignored. Files are CSV (``.csv``) or JSON
(``.json``: ``{"format": "sloweave-profile", "version": 1, "meta": {...}, "rows": [{...}, ...]}``),
or a served engine's step log (``.jsonl``, ``sloweave.core.step_log``: the steps the engine ran,
``step_log.profile_rows``), so a profile can be taken while serving.

``sloweave.core.costs.profile_fit`` fits cost models to a profile (``sloweave.core.costs.fitted``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.atomic import atomic_path, write_text_atomic
from sloweave.core.cells import numbers, show
from sloweave.core.csv_shape import check_csv_shape, located
from sloweave.core.step_log import StepLogError, profile_rows, read_step_log
from sloweave.core.validate import (
    CLOCK_MS,
    DURATION_MS,
    MAX_MS,
    MAX_TOKENS,
    TOKEN_COUNT,
    RepeatedKeyError,
    one_value_per_key,
)

PROFILE_FORMAT = "sloweave-profile"
STEP_LOG_SUFFIX = ".jsonl"  # a served engine's step log (sloweave.core.step_log), read as a profile
PROFILE_VERSION = 1
REQUIRED_COLUMNS = ("n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens", "step_ms")
INT_COLUMNS = ("n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens", "context_tokens")
OFFER_COLUMN = "offer"
START_COLUMN = "start_ms"


class ProfileError(ValueError):
    """A profile that cannot be fitted: missing columns, bad values, a hole in the grid, non-monotone."""


def read_profile(path: str | Path) -> pd.DataFrame:
    """Load and validate a profile (CSV, JSON, or a served engine's ``.jsonl`` step log).
    Raises ProfileError with the reason."""
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"profile {path} does not exist")
    if path.suffix.lower() == STEP_LOG_SUFFIX:
        try:
            return validate_profile(profile_rows(read_step_log(path)), str(path))
        except StepLogError as err:
            raise ProfileError(f"profile {err}") from None
    lines = None  # the file line of each row (CSV only)
    try:
        if path.suffix.lower() == ".json":
            doc = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=one_value_per_key)
            if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
                raise ProfileError(f"profile {path}: JSON must be an object with format={PROFILE_FORMAT!r}")
            version = doc.get("version")
            if isinstance(version, bool) or version != PROFILE_VERSION:  # true == 1 in Python, not a version
                raise ProfileError(f"profile {path}: unsupported version {version!r} (expected {PROFILE_VERSION})")
            frame = pd.DataFrame(_json_rows(path, doc.get("rows", [])))
        else:
            lines = check_csv_shape(
                path, lambda line, problem: ProfileError(f"profile {located(path, line)}: {problem}")
            )
            frame = pd.read_csv(path, index_col=False)
    except ProfileError:
        raise
    except RepeatedKeyError as err:
        raise ProfileError(f"profile {path}: {err}") from None
    except RecursionError:  # JSON nested a few thousand deep
        raise ProfileError(f"profile {path} cannot be parsed: JSON nested too deeply") from None
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise ProfileError(f"profile {path} cannot be parsed: {err}") from None
    return validate_profile(frame, str(path), lines)


def _json_rows(path: Path, rows) -> list[dict]:
    """A JSON profile's rows: a list of objects (pandas would read a dict as columns, or fail)."""
    if not isinstance(rows, list):
        raise ProfileError(f"{path}: rows must be a list of objects (one per step), got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ProfileError(f"{path}: rows[{i}] is {row!r}, not an object (one per step)")
    return rows


def write_profile(frame: pd.DataFrame, path: str | Path, meta: dict | None = None) -> Path:
    """Write a profile as CSV (with ``<name>.meta.json`` beside it when meta is given) or JSON.

    Each file is written beside its name and renamed into place: whole or not at all."""
    path = Path(path)
    frame = validate_profile(frame, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        doc = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "meta": meta or {},
            "rows": frame.to_dict("records"),
        }
        write_text_atomic(path, json.dumps(doc, indent=1))
    else:
        if meta:  # the meta file first: a profile is never there without the meta it was written with
            write_text_atomic(path.with_suffix(".meta.json"), json.dumps(meta, indent=2))
        with atomic_path(path) as temporary:
            frame.to_csv(temporary, index=False)
    return path


def validate_profile(frame: pd.DataFrame, where: str = "profile", lines: list[int] | None = None) -> pd.DataFrame:
    """Check columns and values; return a clean copy with integer columns as int64.

    ``lines``: the file line of each row (a CSV file's), so a bad row is named by its line;
    without it, by its position in the table ("row 3", from 0)."""

    def at(row: int) -> str:
        return f"{located(where, lines[row])}: " if lines is not None else f"{where}: row {row}: "

    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise ProfileError(f"{where}: missing column(s) {', '.join(missing)} (required: {', '.join(REQUIRED_COLUMNS)})")
    if len(frame) == 0:
        raise ProfileError(f"{where}: no rows")
    frame = frame.copy()
    for column in INT_COLUMNS:
        if column not in frame.columns:
            continue
        values = numbers(frame[column])
        # past MAX_TOKENS a count is no step a machine ran (1e13 tokens), and past 2**63 it would wrap
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0) | (values != np.round(values)) | (values > MAX_TOKENS))
        if bad.size:
            raise ProfileError(
                f"{at(bad[0])}{column}={show(frame[column].iloc[bad[0]])}; expected {TOKEN_COUNT.describe()}"
            )
        frame[column] = values.astype(np.int64)
    step = numbers(frame["step_ms"])
    bad = np.flatnonzero(~np.isfinite(step) | (step <= 0) | (step > MAX_MS))
    if bad.size:
        raise ProfileError(
            f"{at(bad[0])}step_ms={show(frame['step_ms'].iloc[bad[0]])}; expected {DURATION_MS.describe()}"
        )
    frame["step_ms"] = step
    if START_COLUMN in frame.columns:
        start = numbers(frame[START_COLUMN])
        bad = np.flatnonzero(~np.isfinite(start) | (start < CLOCK_MS.low) | (start > CLOCK_MS.high))
        if bad.size:
            raise ProfileError(
                f"{at(bad[0])}{START_COLUMN}={show(frame[START_COLUMN].iloc[bad[0]])}; expected {CLOCK_MS.describe()}"
            )
        frame[START_COLUMN] = start
    empty = np.flatnonzero((frame["n_decodes"].to_numpy() == 0) & (frame["chunk_tokens"].to_numpy() == 0))
    if empty.size:
        raise ProfileError(f"{at(empty[0])}an empty step (n_decodes=0 and chunk_tokens=0)")
    if OFFER_COLUMN in frame.columns:
        frame[OFFER_COLUMN] = _checked_offers(frame, at)
    if "split" in frame.columns:
        # as objects first: an all-empty split column reads as floats, which a future pandas won't fill with text
        split = frame["split"].astype(object).fillna("fit").astype(str)
        unknown = np.flatnonzero(~split.isin(["fit", "holdout"]).to_numpy())
        if unknown.size:
            raise ProfileError(
                f"{at(unknown[0])}unknown split value {split.iloc[unknown[0]]!r}; use 'fit' or 'holdout'"
            )
        frame["split"] = split
    else:
        frame["split"] = "fit"
    return frame


def format_offer(offer) -> str:
    """A chunk's prompts, [(tokens, computed), ...], as the ``offer`` column writes them ('' for none)."""
    return ";".join(f"{int(tokens)}:{int(computed)}" for tokens, computed in offer) if offer else ""


def parse_offer(cell: str) -> tuple[tuple[int, int], ...] | None:
    """An ``offer`` cell as ((tokens, computed), ...); None for an empty cell (one prompt).
    Raises ValueError on anything else."""
    if not cell:
        return None
    prompts = []
    for prompt in cell.split(";"):
        tokens, colon, computed = prompt.partition(":")
        if not colon or not tokens.isdigit() or not computed.isdigit():
            raise ValueError(f"{prompt!r} is not tokens:computed")
        prompts.append((int(tokens), int(computed)))
    return tuple(prompts)


def offers_of(frame: pd.DataFrame) -> list[tuple[tuple[int, int], ...] | None]:
    """Each row's offer (None: the chunk is one piece of one prompt), from a validated profile."""
    if OFFER_COLUMN not in frame.columns:
        return [None] * len(frame)
    return [parse_offer(cell) for cell in frame[OFFER_COLUMN]]


def _checked_offers(frame: pd.DataFrame, at) -> pd.Series:
    """The ``offer`` column as strings ('' for none), each naming at least two prompts of >= 1
    token that the step's chunk reaches past the first, the first at the step's prefix."""
    cells = frame[OFFER_COLUMN].astype(object).where(frame[OFFER_COLUMN].notna(), "").astype(str)
    chunks, prefixes = frame["chunk_tokens"].to_numpy(), frame["prefill_prefix_tokens"].to_numpy()
    for row, cell in enumerate(cells):
        try:
            offer = parse_offer(cell)
        except ValueError as err:
            raise ProfileError(f"{at(row)}offer={cell!r}: {err}; expected tokens:computed;... or empty") from None
        if offer is None:
            continue
        if len(offer) < 2 or any(tokens < 1 for tokens, _ in offer):
            raise ProfileError(f"{at(row)}offer={cell!r}: name two or more prompts of >= 1 token, or leave it empty")
        if offer[0][1] != prefixes[row] or not offer[0][0] < chunks[row] <= sum(tokens for tokens, _ in offer):
            raise ProfileError(
                f"{at(row)}offer={cell!r} does not fit the step: the first prompt's computed tokens must be "
                f"prefill_prefix_tokens ({prefixes[row]}) and chunk_tokens ({chunks[row]}) must reach past the first "
                "prompt and not past the last"
            )
    return cells
