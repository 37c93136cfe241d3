"""One public name, one thing: no public name is defined at the top level of two modules of the
package. A piece both need lives in one module that the other imports it from; two things that
mean different things get names that say which is which."""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "sloweave"
# a command's entry point, and each module's own logger (``logging.getLogger(__name__)``)
SAME_NAME_BY_CONVENTION = {"main", "logger"}


def top_level_statements(body):
    """The module's statements, with those under a top-level ``if`` or ``try`` (still defined at import)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from top_level_statements(node.body)
            yield from top_level_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from top_level_statements(block)
        else:
            yield node


def defined_names(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
        yield node.target.id


def public_definitions() -> dict[str, set[str]]:
    """Public name -> the modules that define it."""
    modules_of = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in top_level_statements(ast.parse(path.read_text(encoding="utf-8")).body):
            for name in defined_names(node):
                if not name.startswith("_") and name not in SAME_NAME_BY_CONVENTION:
                    modules_of[name].add(module)
    return modules_of


def test_the_check_sees_definitions_of_every_kind():
    tree = ast.parse("def f(): pass\nclass C: pass\nA = 1\nB: int = 2\nif True:\n    D, E = 3, 4\n_private = 5\n")
    names = {n for node in top_level_statements(tree.body) for n in defined_names(node)}
    assert names == {"f", "C", "A", "B", "D", "E", "_private"}


def test_no_public_name_is_defined_in_two_modules():
    twice = {name: sorted(modules) for name, modules in public_definitions().items() if len(modules) > 1}
    assert not twice, "public names defined in more than one module:\n" + "\n".join(
        f"  {name}: {', '.join(modules)}" for name, modules in sorted(twice.items())
    )
