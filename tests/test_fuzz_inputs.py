"""Property-based fuzz tests (hypothesis) of every boundary where the project reads user input.

Each test generates well-formed and malformed inputs, small by construction (a few rows, short
strings, so nothing can take long), and asserts that every one EITHER loads exactly what it says,
compared with an oracle computed here from the generated rows, OR fails with the tool's own error
(``TraceError``, ``ProfileError``, ``PluginConfigError``) whose message names the file and, for a
problem in one row, its line (``, line N``, 1-based: the header is line 1). No other exception may
escape.

Boundaries:
- ``sloweave.sim.traces.load_trace``: normalised, Azure and Vidur CSV, Mooncake JSONL, any bytes;
- ``sloweave.core.costs.step_profiles.read_profile``: step-time profiles, CSV and JSON;
- ``sloweave.core.costs.operator_profiles.load_profiles``: a preset folder copied and corrupted;
- ``sloweave.vllm_plugin.config.PluginConfig.from_sources``: the plug-in's configuration, and
  ``request_tpot_ms``, a request's own target (the module imports without vLLM, checked below, so
  it is fuzzed here; there the "file" is the key or the environment variable the message names).

A JSON step-time profile has no row lines (one document, rows over several lines each): a bad
row is named by its position, ``row 3``; the tests ask only for the path there.

The oracle's own reading of a number (``number``): a plain decimal literal, surrounding whitespace
allowed; ``nan``, ``inf``, hex, ``1_000`` and non-ASCII digits are not numbers. Cells whose reading
a reasonable loader may take either way (non-ASCII spaces around a number in a profile) are marked
doubtful: refusing them with their line or reading the number are both right.
"""

from __future__ import annotations

import calendar
import gzip
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import MISSING, dataclass, fields, replace
from datetime import datetime, timedelta
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from sloweave.core.costs.step_profiles import REQUIRED_COLUMNS, ProfileError, read_profile
from sloweave.core.costs.operator_profiles import PRESETS, load_profiles, preset_folder
from sloweave.core.validate import DEFAULT_MAX_MODEL_LEN_TOKENS, MAX_MS, MAX_REPEATS, MAX_SECONDS, MAX_TOKENS
from sloweave.sim.traces import FORMATS, TraceError, load_trace
from sloweave.vllm_plugin.config import MAX_TPOT_MS, PluginConfig, PluginConfigError, request_tpot_ms

# Reproducible in CI (derandomize), no example database, and no deadline: a slow machine must not
# turn a correct run into a failure. Counts are modest: the whole file runs in seconds.
FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])

LINE = re.compile(r", line (\d+)\b")
INT64_LIMIT = 2**63  # a length or count at or past this does not fit the int64 it is stored in


def names_file_and_line(err: Exception, path, lines=frozenset()) -> None:
    """``err`` names ``path``; when the oracle found bad rows (``lines``) it names one of them."""
    event("refused for a row" if lines else "refused")  # how the examples split (--hypothesis-show-statistics)
    message = str(err)
    assert str(path) in message, f"the message does not name the file {path}: {message}"
    if lines:
        found = LINE.search(message)
        assert found, f"a problem in a row (line(s) {sorted(lines)}) but no ', line N' in: {message}"
        assert int(found.group(1)) in lines, f"expected one of line(s) {sorted(lines)}: {message}"


# ----------------------------------------------------------------------------- the oracle's numbers

NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def number(text: str) -> float | None:
    """What a cell says as a finite number, or None (not a number)."""
    text = text.strip()
    if not NUMBER.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def tokens(value: float | None) -> int | None:
    """A token length: a whole number >= 1."""
    if value is None or value != round(value) or value < 1:
        return None
    return int(value)


def json_number(value) -> float | None:
    """A JSON value as a finite number (a JSON string holding a number counts; true does not)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return number(value)
    if isinstance(value, int):
        try:
            value = float(value)
        except OverflowError:
            return None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None


# Token lengths to write; long ones (at the default context and far past it) come as junk cells.
LENGTHS = st.integers(1, 4000)
LONG = ("524288", "1048575", "1048576", "1000000000000")

# Cells a file can hold in place of a good value: no comma, quote or line break, so the rows keep
# their shape (those are generated separately as damage).
CELL_JUNK = (
    "",
    " ",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "-1",
    "0",
    "-0",
    "1.5",
    "1.0",
    "1e3",
    "1e12",
    "1e20",
    "1e400",
    "abc",
    "True",
    "false",
    str(INT64_LIMIT),
    "99999999999999999999999",
    " 42 ",
    "\t7",
    "+5",
    "5.",
    ".5e1",
    "0x10",
    "1_000",
    "\uff14\uff12",
    "\u0663",
    "\u00a012",
    "\u00e9",
    "12abc",
    "--1",
    "1e",
    "\x00",
)
SAFE_CHARS = st.characters(blacklist_characters=',"\r\n', blacklist_categories=("Cs",))
JUNK_CELLS = st.one_of(
    st.sampled_from(CELL_JUNK),
    st.sampled_from(LONG),
    st.text(SAFE_CHARS, max_size=5),
    st.integers(-10, 10**25).map(str),
    st.floats().map(repr),
)
LIMITS = st.sampled_from([DEFAULT_MAX_MODEL_LEN_TOKENS, DEFAULT_MAX_MODEL_LEN_TOKENS, 10_000, MAX_TOKENS])


# ----------------------------------------------------------------------------- CSV layout and damage

# Damage done to a CSV file as it is written. Shape damage is refused by the shared shape check at
# its line; the byte-level kinds are refused naming the file only.
SHAPE_DAMAGE = (
    "extra_field_every_row",
    "trailing_comma_rows",
    "trailing_comma_everywhere",
    "extra_field",
    "missing_field",
    "repeated_column",
    "renamed_column",
    "whitespace_line_inside",
    "quoted_line_break",
)
FILE_DAMAGE = ("not_utf8", "gzip", "empty", "header_only")
HARMLESS_DAMAGE = ("blank_lines_at_end", "bom", "blank_line_inside")
CSV_DAMAGE = SHAPE_DAMAGE + FILE_DAMAGE + HARMLESS_DAMAGE


@dataclass(frozen=True)
class Csv:
    """A CSV file to write: its header, rows (cells as written) and one damage (CSV_DAMAGE)."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    damage: str = "none"
    where: int = 0  # which row the damage hits (modulo the rows)
    newline: str = "\n"
    final_newline: bool = True
    renamed: str = ""  # the column "renamed_column" renames

    def layout(self):
        """(bytes, records, problem line): records are (line, cells by column, or None for a
        blank line) in file order; the problem line is where the damage alone must be refused
        (0: the whole file, None: no problem of its own)."""
        header, rows = list(self.header), [list(r) for r in self.rows]
        n, r = len(rows), self.where % len(rows)
        problem = None
        if self.damage == "repeated_column":
            header.append(next(h for h in header if h))
            rows = [row + ["1"] for row in rows]
            problem = 1
        if self.damage == "renamed_column":
            header[header.index(self.renamed)] = self.renamed + "_x"
            problem = 1
        breaks = 0
        if self.damage == "quoted_line_break":
            rows[r][-1] = f'"{rows[r][-1]}\n"'
            problem = r + 2
        lines = [",".join(header)] + [",".join(row) for row in rows]
        records = [[i + 2, dict(zip(header, row))] for i, row in enumerate(self.rows)]
        if self.damage == "quoted_line_break":
            breaks = 1
            for rec in records[r + 1 :]:
                rec[0] += breaks
        if self.damage == "extra_field_every_row":
            lines[1:], problem = [line + ",7" for line in lines[1:]], 2
        elif self.damage == "trailing_comma_rows":
            lines[1:], problem = [line + "," for line in lines[1:]], 2
        elif self.damage == "trailing_comma_everywhere":
            lines, problem = [line + "," for line in lines], 1
        elif self.damage == "extra_field":
            lines[r + 1] += ",7"
            problem = r + 2
        elif self.damage == "missing_field":
            lines[r + 1] = lines[r + 1].rsplit(",", 1)[0]
            problem = r + 2
        elif self.damage in ("blank_line_inside", "whitespace_line_inside") and n > 1:
            k = 1 + self.where % (n - 1)  # before data row k, after at least one request
            lines.insert(k + 1, "" if self.damage == "blank_line_inside" else " \t ")
            for rec in records[k:]:
                rec[0] += 1
            records.insert(k, [k + 2, None])
            problem = None if self.damage == "blank_line_inside" else k + 2
        elif self.damage == "header_only":
            lines, records, problem = lines[:1], [], 0
        elif self.damage == "blank_lines_at_end":
            lines += ["", ""]
        text = self.newline.join(lines) + (
            self.newline if self.final_newline or self.damage == "blank_lines_at_end" else ""
        )
        data = text.encode("utf-8")
        if self.damage == "not_utf8":
            data, problem = data[: self.where % len(data)] + b"\xff" + data[self.where % len(data) :], 0
        elif self.damage == "gzip":
            data, problem = gzip.compress(data, mtime=0), 0
        elif self.damage == "empty":
            data, problem = b"", 0
        elif self.damage == "bom":
            data = b"\xef\xbb\xbf" + data
        return data, [tuple(rec) for rec in records], problem


def blank(cells: dict | None) -> bool:
    return cells is None or all(v.strip() == "" for v in cells.values())


def requests(records):
    """The records that hold requests, and the lines of blank ones inside: blank rows after the
    last request hold nothing (dropped), a blank row before a request is a problem."""
    records = list(records)
    while records and blank(records[-1][1]):
        records.pop()
    return records, {line for line, cells in records if blank(cells)}


@st.composite
def csv_damage(draw):
    return dict(
        damage=draw(st.one_of(st.just("none"), st.sampled_from(CSV_DAMAGE))),
        where=draw(st.integers(0, 20)),
        newline=draw(st.sampled_from(["\n", "\r\n"])),
        final_newline=draw(st.booleans()),
    )


def edit_cells(draw, header, rows, junk):
    """Up to two cells replaced by ``junk`` (which may also hold good values)."""
    rows = [list(r) for r in rows]
    for _ in range(draw(st.integers(0, 2))):
        i = draw(st.integers(0, len(rows) - 1))
        rows[i][draw(st.integers(0, len(header) - 1))] = draw(junk)
    return tuple(tuple(r) for r in rows)


# ----------------------------------------------------------------------------- traces: CSV

TRACE_COLUMNS = {
    "normalised": ("arrival_s", "prompt_tokens", "output_tokens"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "vidur": ("num_prefill_tokens", "num_decode_tokens"),
}
TIME_COLUMN = {"normalised": "arrival_s", "azure": "TIMESTAMP", "vidur": None}
LENGTH_COLUMNS = {fmt: columns[-2:] for fmt, columns in TRACE_COLUMNS.items()}
AZURE_BASE = datetime(2023, 11, 16, 18, 15, 46, 680590)
STAMP_JUNK = (
    "",
    "abc",
    "0",
    "-1",
    "1.5",
    "1e20",
    "2023",
    "2023-11-16",
    "now",
    "today",
    "NaT",
    "nan",
    "2023-13-01 00:00:00",
    "2023-02-30 00:00:00",
    "2023-11-16 25:00:00",
    "2023-11-16 18:15:47Z",
    "2023-11-16T18:15:47+01:00",
    "2023-11-16T18:15:45",
    "2023-11-16 18:15:46.6805900",
    " 2023-11-16 18:15:46 ",
)
STAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2})?")


def stamp(text: str):
    """(seconds since 1970 as a Fraction, has a time zone) of an Azure stamp, or None."""
    m = STAMP.fullmatch(text.strip())
    if not m:
        return None
    try:
        when = datetime(*(int(g) for g in m.groups()[:6]))
    except ValueError:
        return None
    seconds = Fraction(calendar.timegm(when.timetuple()))
    if m[7]:
        seconds += Fraction(int(m[7]), 10 ** len(m[7]))
    zone = m[8]
    if zone and zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        seconds -= sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    return seconds, zone is not None


@dataclass(frozen=True)
class TraceCsv:
    fmt: str
    csv: Csv
    limit: int = DEFAULT_MAX_MODEL_LEN_TOKENS
    forced: bool = False  # fmt= given instead of "auto"


@dataclass(frozen=True)
class Expect:
    """What a file must give: ``loads`` (the values it says) or, when that is None, an error; an
    error for a row must name one of ``lines`` (empty: a problem of the whole file)."""

    loads: dict | None = None
    lines: frozenset[int] = frozenset()


def expect_trace_csv(case: TraceCsv) -> Expect:
    data, records, problem = case.csv.layout()
    if problem is not None:
        return Expect(None, frozenset() if problem == 0 else frozenset({problem}))
    records, bad = requests(records)
    if not records:
        return Expect(None)
    if bad:
        return Expect(None, frozenset(bad))
    p_col, o_col = LENGTH_COLUMNS[case.fmt]
    prompt, output = [], []
    for line, cells in records:
        p, o = tokens(number(cells[p_col])), tokens(number(cells[o_col]))
        if p is None or o is None or p + o > case.limit or p + o >= INT64_LIMIT:
            bad.add(line)
        prompt.append(p)
        output.append(o)
    arrival = None
    time_column = TIME_COLUMN[case.fmt]
    texts = [(line, cells[time_column].strip()) for line, cells in records] if time_column else []
    if case.fmt == "normalised" and any(t for _, t in texts):
        arrival = []
        for line, t in texts:
            if number(t) is None or number(t) < 0 or number(t) > MAX_SECONDS:  # negative times are refused, not shifted
                bad.add(line)
            arrival.append(number(t))
    elif case.fmt == "azure":
        stamps = [(line, stamp(t)) for line, t in texts]
        bad |= {line for line, s in stamps if s is None}
        good = [(line, s) for line, s in stamps if s is not None]
        bad |= {line for line, s in good if s[1] != good[0][1][1]}  # a time zone on some stamps only
        arrival = [None if s is None else s[0] for _, s in stamps]
    if arrival is not None:
        lines = [line for line, _ in records]
        for i in range(1, len(arrival)):
            if arrival[i] is not None and arrival[i - 1] is not None and arrival[i] < arrival[i - 1]:
                bad.add(lines[i])  # goes backwards
    if bad:
        return Expect(None, frozenset(bad))
    if arrival is not None:
        arrival = [float(a - arrival[0]) for a in arrival]
    return Expect(dict(fmt=case.fmt, prompt=prompt, output=output, arrival=arrival))


def check_trace(path: Path, expect: Expect, load) -> None:
    try:
        trace = load()
    except TraceError as err:
        assert expect.loads is None, f"refused a good file: {err}"
        names_file_and_line(err, path, expect.lines)
        return
    assert expect.loads is not None, f"loaded a bad file (expected an error at {sorted(expect.lines) or 'the file'})"
    event("loads")
    want = expect.loads
    assert trace.fmt == want["fmt"]
    assert len(trace) == len(want["prompt"])
    assert trace.prompt_tokens.dtype == np.int64 and trace.output_tokens.dtype == np.int64
    assert trace.prompt_tokens.tolist() == want["prompt"]
    assert trace.output_tokens.tolist() == want["output"]
    if want["arrival"] is None:
        assert trace.arrival_s is None
    else:
        assert trace.arrival_s is not None and trace.arrival_s[0] == 0.0
        np.testing.assert_allclose(trace.arrival_s, want["arrival"], rtol=1e-9, atol=1e-6)


@st.composite
def trace_csvs(draw):
    fmt = draw(st.sampled_from(sorted(TRACE_COLUMNS)))
    n = draw(st.integers(1, 5))
    columns = list(draw(st.permutations(TRACE_COLUMNS[fmt])))
    note = draw(st.booleans())  # a column the loader ignores
    index = draw(st.booleans())  # a written row index (empty first header cell)
    header = ([""] if index else []) + columns + (["note"] if note else [])
    cells = {c: [str(v) for v in draw(st.lists(LENGTHS, min_size=n, max_size=n))] for c in LENGTH_COLUMNS[fmt]}
    micros = np.cumsum(draw(st.lists(st.integers(0, 10**7), min_size=n, max_size=n))).tolist()
    if fmt == "normalised":
        start = draw(st.sampled_from([0, 2_500_000, -3_000_000, 10**15]))
        length_only = draw(st.integers(0, 4)) == 0
        cells["arrival_s"] = ["" if length_only else f"{(start + us) / 1e6:.6f}" for us in micros]
    elif fmt == "azure":
        cells["TIMESTAMP"] = [
            (AZURE_BASE + timedelta(microseconds=us)).strftime("%Y-%m-%d %H:%M:%S.%f") + "0" for us in micros
        ]
    cells["note"] = [draw(st.text(SAFE_CHARS, max_size=3)) for _ in range(n)]
    cells[""] = [str(i) for i in range(n)]
    rows = tuple(tuple(cells[c][i] for c in header) for i in range(n))
    junk = JUNK_CELLS if fmt != "azure" else st.one_of(JUNK_CELLS, st.sampled_from(STAMP_JUNK))
    rows = edit_cells(draw, header, rows, junk)
    time_column = TIME_COLUMN[fmt]
    if time_column and n > 1 and draw(st.booleans()):  # two arrivals swapped: unsorted
        i, j = draw(st.permutations(range(n)))[:2]
        rows = list(map(list, rows))
        k = header.index(time_column)
        rows[i][k], rows[j][k] = rows[j][k], rows[i][k]
        rows = tuple(map(tuple, rows))
    damage = draw(csv_damage())
    csv = Csv(tuple(header), rows, renamed=draw(st.sampled_from(columns)), **damage)
    return TraceCsv(fmt, csv, draw(LIMITS), draw(st.booleans()))


def normalised(rows, damage="none", **kwargs) -> TraceCsv:
    return TraceCsv("normalised", Csv(("arrival_s", "prompt_tokens", "output_tokens"), tuple(rows), damage, **kwargs))


GOOD_ROWS = (("0.0", "100", "20"), ("0.5", "200", "30"))


@settings(max_examples=150, **FUZZ)
@given(case=trace_csvs())
# the known classes: one more field on every row (pandas shifted every column), a trailing
# comma on every row / every line, a duplicated header column, gzip and binary bytes,
# prompts of 1e12 and 1e20 tokens (also under the largest limit), a quoted line break
@example(case=normalised(GOOD_ROWS, "extra_field_every_row"))
@example(case=normalised(GOOD_ROWS, "trailing_comma_rows"))
@example(case=normalised(GOOD_ROWS, "trailing_comma_everywhere"))
@example(case=normalised(GOOD_ROWS, "repeated_column"))
@example(case=normalised(GOOD_ROWS, "gzip"))
@example(case=normalised(GOOD_ROWS, "not_utf8"))
@example(case=normalised([("0.0", "1000000000000", "20")]))
@example(case=normalised([("0.0", "1e20", "20")]))
@example(case=replace(normalised([("0.0", "1e20", "20")]), limit=MAX_TOKENS))
@example(case=normalised(GOOD_ROWS, "quoted_line_break", where=0))
@example(case=normalised(GOOD_ROWS + (("1.0", "5", "5"),), "blank_line_inside", where=0))
@example(case=normalised((("0.5", "100", "20"), ("0.0", "200", "30"))))
@example(
    case=TraceCsv(
        "azure",
        Csv(
            ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
            (("2023-11-16 18:15:46.6805900", "10", "5"), ("2023-11-16T18:15:47+01:00", "10", "5")),
        ),
    )
)
@example(
    case=TraceCsv(
        "azure", Csv(("TIMESTAMP", "ContextTokens", "GeneratedTokens"), (("-1", "10", "5"), ("now", "10", "5")))
    )
)
def test_csv_traces_load_exactly_or_are_refused_with_file_and_line(case):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.csv"
        path.write_bytes(case.csv.layout()[0])
        fmt = case.fmt if case.forced else "auto"
        check_trace(path, expect_trace_csv(case), lambda: load_trace(path, fmt=fmt, max_model_len_tokens=case.limit))


# ----------------------------------------------------------------------------- traces: Mooncake JSONL

JSON_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(["", "abc", "100", " 7 ", "1e3", "nan", "True", "1.5", "-1"]),
    st.integers(-5, 10**30),
    st.sampled_from([0, 1.5, 100.0, 2**20, 10**12, 1e20, 10**400]),
    st.floats(),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
LINE_JUNK = (
    "",
    "   ",
    "{",
    "}",
    "[]",
    "[1, 2]",
    "null",
    "5",
    '"text"',
    "{'timestamp': 1}",
    "NaN",
    "\x00",
    '{"timestamp": 1, "input_length": 2, "output_length": 3} {}',
    "[" * 3000,
)
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")


@dataclass(frozen=True)
class Jsonl:
    lines: tuple[str, ...]
    final_newline: bool = True
    newline: str = "\n"
    limit: int = DEFAULT_MAX_MODEL_LEN_TOKENS
    forced: bool = False

    def data(self) -> bytes:
        return (self.newline.join(self.lines) + (self.newline if self.final_newline else "")).encode("utf-8")


def expect_jsonl(case: Jsonl) -> Expect:
    records, bad = requests(
        [(i, None if line.strip() == "" else {"line": line}) for i, line in enumerate(case.lines, 1)]
    )
    if not records:
        return Expect(None)
    prompt, output, arrival = [], [], []
    for line_number, cells in records:
        if cells is None:
            continue  # a blank line inside: in bad already (refused in file order, like a bad record)
        try:
            record = json.loads(cells["line"])
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict) or any(k not in record for k in MOONCAKE_KEYS):
            bad.add(line_number)
            record = {}
        p, o = tokens(json_number(record.get("input_length"))), tokens(json_number(record.get("output_length")))
        t = json_number(record.get("timestamp"))
        if (
            p is None
            or o is None
            or t is None
            or t < 0
            or t > MAX_SECONDS * 1000
            or p + o > case.limit
            or p + o >= INT64_LIMIT
        ):
            bad.add(line_number)
        if arrival and t is not None and arrival[-1] is not None and t < arrival[-1]:
            bad.add(line_number)
        prompt.append(p)
        output.append(o)
        arrival.append(t)
    if bad:
        return Expect(None, frozenset(bad))
    return Expect(
        dict(fmt="mooncake", prompt=prompt, output=output, arrival=[(t - arrival[0]) / 1000 for t in arrival])
    )


@st.composite
def jsonls(draw):
    n = draw(st.integers(1, 5))
    start = draw(st.sampled_from([0, 1700000000000, 5.5]))
    stamps = (start + np.cumsum(draw(st.lists(st.integers(0, 100_000), min_size=n, max_size=n)))).tolist()
    records = [
        {"timestamp": t, "input_length": draw(LENGTHS), "output_length": draw(LENGTHS)}
        | ({"hash_ids": [1, 2]} if draw(st.booleans()) else {})
        for t in stamps
    ]
    for _ in range(draw(st.integers(0, 2))):
        record = records[draw(st.integers(0, n - 1))]
        key = draw(st.sampled_from(MOONCAKE_KEYS))
        if draw(st.integers(0, 3)) == 0:
            record.pop(key, None)
        else:
            record[key] = draw(JSON_JUNK)
    lines = [json.dumps(r) for r in records]
    if n > 1 and draw(st.integers(0, 3)) == 0:  # two records swapped: unsorted
        i, j = draw(st.permutations(range(n)))[:2]
        lines[i], lines[j] = lines[j], lines[i]
    if draw(st.integers(0, 2)) == 0:
        lines[draw(st.integers(0, n - 1))] = draw(st.sampled_from(LINE_JUNK))
    if draw(st.integers(0, 4)) == 0:
        lines += ["", ""]
    return Jsonl(
        tuple(lines), draw(st.booleans()), draw(st.sampled_from(["\n", "\r\n"])), draw(LIMITS), draw(st.booleans())
    )


MOONCAKE_GOOD = ('{"timestamp": 0, "input_length": 100, "output_length": 20}',)


@settings(max_examples=100, **FUZZ)
@given(case=jsonls())
# true is not a length of 1, null is not 0, a nested value is no number; a JSON line nested
# too deeply for the parser; a prompt of 1e12 / 1e20 tokens
@example(case=Jsonl(('{"timestamp": 0, "input_length": true, "output_length": 20}',)))
@example(case=Jsonl(('{"timestamp": true, "input_length": 5, "output_length": 20}',)))
@example(case=Jsonl(('{"timestamp": 0, "input_length": null, "output_length": 20}',)))
@example(case=Jsonl(('{"timestamp": 0, "input_length": [5], "output_length": {"n": 1}}',)))
@example(case=Jsonl(MOONCAKE_GOOD + ("[" * 3000,)))
@example(case=Jsonl(('{"timestamp": 0, "input_length": 1e12, "output_length": 20}',)))
@example(case=Jsonl(('{"timestamp": 0, "input_length": 1e20, "output_length": 20}',), limit=MAX_TOKENS))
@example(case=Jsonl(MOONCAKE_GOOD + ("", '{"timestamp": 5, "input_length": 1, "output_length": 1}')))
@example(case=Jsonl(('{"input_length": 1, "output_length": 1}', "", MOONCAKE_GOOD[0])))
def test_mooncake_jsonl_loads_exactly_or_is_refused_with_file_and_line(case):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.jsonl"
        path.write_bytes(case.data())
        fmt = "mooncake" if case.forced else "auto"
        check_trace(path, expect_jsonl(case), lambda: load_trace(path, fmt=fmt, max_model_len_tokens=case.limit))


# ----------------------------------------------------------------------------- traces: any bytes

ROW_CELLS = st.sampled_from(
    ["0", "1", "5", "0.5", "7", "", "abc", "-1", "2023-11-16 18:15:46", '"7"', " 3 ", "1e9", "nan"]
)
ROWS = st.lists(st.lists(ROW_CELLS, min_size=1, max_size=4).map(",".join), min_size=1, max_size=4)
CSV_ISH = st.text(st.sampled_from(list('0123456789.,-+e "\n\r\tab{}[]:') + ["\u00e9"]), max_size=80)
HEADERS = st.sampled_from(
    [
        "",
        "arrival_s,prompt_tokens,output_tokens\n",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n",
        "num_prefill_tokens,num_decode_tokens\n",
        ",num_prefill_tokens,num_decode_tokens\n",
    ]
)


@settings(max_examples=120, **FUZZ)
@given(
    data=st.one_of(
        st.binary(max_size=64),
        st.builds(lambda h, t: (h + t).encode("utf-8"), HEADERS, CSV_ISH),
        st.builds(
            lambda h, rows, nl: (h + nl.join(rows) + nl).encode("utf-8"),
            HEADERS,
            ROWS,
            st.sampled_from(["\n", "\r\n", "\r"]),
        ),
        st.builds(lambda t: t.encode("utf-8"), st.text(max_size=40)),
    ),
    suffix=st.sampled_from([".csv", ".jsonl", ".txt"]),
    fmt=st.sampled_from(FORMATS),
)
@example(data=b"\x00\x01\xff\xfe binary \x89PNG\r\n\x1a\n", suffix=".csv", fmt="auto")
@example(data=gzip.compress(b"arrival_s,prompt_tokens,output_tokens\n0.0,100,20\n", mtime=0), suffix=".csv", fmt="auto")
@example(data=b'arrival_s,prompt_tokens,output_tokens\n0,"5\n",5\n1,abc,5\n', suffix=".csv", fmt="auto")
@example(data=b"\narrival_s,prompt_tokens,output_tokens\n0,5,5\n", suffix=".csv", fmt="auto")
def test_any_bytes_load_as_a_sane_trace_or_are_refused_naming_the_file(data, suffix, fmt):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"trace{suffix}"
        path.write_bytes(data)
        try:
            trace = load_trace(path, fmt=fmt)
        except TraceError as err:
            names_file_and_line(err, path)
            line = LINE.search(str(err))
            if line:  # a line the file has
                assert 1 <= int(line.group(1)) <= data.count(b"\n") + data.count(b"\r") + 1, str(err)
            return
    assert len(trace) >= 1
    assert trace.prompt_tokens.min() >= 1 and trace.output_tokens.min() >= 1
    assert (trace.prompt_tokens + trace.output_tokens).max() <= DEFAULT_MAX_MODEL_LEN_TOKENS
    if trace.has_arrivals:
        assert (
            trace.arrival_s[0] == 0.0 and np.all(np.diff(trace.arrival_s) >= 0) and np.all(np.isfinite(trace.arrival_s))
        )


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "1024", None, float("nan"), MAX_TOKENS + 1, 2**70])
def test_a_bad_context_limit_is_refused_before_the_file_is_read(tmp_path, limit):
    path = tmp_path / "trace.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,20\n")
    with pytest.raises(TraceError, match="max_model_len_tokens must be a whole number of tokens >= 1"):
        load_trace(path, max_model_len_tokens=limit)


# ----------------------------------------------------------------------------- regressions found by the fuzzing


def test_azure_stamps_with_and_without_a_time_zone_are_refused_at_the_line(tmp_path):
    # pandas raised a bare ValueError ("Mixed timezones detected") without the file
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,5\n2023-11-16T18:15:47+01:00,10,5\n"
    )
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}, line 3: TIMESTAMP has a time zone"):
        load_trace(path)


def test_azure_stamps_in_different_zones_are_compared_as_instants(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16T18:15:46Z,10,5\n2023-11-16T19:15:48+01:00,10,5\n"
    )
    np.testing.assert_allclose(load_trace(path).arrival_s, [0.0, 2.0])


@pytest.mark.parametrize("bad", ["-1", "2023", "now", "today"])
def test_an_azure_stamp_must_be_a_date_and_a_time(tmp_path, bad):
    # pandas' ISO 8601 parser read "-1" as the year -1, "2023" as 1 January and "now" as the
    # clock at load time: a trace spanning millennia (or the load's own time), read silently
    path = tmp_path / "azure.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,5\n{bad},10,5\n")
    with pytest.raises(TraceError, match=rf"{re.escape(str(path))}, line 3: TIMESTAMP is not a timestamp: '{bad}'"):
        load_trace(path)


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("csv", "arrival_s,prompt_tokens,output_tokens\n0.0,1e20,20\n"),
        ("jsonl", '{"timestamp": 0, "input_length": 100000000000000000000, "output_length": 20}\n'),
    ],
)
def test_a_length_past_int64_is_refused_under_the_largest_limit(tmp_path, fmt, text):
    # with max_model_len_tokens=2**70 a 1e20-token prompt passed the context check and wrapped
    # to -9223372036854775808 tokens when stored as int64; the limit itself now has a range
    path = tmp_path / f"trace.{fmt}"
    path.write_text(text)
    with pytest.raises(
        TraceError,
        match=rf"{re.escape(str(path))}, line {1 if fmt == 'jsonl' else 2}: .*exceed the model's context of 2147483648",
    ):
        load_trace(path, max_model_len_tokens=MAX_TOKENS)


@pytest.mark.parametrize(
    "fmt, text, line",
    [
        ("csv", "arrival_s,prompt_tokens,output_tokens\n0.0,10,20\n1e300,10,20\n", 3),
        ("csv", "arrival_s,prompt_tokens,output_tokens\n9223372036854775808,10,20\n", 2),
        (
            "jsonl",
            '{"timestamp": 0, "input_length": 10, "output_length": 20}\n{"timestamp": 1e300, "input_length": 10, "output_length": 20}\n',
            2,
        ),
    ],
)
def test_an_arrival_past_the_clocks_range_is_refused_at_its_line(tmp_path, fmt, text, line):
    # arrivals of 1e300 s or 2**63 s made a float clock unable to add a millisecond: every
    # request got TTFT 0 and attainment 1.0
    path = tmp_path / f"trace.{fmt}"
    path.write_text(text)
    with pytest.raises(TraceError, match=rf"{re.escape(str(path))}, line {line}: .*arrival times must be <= 1e\+1[03]"):
        load_trace(path)


def test_a_quoted_line_break_is_refused_at_its_line(tmp_path):
    # a line break inside a quoted cell made pandas' row count drift from the file's lines, so
    # the error for "abc" (line 4) said line 3
    path = tmp_path / "trace.csv"
    path.write_text('arrival_s,prompt_tokens,output_tokens\n0,"5\n",5\n1,abc,5\n')
    with pytest.raises(TraceError, match=rf"{re.escape(str(path))}, line 2: a quoted cell spans lines"):
        load_trace(path)


def test_a_blank_first_line_is_refused_as_a_missing_header(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("\narrival_s,prompt_tokens,output_tokens\n0,5,5\n")
    with pytest.raises(TraceError, match=rf"{re.escape(str(path))}, line 1: the header is blank"):
        load_trace(path)


def test_a_jsonl_line_nested_too_deeply_is_refused_at_its_line(tmp_path):
    # json raised RecursionError, which escaped the loader
    path = tmp_path / "trace.jsonl"
    path.write_text(MOONCAKE_GOOD[0] + "\n" + "[" * 3000 + "\n")
    with pytest.raises(TraceError, match=rf"{re.escape(str(path))}, line 2: not valid JSON \(nested too deeply\)"):
        load_trace(path)


# ----------------------------------------------------------------------------- step-time profiles: CSV

PROFILE_OPTIONAL = ("context_tokens", "split", "repeat")
PANDAS_NA = {
    "",
    "#N/A",
    "#N/A N/A",
    "#NA",
    "-1.#IND",
    "-1.#QNAN",
    "-NaN",
    "-nan",
    "1.#IND",
    "1.#QNAN",
    "<NA>",
    "N/A",
    "NA",
    "NULL",
    "NaN",
    "None",
    "n/a",
    "nan",
    "null",
}


def ascii_stripped(text: str) -> bool:
    """Whether stripping ``text`` removes only ASCII spaces and tabs (pandas reads those numbers
    either way; other whitespace around a number is doubtful)."""
    return text.strip() == text.strip(" \t")


@dataclass(frozen=True)
class ProfileCsv:
    csv: Csv
    missing: str = ""  # a required column left out


def expect_profile_csv(case: ProfileCsv) -> tuple[Expect, frozenset[int]]:
    """What the file must give, and lines that may be refused even when the oracle reads them."""
    data, records, problem = case.csv.layout()
    if case.csv.damage == "renamed_column":  # a missing column (named without a line) or one ignored
        problem = None if case.csv.renamed not in REQUIRED_COLUMNS else 0
    if problem is not None:
        return Expect(None, frozenset() if problem == 0 else frozenset({problem})), frozenset()
    records = [r for r in records if r[1] is not None]  # blank lines hold no step
    if case.missing or not records:
        return Expect(None), frozenset()
    bad, doubtful, values = set(), set(), {c: [] for c in (*REQUIRED_COLUMNS, "context_tokens", "split")}
    for line, cells in records:
        for column in REQUIRED_COLUMNS + ("context_tokens",):
            if column not in cells:
                continue
            v = number(cells[column])
            if not ascii_stripped(cells[column]):
                doubtful.add(line)
            if column == "step_ms":
                ok = v is not None and 0 < v <= MAX_MS
            else:
                ok = v is not None and v == round(v) and 0 <= v <= MAX_TOKENS
            if not ok:
                bad.add(line)
            values[column].append(v)
        if values["n_decodes"][-1] == 0 and values["chunk_tokens"][-1] == 0:
            bad.add(line)  # an empty step
        if "split" in cells:
            split = "fit" if cells["split"] in PANDAS_NA else cells["split"]
            if split not in ("fit", "holdout"):
                bad.add(line)
            values["split"].append(split)
        else:
            values["split"].append("fit")
    if bad:
        return Expect(None, frozenset(bad)), frozenset(doubtful)
    return Expect({c: v for c, v in values.items() if v}), frozenset(doubtful)


@st.composite
def profile_csvs(draw):
    n = draw(st.integers(1, 5))
    optional = [c for c in PROFILE_OPTIONAL if draw(st.booleans())]
    header = list(draw(st.permutations(REQUIRED_COLUMNS + tuple(optional))))
    rows = []
    for _ in range(n):
        row = dict(
            n_decodes=draw(st.integers(0, 64)),
            chunk_tokens=draw(st.integers(0, 4096)),
            decode_kv_tokens=draw(st.integers(0, 10**6)),
            prefill_prefix_tokens=draw(st.integers(0, 4096)),
            step_ms=repr(round(draw(st.floats(0.001, 1000)), 3)),
            context_tokens=draw(st.integers(0, 8192)),
            split=draw(st.sampled_from(["fit", "holdout", ""])),
            repeat=draw(st.integers(0, 3)),
        )
        if row["n_decodes"] == 0 and row["chunk_tokens"] == 0:
            row["chunk_tokens"] = 16
        rows.append(tuple(str(row[c]) for c in header))
    junk = st.one_of(JUNK_CELLS, st.sampled_from(["fit", "holdout", "train", "Fit", "holdout ", "1"]))
    rows = edit_cells(draw, header, rows, junk)
    missing = ""
    if draw(st.integers(0, 9)) == 0:  # a required column left out
        missing = draw(st.sampled_from(REQUIRED_COLUMNS))
        k = header.index(missing)
        header.pop(k)
        rows = tuple(r[:k] + r[k + 1 :] for r in rows)
    return ProfileCsv(Csv(tuple(header), rows, renamed=header[0], **draw(csv_damage())), missing)


def check_profile(path: Path, expect: Expect, doubtful=frozenset()) -> None:
    try:
        frame = read_profile(path)
    except ProfileError as err:
        if expect.loads is not None:
            assert doubtful, f"refused a good profile: {err}"
            names_file_and_line(err, path, doubtful)
            return
        names_file_and_line(err, path, expect.lines | doubtful)
        return
    assert expect.loads is not None, f"loaded a bad profile (expected an error at {sorted(expect.lines) or 'the file'})"
    event("loads")
    for column, want in expect.loads.items():
        got = frame[column].tolist()
        if column == "split":
            assert got == want
        elif column == "step_ms":
            np.testing.assert_allclose(got, want, rtol=1e-12)
        else:
            assert frame[column].dtype == np.int64 and got == [int(v) for v in want], column
    assert len(frame) == len(expect.loads["step_ms"])


PROFILE_HEADER = REQUIRED_COLUMNS
PROFILE_ROW = ("1", "0", "300", "0", "2.5")


@settings(max_examples=120, **FUZZ)
@given(case=profile_csvs())
@example(case=ProfileCsv(Csv(PROFILE_HEADER, (PROFILE_ROW, ("4", "0", "1200", "0", "-1")))))
@example(case=ProfileCsv(Csv(PROFILE_HEADER, (PROFILE_ROW, ("nan", "0", "1200", "0", "3")))))
@example(case=ProfileCsv(Csv(PROFILE_HEADER, (PROFILE_ROW, ("1.5", "0", "1200", "0", "3")))))
@example(case=ProfileCsv(Csv(PROFILE_HEADER, (PROFILE_ROW, ("1e20", "0", "1200", "0", "3")))))
@example(case=ProfileCsv(Csv(PROFILE_HEADER, (("1", "0", "0", "0", "True"), ("2", "0", "0", "0", "True")))))
@example(
    case=ProfileCsv(
        Csv(PROFILE_HEADER, (PROFILE_ROW, PROFILE_ROW, ("2", "0", "0", "0", "-3")), "blank_line_inside", where=0)
    )
)
@example(case=ProfileCsv(Csv(PROFILE_HEADER + ("split",), (PROFILE_ROW + ("fit",), PROFILE_ROW + ("train",)))))
@example(case=ProfileCsv(Csv(PROFILE_HEADER, (PROFILE_ROW,), "extra_field_every_row")))
@example(case=ProfileCsv(Csv(PROFILE_HEADER, (PROFILE_ROW,), "repeated_column")))
def test_csv_profiles_load_exactly_or_are_refused_with_file_and_line(case):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "profile.csv"
        path.write_bytes(case.csv.layout()[0])
        expect, doubtful = expect_profile_csv(case)
        check_profile(path, expect, doubtful)


# ----------------------------------------------------------------------------- step-time profiles: JSON


@dataclass(frozen=True)
class ProfileJson:
    doc: object  # the document json.dumps writes, or bytes written as they are


def expect_profile_json(case: ProfileJson) -> Expect:
    doc = case.doc
    if isinstance(doc, bytes) or not isinstance(doc, dict) or doc.get("format") != "sloweave-profile":
        return Expect(None)
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, (int, float)) or version != 1:
        return Expect(None)
    rows = doc.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        return Expect(None)
    values = {c: [] for c in (*REQUIRED_COLUMNS, "split")}
    for row in rows:
        for column in REQUIRED_COLUMNS:
            v = json_number(row.get(column))
            ok = v is not None and (0 < v <= MAX_MS if column == "step_ms" else v == round(v) and 0 <= v <= MAX_TOKENS)
            if not ok:
                return Expect(None)
            values[column].append(v)
        if values["n_decodes"][-1] == 0 and values["chunk_tokens"][-1] == 0:
            return Expect(None)
        split = row.get("split")
        split = "fit" if split is None or (isinstance(split, float) and math.isnan(split)) else split
        if split not in ("fit", "holdout"):
            return Expect(None)
        values["split"].append(split)
    return Expect(values)


JSON_VALUES = st.one_of(JSON_JUNK, st.integers(0, 100), st.sampled_from(["fit", "holdout"]))


@st.composite
def profile_jsons(draw):
    rows = [
        dict(
            n_decodes=draw(st.integers(1, 64)),
            chunk_tokens=draw(st.integers(0, 4096)),
            decode_kv_tokens=draw(st.integers(0, 10**6)),
            prefill_prefix_tokens=0,
            step_ms=draw(st.floats(0.01, 1000)),
            split=draw(st.sampled_from(["fit", "holdout"])),
        )
        for _ in range(draw(st.integers(1, 4)))
    ]
    for _ in range(draw(st.integers(0, 2))):
        row = rows[draw(st.integers(0, len(rows) - 1))]
        key = draw(st.sampled_from(REQUIRED_COLUMNS + ("split",)))
        if draw(st.integers(0, 3)) == 0:
            row.pop(key, None)
        else:
            row[key] = draw(JSON_VALUES)
    doc = {"format": "sloweave-profile", "version": 1, "meta": {}, "rows": rows}
    which = draw(st.integers(0, 9))
    if which == 0:
        doc["format"] = draw(st.sampled_from(["sloweave", None, 1, ["sloweave-profile"]]))
    elif which == 1:
        doc["version"] = draw(st.sampled_from([2, "1", True, 1.0, None, 0]))
    elif which == 2:
        doc["rows"] = draw(st.one_of(JSON_JUNK, st.lists(JSON_JUNK, min_size=1, max_size=2), st.just([])))
    elif which == 3:
        doc = draw(st.one_of(JSON_JUNK, st.lists(st.just(doc), max_size=1)))
    elif which == 4:
        doc = draw(st.sampled_from([b"", b"{not json", b"\x1f\x8b\x08\x00", b"\xff\xfe{}", b"[" * 3000, b"null"]))
    elif which == 5:
        rows.append(draw(JSON_JUNK))
    return ProfileJson(doc)


@settings(max_examples=100, **FUZZ)
@given(case=profile_jsons())
@example(
    case=ProfileJson(
        {
            "format": "sloweave-profile",
            "version": 1,
            "rows": [
                {
                    "n_decodes": True,
                    "chunk_tokens": 0,
                    "decode_kv_tokens": 0,
                    "prefill_prefix_tokens": 0,
                    "step_ms": True,
                }
            ],
        }
    )
)
@example(
    case=ProfileJson(
        {
            "format": "sloweave-profile",
            "version": True,
            "rows": [
                {"n_decodes": 1, "chunk_tokens": 0, "decode_kv_tokens": 0, "prefill_prefix_tokens": 0, "step_ms": 1}
            ],
        }
    )
)
@example(
    case=ProfileJson(
        {
            "format": "sloweave-profile",
            "version": 1,
            "rows": [
                {"n_decodes": 1, "chunk_tokens": 0, "decode_kv_tokens": 0, "prefill_prefix_tokens": 0, "step_ms": 1},
                5,
            ],
        }
    )
)
@example(
    case=ProfileJson(
        {
            "format": "sloweave-profile",
            "version": 1,
            "rows": {
                "n_decodes": [1],
                "chunk_tokens": [0],
                "decode_kv_tokens": [0],
                "prefill_prefix_tokens": [0],
                "step_ms": [1],
            },
        }
    )
)
@example(case=ProfileJson(b"[" * 3000))
@example(
    case=ProfileJson(
        {
            "format": "sloweave-profile",
            "version": 1,
            "rows": [
                {
                    "n_decodes": 10**400,
                    "chunk_tokens": 0,
                    "decode_kv_tokens": 0,
                    "prefill_prefix_tokens": 0,
                    "step_ms": 1,
                }
            ],
        }
    )
)
def test_json_profiles_load_exactly_or_are_refused_naming_the_file(case):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "profile.json"
        path.write_bytes(case.doc if isinstance(case.doc, bytes) else json.dumps(case.doc).encode())
        check_profile(path, expect_profile_json(case))


def test_a_boolean_profile_column_is_not_read_as_ones(tmp_path):
    # pandas reads a column of True/False as booleans and to_numeric made them 1 and 0:
    # step_ms=True was a 1 ms step
    path = tmp_path / "profile.csv"
    path.write_text(",".join(PROFILE_HEADER) + "\n1,0,0,0,True\n2,0,0,0,True\n")
    with pytest.raises(
        ProfileError,
        match=rf"{re.escape(str(path))}, line 2: step_ms=True; expected a finite number of milliseconds > 0 and <= 1e\+10",
    ):
        read_profile(path)


def test_a_profile_error_names_the_line_of_the_row_after_blank_lines(tmp_path):
    # the message said "row 1" (a 0-based row of the table, blank lines skipped), not line 5
    path = tmp_path / "profile.csv"
    path.write_text(",".join(PROFILE_HEADER) + "\n1,0,0,0,1\n\n\n2,0,0,0,-1\n")
    with pytest.raises(
        ProfileError,
        match=rf"{re.escape(str(path))}, line 5: step_ms=-1; expected a finite number of milliseconds > 0 and <= 1e\+10",
    ):
        read_profile(path)


def test_a_count_past_int64_is_refused_not_wrapped(tmp_path):
    # 1e20 decodes were stored as int64 -9223372036854775808
    path = tmp_path / "profile.csv"
    path.write_text(",".join(PROFILE_HEADER) + "\n1e20,0,0,0,1\n")
    with pytest.raises(
        ProfileError,
        match=rf"{re.escape(str(path))}, line 2: n_decodes=1e\+20; expected a whole number of tokens >= 0 and <= 2,147,483,648",
    ):
        read_profile(path)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"n_decodes": 1}, 5], r"rows\[1\] is 5, not an object"),
        ({"n_decodes": [1]}, r"rows must be a list of objects \(one per step\), got dict"),
    ],
)
def test_json_profile_rows_must_be_a_list_of_objects(tmp_path, rows, message):
    # a non-object row made pandas raise TypeError, which escaped read_profile
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "sloweave-profile", "version": 1, "rows": rows}))
    with pytest.raises(ProfileError, match=rf"{re.escape(str(path))}: {message}"):
        read_profile(path)


def test_a_json_integer_too_large_for_a_float_is_refused_at_its_row(tmp_path):
    # pandas' to_numeric raised OverflowError on 10**400, out of read_profile
    path = tmp_path / "profile.json"
    rows = [{"n_decodes": 10**400, "chunk_tokens": 0, "decode_kv_tokens": 0, "prefill_prefix_tokens": 0, "step_ms": 1}]
    path.write_text(json.dumps({"format": "sloweave-profile", "version": 1, "rows": rows}))
    with pytest.raises(
        ProfileError,
        match=rf"{re.escape(str(path))}: row 0: n_decodes=1000+; expected a whole number of tokens >= 0 and <= 2,147,483,648",
    ):
        read_profile(path)


def test_json_profile_version_true_is_not_version_1(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "sloweave-profile", "version": True, "rows": []}))
    with pytest.raises(ProfileError, match="unsupported version True"):
        read_profile(path)


# ----------------------------------------------------------------------------- operator-profile folders

# What load_profiles checks in each file (Vidur's column names): counts are whole numbers >= 0
# (the model's shape >= 1), times finite >= 0 ms, for every row or (attention) the rows of one kind.
SHAPE_COUNTS = ("n_head", "n_kv_head", "n_embd")
CHECKED = {
    "mlp.csv": dict(
        counts=SHAPE_COUNTS + ("num_tokens", "num_tensor_parallel_workers"),
        times=tuple(
            f"time_stats.{op}.median"
            for op in (
                "input_layernorm",
                "attn_pre_proj",
                "attn_rope",
                "attn_post_proj",
                "post_attention_layernorm",
                "mlp_up_proj",
                "mlp_act",
                "mlp_down_proj",
                "add",
            )
        ),
    ),
    "attention.csv": dict(
        counts=(
            "n_embd",
            "n_q_head",
            "n_kv_head",
            "num_tensor_parallel_workers",
            "batch_size",
            "prefill_chunk_size",
            "kv_cache_size",
        ),
        times=(),
    ),
    "all_reduce.csv": dict(counts=("num_workers", "size"), times=("time_stats.all_reduce.median",)),
    "cpu_overheads.csv": dict(
        counts=("batch_size",),
        times=("schedule_median", "sampler_e2e_median", "prepare_inputs_e2e_median", "process_model_outputs_median"),
    ),
}


@dataclass(frozen=True)
class FolderEdit:
    """One file of a copied preset damaged: a cell replaced (``damage`` "cell") or a CSV damage."""

    preset: str
    file: str
    row: int
    column: int
    value: str = ""
    damage: str = "cell"


def preset_files(preset: str) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in preset_folder(preset).iterdir()}


PRESET_TEXT = {name: preset_files(name) for name in PRESETS}
PRESET_LOADED = {name: load_profiles(name) for name in PRESETS}


def cell_is_checked(file: str, column: str, cells: dict) -> str | None:
    """How load_profiles checks this cell: "count", "bytes", "shape", "time", "flag" or None (ignored)."""
    if file == "attention.csv":
        decode = cells["is_prefill"].strip().lower() == "false"
        if column == "is_prefill":
            return "flag"
        if column == ("time_stats.attn_decode.median" if decode else "time_stats.attn_prefill.median"):
            return "time"
    if file == "mlp.csv" and column in SHAPE_COUNTS:
        return "shape"
    if column in CHECKED.get(file, {}).get("counts", ()):
        return "bytes" if column == "size" else "count"
    if column in CHECKED.get(file, {}).get("times", ()):
        return "time"
    return None


def cell_value(kind: str, text: str):
    """The cell's meaning under ``kind`` (None: refused by itself)."""
    if kind == "flag":
        return {"true": True, "false": False}.get(text.lower())
    v = number(text)
    if v is None or v < 0 or v > {"time": MAX_MS, "bytes": 2**53}.get(kind, MAX_TOKENS):
        return None
    if kind in ("count", "shape", "bytes") and v != round(v):
        return None
    if kind == "shape" and v < 1:
        return None
    return v


def same_profiles(a, b) -> None:
    for name in ("mlp", "decode", "prefill", "all_reduce", "cpu"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            pd.testing.assert_frame_equal(x.reset_index(drop=True), y.reset_index(drop=True), check_dtype=False)
    assert a.shape == b.shape and a.attention_note == b.attention_note


def read_columns(file: str) -> set[str]:
    """The columns load_profiles reads from ``file`` (a missing one is refused, naming it)."""
    columns = set(CHECKED[file]["counts"]) | set(CHECKED[file]["times"])
    if file == "attention.csv":
        columns |= {"is_prefill", "time_stats.attn_decode.median", "time_stats.attn_prefill.median"}
    return columns


def enough(values) -> bool:
    """A table read along a column needs two distinct values of it."""
    return len(set(values)) >= 2


def grid_verdict(preset: str, file: str, header: list[str], body: list[str]) -> str:
    """ "loads" or "refused" (naming the file) for a file whose every checked cell is good: the
    tables load_profiles builds need rows at the model's tensor parallelism and two distinct
    points along each axis they are read along."""
    rows = [dict(zip(header, line.split(","))) for line in body]
    tp = json.loads(PRESET_TEXT[preset]["model.json"])["tensor_parallel"]
    value = lambda row, column: number(row[column])  # noqa: E731
    if file == "mlp.csv":
        mine = [value(r, "num_tokens") for r in rows if value(r, "num_tensor_parallel_workers") == tp]
        ok = enough(mine)
    elif file == "all_reduce.csv":
        ok = enough(value(r, "size") for r in rows if value(r, "num_workers") == tp)
    elif file == "cpu_overheads.csv":
        ok = enough(value(r, "batch_size") for r in rows)
    else:  # attention.csv: decode rows by (batch_size, kv_cache_size), prefill rows by (chunk, kv_cache_size)
        prefill = [r for r in rows if r["is_prefill"].lower() == "true"]
        decode = [r for r in rows if r["is_prefill"].lower() == "false"]
        batches = {}
        for r in decode:
            batches.setdefault(value(r, "batch_size"), []).append(value(r, "kv_cache_size"))
        ok = (
            enough(batches)
            and all(enough(kv) for kv in batches.values())
            and enough(value(r, "prefill_chunk_size") for r in prefill)
            and enough(value(r, "kv_cache_size") for r in prefill)
        )
    return "loads" if ok else "refused"


# attention.csv's shape columns: each row's must match the model's (mlp.csv and model.json)
ATTENTION_SHAPE = ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers")


def damaged_folder(edit: FolderEdit, folder: Path):
    """Write the preset with ``edit`` into ``folder``; (file path, verdict), one outcome per edit:
    "same" (loads as the preset), "loads" (loads, with the edited value), ("refused", column)
    (refused naming the file, and the column unless None), a set of lines (refused naming the file
    and one of them), or ("like", bytes) (as the same rows written without the damage)."""
    for name, text in PRESET_TEXT[edit.preset].items():
        (folder / name).write_text(text, encoding="utf-8")
    path = folder / edit.file
    lines = PRESET_TEXT[edit.preset][edit.file].split("\n")
    header = lines[0].split(",")
    body = [line for line in lines[1:] if line]
    r = edit.row % len(body)
    if edit.damage != "cell":
        rows = tuple(tuple(line.split(",")) for line in body[max(0, r - 2) : r + 2])  # a few rows around the damage
        csv = Csv(tuple(header), rows, edit.damage, where=edit.row, renamed=header[edit.column % len(header)])
        data, _, problem = csv.layout()
        path.write_bytes(data)
        if problem == 0:  # not UTF-8, gzipped, empty, a header alone: the whole file is refused
            return path, ("refused", None)
        if edit.damage == "renamed_column":
            if csv.renamed in read_columns(edit.file):
                return path, ("refused", csv.renamed)  # a column it reads is missing
            problem = None  # an ignored column: the file reads as without the damage
        if problem is not None:  # refused by the shape check at its line
            return path, {problem}
        return path, ("like", replace(csv, damage="none").layout()[0])  # harmless: the rows as they are
    cells = body[r].split(",")
    column = header[edit.column % len(header)]
    before = dict(zip(header, cells))
    kind = cell_is_checked(edit.file, column, before)
    old = cells[header.index(column)]
    cells[header.index(column)] = edit.value
    body[r] = ",".join(cells)
    path.write_text("\n".join([lines[0]] + body) + "\n", encoding="utf-8")
    if kind is None:
        return path, "same"
    if not ascii_stripped(edit.value):
        return path, {r + 2}  # a number among non-ASCII spaces is no number (the shared number rule)
    new, was = cell_value(kind, edit.value), cell_value(kind, old)
    if new is None:
        return path, {r + 2}
    if new == was:
        return path, "same"
    if kind == "shape":  # mlp.csv's model shape now takes two values
        return path, ("refused", column)
    if edit.file == "attention.csv" and column in ATTENTION_SHAPE:
        return path, {r + 2}  # no longer the model's
    if kind == "flag":  # the row is now of the other kind, timed by that kind's column
        time_column = "time_stats.attn_prefill.median" if new else "time_stats.attn_decode.median"
        if cell_value("time", before[time_column]) is None:
            return path, {r + 2}
    return path, grid_verdict(edit.preset, edit.file, header, body)


FOLDER_FILES = {name: sorted(n for n in text if n.endswith(".csv")) for name, text in PRESET_TEXT.items()}


@st.composite
def folder_edits(draw):
    preset = draw(st.sampled_from(PRESETS))
    return FolderEdit(
        preset,
        draw(st.sampled_from(FOLDER_FILES[preset])),
        draw(st.integers(0, 10**6)),
        draw(st.integers(0, 40)),
        draw(st.one_of(JUNK_CELLS, st.sampled_from(["0", "1", "2", "8", "True", "false", "FALSE", "0.5"]))),
        draw(st.one_of(st.just("cell"), st.just("cell"), st.sampled_from(CSV_DAMAGE))),
    )


@settings(max_examples=60, **FUZZ)
@given(edit=folder_edits())
@example(edit=FolderEdit("llama3-8b-tp1-a100", "mlp.csv", 0, 0, "0"))  # n_head=0: head size 0, a ZeroDivisionError
@example(edit=FolderEdit("llama2-70b-tp2-a100", "attention.csv", 5, 10, "nan"))
@example(edit=FolderEdit("llama2-70b-tp2-a100", "mlp.csv", 3, 0, "", "blank_line_inside"))
def test_a_corrupted_preset_copy_loads_as_it_says_or_is_refused_with_file_and_line(edit):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "profile"
        folder.mkdir()
        path, verdict = damaged_folder(edit, folder)
        if isinstance(verdict, tuple) and verdict[0] == "like":  # the same rows without the damage
            clean = Path(tmp) / "clean"
            shutil.copytree(folder, clean)
            (clean / edit.file).write_bytes(verdict[1])
            try:
                verdict = ("same as", load_profiles(clean))
            except ProfileError as err:
                verdict = ("refused as", str(err).replace(str(clean), str(folder)))
        loads = verdict in ("same", "loads") or (isinstance(verdict, tuple) and verdict[0] == "same as")
        try:
            loaded = load_profiles(folder)
        except ProfileError as err:
            assert not loads, f"refused a good folder ({verdict}): {err}"
            if isinstance(verdict, set):
                names_file_and_line(err, path, verdict)
            elif verdict[0] == "refused as":  # the same refusal, up to the lines the damage shifted
                assert LINE.sub("", str(err)) == LINE.sub("", verdict[1])
            else:
                names_file_and_line(err, path)
                assert verdict[1] is None or verdict[1] in str(err), f"does not name the column {verdict[1]}: {err}"
            return
        assert loads, f"loaded a bad file ({verdict}: {path})"
        event(f"loads ({verdict if isinstance(verdict, str) else verdict[0]})")
        if verdict == "same":
            same_profiles(loaded, PRESET_LOADED[edit.preset])
        elif verdict != "loads":
            same_profiles(loaded, verdict[1])


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("damage", FILE_DAMAGE)
def test_an_unreadable_or_empty_mlp_csv_is_refused_naming_it(tmp_path, preset, damage):
    """Not UTF-8, gzipped, empty or a header alone: refused, naming the file (never a default)."""
    folder = tmp_path / "profile"
    folder.mkdir()
    path, verdict = damaged_folder(FolderEdit(preset, "mlp.csv", 3, 0, "", damage), folder)
    assert verdict == ("refused", None)
    with pytest.raises(ProfileError, match=rf"^{re.escape(str(path))}: "):
        load_profiles(folder)


def test_a_preset_copied_elsewhere_loads_as_the_preset(tmp_path):
    for name in PRESETS:
        shutil.copytree(preset_folder(name), tmp_path / name)
        same_profiles(load_profiles(tmp_path / name), PRESET_LOADED[name])


MODEL_JUNK = st.one_of(
    JSON_JUNK,
    st.sampled_from(
        [
            1,
            2,
            80,
            MAX_REPEATS,
            MAX_REPEATS + 1,
            10**400,
            "2",
            2.0,
            "measured",
            {"derived_from": "llama2-70b-tp2-a100"},
            {"derived_from": ""},
            {"derived_from": "nowhere"},
            {"derived_from": 5},
            {"derived_from": "a\x00b"},
            {"derived_from": "x", "more": 1},
        ]
    ),
)


@settings(max_examples=60, **FUZZ)
@given(
    preset=st.sampled_from(PRESETS),
    edits=st.dictionaries(
        st.sampled_from(["name", "num_layers", "tensor_parallel", "attention", "notes", "device"]),
        MODEL_JUNK,
        max_size=3,
    ),
    raw=st.one_of(st.none(), st.sampled_from([b"", b"{", b"[]", b"\xff\xfe", b"[" * 3000, b"null"])),
)
@example(preset="llama2-70b-tp2-a100", edits={"attention": {"derived_from": "a\x00b"}}, raw=None)
@example(preset="llama2-70b-tp2-a100", edits={"num_layers": True}, raw=None)
@example(preset="llama2-70b-tp2-a100", edits={}, raw=b"[" * 3000)
def test_model_json_junk_is_refused_naming_the_file(preset, edits, raw):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "profile"
        folder.mkdir()
        for name, text in PRESET_TEXT[preset].items():
            (folder / name).write_text(text, encoding="utf-8")
        model = json.loads(PRESET_TEXT[preset]["model.json"]) | edits
        (folder / "model.json").write_bytes(raw if raw is not None else json.dumps(model).encode())
        try:
            loaded = load_profiles(folder)
        except ProfileError as err:
            assert str(folder) in str(err), str(err)
            return
        assert raw is None
        for key in ("num_layers", "tensor_parallel"):
            assert isinstance(model[key], int) and not isinstance(model[key], bool) and 1 <= model[key] <= MAX_REPEATS
        assert (
            loaded.shape.num_layers == model["num_layers"] and loaded.shape.tensor_parallel == model["tensor_parallel"]
        )


def test_a_model_without_heads_is_refused_at_its_line(tmp_path):
    # n_head=0 gave a head size of 0 and a ZeroDivisionError when attention was derived from it
    folder = tmp_path / "profile"
    shutil.copytree(preset_folder("llama3-8b-tp1-a100"), folder)
    mlp = folder / "mlp.csv"
    lines = mlp.read_text().split("\n")
    lines[1:] = [line.replace("32,8,4096,", "0,8,4096,", 1) for line in lines[1:]]
    mlp.write_text("\n".join(lines))
    with pytest.raises(ProfileError, match=rf"{re.escape(str(mlp))}, line 2: n_head=0; expected a whole number >= 1"):
        load_profiles(folder)


def test_a_blank_line_does_not_shift_an_operator_profile_line(tmp_path):
    # the line was row + 2, wrong after a blank line that pandas skips
    folder = tmp_path / "profile"
    shutil.copytree(preset_folder("llama2-70b-tp2-a100"), folder)
    path = folder / "cpu_overheads.csv"
    lines = path.read_text().split("\n")
    cells = lines[3].split(",")
    cells[3] = "-1"
    lines[3] = ",".join(cells)
    lines.insert(2, "")
    path.write_text("\n".join(lines))
    with pytest.raises(ProfileError, match=rf"{re.escape(str(path))}, line 5: schedule_median=-1"):
        load_profiles(folder)


def test_a_boolean_operator_profile_column_is_not_read_as_ones(tmp_path):
    folder = tmp_path / "profile"
    shutil.copytree(preset_folder("llama2-70b-tp2-a100"), folder)
    path = folder / "cpu_overheads.csv"
    lines = path.read_text().split("\n")
    header = lines[0].split(",")
    k = header.index("schedule_median")
    for i in range(1, len(lines)):
        if lines[i]:
            cells = lines[i].split(",")
            cells[k] = "True"
            lines[i] = ",".join(cells)
    path.write_text("\n".join(lines))
    with pytest.raises(
        ProfileError,
        match=rf"{re.escape(str(path))}, line 2: schedule_median=True; expected a finite number of milliseconds >= 0 and <= 1e\+10",
    ):
        load_profiles(folder)


# ----------------------------------------------------------------------------- the vLLM plug-in's configuration


def test_the_plugin_config_imports_without_vllm():
    code = "import sys; sys.modules['vllm'] = None; import sloweave.vllm_plugin.config as c; c.PluginConfig.from_sources({}, {})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


CONFIG_FIELDS = {f.name: f for f in fields(PluginConfig)}
CONFIG_VALUES = st.one_of(
    JSON_JUNK,
    st.sampled_from(
        [
            25,
            25.0,
            0.5,
            3_600_000,
            3_600_001,
            4096,
            1,
            0,
            -1,
            10**400,
            float("nan"),
            float("inf"),
            "25",
            "false",
            "true",
            True,
            False,
            "analytic",
            "llama2-70b-tp2-a100",
            "regression",
            "table",
            "PROFILE",
            "/nowhere",
            "a\x00b",
            {},
            {"base_ms": 1.0},
            {"base_ms": "x"},
            {"nested": {"deep": [1]}},
        ]
    ),
)
ENV_VALUES = st.one_of(
    st.sampled_from(
        [
            "25",
            "0",
            "-1",
            "1.5",
            "nan",
            "inf",
            "1e3",
            "1e309",
            "abc",
            "",
            " 7 ",
            "true",
            "FALSE",
            "yes",
            "no",
            "1",
            "1_000",
            "4096",
            "4096.0",
            "analytic",
            "table",
            "\x00",
            "\u0663",
        ]
    ),
    st.text(max_size=4),
)
CONFIG_KEYS = st.one_of(st.sampled_from(sorted(CONFIG_FIELDS)), st.sampled_from(["tpot", "TPOT_MS", "", "margin", 1]))


def is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def finite(v) -> bool:
    try:
        return is_real(v) and math.isfinite(v)
    except OverflowError:
        return False


def config_problems(values: dict, profile_file: str) -> set[str]:
    """The keys whose value the plug-in must refuse (the oracle's own rules, from the module's table)."""
    bad = set()
    for key, v in values.items():
        if key == "tpot_ms":
            ok = finite(v) and 0 < v <= MAX_TPOT_MS
        elif key in ("max_chunk_tokens", "aging_chunk_tokens", "step_log_max_steps"):
            ok = isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_TOKENS
        elif key in ("margin_ms", "margin_fraction", "aging_ms"):
            high = {"margin_ms": MAX_TPOT_MS, "margin_fraction": 100.0, "aging_ms": MAX_MS}[key]
            ok = finite(v) and 0 <= v <= high
        elif key == "step_log":  # off (""), or a file in a folder that exists and can be written
            folder = os.path.dirname(os.path.abspath(v)) if isinstance(v, str) and v else None
            ok = isinstance(v, str) and (
                v == "" or (not os.path.isdir(v) and os.path.isdir(folder) and os.access(folder, os.W_OK))
            )
        elif key == "cost":  # a folder or file that exists counts too
            ok = isinstance(v, str) and (v in ("analytic", *PRESETS) or os.path.exists(v))
        elif key == "cost_kind":
            ok = v in ("regression", "table") and isinstance(v, str)
        elif key == "analytic":
            ok = isinstance(v, dict)
        elif key == "margin_form":  # a form given needs online_correction
            ok = isinstance(v, str) and v in ("relative", "per-step") and values.get("online_correction") is True
        else:  # profile_margin, online_correction
            ok = isinstance(v, bool)
        if not ok:
            bad.add(key)
    if values.get("profile_margin") is True and not (
        isinstance(values.get("cost"), str) and os.path.isfile(values["cost"])
    ):
        bad.add("profile_margin")
    if values.get("profile_margin") is True and values.get("online_correction") is True:
        bad.add("profile_margin")
    return bad


def env_value(key: str, raw: str):
    """What SLOWEAVE_<KEY>=raw means, or KeyError when it is not a value of the key's type."""
    kind = CONFIG_FIELDS[key].type
    try:
        if kind == "bool":
            return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[raw.lower()]
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise KeyError(key) from None
    return raw


@pytest.fixture(scope="module")
def step_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "profile.csv"
    rows = [f"{n},{c},{n * 300},0,{1 + 0.01 * n + 0.002 * c}" for n in (0, 1, 4, 16) for c in (0, 64, 256) if n or c]
    path.write_text(",".join(REQUIRED_COLUMNS) + "\n" + "\n".join(rows) + "\n")
    return str(path)


GOOD_CONFIG = {
    "tpot_ms": [25, 0.5, 3_600_000],
    "max_chunk_tokens": [4096, 1],
    "aging_chunk_tokens": [256],
    "cost": ["analytic", "PROFILE", *PRESETS],
    "cost_kind": ["regression", "table"],
    "analytic": [{}, {"base_ms": 1.0}],
    "margin_ms": [0, 1.5],
    "margin_fraction": [0.0, 0.1],
    "profile_margin": [False, True],
    "aging_ms": [0, 2000.0],
    "online_correction": [False, True],
    "margin_form": ["relative", "per-step"],
}


@st.composite
def sections(draw):
    """A plug-in section: known keys, mostly with good values, and now and then junk or an unknown key."""
    section = {}
    for _ in range(draw(st.integers(0, 4))):
        key = draw(CONFIG_KEYS)
        good = GOOD_CONFIG.get(key)
        section[key] = draw(st.sampled_from(good)) if good and draw(st.integers(0, 2)) else draw(CONFIG_VALUES)
    return section


@settings(max_examples=150, **FUZZ)
@given(
    section=sections(),
    env=st.dictionaries(st.sampled_from(sorted(k for k in CONFIG_FIELDS if k != "analytic")), ENV_VALUES, max_size=2),
    wrap=st.sampled_from(["plain", "plain", "plain", "none", "not_a_mapping", "section_junk"]),
)
@example(section={"profile_margin": "false"}, env={}, wrap="plain")
@example(section={"profile_margin": "false", "cost": "PROFILE"}, env={}, wrap="plain")
@example(section={1: 0, "a": 1}, env={}, wrap="plain")
@example(section={"tpot_ms": 10**400}, env={}, wrap="plain")
@example(section={"margin_ms": 10**400}, env={}, wrap="plain")
@example(section={}, env={"profile_margin": "false", "tpot_ms": "nan"}, wrap="plain")
def test_plugin_configuration_is_taken_as_given_or_refused_naming_the_key(step_profile, section, env, wrap):
    section = {k: (step_profile if v == "PROFILE" else v) for k, v in section.items()}
    environ = {f"SLOWEAVE_{k.upper()}": v for k, v in env.items()} | {"UNRELATED": "x"}
    additional = {
        "plain": {"sloweave": section, "other_plugin": [1]},
        "none": None,
        "not_a_mapping": ["sloweave"],
        "section_junk": {"sloweave": ["tpot_ms", 25]},
    }[wrap]
    values, problems = {}, set()
    for key, raw in env.items():
        try:
            values[key] = env_value(key, raw)
        except KeyError:
            problems.add(f"SLOWEAVE_{key.upper()}")
    if wrap == "plain":
        unknown = [k for k in section if k not in CONFIG_FIELDS]
        if unknown:
            problems.add("unknown key")
        values |= section
    elif wrap in ("section_junk", "not_a_mapping"):
        problems.add("must be an object")
    if not problems:
        problems = config_problems(values, step_profile)
    try:
        config = PluginConfig.from_sources(additional, environ)
    except PluginConfigError as err:
        assert problems, f"refused a good configuration {values}: {err}"
        event("refused")
        assert any(p in str(err) for p in problems), f"the message names none of {sorted(problems)}: {err}"
        return
    assert not problems, f"took a bad configuration (bad: {sorted(problems)}): {values}"
    event("taken")
    # with online_correction and no form given, the plug-in's own form
    defaults = {"margin_form": "per-step" if values.get("online_correction") is True else None}
    for key, f in CONFIG_FIELDS.items():
        default = defaults.get(key, f.default if f.default_factory is MISSING else f.default_factory())
        want = values.get(key, default)
        got = getattr(config, key)
        assert got == want or (is_real(want) and isinstance(got, float) and got == float(want)), (
            key
        )  # numbers kept as floats
    if config.cost == "analytic":  # the analytic coefficients are checked when the model is built
        try:
            config.build_cost_and_margin()
        except PluginConfigError as err:
            assert "analytic" in str(err)


def test_unknown_keys_of_mixed_types_are_listed_not_a_type_error():
    # sorting {1, "a"} raised TypeError out of from_sources
    with pytest.raises(PluginConfigError, match=r"unknown key\(s\) \['a', 1\]"):
        PluginConfig.from_sources({"sloweave": {1: 0, "a": 1}}, {})


@pytest.mark.parametrize("key", ["tpot_ms", "margin_ms", "aging_ms"])
def test_an_integer_too_large_for_a_float_is_refused_as_a_config_error(key):
    # math.isfinite(10**400) raised OverflowError out of the check
    with pytest.raises(PluginConfigError, match=rf"sloweave config: {key} must be a finite number"):
        PluginConfig.from_sources({"sloweave": {key: 10**400}}, {})


@settings(max_examples=80, **FUZZ)
@given(
    extra=st.one_of(
        st.none(), JSON_JUNK, st.dictionaries(st.sampled_from(["sloweave_tpot_ms", "other"]), CONFIG_VALUES, max_size=2)
    )
)
@example(extra={"sloweave_tpot_ms": 10**400})
@example(extra={"sloweave_tpot_ms": "25"})
@example(extra={"sloweave_tpot_ms": True})
def test_a_request_target_is_taken_or_refused_with_a_value_error_naming_the_key(extra):
    # The scheduler serves a request whose target raises ValueError (or TypeError) with the
    # default target; any other exception would escape add_request and stop the engine core.
    try:
        target = request_tpot_ms(extra, "r1")
    except ValueError as err:
        assert "request r1" in str(err) and ("sloweave_tpot_ms" in str(err) or "extra arguments" in str(err)), str(err)
        return
    tpot = extra.get("sloweave_tpot_ms") if isinstance(extra, dict) else None
    if target is None:
        assert not extra or "sloweave_tpot_ms" not in extra
    else:
        assert finite(tpot) and 0 < tpot <= MAX_TPOT_MS and target == float(tpot)


def test_a_request_target_too_large_for_a_float_is_a_value_error():
    # OverflowError escaped request_tpot_ms; the scheduler's add_request catches ValueError only,
    # so one request with {"sloweave_tpot_ms": 1000...0} (400 digits) would have stopped the engine
    with pytest.raises(ValueError, match="request r1: sloweave_tpot_ms must be a finite number of milliseconds > 0"):
        request_tpot_ms({"sloweave_tpot_ms": 10**400}, "r1")


def test_an_integer_margin_is_kept_as_a_float_and_one_past_its_range_is_refused_by_name():
    # margin_fraction=2**64 passed the check, then numpy raised TypeError building the margin;
    # a margin has a range now (an hour; 100x the prediction), and integers within it are floats
    config = PluginConfig.from_sources({"sloweave": {"margin_fraction": 100, "margin_ms": 3_600_000}}, {})
    assert isinstance(config.margin_fraction, float) and isinstance(config.margin_ms, float)
    config.build_cost_and_margin()
    for key in ("margin_fraction", "margin_ms"):
        with pytest.raises(
            PluginConfigError, match=f"sloweave config: {key} must be a finite number[a-z ]* >= 0 and <= "
        ):
            PluginConfig.from_sources({"sloweave": {key: 2**64}}, {})


def test_profile_margin_false_as_a_string_is_refused_as_not_a_boolean(step_profile):
    # "false" is truthy: it was refused for the wrong reason ("needs cost set to a step-time profile
    # file") without a profile, and with one the type check came after
    for section in ({"profile_margin": "false"}, {"profile_margin": "false", "cost": step_profile}):
        with pytest.raises(PluginConfigError, match=r"profile_margin must be true or false, got 'false'"):
            PluginConfig.from_sources({"sloweave": section}, {})
