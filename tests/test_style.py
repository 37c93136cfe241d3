"""One formatter and one linter for the whole tree (configured in pyproject.toml: ruff, 120
columns, the rules that catch errors). A change that is not formatted, or that leaves an unused
import or an undefined name, fails here with ruff's own list of what to fix."""

import ast
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


SOURCE = ROOT / "src" / "sloweave"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500


def long_functions(path: Path, root: Path = SOURCE) -> list[str]:
    """Functions over the limit, counted from the ``def`` line to the last (decorators excluded)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_needs_a_scroll_bar():
    found = [entry for path in sorted(SOURCE.rglob("*.py")) for entry in long_functions(path)]
    assert found == [], f"functions over {MAX_FUNCTION_LINES} lines: split them into named steps"


def test_no_module_is_over_500_lines():
    sizes = {path: len(path.read_text().splitlines()) for path in sorted(SOURCE.rglob("*.py"))}
    found = [f"{path.relative_to(SOURCE)} ({n} lines)" for path, n in sizes.items() if n > MAX_MODULE_LINES]
    assert found == [], f"modules over {MAX_MODULE_LINES} lines: split them along a seam"


def test_the_length_checker_counts_from_def_to_the_last_line(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "m.py").write_text(f"@decorator\ndef fits():\n{body}\n\ndef over():\n{body}\n    return 1\n")
    assert long_functions(tmp_path / "m.py", root=tmp_path) == [f"m.py:{MAX_FUNCTION_LINES + 3} over (61 lines)"]
