"""The lock behind the README's install commands: every dependency is pinned in constraints.txt.

A new dependency added to pyproject.toml without a pin would let tomorrow's release break a
fresh install (issue 40: pytest 9.2 broke schemathesis' plugin while CI kept an older pytest).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
UNPINNED = {"torch"}  # pinned on the README's command line (the local CPU build)


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in ("test", "examples"):
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def test_every_dependency_of_the_readme_installs_is_pinned_within_its_bounds() -> None:
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name in UNPINNED or (req.marker is not None and not req.marker.evaluate()):
            continue
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject's {req.specifier}")


def test_the_readme_and_ci_install_with_the_lock() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"^\s+(pip install .*)$", readme, flags=re.M)
    assert len(commands) == 2 and all("-c constraints.txt" in c for c in commands), commands
    test_command = next(c for c in commands if "[test]" in c)
    assert test_command.split(" && ")[0] in ci
