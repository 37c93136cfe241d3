"""Files that appear whole or not at all: written beside their destination, then renamed into place.

A rename within one file system is atomic (``os.replace``): a reader sees the old file or the
new one, never a half-written one, and a run stopped while writing leaves the old file as it
was. Folders of results use the same idea (``sloweave.studies.result_folders.result_folder``).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def sibling_name(path: Path, tag: str, suffix: str = "") -> Path:
    """A new hidden name beside ``path`` (``.NAME.TAG-RANDOM`` + suffix), not yet created."""
    return path.parent / f".{path.name}.{tag}-{secrets.token_hex(4)}{suffix}"


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same folder, same suffix) for the caller to write; it
    replaces ``path`` when the block ends, and is removed if the block raises (or is interrupted).
    The file is created by the caller, so it gets the usual permissions (the umask's)."""
    path = Path(path)
    temporary = sibling_name(path, "tmp", path.suffix)
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """``Path(path).write_text(text)``, whole or not at all."""
    with atomic_path(path) as temporary:
        temporary.write_text(text)
