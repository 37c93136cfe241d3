"""The README and docs/ name only what exists: every relative link (and its #anchor), every path in
backticks under the project's folders, and every ``sloweave.x.y`` name (module, and the function,
class or method in it). Names are resolved from the source with ``ast``, without importing it, so
the plug-in's modules are checked without vLLM. CHANGELOG.md is left out: it names removed paths
on purpose."""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_ROOT = ROOT / "src"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = ("src/", "tests/", "benchmarks/", "docs/", "scripts/", "sloweave/")

LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w.])sloweave(?:\.\w+)+")
IMPORT = re.compile(r"^\s*from (sloweave[\w.]*) import \(?([\w, ]+)", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    return frozenset(slug(h) for h in HEADING.findall(page.read_text()))


def broken_links(page: Path) -> list[str]:
    wrong = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            wrong.append(f"{target}: no such heading")
    return wrong


def broken_paths(page: Path) -> list[str]:
    wrong = []
    for code in CODE.findall(page.read_text()):
        for word in code.split():
            word = re.split(r"::|:\d", word.strip(".,;()'\""))[0]
            # placeholders and the folders a command makes (hidden ones: .vidur-venv, .vllm-tests)
            if not word.startswith(FOLDERS) or re.search(r"[*<>{}$]|\.\.\.|/\.", word):
                continue
            base = PACKAGE_ROOT if word.startswith("sloweave/") else ROOT
            if not (base / word).exists():
                wrong.append(word)
    return wrong


@cache
def module_tree(dotted: str) -> ast.Module | None:
    path = PACKAGE_ROOT.joinpath(*dotted.split("."))
    for file in (path.with_suffix(".py"), path / "__init__.py"):
        if file.exists():
            return ast.parse(file.read_text())
    return None


def defines(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The statement in ``body`` that binds ``name`` (a def, class, assignment or import), if any."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets = [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return node
        if isinstance(node, (ast.If, ast.Try)) and (found := defines(node.body, name)):
            return found
    return None


def resolves(dotted: str) -> bool:
    """``sloweave.a.b`` a module, or a module then names inside it (a class's methods too)."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        tree = module_tree(".".join(parts[:split]))
        if tree is None:
            continue
        scope: ast.AST = tree
        for name in parts[split:]:
            found = defines(scope.body, name) if hasattr(scope, "body") else None
            if found is None:
                return False
            scope = found
        return True
    return False


def broken_names(page: Path) -> list[str]:
    text = page.read_text()
    names = {name for code in CODE.findall(text) for name in DOTTED.findall(code)}
    names |= {
        f"{module}.{name.strip()}"
        for module, names in IMPORT.findall(text)
        for name in names.split(",")
        if name.strip()
    }
    return sorted(name for name in names if not resolves(name))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_path_and_name_a_page_gives_exists(page):
    assert broken_links(page) == [], "links to nothing"
    assert broken_paths(page) == [], "paths that do not exist"
    assert broken_names(page) == [], "sloweave names that do not exist"


def test_the_checker_finds_a_stale_link_path_and_name(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Real heading\n[ok](#real-heading) [bad](#gone) [file](missing.md)\n"
        "`src/sloweave/core/policy.py` `src/sloweave/nowhere.py` `tests/test_docs.py::test_x`\n"
        "`sloweave.core.policy.SLOWeave.decide` `sloweave.core.policy.Nope` `sloweave.core.gone`\n"
        "```python\nfrom sloweave.core.deadlines import DeadlineTracker, Gone\n```\n"
    )
    assert broken_links(page) == ["#gone: no such heading", "missing.md: no such file"]
    assert broken_paths(page) == ["src/sloweave/nowhere.py"]
    assert broken_names(page) == ["sloweave.core.deadlines.Gone", "sloweave.core.gone", "sloweave.core.policy.Nope"]
