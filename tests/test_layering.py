"""Layering guards, by static analysis of import statements (no module is imported, so it is fast).

- importing any module of jaxllm/server/ never imports jaxllm.cli (the server does not depend on
  the command line; engine arguments live in jaxllm.engine.arg_utils);
- importing any module of jaxllm/parallel/ never imports jaxllm.engine;
- importing any module of jaxllm/runtime/ never imports jax (the host-side runtime is pure Python).

A module of the guarded package counts every import statement it holds, also those inside
functions (they run when the function is called). What it imports counts transitively with the
statements that run at import time (module level, including `if` / `try` blocks, not
`if TYPE_CHECKING:`), and importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` too.
`importlib.import_module("literal")` counts as an import.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxllm"

RULES = [  # (package whose modules are guarded, module it must never import, why)
    ("jaxllm.server", "jaxllm.cli", "the server must not depend on the command line"),
    ("jaxllm.parallel", "jaxllm.engine", "parallel is below the engine"),
    ("jaxllm.runtime", "jax", "the host-side runtime is pure Python + numpy"),
]


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package at `root`."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, everywhere: bool) -> list[ast.AST]:
    """Import statements (and import_module calls) of a module, never those under
    `if TYPE_CHECKING:`: all the others, or only those that run when the module is imported
    (not in function bodies)."""
    found: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.Call) and _import_module_arg(node) is not None:
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):  # never runs
            for child in node.orelse:
                visit(child)
            return
        if not everywhere and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in getattr(node, "decorator_list", []):  # decorators and defaults run at import time
                visit(d)
            for d in node.args.defaults + node.args.kw_defaults:
                if d is not None:
                    visit(d)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _import_module_arg(call: ast.Call) -> str | None:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name in ("import_module", "__import__") and call.args and isinstance(call.args[0], ast.Constant) \
            and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def _with_parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


class ImportGraph:
    def __init__(self, root: Path) -> None:
        self.modules = _modules(root)

    @lru_cache(maxsize=None)
    def imports(self, module: str, everywhere: bool) -> frozenset[str]:
        """Modules one module's statements import (with their parent packages)."""
        path = self.modules[module]
        tree = ast.parse(path.read_text(), filename=str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        out: set[str] = set()
        for node in _import_nodes(tree, everywhere):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                # `from pkg import name`: name may be a submodule
                names = [target] + [f"{target}.{a.name}" for a in node.names
                                    if f"{target}.{a.name}" in self.modules]
            else:
                names = [_import_module_arg(node)]
            for n in names:
                out |= _with_parents(n)
        return frozenset(out)

    def reach(self, start: str, layer: str) -> dict[str, str | None]:
        """Every module importing `start` imports: {module: the module that imported it}.
        Modules of `layer` count all their imports; others those run at import time."""
        seen: dict[str, str | None] = {}
        todo = [(m, None) for m in sorted(_with_parents(start))]
        while todo:
            mod, parent = todo.pop()
            if mod in seen:
                continue
            seen[mod] = parent
            if mod in self.modules:
                everywhere = mod == layer or mod.startswith(layer + ".")
                todo.extend((m, mod) for m in sorted(self.imports(mod, everywhere)) if m not in seen)
        return seen


def violations(root: Path, layer: str, forbidden: str) -> list[str]:
    """'module: chain' for each module of `layer` whose import reaches `forbidden`."""
    graph = ImportGraph(root)
    out = []
    for mod in sorted(m for m in graph.modules if m == layer or m.startswith(layer + ".")):
        seen = graph.reach(mod, layer)
        hit = next((m for m in sorted(seen) if m == forbidden or m.startswith(forbidden + ".")), None)
        if hit is not None:
            chain = [hit]
            while seen[chain[-1]] is not None:
                chain.append(seen[chain[-1]])
            out.append(f"{mod}: {' <- '.join(chain)}")
    return out


@pytest.mark.parametrize("layer,forbidden,why", RULES, ids=[r[0] for r in RULES])
def test_layer_never_imports(layer, forbidden, why) -> None:
    graph = ImportGraph(PACKAGE)
    members = [m for m in graph.modules if m == layer or m.startswith(layer + ".")]
    assert len(members) > 2, f"no modules found for {layer} under {PACKAGE}"
    bad = violations(PACKAGE, layer, forbidden)
    assert not bad, f"{layer} must never import {forbidden} ({why}):\n" + "\n".join(bad)


def test_the_analysis_sees_real_imports() -> None:
    """The graph of the real tree is not vacuous: imports it must hold are found, transitively."""
    graph = ImportGraph(PACKAGE)
    server = graph.reach("jaxllm.server.app", "jaxllm.server")
    assert "jaxllm.engine.async_engine" in server and "jax" in server  # the server runs the engine
    assert "jax" in graph.reach("jaxllm.parallel.tp", "jaxllm.parallel")
    assert "jaxllm.runtime.request" in graph.reach("jaxllm.runtime.scheduler", "jaxllm.runtime")


PLANTS = {
    # where: a function-level import in the guarded package itself
    "server": ("server/fine.py", "def f():\n    from jaxllm.cli import main\n", "jaxllm.server", "jaxllm.cli"),
    # where: module level, two hops away through another package, by a relative import
    "parallel": ("parallel/fine.py", "from ..models import helper\n", "jaxllm.parallel", "jaxllm.engine"),
    # where: importlib.import_module with a literal name
    "runtime": ("runtime/fine.py", "import importlib\nimportlib.import_module('jax.numpy')\n",
                "jaxllm.runtime", "jax"),
}


@pytest.mark.parametrize("which", sorted(PLANTS))
def test_a_planted_violation_is_found(tmp_path, which) -> None:
    """The same analysis over a small tree with one planted violation reports it with its chain;
    without the plant the tree is clean, and under `if TYPE_CHECKING:` the plant does not count."""
    files = {
        "__init__.py": "", "cli.py": "import argparse\n", "engine/__init__.py": "import jax\n",
        "server/__init__.py": "", "server/app.py": "from jaxllm.engine import x\n",
        "parallel/__init__.py": "from jaxllm.parallel.fine import *\n", "parallel/fine.py": "",
        "runtime/__init__.py": "", "runtime/fine.py": "import numpy\n", "server/fine.py": "",
        "models/__init__.py": "", "models/helper.py": "def g():\n    import jaxllm.engine\n",
    }
    root = tmp_path / "jaxllm"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    rel, plant, layer, forbidden = PLANTS[which]
    assert violations(root, layer, forbidden) == []
    if which == "parallel":  # models.helper imports the engine only in a function: make it run at import
        (root / "models/helper.py").write_text("from jaxllm import engine\n")
        assert violations(root, layer, forbidden) == []  # nothing in parallel imports models yet
    (root / rel).write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            + "".join(f"    {line}\n" for line in plant.splitlines()))
    assert violations(root, layer, forbidden) == []
    (root / rel).write_text(plant)
    bad = violations(root, layer, forbidden)
    assert bad and all(forbidden in b for b in bad), bad
    assert any(b.startswith(f"{layer}.fine:") for b in bad), bad
