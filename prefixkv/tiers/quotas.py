"""TenantKeys: a lower tier's blocks per tenant, and the quota whose excess is evicted first.

A block's tenant is its request's namespace (``cache_salt`` and / or LoRA adapter), as in the
pool (:mod:`prefixkv.cache.quotas`). The tiers name it by :func:`tenant_label`: ``default``
for no namespace, else the first 12 hex digits of its SHA-256 (the label the metrics show; a
salt is a secret, so the disk stores the label in its records, never the salt).

With a quota, a tenant holding more than ``quota`` blocks of a tier is *over* it, and when the
tier evicts for room its excess goes first (:meth:`TenantKeys.victims`): each over-quota
tenant's own evictable keys, most over first, up to its excess, in the tier's order (its
unretained keys before its soft-retained ones: the quota caps retention too); only then the
tier's normal order (unretained first, :class:`~prefixkv.tiers.retained.RetainedKeys`). Held
and pinned keys are never candidates (the tier's ``evictable`` says which are). So one tenant
flooding a tier cannot flush another's blocks while it is over its quota.

Each tenant's keys are kept in the tier's recency order (the tier calls :meth:`touch` where it
refreshes a key), so its victims are found without scanning the other tenants' keys, and the
tenants over the quota are kept as a set, so an eviction looks at those only. Not thread safe:
the owning tier's lock guards it (the disk's index lock; the host's engine thread).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

from prefixkv.tiers.retained import RetainedKeys

DEFAULT_TENANT = "default"
"""The label of blocks without a namespace (and of records written before tenants were kept)."""


def tenant_label(namespace: Hashable | None) -> str:
    """The tiers' (and the metrics') name of a tenant: :data:`DEFAULT_TENANT` for ``None``,
    else the first 12 hex digits of the SHA-256 of it (of its ``repr`` unless a string)."""
    if namespace is None:
        return DEFAULT_TENANT
    text = namespace if isinstance(namespace, str) else repr(namespace)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class TenantKeys:
    """The keys one tier holds, per tenant label, in the tier's recency order.

    Args:
        quota: most blocks a tenant may hold in the tier before its own go first; ``None``:
            counted, never over. Fixed once built.
    """

    __slots__ = ("_keys", "_of", "_over", "quota")

    def __init__(self, quota: int | None = None) -> None:
        if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int)
                                  or quota < 0):
            raise ValueError(f"kv_blocks_per_tenant must be an int >= 0, got {quota!r}")
        self.quota = quota
        self._of: dict[bytes, str] = {}
        self._keys: dict[str, OrderedDict[bytes, None]] = {}  # least recent first
        self._over: set[str] = set()  # tenants holding more than the quota

    def __len__(self) -> int:
        return len(self._of)

    def tenant(self, key: bytes) -> str | None:
        """The label ``key`` is counted under, or ``None`` if not counted."""
        return self._of.get(key)

    def add(self, key: bytes, tenant: str) -> None:
        """Count ``key`` under ``tenant``, as its most recent key (a counted key is moved)."""
        old = self._of.get(key)
        if old is not None and old != tenant:
            self.remove([key])
            old = None
        if old is None:
            self._of[key] = tenant
            own = self._keys.setdefault(tenant, OrderedDict())
            own[key] = None
            if self.quota is not None and len(own) > self.quota:
                self._over.add(tenant)
        else:
            self._keys[tenant].move_to_end(key)

    def touch(self, key: bytes) -> None:
        """Make ``key`` its tenant's most recent (not counted: nothing)."""
        t = self._of.get(key)
        if t is not None:
            self._keys[t].move_to_end(key)

    def remove(self, keys: Iterable[bytes]) -> None:
        """Stop counting ``keys`` (those not counted are ignored)."""
        for k in keys:
            t = self._of.pop(k, None)
            if t is not None:
                own = self._keys[t]
                del own[k]
                if self.quota is None or len(own) <= self.quota:
                    self._over.discard(t)
                if not own:
                    del self._keys[t]

    def clear(self) -> None:
        """Count nothing."""
        self._of.clear()
        self._keys.clear()
        self._over.clear()

    def counts(self) -> dict[str, int]:
        """Blocks per tenant holding any."""
        return {t: len(own) for t, own in self._keys.items()}

    def over(self) -> list[tuple[str, int]]:
        """Tenants over the quota and by how many blocks, most over first."""
        q = self.quota
        if q is None or not self._over:
            return []
        out = [(t, len(self._keys[t]) - q) for t in self._over]
        out.sort(key=lambda x: (-x[1], x[0]))
        return out

    def victims(self, n: int, evictable: Callable[[bytes], bool], retained: RetainedKeys,
                order: Iterable[bytes]) -> list[bytes]:
        """The ``n`` keys (or fewer) to evict: over-quota tenants' excess first (each tenant's
        own ``evictable`` keys in its order, retained ones last), then ``order`` (the tier's
        keys, least recent first) as :meth:`RetainedKeys.victims` picks. The caller drops them
        and calls :meth:`remove`."""
        out: list[bytes] = []
        for tenant, excess in self.over():
            take = min(excess, n - len(out))
            if take <= 0:
                break
            out += retained.victims((k for k in self._keys[tenant] if evictable(k)), take)
        if len(out) < n:
            chosen = set(out)
            out += retained.victims((k for k in order if k not in chosen and evictable(k)),
                                    n - len(out))
        return out
