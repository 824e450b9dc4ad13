"""Peer prefix caches for ``prefixkv bench ops``: SGLang 0.5.23 and vLLM 0.33.0, run standalone.

Each adapter builds one peer's cache with no model, no GPU and no scheduler, and exposes the
operations the benchmark times on the same workload as our indexes:

- ``key(tokens)`` and ``insert_input(tokens, block_ids)``: the peer's native inputs, built
  outside the timed region as ours are (SGLang keys are ``array('q')`` and values an int64
  tensor; vLLM takes a ``Request``, whose block hashes are computed when it is built).
- ``match(key) -> int``: the cached prefix length, in tokens.
- ``insert(inp)``: cache a sequence whose first part is already cached.
- ``evict_tokens(num_tokens) -> (tokens, units)``: ask for ``num_tokens`` tokens back; returns
  the tokens the peer actually freed and the leaves (SGLang) or blocks (vLLM) that held them.
- ``memory(prefixes) -> float | None``: bytes per cached prefix, or ``None`` where it cannot be
  measured from Python.

Importing this module imports neither torch nor the peers; :func:`make_peer` does. SGLang
imports ``torchvision`` at module level, and PyPI only has CUDA builds of it, which fail to
load against a CPU torch; the radix tree never uses it, so :func:`install_torchvision_stand_in`
answers that import with a stand-in module (only while these adapters are in use: the finder
is added by :func:`make_peer` for SGLang kinds). Benchmark use only.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import sys
import tracemalloc
import types
from array import array
from typing import Any

SGLANG_KINDS = ("sglang-radix-bs1", "sglang-radix-bs16", "sglang-unified:python-bs1",
                "sglang-unified:rust-bs1", "sglang-unified:rust-bs16")
VLLM_KINDS = ("vllm-bs16", "vllm-bs16+hash")

NOTES = {
    "sglang": "SGLang: keys are array('q') built outside the timed call (compared with our "
              "+array rows, which get the same array('q')); match refreshes recency and returns "
              "the length and last node (the KV indices are gathered later, untimed); insert "
              "takes a prebuilt int64 tensor and checks nothing; evict(num_tokens=10240) frees "
              "whole leaves until that many tokens are freed (the classic tree heapifies every "
              "evictable leaf on each call; its KV allocator only counts, except in +alloc rows, "
              "where each freed leaf goes through SGLang's own allocator onto an empty free "
              "list); memory = Python heap + 8 B/token of value tensors "
              "(n/a for the Rust core, invisible to tracemalloc).",
    "vllm": "vLLM: match = get_computed_blocks (does not refresh recency; +hash also builds the "
            "Request, i.e. hashes the blocks); insert = get_computed_blocks + allocate_slots + "
            "free (it also takes its 32 new blocks from its pool; +hash builds the Request); "
            "evict = BlockPool.get_new_blocks(640) (10,240 tokens) on a pool whose free blocks are "
            "all cached (any block may go, not only leaves: lookups stop at the first missing "
            "block).",
}


class _Placeholder:
    """An attribute of the torchvision stand-in: any attribute chain exists; calling fails."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _Placeholder(f"{self._name}.{attr}")
        object.__setattr__(self, attr, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is a stand-in in prefixkv bench ops")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import torchvision[.*]`` with modules whose attributes are placeholders.

    SGLang and transformers only import names from it at module level (``InterpolationMode``,
    ``transforms.functional``); nothing on the prefix-cache path calls them.
    """

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__version__ = "0.28.0"  # type: ignore[attr-defined]
        module.__path__ = []

        def getattr_(attr: str) -> _Placeholder:
            if attr.startswith("__"):
                raise AttributeError(attr)
            value = _Placeholder(f"{spec.name}.{attr}")
            setattr(module, attr, value)
            return value

        module.__getattr__ = getattr_  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is complete when created."""


def install_torchvision_stand_in() -> None:
    """Add the stand-in finder (once) unless a real torchvision is already imported."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionStandIn)
                                           for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionStandIn())


class _CountingAllocator:
    """The KV allocator SGLang's trees call back into: counts the token slots freed to it and
    the segments (an evicted leaf is one segment)."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed_tokens = 0
        self.freed_segments = 0

    def free(self, indices: Any) -> None:
        """Slots given back (count only: there is no KV memory)."""
        self.freed_tokens += len(indices)
        self.freed_segments += 1

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        """Slots given back by an eviction or a duplicate insert (count only)."""
        self.freed_tokens += len(indices)
        self.freed_segments += 1

    def taken(self) -> None:
        """The engine took what the last eviction freed (nothing to do: nothing is kept)."""


class _SGLangAllocator(_CountingAllocator):
    """SGLang's own allocator behind the counting one (the ``+alloc`` kinds): each evicted leaf
    goes through its real free path (``TokenToKVPoolAllocator`` at page size 1, else
    ``PagedTokenToKVPoolAllocator``), which puts the slots on its free list (``torch.cat``), as
    our evict returns its freed ids in one array. The free list is empty when an eviction
    starts, as in an engine that evicts because its pool is full and then takes the freed slots
    at once (:meth:`taken` empties it again with one attribute store)."""

    def __init__(self, page_size: int, capacity_tokens: int) -> None:
        super().__init__()
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        size = max(capacity_tokens, page_size)
        self.real = (TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
                     if page_size == 1 else
                     PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False))
        self._full = self.real.free_pages[:0]  # a full pool: nothing on the free list
        self.real.free_pages = self._full

    def free(self, indices: Any) -> None:
        """Count, then SGLang's ``free``."""
        super().free(indices)
        self.real.free(indices)

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        """Count, then SGLang's ``free_segment`` (what its trees call for an evicted leaf)."""
        super().free_segment(indices, start_pos)
        self.real.free_segment(indices, start_pos=start_pos)

    def taken(self) -> None:
        """The engine took the freed slots: the free list is empty again."""
        self.real.free_pages = self._full


def _values(block_ids: list[int], block_size: int) -> Any:
    """SGLang values: one int64 KV slot per token (block ``b`` holds slots ``b*bs..``)."""
    import torch

    ids = torch.tensor(block_ids, dtype=torch.int64)
    return (ids[:, None] * block_size + torch.arange(block_size)).reshape(-1)


class SGLangPeer:
    """SGLang's classic ``RadixCache`` or its ``UnifiedRadixCache`` (Python or Rust core)."""

    def __init__(self, kind: str, tree: str, backend: str | None, page_size: int,
                 allocator_tokens: int = 0) -> None:
        install_torchvision_stand_in()
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.kind, self.block_size = kind, page_size
        self._tree, self._backend = tree, backend
        self._key_cls, self._insert_cls = RadixKey, InsertParams
        self._match_cls, self._evict_cls = MatchPrefixParams, EvictParams
        self.allocator = (_SGLangAllocator(page_size, allocator_tokens) if allocator_tokens
                          else _CountingAllocator())
        self.cache = self._new_cache(self.allocator)
        self.note = NOTES["sglang"]

    def _new_cache(self, allocator: _CountingAllocator) -> Any:
        if self._tree == "radix":
            from sglang.srt.mem_cache.radix_cache import RadixCache

            return RadixCache.create_simulated(mock_allocator=allocator,
                                               page_size=self.block_size)
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        return UnifiedRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
            page_size=self.block_size, tree_components=(ComponentType.FULL,),
            tree_core_backend=self._backend))

    def key(self, tokens: list[int]) -> array[int]:
        """SGLang's key type (``array('q')``), built outside the timed region."""
        return array("q", tokens)

    def insert_input(self, tokens: list[int], block_ids: list[int]) -> tuple[array[int], Any]:
        """The key and the int64 KV-slot tensor SGLang stores as the node's value."""
        return self.key(tokens), _values(block_ids, self.block_size)

    def match(self, key: array[int]) -> int:
        """``match_prefix``: matched tokens (page aligned)."""
        m = self.cache.match_prefix(self._match_cls(key=self._key_cls(key)))
        return int(m.device_prefix_len)

    def insert(self, inp: tuple[array[int], Any]) -> None:
        """``insert`` of :meth:`insert_input`'s key and values (page-aligned)."""
        key, values = inp
        self.cache.insert(self._insert_cls(key=self._key_cls(key), value=values))

    def evict_tokens(self, num_tokens: int) -> tuple[int, int]:
        """``evict(num_tokens=...)``; returns (tokens, leaves) actually freed."""
        tokens, leaves = self.allocator.freed_tokens, self.allocator.freed_segments
        self.cache.evict(self._evict_cls(num_tokens=num_tokens))
        self.allocator.taken()
        return self.allocator.freed_tokens - tokens, self.allocator.freed_segments - leaves

    def memory(self, prefixes: list[list[int]]) -> float | None:
        """Bytes per cached prefix: Python heap (tracemalloc; keys are built inside the traced
        region because the tree keeps the caller's array) + the int64 value tensors it keeps
        (torch storage is invisible to tracemalloc). ``None`` for the Rust core."""
        if self._backend == "rust":
            return None
        n_blocks = [len(p) // self.block_size for p in prefixes]
        starts = [sum(n_blocks[:i]) for i in range(len(n_blocks))]
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        cache = self._new_cache(_CountingAllocator())
        for p, start, n in zip(prefixes, starts, n_blocks):
            key, values = self.insert_input(p, list(range(start, start + n)))
            cache.insert(self._insert_cls(key=self._key_cls(key), value=values))
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        del cache
        return (used + 8 * self.block_size * sum(n_blocks)) / len(prefixes)


class VLLMPeer:
    """vLLM's ``KVCacheManager`` (chained sha256 block hashes, block size 16) and its pool."""

    def __init__(self, kind: str, num_blocks: int, *, hash_in_op: bool) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        self.kind, self.block_size, self.hash_in_op = kind, 16, hash_in_op
        self._hasher = get_request_block_hasher(16, sha256)
        self._request_cls, self._sampling = Request, SamplingParams(max_tokens=1)
        self._next_id = 0
        self.manager = self._new_manager(num_blocks)
        self.note = NOTES["vllm"]

    def _new_manager(self, num_blocks: int) -> Any:
        import torch
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        return KVCacheManager(cfg, max_model_len=1 << 20, scheduler_block_size=16,
                              hash_block_size=16, enable_caching=True)

    def _request(self, tokens: list[int]) -> Any:
        self._next_id += 1
        return self._request_cls(request_id=str(self._next_id), prompt_token_ids=tokens,
                                 sampling_params=self._sampling, pooling_params=None,
                                 block_hasher=self._hasher)

    def key(self, tokens: list[int]) -> Any:
        """A ``Request`` (block hashes computed now), or the tokens when hashing is timed."""
        return tokens if self.hash_in_op else self._request(tokens)

    def insert_input(self, tokens: list[int], block_ids: list[int]) -> Any:
        """As :meth:`key`; ``block_ids`` is unused: vLLM takes its blocks from its own pool
        inside ``allocate_slots`` (part of the timed insert)."""
        return self.key(tokens)

    def match(self, key: Any) -> int:
        """``get_computed_blocks``: cached tokens (at most ``len - 1``, block aligned)."""
        req = self._request(key) if self.hash_in_op else key
        return int(self.manager.get_computed_blocks(req)[1])

    def insert(self, inp: Any) -> None:
        """The scheduler's flow: look up, ``allocate_slots`` (caches full blocks), ``free``."""
        req = self._request(inp) if self.hash_in_op else inp
        self.add(req)

    def add(self, req: Any) -> None:
        """Cache ``req``'s full blocks and release them (they stay cached, evictable)."""
        blocks, n, _ = self.manager.get_computed_blocks(req)
        if self.manager.allocate_slots(req, req.num_tokens - n, n, blocks) is None:
            raise RuntimeError(f"{self.kind}: pool too small for {req.num_tokens} tokens")
        self.manager.free(req)

    def evict_tokens(self, num_tokens: int) -> tuple[int, int]:
        """``BlockPool.get_new_blocks(num_tokens // 16)``: takes blocks from the free queue's
        head, evicting their cached hashes; returns (tokens, blocks) whose entry was dropped."""
        pool = self.manager.block_pool
        before = len(pool.cached_block_hash_to_block)
        pool.get_new_blocks(num_tokens // self.block_size)
        dropped = before - len(pool.cached_block_hash_to_block)
        return dropped * self.block_size, dropped

    def memory(self, prefixes: list[list[int]]) -> float | None:
        """Bytes per cached prefix (tracemalloc): a manager sized for exactly these blocks, its
        block objects and hash map, after caching every prefix (requests, and so the block
        hashes the cache keeps, are built inside the traced region) and dropping the requests."""
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        keep = self.manager
        self.manager = self._new_manager(sum(len(p) // 16 for p in prefixes) + 1)
        try:
            for p in prefixes:
                self.add(self._request(p))
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            self.manager = keep
        return used / len(prefixes)


def is_peer_kind(kind: str) -> bool:
    """Whether ``kind`` names a peer (``sglang-...`` or ``vllm-...``)."""
    return kind.startswith(("sglang-", "vllm-"))


def parse_peer(kind: str) -> tuple[str, str | None, int, bool]:
    """``sglang-unified:rust-bs16`` -> (``sglang-unified``, ``rust``, 16, False): the peer,
    its tree-core backend, block (page) size, and whether hashing is inside the timed op.

    Kinds: ``sglang-radix-bsN``, ``sglang-unified:python-bsN``, ``sglang-unified:rust-bsN``
    (each with ``+alloc``: evicted leaves go through SGLang's own allocator, see
    :class:`_SGLangAllocator`), ``vllm-bs16`` and ``vllm-bs16+hash``; anything else is a
    ``ValueError``. Imports nothing.
    """
    body, _, mode = kind.partition("+")
    name, sep, bs = body.rpartition("-bs")
    if not sep or not bs.isdigit() or int(bs) <= 0:
        raise ValueError(f"bad peer kind {kind!r}: expected e.g. sglang-radix-bs16, vllm-bs16")
    if name == "vllm":
        if int(bs) != 16 or mode not in ("", "hash"):
            raise ValueError(f"bad peer kind {kind!r}: vLLM kinds are vllm-bs16[+hash]")
        return name, None, 16, mode == "hash"
    if mode not in ("", "alloc"):
        raise ValueError(f"bad peer kind {kind!r}: SGLang keys are always arrays (no +{mode}); "
                         "+alloc frees through SGLang's own allocator")
    if name == "sglang-radix":
        return name, None, int(bs), False
    tree, _, backend = name.partition(":")
    if tree != "sglang-unified" or backend not in ("python", "rust"):
        raise ValueError(f"unknown peer kind {kind!r}")
    return tree, backend, int(bs), False


def make_peer(kind: str, capacity_tokens: int) -> SGLangPeer | VLLMPeer:
    """Build the peer for ``kind`` (see :func:`parse_peer`) with room for ``capacity_tokens``.

    SGLang's trees are unbounded (the allocator bounds them). vLLM's pool gets exactly
    ``capacity_tokens // 16`` blocks plus its null block, so once the workload is cached every
    free block is a cached one and taking a block evicts. Raises ``ImportError`` when the peer
    is not installed.
    """
    name, backend, bs, hash_in_op = parse_peer(kind)
    if name == "vllm":
        return VLLMPeer(kind, capacity_tokens // 16 + 1, hash_in_op=hash_in_op)
    return SGLangPeer(kind, "radix" if name == "sglang-radix" else "unified", backend, bs,
                      capacity_tokens if kind.endswith("+alloc") else 0)


def available_peers() -> tuple[tuple[str, ...], list[str]]:
    """Default peer kinds whose package imports here, and one line per missing package."""
    kinds: list[str] = []
    missing: list[str] = []
    for package, group in (("sglang", SGLANG_KINDS), ("vllm", VLLM_KINDS)):
        try:
            __import__(package)
        except ImportError as exc:
            missing.append(f"{package}: {exc}")
        else:
            kinds.extend(group)
    return tuple(kinds), missing
