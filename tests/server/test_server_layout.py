"""The server's layer rule, read from the code's own imports (docs/architecture.md).

A small core and one subpackage per API dialect: the core imports no dialect but ``app.py``
(which mounts them), ``openai/`` imports no other dialect, ``anthropic/`` may import
``openai/`` (a Messages request runs as a chat completion), ``sglang/`` only ``openai/tools.py``;
nothing under ``server/`` imports the commands; and no import cycle runs through
``prefixkv.server`` or ``prefixkv.cli``. Every module there opens with its two-line docstring.
Imports inside functions count too (they are real edges, only later).
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import prefixkv

ROOT = Path(prefixkv.__file__).parent
DIALECTS = ("openai", "anthropic", "sglang")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The ``prefixkv`` modules ``path`` imports (a ``from X import name`` of a submodule
    counts as that submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("prefixkv"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("prefixkv"):
            out.add(node.module)
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists():
                    out.add(sub)
    return out


class _Graph:
    """Every ``prefixkv`` module and the ``prefixkv`` modules it imports."""

    def __init__(self) -> None:
        self.deps = {_module_name(p): _imports(p) - {_module_name(p)} for p in ROOT.rglob("*.py")}
        self.edges = [(a, b) for a, targets in self.deps.items() for b in sorted(targets)]


def _dialect(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["prefixkv", "server"] \
        and parts[2] in DIALECTS else None


def test_the_core_imports_no_dialect_but_the_app_factory() -> None:
    graph = _Graph()
    bad = [(a, b) for a, b in graph.edges
           if a.startswith("prefixkv.server") and _dialect(a) is None
           and a not in ("prefixkv.server.app",) and _dialect(b) is not None]
    assert bad == []


def test_dialects_import_only_what_the_rule_allows() -> None:
    allowed = {  # dialect -> the other dialects' modules it may import
        "openai": set(),
        "anthropic": {"prefixkv.server.openai"},  # any openai module (the chat path)
        "sglang": {"prefixkv.server.openai.tools"},
    }
    graph = _Graph()
    bad = []
    for a, b in graph.edges:
        da, db = _dialect(a), _dialect(b)
        if da is None or db is None or da == db:
            continue
        if not any(b == ok or b.startswith(ok + ".") for ok in allowed[da]):
            bad.append((a, b))
    assert bad == []
    assert not [(a, b) for a, b in graph.edges if _dialect(a) and b == "prefixkv.server.app"]


def test_the_server_imports_no_command_and_no_cycle_runs_through_server_or_cli() -> None:
    graph = _Graph()
    assert [(a, b) for a, b in graph.edges
            if a.startswith("prefixkv.server") and b.startswith("prefixkv.cli")] == []
    ours = ("prefixkv.server", "prefixkv.cli")
    sub = {a: {b for b in deps if b.startswith(ours)}
           for a, deps in graph.deps.items() if a.startswith(ours)}
    graphlib.TopologicalSorter(sub).prepare()  # CycleError names a cycle


def test_every_server_and_cli_module_says_what_it_owns_and_may_import() -> None:
    missing = []
    for folder in ("server", "cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            lines = doc.splitlines()
            if len(lines) < 2 or not lines[0].startswith("Owns: ") \
                    or not lines[1].startswith("Imports: "):
                missing.append(str(path.relative_to(ROOT)))
    assert missing == []
