"""The offline examples run as shipped (the server ones run in .ci/readme_examples.sh)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_system_prompt_and_tenants_example():
    out = subprocess.run([sys.executable, str(EXAMPLES / "system_prompt_and_tenants.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pinned" in out.stdout and "tenant-b 0" in out.stdout
