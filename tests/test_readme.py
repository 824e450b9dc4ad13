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
