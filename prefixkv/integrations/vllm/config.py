"""ConnectorConfig: ``kv_connector_extra_config`` read once, validated, and resolved.

The keys are prefixkv's tier flags under the same names (docs/tiers.md): a bare number for
``kv_offload_size`` is GiB, as vLLM's ``--kv-offloading-size`` and prefixkv's own flag read it
(a block count takes the ``blocks`` suffix). Unknown keys are a ``ValueError`` naming them (a
misspelt tier must not silently turn into "no tier").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixkv.tiers.spec import TierSpec, parse_size

_BARE_NUMBER = re.compile(r"^\s*\d+(?:\.\d+)?\s*$")
KEYS = frozenset({
    "kv_offload_size", "kv_disk_dir", "kv_disk_size", "kv_remote", "kv_remote_timeout",
    "kv_remote_ttl", "kv_remote_secret", "kv_namespace", "kv_pin_prefixes", "kv_load_async",
    "kv_blocks_per_tenant",
})
"""The ``kv_connector_extra_config`` keys the connector reads."""


@dataclass(frozen=True, slots=True)
class PinnedPrefix:
    """One ``kv_pin_prefixes`` entry: a prompt (text, tokenized by the model's tokenizer as
    vLLM tokenizes a completion prompt, or token ids) and the ``cache_salt`` its requests carry."""

    prompt: str | tuple[int, ...]
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The tiers the connector runs, as a :class:`TierSpec` (host size in bytes or blocks),
    and the pinned prefixes."""

    spec: TierSpec
    pins: tuple[PinnedPrefix, ...] = ()
    load_async: bool = False
    """Load on the worker's loader thread while vLLM runs other requests (the request waits in
    ``WAITING_FOR_REMOTE_KVS``); off: loads run before the step's forward pass."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse vLLM's ``kv_connector_extra_config``; ``ValueError`` naming a bad key."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KEYS)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; "
                             f"known: {sorted(KEYS)}")
        offload = extra.get("kv_offload_size")
        if isinstance(offload, bool):
            raise ValueError(f"kv_offload_size must be a size, got {offload!r}")
        if isinstance(offload, (int, float)) or (
                isinstance(offload, str) and _BARE_NUMBER.match(offload)):
            offload = f"{float(offload)}GiB" if offload else None
        elif offload is not None and not isinstance(offload, str):
            raise ValueError(f"kv_offload_size must be GiB or a size like '512MiB', got {offload!r}")
        namespace = extra.get("kv_namespace", "")
        if not isinstance(namespace, str):
            raise ValueError(f"kv_namespace must be a string, got {namespace!r}")
        disk_dir = extra.get("kv_disk_dir")
        if disk_dir is not None and not (isinstance(disk_dir, str) and disk_dir):
            raise ValueError(f"kv_disk_dir must be a directory path, got {disk_dir!r}")
        spec = TierSpec(
            offload_size=offload, disk_dir=disk_dir, disk_size=extra.get("kv_disk_size"),
            remote=extra.get("kv_remote"), remote_timeout=extra.get("kv_remote_timeout", 0.5),
            remote_ttl=extra.get("kv_remote_ttl"), namespace=namespace,
            remote_secret=extra.get("kv_remote_secret"), prefetch_blocks=0,
            blocks_per_tenant=extra.get("kv_blocks_per_tenant"),
        )
        if not spec.enabled:
            raise ValueError("kv_connector_extra_config names no tier: set kv_offload_size, "
                             "kv_disk_dir or kv_remote")
        load_async = extra.get("kv_load_async", False)
        if not isinstance(load_async, bool):
            raise ValueError(f"kv_load_async must be true or false, got {load_async!r}")
        return cls(spec, parse_pins(extra.get("kv_pin_prefixes")), load_async)

    def host_blocks(self, block_nbytes: int) -> int:
        """Host-tier capacity in blocks of ``block_nbytes`` (0: no host tier)."""
        return parse_size(self.spec.offload_size, block_nbytes, "kv_offload_size")


def parse_pins(value: Any) -> tuple[PinnedPrefix, ...]:
    """``kv_pin_prefixes``: a list whose entries are a prompt (a string or a list of token ids)
    or ``{"prompt": ..., "cache_salt": "..."}``; ``ValueError`` naming a bad entry."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"kv_pin_prefixes must be a list of prompts, got {value!r}")
    out = []
    for i, entry in enumerate(value):
        salt: Any = ""
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - {"prompt", "cache_salt"})
            if unknown or "prompt" not in entry:
                raise ValueError(f"kv_pin_prefixes[{i}]: keys are 'prompt' and 'cache_salt', "
                                 f"got {sorted(entry)}")
            entry, salt = entry["prompt"], entry.get("cache_salt") or ""
        if not isinstance(salt, str):
            raise ValueError(f"kv_pin_prefixes[{i}].cache_salt must be a string, got {salt!r}")
        if isinstance(entry, str) and entry:
            out.append(PinnedPrefix(entry, salt))
        elif isinstance(entry, list) and entry and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in entry):
            out.append(PinnedPrefix(tuple(entry), salt))
        else:
            raise ValueError(f"kv_pin_prefixes[{i}] must be a non-empty string or list of "
                             f"token ids, got {entry!r}")
    return tuple(out)
