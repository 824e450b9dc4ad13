"""The engine's LoRA adapters: which names are known, which are loaded, and what a request runs.

``LoRARequest`` is vLLM's (a name, an int id, a path). :class:`LoRARegistry` knows adapters by
name (``--lora-modules name=path``, or added at run time, vLLM's ``/v1/load_lora_adapter``) and
keeps at most ``max_loras`` of them loaded, least recently used first out (a request holds its
own reference: an adapter leaving the registry stays usable by the requests running on it, and
is loaded again from its path when asked for next). Loading happens on the caller's thread, and
a request's adapter is resolved before it is queued, so a bad adapter is that request's
``ValueError``.

The prefix cache keys a request's blocks by :func:`lora_namespace` of its adapter: the digest of
the weights, never the name, so an adapter reloaded with other weights under the same name reads
none of the old blocks, and no ``cache_salt`` (a client's string) can equal it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefixkv.models.lora import LoRAAdapter

if TYPE_CHECKING:
    from prefixkv.config import ModelSettings
    from prefixkv.engine.llm_engine import LLMEngine
    from prefixkv.engine.sequence import Sequence
    from prefixkv.runner.model_runner import ModelRunner

__all__ = ["LoRARegistry", "LoRARequest", "lora_name", "lora_namespace", "lora_requests_info", "make_registry",
           "parse_lora_modules", "request_lora"]


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: the adapter ``lora_name`` at ``lora_path`` (``lora_int_id`` is
    accepted for vLLM's callers; the name identifies it here)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


def lora_namespace(adapter: LoRAAdapter) -> tuple[str, str, str]:
    """The prefix-index key part of ``adapter``'s blocks: ``("lora", name, weights digest)`` (a
    tuple: never a client's string; the digest makes a reload with other weights a miss, the
    name goes out in the KV events as ``lora_name``)."""
    return ("lora", adapter.name, adapter.digest)


def lora_name(namespace: object) -> str | None:
    """The adapter name in an engine namespace ``(cache_salt, lora part)``, else ``None``."""
    part = namespace[1] if isinstance(namespace, tuple) and len(namespace) == 2 else None
    return part[1] if isinstance(part, tuple) and len(part) == 3 and part[0] == "lora" else None


def parse_lora_modules(specs: Iterable[str]) -> dict[str, str]:
    """``["name=path", ...]`` (vLLM's ``--lora-modules``) as ``{name: path}`` (``ValueError``
    naming ``lora_modules`` for a malformed or repeated entry)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = str(spec).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules entries are name=path, got {spec!r}")
        if name.strip() in out:
            raise ValueError(f"lora_modules names {name.strip()!r} twice")
        out[name.strip()] = path.strip()
    return out


class LoRARegistry:
    """Adapters by name; ``load(path, name)`` builds one (the runner's ``load_lora``).

    Not thread-safe: the engine calls it under its own lock (``AsyncEngine`` runs admin calls
    on the engine thread).
    """

    def __init__(self, load: Callable[[str, str], LoRAAdapter], *, max_loras: int,
                 modules: dict[str, str] | None = None) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras!r}")
        self._load = load
        self.max_loras = max_loras
        self.paths: dict[str, str] = {}
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        for name, path in (modules or {}).items():
            self.add(name, path)

    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load ``path`` as ``name`` now (replacing an adapter of that name: later requests run
        the new weights and share no cached blocks with the old)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        adapter = self._load(str(path), name)
        self.paths[name] = str(path)
        self._loaded[name] = adapter
        self._loaded.move_to_end(name)
        self._trim()
        return adapter

    def remove(self, name: str) -> bool:
        """Forget ``name`` (running requests keep their adapter); whether it was known."""
        self._loaded.pop(name, None)
        return self.paths.pop(name, None) is not None

    def resolve(self, request: LoRARequest | str) -> LoRAAdapter:
        """The adapter a request runs: a known name (loaded again if it left memory), or a
        ``LoRARequest`` with a path for a name not known yet (vLLM's offline API)."""
        name = request if isinstance(request, str) else request.lora_name
        path = None if isinstance(request, str) else request.lora_path
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return self._loaded[name]
        if name in self.paths:
            return self.add(name, self.paths[name])
        if path is None:
            raise ValueError(f"lora adapter {name!r} is not loaded; known: {sorted(self.paths)}")
        return self.add(name, path)

    def names(self) -> list[str]:
        """Known adapter names, in the order they were added."""
        return list(self.paths)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is a known adapter."""
        return name in self.paths

    def _trim(self) -> None:
        while len(self._loaded) > self.max_loras:
            self._loaded.popitem(last=False)


def make_registry(settings: ModelSettings, runner: ModelRunner) -> LoRARegistry | None:
    """The engine's registry when ``enable_lora`` is on (its ``lora_modules`` loaded now)."""
    if not settings.enable_lora:
        return None
    rank = settings.max_lora_rank
    return LoRARegistry(lambda path, name: runner.load_lora(path, name=name, max_rank=rank),
                        max_loras=settings.max_loras,
                        modules=parse_lora_modules(settings.lora_modules))


def request_lora(registry: LoRARegistry | None, request: LoRARequest | str | None,
                 lora_id: Hashable | None) -> tuple[LoRAAdapter | None, Hashable | None]:
    """A request's adapter and the ``lora_id`` its blocks are keyed by (the adapter's
    :func:`lora_namespace`, else the caller's own ``lora_id``); ``ValueError`` naming
    ``lora_request`` when adapters are off or it is unknown."""
    if request is None:
        return None, lora_id
    if registry is None:
        raise ValueError("lora_request needs an engine started with enable_lora (--enable-lora)")
    adapter = registry.resolve(request)
    return adapter, lora_namespace(adapter)


def lora_requests_info(engine: LLMEngine) -> tuple[list[str], list[str], int] | None:
    """vLLM's ``lora_requests_info``: the adapters of running and of waiting requests (sorted
    names) and ``max_loras``; ``None`` without ``enable_lora``. Call it on the engine thread."""
    if engine.lora is None:
        return None

    def names(seqs: Iterable[Sequence]) -> list[str]:
        return sorted({s.request.lora.name for s in seqs if s.request.lora is not None})

    return (names(engine.scheduler.running), names(engine.scheduler.waiting),
            engine.lora.max_loras)
