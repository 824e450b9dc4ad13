"""The README's Python examples run as written (tinygrad's habit: docs that cannot rot)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    """The offline blocks; those that talk to a server run in .ci/readme_examples.sh."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    offline = [b for b in blocks if "openai" not in b]
    assert offline, "README lost its examples"
    for code in offline:
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    commands = re.findall(r"^    (pip install .*)$", text, flags=re.MULTILINE)
    assert len(commands) == 2
    ci = (README.parent / ".ci" / "run").read_text()
    install, test = commands[1].split(" && ")
    assert install in ci and test in ci


def test_the_examples_extra_holds_every_package_the_client_examples_import():
    """`examples/*.py` and the README's server blocks import only the standard library, prefixkv
    and what the `examples` extra (named in the README) installs."""
    import ast
    import sys
    import tomllib

    from packaging.utils import canonicalize_name

    root = README.parent
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["examples"]
    provided = {canonicalize_name(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in extra}
    text = README.read_text()
    assert '-e ".[examples]"' in text and "-c constraints.txt" in text
    sources = [p.read_text() for p in sorted((root / "examples").glob("*.py"))]
    sources += [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
                if "openai" in b]
    imported = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported
                   if m not in sys.stdlib_module_names and m not in ("prefixkv", "__future__")}
    assert third_party and {canonicalize_name(m) for m in third_party} <= provided, third_party
