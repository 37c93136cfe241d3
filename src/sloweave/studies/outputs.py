"""Result files: strict JSON (no NaN or Infinity) that records what made it.

JSON has no NaN or Infinity; a missing or unbounded number is written as ``null`` (the
file's own fields say what it stands for, e.g. a capacity the run was too short to
measure). Every payload carries the package version, where its code was imported from (and in a
git work tree that code's commit), and the settings that produced it.
The folders they go in are ``sloweave.studies.result_folders``'.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from sloweave.core.atomic import sibling_name, write_text_atomic
from sloweave.core.validate import OptionError


def package_version() -> str:
    try:
        return metadata.version("sloweave")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


@functools.cache
def code_source() -> dict:
    """Where the running sloweave was imported from and, in a git work tree, that tree's commit and
    how many of its files differ from it. The package version alone does not tell two trees apart:
    a result made by an earlier tree put first on the path (to set it against this one) says so here."""
    path = Path(__file__).resolve().parents[1]  # the package this module belongs to

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    changed = git("status", "--porcelain", "--", ".")
    return {
        "path": str(path),
        "git_commit": git("rev-parse", "HEAD"),
        "files_changed_since_commit": None if changed is None else len(changed.splitlines()),
    }


def _strict(value):
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, (np.integer, int)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    return value


def strict_json(payload: dict) -> str:
    """``payload`` as strict JSON text; non-finite numbers become null."""
    return json.dumps(_strict(payload), indent=2, allow_nan=False) + "\n"


def write_result_json(path: Path, payload: dict) -> None:
    """``payload`` with the package version, as strict JSON, written whole or not at all."""
    write_text_atomic(
        path, strict_json({"sloweave_version": package_version(), "sloweave_code": code_source(), **payload})
    )


def check_writable(out: Path, label: str, is_file: bool = False) -> None:
    """Fail before any work when the output folder (or, ``is_file``, the output file) cannot be
    made or written: the nearest existing ancestor of the folder it goes in must be a folder
    where something can really be made (tried: permission bits say nothing for root or /proc).
    Results are written beside their destination and renamed into place, so that is the folder."""
    out = Path(out)
    if is_file:
        if out.is_dir():
            raise OptionError(f"{out} is a folder, not a file", label)
        if out.exists() and not os.access(out, os.W_OK):
            raise OptionError(f"cannot write {out} (the file is not writable)", label)
    elif out.exists() and not out.is_dir():
        raise OptionError(f"{out} is a file, not a folder", label)
    probe = out.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and (not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK)):
        raise OptionError(f"cannot write results under {out} ({probe} is not a writable folder)", label)
    if probe.is_dir():
        trial = sibling_name(probe / "x", "write-check")
        try:
            trial.mkdir()
            trial.rmdir()
        except OSError as err:
            raise OptionError(
                f"cannot write results under {out} ({probe} is not a writable folder: {err.strerror or err})",
                label,
            ) from None


# Options that say where and how results are written, not what made them: left out of the
# settings (two runs differing only there match byte for byte, a resumed run too).
WRITING_OPTIONS = ("out_dir", "out_path", "force", "resume")


@dataclass(frozen=True)
class CommandRun:
    """The command being run, as its command line gave it: what its result files record."""

    name: str  # "replay"
    path: str  # "sloweave replay"
    params: dict  # every option and argument by parameter name, as given or defaulted
    labels: dict[str, str]  # parameter name -> how the command line names it ("--trace", "TRACE")


_RUNNING: ContextVar[CommandRun | None] = ContextVar("running_command", default=None)


@contextmanager
def running_command(run: CommandRun) -> Iterator[CommandRun]:
    """``run`` is the running command while the block runs (the command line enters it)."""
    token = _RUNNING.set(run)
    try:
        yield run
    finally:
        _RUNNING.reset(token)


def current_command() -> CommandRun | None:
    """The command being run, or None (called from Python, not from the command line)."""
    return _RUNNING.get()


def command_settings() -> dict:
    """The running command's options as JSON-able settings (what a result file was made with);
    empty when no command runs."""

    def plain(value):
        for attribute in ("spec", "describe"):  # a resolved cost model, engine options
            if hasattr(value, attribute):
                found = getattr(value, attribute)
                return found() if callable(found) else found
        return str(value) if isinstance(value, Path) else value

    run = current_command()
    params = {} if run is None else run.params  # in the order given on the command line: sort
    return {k: plain(params[k]) for k in sorted(params) if k not in WRITING_OPTIONS}
