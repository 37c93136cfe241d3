"""The package's layers: what may import what, read from the source itself.

core (decision core) < sim (simulator) < studies < observability (dashboards, served runs)
< the bodies runtime (CPU, transformers) and vllm_plugin < cli. A layer imports only the layers before it (the two bodies not each
other), and only the bodies import an engine (torch, transformers, vLLM).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "sloweave"
ENGINES = {"torch", "transformers", "vllm", "prometheus_client"}
MAY_IMPORT = {
    "data": set(),  # the shipped length data (read as files, imports nothing)
    "core": {"core"},
    "sim": {"core", "sim"},
    "studies": {"core", "sim", "studies"},
    "observability": {"core", "sim", "studies", "observability"},
    "runtime": {"core", "sim", "studies", "runtime"},
    "vllm_plugin": {"core", "sim", "vllm_plugin"},
    "cli": {"core", "sim", "studies", "observability", "runtime", "vllm_plugin", "cli"},
}
ENGINES_ALLOWED = {
    "runtime": {"torch", "transformers"},
    "vllm_plugin": {"torch", "vllm", "prometheus_client"},
    "cli": {"click"},
}
# the command line's own library: options and commands are defined in the cli layer only
CLI_ONLY = {"click"}


def layer_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "top"


def imported_modules(path: Path):
    """Every module a file imports, at any depth (function-level imports too), with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "sloweave":  # from sloweave import x
                for alias in node.names:
                    yield f"sloweave.{alias.name}", node.lineno
            else:
                yield node.module, node.lineno


def source_files():
    return sorted(p for p in PACKAGE.rglob("*.py") if layer_of(p) != "top")


def test_every_module_sits_in_a_layer():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py"], "a module outside the layers: put it in core, sim, studies or cli"
    assert {layer_of(p) for p in source_files()} == set(MAY_IMPORT)


def violations(path: Path, layer: str) -> list[str]:
    wrong = []
    for module, line in imported_modules(path):
        root = module.split(".")[0]
        if root == "sloweave":
            target = module.split(".")[1] if "." in module else "top"
            if target not in MAY_IMPORT[layer]:
                wrong.append(f"line {line}: {module}")
        elif root in ENGINES and root not in ENGINES_ALLOWED.get(layer, set()):
            wrong.append(f"line {line}: {module} (an engine)")
        elif root in CLI_ONLY and root not in ENGINES_ALLOWED.get(layer, set()):
            wrong.append(f"line {line}: {module} (command-line code outside the cli layer)")
    return wrong


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_layer_imports_only_the_layers_before_it_and_no_engine_below_the_bodies(path):
    assert violations(path, layer_of(path)) == [], (
        f"{path.relative_to(PACKAGE)} ({layer_of(path)}) imports above its layer"
    )


def test_the_checker_catches_an_import_from_above_or_an_engine_even_inside_a_function(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text(
        "from sloweave.core import cost\ndef f():\n    from sloweave.sim.engine import simulate\n    import torch.nn\n    import click\n"
    )
    assert violations(bad, "core") == [
        "line 3: sloweave.sim.engine",
        "line 4: torch.nn (an engine)",
        "line 5: click (command-line code outside the cli layer)",
    ]
    assert violations(bad, "runtime") == ["line 5: click (command-line code outside the cli layer)"]
    assert violations(bad, "cli") == ["line 4: torch.nn (an engine)"]


def test_importing_the_core_the_simulator_and_the_studies_loads_no_engine():
    code = (
        "import sys, importlib, pkgutil, sloweave\n"
        "for layer in ('core', 'sim', 'studies'):\n"
        "    pkg = importlib.import_module('sloweave.' + layer)\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(f'sloweave.{layer}.{m.name}')\n"
        "import sloweave.vllm_plugin.config\n"
        "print(sorted(e for e in ('torch', 'transformers', 'vllm') if e in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
