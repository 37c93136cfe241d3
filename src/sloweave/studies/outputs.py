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


def check_writable(out_dir: Path, label: str) -> None:
    """Fail before any work when the output folder cannot be made or written."""
    probe = Path(out_dir)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and (not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK)):
        import click

        raise click.BadParameter(f"cannot write results under {out_dir} ({probe} is not a writable folder)", param_hint=label)
