"""One shape check for every CSV file the project reads: traces, step-time profiles, operator profiles.

pandas reads a file whose rows all have one field more than the header by making the first
column an index, which shifts every column by one (prompt lengths read as arrival times),
renames a duplicated header column silently (``x``, ``x.1``), and reports a compressed or
binary file as a codec error without the path. So before pandas sees a file, this reads it
once with the csv module and refuses, naming the file and the line:
- bytes that are not UTF-8 text (a gzip-compressed or binary file);
- a header cell after the first that is empty (a trailing comma on the header) or a column
  named twice (an empty first cell is a written row index, as pandas and Vidur write it);
- a row whose number of fields differs from the header's (a trailing comma, a missing field);
- a blank first line (pandas would take the next line as the header, the csv module none);
- a quoted cell holding a line break: pandas' rows would then drift from the file's lines, so
  every later error would name the wrong line (no file read here has text cells that need one).
Blank lines are left to the caller (traces count them for line numbers); the line of every
other row is returned, so a caller that lets pandas skip blank lines still names the right one.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

# fail(line or None, problem) -> the caller's own error, which names the file (see ``located``)
Fail = Callable[[int | None, str], Exception]


def located(path: Path, line: int | None) -> str:
    """``PATH`` or ``PATH, line N``: how every reader names where a problem is."""
    return f"{path}" if line is None else f"{path}, line {line}"


def check_csv_shape(path: Path, fail: Fail) -> list[int]:
    """Refuse a misshapen file; return the line number of each non-blank row after the header
    (pandas' rows in order when it skips blank lines)."""
    lines: list[int] = []
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None:
                return lines  # empty: the caller says what an empty file means for it
            if not header:
                raise fail(1, "the header is blank (the first line must name the columns)")
            _check_header([cell.strip() for cell in header], fail)
            last = reader.line_num
            for row in reader:
                start, last = last + 1, reader.line_num
                if last != start:
                    raise fail(
                        start, "a quoted cell spans lines (a line break inside quotes); write each row on one line"
                    )
                if row and len(row) != len(header):
                    raise fail(
                        start,
                        f"{len(row)} fields where the header has {len(header)} ({', '.join(header)}); "
                        "a trailing comma or a missing or extra value?",
                    )
                if row:
                    lines.append(start)
    except UnicodeDecodeError as err:
        raise fail(None, not_text(err)) from None
    except csv.Error as err:
        raise fail(None, f"not a readable CSV file ({err})") from None
    return lines


def _check_header(header: list[str], fail: Fail) -> None:
    # An empty FIRST cell is a written row index (pandas' to_csv, Vidur's profiles): allowed.
    for i, name in enumerate(header[1:], start=2):
        if not name:
            raise fail(1, f"header field {i} is empty (a trailing comma on the header?)")
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:
        raise fail(1, f"column(s) named more than once in the header: {', '.join(repeated)}")


def not_text(err: UnicodeDecodeError) -> str:
    """What to say about a file that is not UTF-8 text (the same words for every reader)."""
    return f"not a UTF-8 text file (byte {err.start} is 0x{err.object[err.start]:02x}; compressed or binary?)"
