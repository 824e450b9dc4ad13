"""The tiers package imports no torch (the runner moves the bytes)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import prefixkv.tiers, prefixkv.tiers.disk, prefixkv.tiers.remote
assert "torch" not in sys.modules
print("ok")
"""


def test_tiers_import_without_torch() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
