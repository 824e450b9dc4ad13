"""What a stored block's key says about the engine that computed it (pure Python, no vLLM).

Both connector halves compute the same keys without talking to each other: the scheduler to
look blocks up, the worker to store them. A key (``prefixkv.tiers.keys.BlockKeyer``) chains the
block's tokens onto a root made of

* the **weights**: :func:`weights_fingerprint`, a digest of the checkpoint files themselves
  (each file's name and size, a safetensors file's header, and 16 samples of 4 KiB spread over
  every weight file), so another checkpoint, even of the same architecture, never shares keys;
* the **KV geometry**: :class:`KVGeometry` (dtype, block size, KV heads, head size, layer count,
  attention spec, device kind): an engine with another dtype, block size or layout misses;
* the operator's ``kv_namespace`` and, per request, ``cache_salt`` and the LoRA adapter.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixkv.tiers.keys import BlockKeyer

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLES = 16
SAMPLE_BYTES = 4096
CONFIG_FILES = ("config.json", "generation_config.json")


def weights_fingerprint(model_dir: str | Path) -> str:
    """A digest of the checkpoint in ``model_dir`` (32 hex digits); equal files give equal
    digests on any machine. ``ValueError`` if the directory holds no weight file."""
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES) \
        if root.is_dir() else []
    if not files:
        raise ValueError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) under {str(root)!r}")
    h = hashlib.sha256(b"prefixkv/weights/v1")
    for name in CONFIG_FILES:
        cfg = root / name
        if cfg.is_file():
            h.update(name.encode() + b"\0" + cfg.read_bytes())
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.relative_to(root).as_posix()}:{size};".encode())
        with open(path, "rb") as f:
            if path.suffix == ".safetensors" and size >= 8:
                (head_len,) = struct.unpack("<Q", f.read(8))
                h.update(f.read(min(head_len, size - 8)))  # tensor names, dtypes, shapes, offsets
            for i in range(SAMPLES):
                f.seek(max(0, (size - SAMPLE_BYTES) * i // max(1, SAMPLES - 1)))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The KV cache's shape as vLLM's ``KVCacheConfig`` states it (equal in both processes)."""

    dtype: str
    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    spec: str
    device: str

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def describe(self) -> str:
        """A stable one-line form, part of every key's root."""
        return json.dumps([self.dtype, self.block_size, self.num_kv_heads, self.head_size,
                           self.num_layers, self.spec, self.device])

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        for tag, size in (("float64", 8), ("float32", 4), ("16", 2), ("float8", 1), ("int8", 1),
                          ("uint8", 1)):
            if tag in self.dtype:
                return size
        raise ValueError(f"unsupported KV dtype {self.dtype!r}")

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.itemsize \
            * self.num_layers


def make_keyer(weights: str, model_ref: str, geometry: KVGeometry, namespace: str,
               secret_id: str = "") -> BlockKeyer:
    """The block keyer of one engine: ``weights`` (a :func:`weights_fingerprint`, or "" when
    the model is not a local directory, then ``model_ref`` names it), its geometry, the
    operator's namespace and (with a secret) the secret's public id."""
    root = "/".join(("vllm", weights or f"ref:{model_ref}", geometry.describe, namespace,
                     f"mac:{secret_id}" if secret_id else ""))
    return BlockKeyer(root, geometry.block_size)


def request_namespace(cache_salt: str | None, lora_name: str | None) -> Hashable:
    """The per-request key namespace: two salts (or adapters) never share a block."""
    return (cache_salt or "", lora_name or "")


@dataclass(slots=True)
class RequestKeys:
    """The chained keys of one request's full blocks, extended as its tokens grow."""

    keyer: BlockKeyer
    namespace: Hashable
    chain: list[bytes]

    def upto(self, token_ids: Sequence[int], num_blocks: int) -> list[bytes]:
        """The keys of the first ``num_blocks`` blocks of ``token_ids`` (computed once each)."""
        if num_blocks > len(self.chain):
            self.keyer.extend(self.chain, token_ids, num_blocks, self.namespace)
        return self.chain[:num_blocks]


def prefix_keys(keyer: BlockKeyer, token_ids: Sequence[int], cache_salt: str = "") -> list[bytes]:
    """The keys of every full block of ``token_ids`` as a request with ``cache_salt`` (no LoRA)
    would key them: what pinning that prefix protects."""
    return keyer.extend([], token_ids, len(token_ids) // keyer.block_size,
                        request_namespace(cache_salt, None))
