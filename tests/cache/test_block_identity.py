"""Block identities: a fixed root, equal in every process whatever PYTHONHASHSEED says."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from prefixkv.cache import RadixPrefixCache
from prefixkv.cache.block_identity import fold_identities, identity_root
from prefixkv.cache.policies import LRUPolicy

_SCRIPT = """
from prefixkv.cache import RadixPrefixCache
from prefixkv.cache.policy_experts import ExpertsPolicy
from prefixkv.cache.block_identity import identity_root
pol = ExpertsPolicy(sample_every=4)
cache = RadixPrefixCache(64, 4, eviction_policy=pol, max_pinned_blocks=0)
cache.insert_prefix(list(range(40)), list(range(10)))
cache.insert_prefix(list(range(20)) + [7] * 20, list(range(5)) + list(range(10, 15)))
print(identity_root("x"), sorted(i for r in pol._entries.values() for i in r[2]),
      sorted(pol._shadows[0].where))
"""


def _run(seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout


def test_identities_do_not_depend_on_the_hash_seed() -> None:
    """The experts policy samples blocks by identity: a replay must give the same figures in
    every process (it did not while the root was ``hash()`` of a string)."""
    first = _run("1")
    assert first == _run("2") == _run("random")
    assert first.split()[0] == str(identity_root("x"))


def test_identity_root_is_a_stable_int_per_label() -> None:
    assert identity_root("a") == identity_root("a") != identity_root("b")
    assert 0 <= identity_root("a") < 2**63


class Recording(LRUPolicy):
    """LRU that keeps the entries it was told about."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_access(self, entry: Any) -> None:
        self.seen.append(entry)


def test_fold_identities_memoizes_and_chains_from_the_root() -> None:
    pol = Recording()
    cache = RadixPrefixCache(64, 2, eviction_policy=pol, max_pinned_blocks=0)
    cache.insert_prefix([1, 2, 3, 4, 5, 6], [0, 1, 2])
    node = pol.seen[-1]
    memo: dict[int, list[int]] = {}
    ids = fold_identities(node, 7, lambda n: memo.get(id(n)),
                          lambda n, got: memo.__setitem__(id(n), got))
    h1 = hash((7, (1, 2)))
    h2 = hash((h1, (3, 4)))
    assert ids == [h1, h2, hash((h2, (5, 6)))] and memo[id(node)] == ids
    assert fold_identities(node, 7, lambda n: memo.get(id(n)), lambda n, got: None) is ids
