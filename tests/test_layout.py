"""The house rules, checked on the code's own imports (an AST walk, nothing is imported).

- ``kvasir_bus`` is the contract: it imports no other project package.
- ``kernels`` (compute) and ``modelfile`` (GGUF slices) are shared libraries, not roles: they
  import the contract and each other's lower floor only, never a role.
- The roles (``workers``, ``backbone``, ``market``) import the contract and the libraries,
  never each other: the backbone's fallback is a local expert kernel, not the worker role.
- ``synth`` may read a role's tables (the architectures live in ``backbone.config``); only
  ``launch`` (``kvasir up``) imports every role.
- No import loop between project modules; no module takes another module's private names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvasir_bus", "kernels", "modelfile", "workers", "backbone", "market", "synth", "launch")
ROLES = ("workers", "backbone", "market")

#: package -> the project packages it may import (itself always).
ALLOWED = {
    "kvasir_bus": set(),
    "kernels": {"kvasir_bus"},
    "modelfile": {"kvasir_bus", "kernels"},
    "workers": {"kvasir_bus", "kernels", "modelfile"},
    "backbone": {"kvasir_bus", "kernels", "modelfile"},
    "market": {"kvasir_bus", "kernels", "modelfile"},
    "synth": {"kvasir_bus", "kernels", "modelfile", "backbone"},
    "launch": {"kvasir_bus", "kernels", "modelfile", "workers", "backbone", "market", "synth"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import names (``a.b.c`` -> ``a.b`` when ``c`` is a name in it)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


class _Imports(ast.NodeVisitor):
    """Every import of a module, top level or inside a function, and every private name taken."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.edges: set[str] = set()
        self.private: list[str] = []
        self.aliases: dict[str, str] = {}  # local name -> project module

    def _add(self, target: str | None, lineno: int) -> None:
        if target and target != self.module:
            self.edges.add(target)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            target = _resolve(alias.name)
            self._add(target, node.lineno)
            if target and alias.asname:
                self.aliases[alias.asname] = target

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            self.private.append(f"line {node.lineno}: relative import")
            return
        base = _resolve(node.module)
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            if full in MODULES:  # `from package import module`
                self._add(full, node.lineno)
                self.aliases[alias.asname or alias.name] = full
                continue
            self._add(base, node.lineno)
            if base and base != self.module and alias.name.startswith("_") and not alias.name.startswith("__"):
                self.private.append(f"line {node.lineno}: {alias.name} from {node.module}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases:
            target = self.aliases[node.value.id]
            if target != self.module and node.attr.startswith("_") and not node.attr.startswith("__"):
                self.private.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({target})")
        self.generic_visit(node)


def _scan() -> dict[str, _Imports]:
    result = {}
    for name, path in MODULES.items():
        visitor = _Imports(name)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        result[name] = visitor
    return result


SCAN = _scan()


def test_the_walk_sees_the_whole_house():
    assert set(PACKAGES) <= set(MODULES)
    assert "backbone.model" in MODULES and "workers.runtime" in MODULES
    assert SCAN["backbone.model"].edges, "the backbone's model imports project modules"


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_its_floor_allows(package):
    wrong = sorted(f"{name} imports {target}"
                   for name, scan in SCAN.items() if name.split(".")[0] == package
                   for target in scan.edges
                   if target.split(".")[0] not in ALLOWED[package] | {package})
    assert not wrong, "\n".join(wrong)


def test_no_role_imports_another_role():
    for name, scan in SCAN.items():
        own = name.split(".")[0]
        if own in ROLES:
            others = {t for t in scan.edges if t.split(".")[0] in ROLES and t.split(".")[0] != own}
            assert not others, f"{name} imports {sorted(others)}"


def test_no_import_loop_between_project_modules():
    graph = {name: scan.edges for name, scan in SCAN.items()}
    # A package's __init__ and its modules are one room: `package -> package.x` is not a loop edge.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt == node.split(".")[0] and node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                loop = visit(nxt)
                if loop:
                    return loop
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            loop = visit(node)
            assert loop is None, "import loop: " + " -> ".join(loop)


def test_no_module_takes_another_modules_private_names():
    wrong = [f"{name}: {what}" for name, scan in SCAN.items() for what in scan.private]
    assert not wrong, "\n".join(wrong)
