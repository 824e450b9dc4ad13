"""Process-independent block keys for the lower tiers.

Key of block ``j`` of a prompt = ``sha256(parent_key || tokens of block j)``, where the chain's
root is ``sha256`` of the *fingerprint* (model weights sample, dtype, block size, KV layout,
tier namespace) and the request's namespace (``cache_salt`` / LoRA id). Equal keys therefore
mean: same model, same KV layout, same tenant, same tokens from position 0 up to the block's
end; so a key names exactly one block of KV, on any machine. sha256 keeps collisions out of
reach, so a hit needs no token check.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence

from prefixkv.cache.hashing import check_key_part

KEY_VERSION = b"prefixkv/tier-key/v1"


class BlockKeyer:
    """Computes chained block keys (32-byte digests) for one engine's KV layout."""

    __slots__ = ("block_size", "fingerprint")

    def __init__(self, fingerprint: str, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.fingerprint = fingerprint
        self.block_size = block_size

    def root(self, namespace: Hashable | None) -> bytes:
        """The parent key of a chain's first block in ``namespace``."""
        check_key_part(namespace, "namespace")
        seed = b"\x00".join(
            (KEY_VERSION, self.fingerprint.encode(), str(self.block_size).encode(),
             repr(namespace).encode())
        )
        return hashlib.sha256(seed).digest()

    def extend(
        self, chain: list[bytes], token_ids: Sequence[int], num_blocks: int,
        namespace: Hashable | None,
    ) -> list[bytes]:
        """Extend ``chain`` (the keys of ``token_ids``' first ``len(chain)`` blocks) in place to
        ``num_blocks`` keys; returns it. ``token_ids`` must hold that many full blocks."""
        bs = self.block_size
        if num_blocks * bs > len(token_ids):
            raise ValueError(f"{num_blocks} blocks need {num_blocks * bs} tokens, got {len(token_ids)}")
        parent = chain[-1] if chain else self.root(namespace)
        for j in range(len(chain), num_blocks):
            block = token_ids[j * bs : (j + 1) * bs]
            parent = hashlib.sha256(parent + struct.pack(f"<{bs}q", *block)).digest()
            chain.append(parent)
        return chain
