"""Result files: strict JSON (no NaN or Infinity) that records what made it.

JSON has no NaN or Infinity; a missing or unbounded number is written as ``null`` (the
file's own fields say what it stands for, e.g. a capacity the run was too short to
measure). Every payload carries the package version and the settings that produced it.
"""

from __future__ import annotations

import json
import math
import os
from importlib import metadata
from pathlib import Path

import numpy as np


def package_version() -> str:
    try:
        return metadata.version("sloweave")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


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
    path.write_text(strict_json({"sloweave_version": package_version(), **payload}))


def check_writable(out: Path, label: str, is_file: bool = False) -> None:
    """Fail before any work when the output folder (or, ``is_file``, the output file) cannot be
    made or written: the nearest existing ancestor must be a writable folder."""
    import click

    out = Path(out)
    if is_file:
        if out.is_dir():
            raise click.BadParameter(f"{out} is a folder, not a file", param_hint=label)
        if out.exists() and not os.access(out, os.W_OK):
            raise click.BadParameter(f"cannot write {out} (the file is not writable)", param_hint=label)
        out = out.parent
    probe = out
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and (not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK)):
        raise click.BadParameter(f"cannot write results under {out} ({probe} is not a writable folder)", param_hint=label)


def command_settings() -> dict:
    """The running command's options as JSON-able settings (what a result file was made with)."""
    import click

    def plain(value):
        for attribute in ("spec", "describe"):  # a resolved cost model, engine options
            if hasattr(value, attribute):
                found = getattr(value, attribute)
                return found() if callable(found) else found
        return str(value) if isinstance(value, Path) else value

    # where the results are written is not what made them (two runs differing only there match byte for byte)
    params = click.get_current_context().params  # in the order given on the command line: sort
    return {k: plain(params[k]) for k in sorted(params) if k not in ("out_dir", "out_path")}
