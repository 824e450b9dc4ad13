"""TierSpec: what the operator asked for (sizes as given), resolved to blocks once the block
size in bytes is known.

Sizes given as text (the ``--kv-offload-size`` / ``--kv-disk-size`` flags, config strings) are
GiB when bare (``"2"``, ``"0.5"``: what vLLM's ``--kv-offloading-size``, SGLang's and LMCache's
sizes mean), bytes with a unit (``"2GiB"``, ``"512MiB"``, ``"1.5GB"``) or a block count with the
``blocks`` suffix (``"512blocks"``, ``"1 block"``); a Python ``int`` is a block count.
``0`` / ``None`` turns a tier off. Bad values raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_BLOCK_UNITS = ("block", "blocks")
BARE_UNIT = "gib"
"""What a bare number in a size string means: GiB, as in vLLM, SGLang and LMCache."""

Size = int | str | None

LOWER_TIERS = ("host", "disk", "remote")
REMOTE_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")
"""URL schemes of ``kv_remote``: ``rediss`` / ``valkeys`` are TLS, ``unix`` a socket path."""
RESET_PRESETS = {"local": frozenset({"host"}), "all": frozenset(LOWER_TIERS), "none": frozenset()}
"""What an admin reset clears below the pool: ``local`` (the default: the host tier, which like
the pool is this process's memory), ``all`` (also the disk and the shared remote tier), or
``none`` (the pool only)."""


def reset_tiers(value: str | Iterable[str]) -> frozenset[str]:
    """The lower tiers an admin reset should clear: a preset of :data:`RESET_PRESETS`, or tier
    names (``"host,disk"`` or a list). ``ValueError`` naming ``tiers`` for anything else."""
    if isinstance(value, str):
        if value.strip().lower() in RESET_PRESETS:
            return RESET_PRESETS[value.strip().lower()]
        value = value.split(",")
    names = {str(v).strip().lower() for v in value} - {""}
    bad = sorted(names - set(LOWER_TIERS))
    if bad:
        raise ValueError(f"tiers must be one of {sorted(RESET_PRESETS)} or names from "
                         f"{list(LOWER_TIERS)}, got {bad}")
    return frozenset(names)


def parse_size(value: Size, block_nbytes: int, name: str) -> int:
    """Blocks meant by ``value``: text is a size (bare: GiB; with a unit: bytes; ``512blocks``:
    a block count), rounded down to whole blocks of ``block_nbytes``; an ``int`` is a block
    count; ``None`` is 0. ``ValueError`` naming ``name`` if malformed."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        msg = (f"{name} must be a size like '2' (GiB), '512MiB' or '512blocks', or an int "
               f"block count, got {value!r}")
        raise ValueError(msg)  # noqa: TRY004 - bad arguments are ValueErrors here
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        return value
    m = _SIZE.match(value)
    unit = m.group(2).lower() if m is not None else ""
    if m is None or (unit and unit not in _UNITS and unit not in _BLOCK_UNITS):
        raise ValueError(
            f"{name} must be a size like '2' (GiB), '2GiB', '512MiB' or a block count like "
            f"'512blocks', got {value!r}"
        )
    number = m.group(1)
    if unit in _BLOCK_UNITS:
        if "." in number:
            raise ValueError(f"{name}: a block count must be a whole number, got {value!r}")
        return int(number)
    return int(float(number) * _UNITS[unit or BARE_UNIT]) // block_nbytes


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # not a POSIX system that says
        return None


def _check_fits_memory(offload_size: Size) -> None:
    """``ValueError`` naming ``kv_offload_size`` when a size in bytes (not blocks) is more than
    this machine's memory: most likely a block count from before bare numbers meant GiB."""
    if not isinstance(offload_size, str) or offload_size.strip().lower().endswith(_BLOCK_UNITS):
        return
    nbytes, total = parse_size(offload_size, 1, "kv_offload_size"), _physical_memory()
    if total is not None and nbytes > total:
        raise ValueError(
            f"kv_offload_size {offload_size!r} is {nbytes / 2**30:,.1f} GiB, more than this "
            f"machine's {total / 2**30:,.1f} GiB of memory (a bare number is GiB, as in vLLM; "
            f"a block count takes the suffix: '{offload_size.strip()}blocks')")


@dataclass(frozen=True, slots=True)
class TierSpec:
    """The lower tiers an engine should have (the KV pool is always tier 0).

    Attributes:
        offload_size: host-memory tier (L2) capacity: a size (bare text is GiB) or blocks
            (an int, or text with the ``blocks`` suffix); see :func:`parse_size`.
        disk_dir: directory of the disk tier (L3); ``None``: no disk tier.
        disk_size: disk tier capacity (default 10GiB when ``disk_dir`` is set).
        remote: URL of a shared Valkey/Redis tier (:data:`REMOTE_SCHEMES`; a password and
            TLS as redis-py reads them: ``rediss://user:pass@host:6380/0``); ``None``: none.
        remote_timeout: seconds a remote call may take before it counts as down.
        remote_ttl: expiry (seconds) of the unpinned blocks this engine stores in the remote
            tier; with the server on ``maxmemory-policy volatile-lru`` pinned blocks (no
            expiry) are then never evicted there. ``None``: no expiry.
        namespace: extra key part for every stored block (e.g. a deployment name); blocks
            stored under one namespace are invisible to engines using another.
        prefetch_blocks: most blocks read ahead from disk / remote into host staging while
            their requests wait in the queue (``prefixkv.tiers.prefetch``); 0 turns it off.
        remote_secret: key of the HMAC every disk and remote record then carries
            (:mod:`prefixkv.tiers.codec`): records without a valid one are misses. ``None``:
            checksums only. Never shown in a repr.
        blocks_per_tenant: a tenant's quota in the lower tiers, in blocks (its blocks beyond
            it are evicted first, :mod:`prefixkv.tiers.quotas`): one count for every tier
            (``512``, ``"512"``) or per tier (``"host=512,disk=4096,remote=8192"``; a tier not
            named keeps the default). ``None``: each tier takes the pool's
            ``max_cached_blocks_per_tenant`` (no quota if that is unset).
    """

    offload_size: Size = None
    disk_dir: str | Path | None = None
    disk_size: Size = None
    remote: str | None = None
    remote_timeout: float = 0.5
    remote_ttl: float | None = None
    namespace: str = ""
    prefetch_blocks: int = 1024
    remote_secret: str | None = field(default=None, repr=False)
    blocks_per_tenant: int | str | None = None

    def __post_init__(self) -> None:
        if self.remote is not None and not (
            isinstance(self.remote, str) and self.remote.startswith(REMOTE_SCHEMES)
        ):  # the URL is not echoed: it may carry a password
            scheme = self.remote.split("://")[0] if isinstance(self.remote, str) else self.remote
            raise ValueError(f"kv_remote must be a URL starting {' / '.join(REMOTE_SCHEMES)}, "
                             f"got {scheme!r}")
        if self.remote_secret is not None and not (
            isinstance(self.remote_secret, str) and self.remote_secret
        ):
            raise ValueError("kv_remote_secret must be a non-empty string")
        if not isinstance(self.remote_timeout, (int, float)) or not self.remote_timeout > 0:
            raise ValueError(f"kv_remote_timeout must be > 0, got {self.remote_timeout!r}")
        if self.remote_ttl is not None and (
            isinstance(self.remote_ttl, bool) or not isinstance(self.remote_ttl, (int, float))
            or not self.remote_ttl > 0
        ):
            raise ValueError(f"kv_remote_ttl must be > 0 seconds, got {self.remote_ttl!r}")
        if isinstance(self.prefetch_blocks, bool) or not isinstance(self.prefetch_blocks, int) \
                or self.prefetch_blocks < 0:
            raise ValueError(f"kv_prefetch_blocks must be an int >= 0, got {self.prefetch_blocks!r}")
        if self.disk_size is not None and self.disk_dir is None:
            raise ValueError("kv_disk_size needs kv_disk_dir")
        self.tenant_quotas(None)  # a malformed quota fails here
        parse_size(self.offload_size, 1, "kv_offload_size")  # malformed sizes fail before loading
        parse_size(self.disk_size, 1, "kv_disk_size")
        _check_fits_memory(self.offload_size)

    def tenant_quotas(self, pool_quota: int | None) -> dict[str, int | None]:
        """Each lower tier's tenant quota in blocks: :attr:`blocks_per_tenant` where it names
        one, else ``pool_quota`` (``None``: no quota). ``ValueError`` naming
        ``kv_blocks_per_tenant`` for a malformed value."""
        out: dict[str, int | None] = dict.fromkeys(LOWER_TIERS, pool_quota)
        value = self.blocks_per_tenant
        if value is None:
            return out
        bad = ValueError("kv_blocks_per_tenant must be a block count >= 0 or per tier like "
                         f"'host=512,disk=4096,remote=8192', got {value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad
        if isinstance(value, int) or re.fullmatch(r"\s*[0-9]+\s*", value):
            n = int(value)
            if n < 0:
                raise bad
            return dict.fromkeys(LOWER_TIERS, n)
        for part in value.split(","):
            name, eq, count = part.partition("=")
            name = name.strip().lower()
            if not eq or name not in LOWER_TIERS or not re.fullmatch(r"\s*[0-9]+\s*", count):
                raise bad
            out[name] = int(count)
        return out

    @property
    def enabled(self) -> bool:
        """Whether any lower tier is asked for."""
        return bool(self.offload_size) or self.disk_dir is not None or self.remote is not None
