"""Per-worker approximate prefix trees: what the router believes each worker has cached.

The router never sees a worker's real cache. Like SGLang's router (seed 003), it keeps, for each
worker, a radix tree of the prompts it sent there, and assumes the worker cached them until the
tree forgets them under its own LRU bound. The trees are :class:`~prefixkv.cache.RadixPrefixCache`
instances (block size 1), not a second tree implementation.

Keys. The router has no tokenizer (workers may serve any model), so a prompt's key is the UTF-8
bytes of its text, one "token" per byte: a string prompt as is; a chat as its messages rendered
``role\\x1fcontent\\x1e`` in order (a stable rendering: turn ``t + 1``'s key extends turn ``t``'s,
which is all prefix matching needs). Prompts given as token ids are keyed by those ids, in a
separate namespace. The namespace also carries the model name and ``cache_salt``, since a worker
never shares cache entries across them. Match ratio = matched key length / key length.

Values. Each tree's "block ids" are fake ids from its own :class:`~prefixkv.cache.BlockPool`; they
only measure size (one id per key element).

Bounds (SGLang's semantics, made safe by the pool): every ``eviction_interval`` the router trims
each tree down to ``max_size`` elements, least recently used leaves first. Between trims a tree
may grow up to ``2 * max_size``, its pool's size; an insert beyond that evicts LRU leaves at once.
With ``eviction_interval == 0`` the router trims after every insert, so ``max_size`` always holds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prefixkv.cache import BlockPool, RadixPrefixCache

_ROLE_END = "\x1f"
_MESSAGE_END = "\x1e"


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What the router matches: a namespace and a sequence of non-negative ints."""

    namespace: Hashable
    ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.ids)


def _text_key(text: str, namespace: Hashable) -> RouteKey:
    return RouteKey(("text", namespace), tuple(text.encode("utf-8")))


def _namespace(body: Mapping[str, Any]) -> Hashable:
    model, salt = body.get("model"), body.get("cache_salt")
    return (model if isinstance(model, str) else None, salt if isinstance(salt, str) else None)


def completion_key(body: Mapping[str, Any]) -> RouteKey:
    """Key of a ``/v1/completions`` body; a batch (list of prompts) is keyed by its first one.

    A missing or malformed prompt gives an empty key (the worker answers the 400).
    """
    ns = _namespace(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text_key(prompt, ns)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return RouteKey(("ids", ns), tuple(prompt))
    return RouteKey(("text", ns), ())


def render_messages(messages: Iterable[Any]) -> str:
    """The router's stable rendering of chat messages (not the model's chat template)."""
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            parts.append(json.dumps(message, sort_keys=True) + _MESSAGE_END)
            continue
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(
                p["text"] if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                else json.dumps(p, sort_keys=True)
                for p in content
            )
        elif not isinstance(content, str):
            content = "" if content is None else json.dumps(content, sort_keys=True)
        parts.append(f"{message.get('role', '')}{_ROLE_END}{content}{_MESSAGE_END}")
    return "".join(parts)


def chat_key(body: Mapping[str, Any]) -> RouteKey:
    """Key of a ``/v1/chat/completions`` body (empty when ``messages`` is not a list)."""
    messages = body.get("messages")
    text = render_messages(messages) if isinstance(messages, list) else ""
    return _text_key(text, _namespace(body))


class ApproxTree:
    """One worker's approximate prefix tree: a ``RadixPrefixCache`` over fake block ids.

    Owns its pool and its cache; ids never leave this object. Not thread safe beyond the
    cache's own lock: the router calls it from its event loop only.
    """

    __slots__ = ("_cache", "_pool", "max_size")

    def __init__(self, max_size: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size <= 0:
            raise ValueError(f"max_size must be a positive int, got {max_size!r}")
        self.max_size = max_size
        self._pool = BlockPool(2 * max_size)
        self._cache = RadixPrefixCache(2 * max_size, block_size=1, clock=clock)

    @property
    def size(self) -> int:
        """Key elements (bytes or token ids) the tree holds now."""
        return self._cache.num_cached_blocks

    def match(self, key: RouteKey) -> int:
        """Length of the longest prefix of ``key`` in the tree (refreshes its recency)."""
        if not key.ids:
            return 0
        return self._cache.match_prefix(key.ids, namespace=key.namespace).match_length

    def insert(self, key: RouteKey) -> None:
        """Record that the worker received ``key``; evicts LRU leaves if the pool is full.

        A key longer than the pool keeps only its leading part.
        """
        if not key.ids:
            return
        m = self._cache.match_prefix(key.ids, namespace=key.namespace, lock=True)
        try:
            room = self._pool.num_free + self._cache.num_evictable_blocks
            n = min(len(key.ids) - m.match_length, room)
            if n <= 0:
                return
            fresh = self._pool.allocate(n, evict_from=self._cache)
            if fresh is None:  # cannot happen: room counted what eviction can free
                return
            node = self._cache.insert_prefix(
                key.ids[: m.match_length + n], m.matched_kv_blocks + fresh,
                namespace=key.namespace,
            )
            self._pool.free(node.returned_block_ids)
        finally:
            self._cache.unlock(m)

    def trim(self) -> int:
        """Evict LRU leaves down to ``max_size``; returns how many elements left the tree."""
        excess = self._cache.num_cached_blocks - self.max_size
        if excess <= 0:
            return 0
        freed = self._cache.evict(excess)
        self._pool.free(freed)
        return len(freed)

    def reset(self) -> None:
        """Forget everything (the worker restarted or was unhealthy)."""
        self._pool.free(self._cache.reset())


class PrefixTrees:
    """The approximate trees of all workers, keyed by worker URL.

    ``eviction_interval == 0`` trims a tree right after each insert; otherwise the router's
    background task calls :meth:`trim` every ``eviction_interval`` seconds.
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        max_size: int,
        eviction_interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if eviction_interval < 0:
            raise ValueError(f"eviction_interval must be >= 0, got {eviction_interval!r}")
        self.max_size = max_size
        self.eviction_interval = eviction_interval
        self._clock = clock
        self._trees = {url: ApproxTree(max_size, clock=clock) for url in urls}

    def match(self, key: RouteKey, urls: Iterable[str]) -> dict[str, int]:
        """Match length of ``key`` in each of ``urls``' trees."""
        return {url: self._trees[url].match(key) for url in urls}

    def insert(self, url: str, key: RouteKey) -> None:
        """Record ``key`` as sent to ``url``."""
        tree = self._trees[url]
        tree.insert(key)
        if self.eviction_interval == 0:
            tree.trim()

    def set_max_size(self, url: str, max_size: int) -> None:
        """Bound ``url``'s tree by ``max_size`` (capped at the configured ``max_size``), e.g. the
        worker's real capacity; takes effect at the next trim (at once with interval 0)."""
        tree = self._trees[url]
        tree.max_size = max(1, min(max_size, self.max_size))
        if self.eviction_interval == 0:
            tree.trim()

    def max_sizes(self) -> dict[str, int]:
        """Each tree's current bound."""
        return {url: tree.max_size for url, tree in self._trees.items()}

    def size(self, url: str) -> int:
        """Elements held by ``url``'s tree."""
        return self._trees[url].size

    def sizes(self) -> dict[str, int]:
        """Elements held by every tree."""
        return {url: tree.size for url, tree in self._trees.items()}

    def trim(self) -> int:
        """Trim every tree to ``max_size``; returns the total evicted."""
        return sum(tree.trim() for tree in self._trees.values())

    def reset(self, url: str) -> None:
        """Forget what ``url`` was believed to hold."""
        self._trees[url].reset()
