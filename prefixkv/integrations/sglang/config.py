"""SGLang storage settings and page keys, without SGLang or torch.

``StorageSettings.from_extra`` reads ``--hicache-storage-backend-extra-config``: prefixkv's tier
flags under the same names as ``prefixkv serve`` (``kv_disk_dir``, ``kv_disk_size``,
``kv_remote``, ``kv_remote_timeout``, ``kv_remote_ttl``, ``kv_remote_secret``, ``kv_namespace``)
plus ``kv_clear_remote``. SGLang hands the backend the whole JSON object, its own keys included
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ...): those are left to
SGLang; an unknown ``kv_*`` key is a ``ValueError`` naming it (a misspelt tier must not turn
into "no tier"), any other unknown key one logged warning.

``PageKeys`` maps SGLang's page key (a hex sha256 chained over the page's tokens from the
sequence start, seeded by ``cache_salt`` / ``extra_key``; it names no model, shard or format)
to a 32-byte tier key: ``sha256(scope || page key)``, where the scope names the namespace, the
model (SGLang appends the host pool's format tag), the shard this rank holds (TP rank unless the
KV is replicated across ranks as with MLA, PP stage, context-parallel rank), the page's byte
layout (dtype, host layout, elements) and the record secret's public id. Ranks, models and
layouts therefore never read each other's pages, and ranks holding the same shard share them.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixkv.tiers.codec import secret_id
from prefixkv.tiers.spec import REMOTE_SCHEMES, parse_size

logger = logging.getLogger(__name__)
KEYS = frozenset({
    "kv_disk_dir", "kv_disk_size", "kv_remote", "kv_remote_timeout", "kv_remote_ttl",
    "kv_remote_secret", "kv_namespace", "kv_clear_remote",
})
"""The extra-config keys this backend reads."""
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
    "tp_lcm_size",
})
"""Keys SGLang itself reads from the same object (never warned about)."""
DEFAULT_DISK_SIZE = "10GiB"
SECRET_ENV = "PREFIXKV_KV_REMOTE_SECRET"
KEY_VERSION = b"prefixkv/sglang-page/v1"
_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """The tiers under SGLang's host pool, validated.

    Attributes:
        disk_dir: the disk tier's directory (``None``: no disk tier).
        disk_size: its capacity: a size with a unit (``"10GiB"``, the default), a bare number
            in GiB (``"2"``), or pages (an int, or ``"512blocks"``), as ``--kv-disk-size``.
        remote: a Valkey/Redis URL (``None``: no shared tier).
        remote_timeout / remote_ttl: as ``prefixkv serve``'s ``--kv-remote-timeout`` / ``-ttl``.
        namespace: prefix of every key: instances with other namespaces share nothing.
        clear_remote: whether :meth:`clear` (SGLang's ``/clear_hicache_storage_backend``) also
            deletes every prefixkv block on the shared server (other instances' too); default
            ``False``: only the disk tier is cleared.
        secret: ``kv_remote_secret`` or ``$PREFIXKV_KV_REMOTE_SECRET``: an HMAC on every record.
    """

    disk_dir: str | None = None
    disk_size: int | str = DEFAULT_DISK_SIZE
    remote: str | None = field(default=None, repr=False)  # may carry a password
    remote_timeout: float = 0.5
    remote_ttl: float | None = None
    namespace: str = ""
    clear_remote: bool = False
    secret: str | None = field(default=None, repr=False)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> StorageSettings:
        """Read SGLang's extra config; ``ValueError`` naming the key of a bad value."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KEYS - SGLANG_KEYS)
        bad = [k for k in unknown if k.startswith("kv_")]
        if bad:
            raise ValueError(f"hicache-storage-backend-extra-config: unknown key(s) {bad}; "
                             f"prefixkv reads {sorted(KEYS)}")
        for k in unknown:
            if k not in _warned:
                _warned.add(k)
                logger.warning("hicache-storage-backend-extra-config: %r is not a prefixkv "
                               "setting; ignored", k)
        disk_dir = extra.get("kv_disk_dir")
        if disk_dir is not None and not (isinstance(disk_dir, str) and disk_dir):
            raise ValueError(f"kv_disk_dir must be a directory path, got {disk_dir!r}")
        disk_size = extra.get("kv_disk_size")
        if disk_size is not None and disk_dir is None:
            raise ValueError("kv_disk_size needs kv_disk_dir")
        disk_size = DEFAULT_DISK_SIZE if disk_size is None else disk_size
        parse_size(disk_size, 1, "kv_disk_size")
        remote = extra.get("kv_remote")
        if remote is not None and not (
                isinstance(remote, str) and remote.startswith(REMOTE_SCHEMES)):
            scheme = remote.partition("://")[0] if isinstance(remote, str) else remote
            raise ValueError(f"kv_remote must be a URL starting {' / '.join(REMOTE_SCHEMES)}, "
                             f"got {scheme!r}")  # the URL is not echoed: it may carry a password
        if disk_dir is None and remote is None:
            raise ValueError("prefixkv's SGLang backend needs kv_disk_dir or kv_remote "
                             "(SGLang's host pool is the memory tier)")
        timeout = extra.get("kv_remote_timeout", 0.5)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"kv_remote_timeout must be > 0 seconds, got {timeout!r}")
        ttl = extra.get("kv_remote_ttl")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                                or not ttl > 0):
            raise ValueError(f"kv_remote_ttl must be > 0 seconds, got {ttl!r}")
        namespace = extra.get("kv_namespace", "")
        if not isinstance(namespace, str):
            raise ValueError(f"kv_namespace must be a string, got {namespace!r}")
        clear_remote = extra.get("kv_clear_remote", False)
        if not isinstance(clear_remote, bool):
            raise ValueError(f"kv_clear_remote must be true or false, got {clear_remote!r}")
        secret = extra.get("kv_remote_secret") or os.environ.get(SECRET_ENV) or None
        if secret is not None and not isinstance(secret, str):
            raise ValueError("kv_remote_secret must be a non-empty string")
        return cls(disk_dir, disk_size, remote, float(timeout),
                   None if ttl is None else float(ttl), namespace, clear_remote, secret)


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of a page this rank holds (from SGLang's ``HiCacheStorageConfig``)."""

    model_name: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    replicated: bool = False
    """KV the same on every TP rank (SGLang's ``is_mla_model``): the TP rank is not in the key."""

    @classmethod
    def of(cls, config: Any) -> Shard:
        """The shard of SGLang's ``HiCacheStorageConfig`` (read by attribute)."""
        dcp = int(getattr(config, "dcp_size", 1) or 1)
        if dcp > 1:
            raise ValueError("prefixkv's SGLang backend does not support decode context "
                             "parallelism (dcp_size > 1); use SGLang's file or Mooncake backend")
        return cls(config.model_name or "", config.tp_rank, config.tp_size, config.pp_rank,
                   config.pp_size, config.attn_cp_rank, config.attn_cp_size,
                   bool(config.is_mla_model))

    def label(self) -> str:
        """The shard as a key part."""
        tp = "tp=replicated" if self.replicated else f"tp={self.tp_rank}/{self.tp_size}"
        return f"{tp};pp={self.pp_rank}/{self.pp_size};cp={self.cp_rank}/{self.cp_size}"


def page_layout(dtype: str, host_layout: str, numel: int) -> str:
    """The codec layout string of one page: element type, SGLang's host layout, elements."""
    return f"sglang:{dtype}:{host_layout}:{numel}"


class PageKeys:
    """SGLang page keys -> 32-byte tier keys in one scope (see the module docstring)."""

    __slots__ = ("scope",)

    def __init__(self, settings: StorageSettings, shard: Shard, layout: str) -> None:
        sid = secret_id(settings.secret.encode()) if settings.secret else ""
        parts = (KEY_VERSION, settings.namespace, shard.model_name, shard.label(), layout, sid)
        self.scope = hashlib.sha256(b"\x00".join(
            p if isinstance(p, bytes) else p.encode() for p in parts)).digest()

    def __call__(self, key: str) -> bytes:
        """The tier key of SGLang's page key ``key``."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"an SGLang page key must be a non-empty string, got {key!r}")
        return hashlib.sha256(self.scope + key.encode()).digest()
