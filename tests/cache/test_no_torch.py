"""The cache core must import and run without torch (the router and simulator rely on it)."""

from __future__ import annotations

import subprocess
import sys

BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import prefixkv, prefixkv.cache
from prefixkv import RadixPrefixCache, HashPrefixCache, BlockPool
c = RadixPrefixCache(8); c.insert_prefix([1, 2, 3], [0, 1, 2])
assert c.match_prefix([1, 2, 3, 4]).match_length == 3
h = HashPrefixCache(8, 2); h.insert_prefix([1, 2, 3, 4], [0, 1])
assert h.match_prefix([1, 2, 3, 4]).match_length == 4
assert "torch" not in sys.modules
print("ok")
"""


def test_cache_core_imports_without_torch():
    out = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
