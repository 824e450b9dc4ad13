"""The layout docs/architecture.md draws: module docstrings, the layer rule, no cross-folder cycle.

Read from the source (every ``import`` and ``from ... import``, lazy ones inside functions
included), so a change that breaks the picture fails here rather than in a reader's head.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "prefixkv"


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The prefixkv modules ``name`` imports (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def _layer(module: str) -> str:
    """The top-level folder a module belongs to (``prefixkv`` for the loose top-level modules)."""
    parts = module.split(".")
    if len(parts) > 2 or MODULES[module].name == "__init__.py" and len(parts) == 2:
        return ".".join(parts[:2])
    return "prefixkv"


EDGES: dict[str, set[str]] = defaultdict(set)
for _name, _path in MODULES.items():
    for _target in _imports(_name, _path):
        if _layer(_target) != _layer(_name):
            EDGES[_layer(_name)].add(_layer(_target))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_says_what_it_owns(name: str) -> None:
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text()))
    assert doc and len(doc.split()) >= 5, f"{name} has no module docstring"


def test_no_import_cycle_between_top_level_folders() -> None:
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(EDGES.get(node, ())):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(EDGES):
        if node not in state:
            visit(node, [])


ALLOWED = {  # the layer rule (docs/architecture.md): what each folder may import
    "prefixkv.cache": set(),
    "prefixkv.tiers": {"prefixkv.cache"},
    "prefixkv.wire": {"prefixkv.tiers"},
    "prefixkv.models": set(),
    "prefixkv.runner": {"prefixkv.models"},
    "prefixkv.router": {"prefixkv", "prefixkv.cache", "prefixkv.tiers", "prefixkv.wire"},
    "prefixkv.integrations": {"prefixkv.tiers", "prefixkv.cache", "prefixkv.wire"},
}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_lower_layers_import_only_what_the_layer_rule_allows(layer: str) -> None:
    extra = EDGES.get(layer, set()) - ALLOWED[layer]
    assert not extra, f"{layer} imports {sorted(extra)}"


@pytest.mark.parametrize("layer", ["prefixkv.engine", "prefixkv.server", "prefixkv.router"])
def test_serving_layers_never_import_the_cli_or_the_benchmarks(layer: str) -> None:
    assert not EDGES.get(layer, set()) & {"prefixkv.cli", "prefixkv.bench"}
