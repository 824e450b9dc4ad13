"""StepPlan: what the scheduler half tells the worker half to copy in one engine step.

Plain records (pickled into vLLM's scheduler output). The worker runs a plan in order: every
load in ``start_load_kv`` (before the forward pass), every save queued in ``wait_for_save``
(after it; copied out on the worker's save thread, in order). The scheduler relies on that
order: a host slot released by this step's loads may be reserved for this step's saves, and a
slot reserved by an earlier step's save is only read after that copy (the worker waits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixkv.tiers.quotas import DEFAULT_TENANT

HOST = "host"
DISK = "disk"
REMOTE = "remote"
GONE = "gone"
"""A load whose block left its tier after the scheduler counted it: the worker reports it
failed (vLLM recomputes it)."""


@dataclass(frozen=True, slots=True)
class LoadBlock:
    """Copy the block stored under ``key`` in ``tier`` (host: arena ``slot``) into vLLM's
    block ``block_id``."""

    block_id: int
    key: bytes
    tier: str
    slot: int | None = None
    req_id: str = ""


@dataclass(frozen=True, slots=True)
class SaveBlock:
    """Store vLLM's block ``block_id`` under ``key``: into host arena ``slot`` when given,
    and into the disk and remote tiers unless they hold ``key`` already."""

    block_id: int
    key: bytes
    slot: int | None = None
    req_id: str = ""
    """The request whose block it is (vLLM keeps a finished request's blocks until all of
    its saves are copied)."""
    tenant: str = DEFAULT_TENANT
    """The request's tenant label (``cache_salt`` / LoRA, :func:`~prefixkv.tiers.tenant_label`):
    counted against its quota in every tier (``kv_blocks_per_tenant``)."""


@dataclass(slots=True)
class StepPlan:
    """One step's loads and saves; ``recv``: loads run asynchronously (``kv_load_async``: the
    worker names each request in ``finished_recving`` once all of its loads are done);
    ``preempted``: vLLM freed some request's blocks this step (the worker finishes pending
    copies first); ``pins``: the pinned prefixes' keys (sent once, in the first plan)."""

    loads: list[LoadBlock] = field(default_factory=list)
    recv: list[LoadBlock] = field(default_factory=list)
    saves: list[SaveBlock] = field(default_factory=list)
    preempted: bool = False
    pins: tuple[bytes, ...] = ()
