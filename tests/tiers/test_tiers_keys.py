from __future__ import annotations

import subprocess
import sys

import pytest

from prefixkv.tiers import BlockKeyer


def test_chain_is_prefix_determined_and_namespaced() -> None:
    k = BlockKeyer("fp", 4)
    a = k.extend([], list(range(12)), 3, None)
    assert len(a) == 3 and len(set(a)) == 3
    assert k.extend([], list(range(8)) + [99, 9, 10, 11], 3, None)[:2] == a[:2]
    assert k.extend([], list(range(12)), 3, None)[2] == a[2]
    assert k.extend([], [1] + list(range(1, 12)), 3, None)[2] != a[2]  # the parent matters
    assert k.extend([], list(range(12)), 3, ("t", None))[0] != a[0]
    assert BlockKeyer("other", 4).extend([], list(range(12)), 1, None)[0] != a[0]
    partial = k.extend([], list(range(12)), 1, None)
    assert k.extend(partial, list(range(12)), 3, None) == a  # extends in place
    with pytest.raises(ValueError):
        k.extend([], [1, 2], 1, None)
    with pytest.raises(ValueError):
        BlockKeyer("fp", 0)


def test_keys_agree_across_processes() -> None:
    code = ("from prefixkv.tiers import BlockKeyer;"
            "print(BlockKeyer('fp', 2).extend([], [1, 2, 3, 4], 2, ('salt', None))[1].hex())")
    here = BlockKeyer("fp", 2).extend([], [1, 2, 3, 4], 2, ("salt", None))[1].hex()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here
