"""The package tree reads like the request path: no module imports from a package above it,
and few modules sit loose under tokenyard/ (DESIGN.md, "Package layout")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tokenyard"

# lowest first; a module may import its own package and anything in a lower layer (the first
# layer's modules are the shared ground: wire types, settings, errors and observability)
LAYERS: list[set[str]] = [
    {"messages", "config", "errors", "limits", "logs", "heap", "children", "tracing", "metrics"},
    {"tenancy"},
    {"broker"},
    {"engines"},
    {"worker"},
    {"gateway"},
    {"fleet"},
    {"bench"},
    {"cli"},
    {"__main__"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "tokenyard":
                found += [(node.lineno, f"tokenyard.{alias.name}") for alias in node.names]
            elif node.module.startswith("tokenyard."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("tokenyard.")]
    return found


def test_no_module_imports_from_a_package_above_it() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        home = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if home == "__init__":
            continue
        assert home in LAYER, f"{home} has no place in LAYERS"
        for line, module in _imported(ast.parse(path.read_text())):
            target = module.split(".")[1]
            assert target in LAYER, f"{module} has no place in LAYERS"
            if target != home and LAYER[target] >= LAYER[home] and LAYER[home] > 0:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert upward == []


def test_few_modules_sit_loose_under_the_package() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 10, loose
