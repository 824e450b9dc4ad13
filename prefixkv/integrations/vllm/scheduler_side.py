"""SchedulerSide: the connector's half in vLLM's engine-core process (pure Python, no vLLM).

It decides, the worker copies. How the scheduler knows what each tier holds:

* **host**: the scheduler *owns* the host tier's index (:class:`~prefixkv.tiers.host.HostTier`,
  bookkeeping only); the bytes live in the worker's arena. Every save names the slot it goes to,
  every load the slot it comes from, so the index is exact without any message back. The worker
  still checks that a slot holds the key it is asked for (a mismatch is a load error, never
  wrong KV).
* **disk**: the block's file exists (``<key hex>.kvb`` in ``kv_disk_dir``); the worker's
  :class:`~prefixkv.tiers.disk.DiskTier` writes, evicts and verifies on read.
* **remote**: one pipelined ``EXISTS`` per lookup on the shared Valkey/Redis.

Saves: every planned save names its request; :meth:`SchedulerSide.finished` (vLLM's
``request_finished``) says whether a finished request had any, i.e. whether vLLM must keep its
blocks until the worker reports the copies done. KV events of the host and disk tiers are
collected in :class:`~prefixkv.integrations.vllm.events.TierEvents` when vLLM publishes events
(the disk and remote tiers' changes come from the worker: :meth:`SchedulerSide.tier_changed`).
Pinned keys (``kv_pin_prefixes``) are never evicted from the host index.

A block counted here that cannot be read when its load runs (a corrupt or vanished file, the
remote down) is reported by the worker through ``get_block_ids_with_load_errors``; with
``kv_load_failure_policy: recompute`` vLLM recomputes it.

vLLM objects are read by attribute only (``Request``, ``KVCacheBlocks``, ``SchedulerOutput``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixkv.integrations.vllm.events import HOST_MEDIUM, TierEvents
from prefixkv.integrations.vllm.identity import RequestKeys, request_namespace
from prefixkv.integrations.vllm.plan import DISK, GONE, HOST, REMOTE, LoadBlock, SaveBlock, StepPlan
from prefixkv.tiers.disk import SUFFIX
from prefixkv.tiers.host import HostTier
from prefixkv.tiers.keys import BlockKeyer
from prefixkv.tiers.pins import PinnedKeys
from prefixkv.tiers.quotas import tenant_label

Present = Callable[[Sequence[bytes]], list[bool]]
"""Which of some keys the remote tier holds (``RemoteTier.present``)."""


@dataclass(slots=True)
class _Tracked:
    """One live request: its Request object, keys, vLLM block ids and save progress."""

    request: Any
    keys: RequestKeys
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    """Blocks [0, saved) were planned for saving (or loaded from a tier)."""
    loaded: range = range(0)
    """Block indexes this request loads from a tier (never saved back from this request)."""


class SchedulerSide:
    """Lookups, load plans and save plans for one engine."""

    def __init__(self, keyer: BlockKeyer, host_blocks: int, disk_dir: str | Path | None,
                 remote_present: Present | None, pins: Sequence[bytes] = (),
                 events: TierEvents | None = None, load_async: bool = False,
                 host_quota: int | None = None) -> None:
        self.keyer = keyer
        self.pins = tuple(pins)
        pinned = PinnedKeys()
        pinned.add(self.pins)
        self.host = HostTier(host_blocks, pinned, host_quota) if host_blocks else None
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.remote_present = remote_present
        self.events = events
        if self.host is not None and events is not None:
            self.host.on_drop = lambda keys: events.change(False, HOST_MEDIUM, keys)
        self._requests: dict[str, _Tracked] = {}
        self._lookups: dict[str, tuple[int, list[str]]] = {}
        self.load_async = load_async
        """Loads run while vLLM schedules other requests (its ``WAITING_FOR_REMOTE_KVS``)."""
        self._loads: list[LoadBlock] = []
        self._held: list[bytes] = []
        self._recv: list[LoadBlock] = []
        self._recv_held: dict[str, list[bytes]] = {}  # async loads' host keys, until done
        self._saving: set[str] = set()  # requests with a save planned (told to request_finished)
        self._pins_sent = not self.pins

    # ------------------------------------------------------------------ lookups
    def track(self, request: Any) -> _Tracked:
        """The state of ``request`` (created on first sight)."""
        t = self._requests.get(request.request_id)
        if t is None:
            lora = getattr(request, "lora_request", None)
            ns = request_namespace(getattr(request, "cache_salt", None),
                                   getattr(lora, "lora_name", None) if lora else None)
            t = _Tracked(request, RequestKeys(self.keyer, ns, []))
            self._requests[request.request_id] = t
        return t

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past vLLM's own hit (``num_computed_tokens``) that the tiers hold: whole
        leading blocks, never the prompt's last token. Reads nothing, holds nothing."""
        bs = self.keyer.block_size
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // bs
        start = num_computed_tokens // bs
        if num_computed_tokens % bs or start >= limit:
            return 0
        keys = self.track(request).keys.upto(tokens, limit)[start:]
        sources = self.sources(keys)
        self._lookups[request.request_id] = (start, sources)
        return len(sources) * bs

    def sources(self, keys: Sequence[bytes]) -> list[str]:
        """The tier each leading key would load from (host, disk, remote), up to the first
        key none holds."""
        local = [self._local(k) for k in keys]
        if None in local and self.remote_present is not None:
            first = local.index(None)
            remote = [False] * first + self.remote_present(keys[first:])
        else:
            remote = [False] * len(keys)
        out: list[str] = []
        for src, in_remote in zip(local, remote):
            if src is None and not in_remote:
                break
            out.append(src if src is not None else REMOTE)
        return out

    def _local(self, key: bytes) -> str | None:
        if self.host is not None and key in self.host:
            return HOST
        if self.disk_dir is not None and (self.disk_dir / (key.hex() + SUFFIX)).exists():
            return DISK
        return None

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Plan the loads of the ``num_external_tokens`` counted for ``request`` into its
        blocks ``block_ids`` (all of them, vLLM's hits first); host slots stay held until
        this step's plan is built (asynchronous loads: until :meth:`recv_done`)."""
        found = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or found is None:
            return
        start, sources = found
        t = self.track(request)
        n = num_external_tokens // self.keyer.block_size
        keys = t.keys.chain[start : start + n]
        rid = request.request_id
        loads, held = (self._recv, self._recv_held.setdefault(rid, [])) if self.load_async \
            else (self._loads, self._held)
        for j, (key, tier) in enumerate(zip(keys, sources)):
            slot = None
            if tier == HOST:
                slot = self.host.hold(key) if self.host is not None else None
                if slot is None:
                    tier = GONE
                else:
                    held.append(key)
            loads.append(LoadBlock(block_ids[start + j], key, tier, slot, rid))
        t.loaded = range(start, start + n)

    def recv_done(self, request_ids: Iterable[str]) -> None:
        """The worker finished these requests' asynchronous loads: their host slots are free
        to evict again."""
        for rid in request_ids:
            for key in self._recv_held.pop(rid, ()):
                if self.host is not None:
                    self.host.release(key)

    # ------------------------------------------------------------------ one step
    def build(self, out: Any) -> StepPlan:
        """This step's plan from vLLM's ``SchedulerOutput``: the loads planned since the last
        step, then saves of every block that becomes full in this step."""
        plan = StepPlan(loads=self._loads, recv=self._recv)
        self._loads, self._recv = [], []
        if not self._pins_sent:
            plan.pins, self._pins_sent = self.pins, True
        if self.host is not None:  # the worker reads them before this step's saves
            for key in self._held:
                self.host.release(key)
        self._held = []
        scheduled = out.num_scheduled_tokens
        preempted = getattr(out, "preempted_req_ids", None) or ()
        plan.preempted = bool(preempted)
        for rid in preempted:
            if rid in self._requests:
                self._requests[rid].loaded = range(0)
        for new in out.scheduled_new_reqs:
            t = self._requests.get(new.req_id)
            if t is not None:
                t.block_ids = list(new.block_ids[0])
                self._plan_saves(t, new.num_computed_tokens + scheduled[new.req_id], plan.saves)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._requests.get(rid)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                t.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                t.block_ids.extend(new_ids[0])
            self._plan_saves(t, cached.num_computed_tokens[i] + scheduled[rid], plan.saves)
        for rid in out.finished_req_ids:
            self.forget(rid)
        return plan

    def _plan_saves(self, t: _Tracked, computed: int, saves: list[SaveBlock]) -> None:
        tokens = t.request.all_token_ids
        full = min(computed, len(tokens)) // self.keyer.block_size
        full = min(full, len(t.block_ids))
        if full <= t.saved:
            return
        keys = t.keys.upto(tokens, full)
        lower = self.disk_dir is not None or self.remote_present is not None
        ns = t.keys.namespace  # (cache_salt, lora): ("", "") is the default tenant
        rid, tenant = t.request.request_id, tenant_label(None if ns == ("", "") else ns)
        for j in range(t.saved, full):
            if j in t.loaded:
                continue
            slot = self.host.reserve(keys[j], tenant) if self.host is not None else None
            if slot is not None or lower:
                saves.append(SaveBlock(t.block_ids[j], keys[j], slot, rid, tenant))
                self._saving.add(rid)
                if self.events is not None:
                    self.events.learn(t.request, j, keys[j])
                    if slot is not None:
                        self.events.change(True, HOST_MEDIUM, [keys[j]])
        t.saved = full

    def finished(self, request_id: str) -> bool:
        """vLLM's ``request_finished``: whether the request had a save planned (then vLLM keeps
        its blocks until the worker reports its copies done)."""
        self.forget(request_id)
        if request_id in self._saving:
            self._saving.discard(request_id)
            return True
        return False

    def tier_changed(self, medium: str, stored: Sequence[bytes], dropped: Sequence[bytes]) -> None:
        """The worker's disk (``DISK_MEDIUM``) or remote (``REMOTE_MEDIUM``) tier gained
        ``stored`` and lost ``dropped`` (KV events)."""
        if self.events is not None:
            self.events.change(True, medium, stored)
            self.events.change(False, medium, dropped)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state."""
        self._requests.pop(request_id, None)
        self._lookups.pop(request_id, None)

    def reset(self) -> int:
        """Forget the host tier's blocks (vLLM's ``reset_prefix_cache(reset_connector=True)``);
        the disk and remote tiers are kept (they outlive the process by design). Returns how
        many host blocks were dropped."""
        return self.host.clear() if self.host is not None else 0
