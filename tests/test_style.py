"""One formatter and one linter for the whole tree (configured in pyproject.toml: ruff, 120
columns, the rules that catch errors). A change that is not formatted, or that leaves an unused
import or an undefined name, fails here with ruff's own list of what to fix."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ["src", "tests", "benchmarks", "scripts"]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_the_tree_is_formatted_and_lint_free(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, *TREES], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
