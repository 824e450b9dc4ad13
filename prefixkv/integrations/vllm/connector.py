"""PrefixKVConnector: vLLM's ``KVConnectorBase_V1`` over prefixkv's host, disk and Valkey tiers.

vLLM builds the class once per role: in the engine-core process (``SCHEDULER``: a
:class:`SchedulerSide`, which decides every load and save) and in each worker process
(``WORKER``: a :class:`WorkerSide`, which copies the bytes). Loads are synchronous (before the
step's forward pass); saves are copied out on the worker's save thread after the step
(``wait_for_save`` only queues them), and vLLM keeps a finished request's blocks until
``get_finished`` reports its saves copied. The host, disk and Valkey tiers are announced in
vLLM's KV events (``take_events``); their counters are vLLM connector stats and Prometheus
series (``build_prom_metrics``). See docs/vllm.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from prefixkv.integrations.vllm.config import ConnectorConfig, PinnedPrefix
from prefixkv.integrations.vllm.events import (
    DISK_MEDIUM,
    REMOTE_MEDIUM,
    BlockFacts,
    TierEvent,
    TierEvents,
)
from prefixkv.integrations.vllm.identity import (
    KVGeometry,
    make_keyer,
    prefix_keys,
    weights_fingerprint,
)
from prefixkv.integrations.vllm.plan import StepPlan
from prefixkv.integrations.vllm.scheduler_side import SchedulerSide
from prefixkv.integrations.vllm.stats import PrefixKVPromMetrics, PrefixKVStats, stats_from
from prefixkv.integrations.vllm.worker_side import WorkerSide
from prefixkv.tiers.codec import secret_id
from prefixkv.tiers.remote import RemoteTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.prefixkv")  # under vLLM's handlers, with its log lines


class PrefixKVMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's :class:`StepPlan`, as vLLM carries it to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class PrefixKVWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler, once a step: per medium (``DISK``, ``SHARED_STORAGE``), the keys
    the tier gained and lost."""

    def __init__(self, changes: dict[str, tuple[list[bytes], list[bytes]]]) -> None:
        self.changes = changes

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Both workers' changes (one worker is all the connector supports today)."""
        assert isinstance(other, PrefixKVWorkerMeta)
        out = {m: (list(s), list(d)) for m, (s, d) in self.changes.items()}
        for medium, (stored, dropped) in other.changes.items():
            mine = out.setdefault(medium, ([], []))
            mine[0].extend(stored)
            mine[1].extend(dropped)
        return PrefixKVWorkerMeta(out)


def geometry_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVGeometry:
    """The KV geometry both halves key by; ``ValueError`` for a model with several KV cache
    groups (hybrid attention) or without a plain attention spec."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"PrefixKVConnector supports one KV cache group (full attention), "
                         f"this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, attr):
            raise ValueError(f"PrefixKVConnector: KV spec {type(spec).__name__} has no {attr}")
    return KVGeometry(
        dtype=str(spec.dtype).removeprefix("torch."), block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
        num_layers=len(groups[0].layer_names), spec=type(spec).__name__,
        device=str(vllm_config.device_config.device_type),
    )


def fingerprint_of(vllm_config: VllmConfig) -> tuple[str, str]:
    """(weights fingerprint or "", the model's name@revision) for the keys' root."""
    mc = vllm_config.model_config
    ref = f"{mc.model}@{mc.revision or ''}/{mc.dtype}/{mc.quantization or ''}"
    path = Path(mc.model)
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(mc.model, revision=mc.revision, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached locally: the name and revision key it
            return "", ref
    try:
        return weights_fingerprint(path), ref
    except ValueError:
        return "", ref


def pin_tokens(pin: PinnedPrefix, vllm_config: VllmConfig) -> list[int]:
    """A pinned prefix's token ids (a text is tokenized as vLLM tokenizes a completion's
    prompt, with the model's tokenizer)."""
    if not isinstance(pin.prompt, str):
        return list(pin.prompt)
    from transformers import AutoTokenizer

    mc = vllm_config.model_config
    tok = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision,
                                        trust_remote_code=mc.trust_remote_code)
    ids: list[int] = tok(pin.prompt)["input_ids"]
    return ids


def describe_block(request: Request, j: int, block_size: int) -> BlockFacts | None:
    """The facts vLLM's own ``BlockStored`` gives for ``request``'s ``j``-th block (None when
    vLLM keeps no block hashes: prefix caching off)."""
    hashes = request.block_hashes
    if j >= len(hashes):
        return None
    start, end = j * block_size, (j + 1) * block_size
    extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
    lora = request.lora_request
    return BlockFacts(
        block_hash=maybe_convert_block_hash(hashes[j]),
        parent_hash=maybe_convert_block_hash(hashes[j - 1]) if j else None,
        token_ids=tuple(request.all_token_ids[start:end]),
        lora_id=lora.adapter_id if lora else None, lora_name=lora.name if lora else None,
        extra_keys=to_event_extra_keys([extra]))


def to_vllm_event(event: TierEvent) -> KVCacheEvent:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` for one tier change."""
    f = event.facts
    if not event.stored:
        return BlockRemoved(block_hashes=[f.block_hash], medium=event.medium, group_idx=0)
    return BlockStored(block_hashes=[f.block_hash], parent_block_hash=f.parent_hash,
                       token_ids=list(f.token_ids), block_size=len(f.token_ids),
                       lora_id=f.lora_id, medium=event.medium, lora_name=f.lora_name,
                       extra_keys=f.extra_keys, group_idx=0)


class PrefixKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """prefixkv's KV tiers (host memory, disk, shared Valkey) as a vLLM KV connector."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        par = vllm_config.parallel_config
        if par.tensor_parallel_size * par.pipeline_parallel_size > 1:
            # each rank holds a shard of every block under the same key: records would collide
            raise ValueError("PrefixKVConnector supports one worker (tensor_parallel_size and "
                             "pipeline_parallel_size 1)")
        transfer = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        self.geometry = geometry_of(vllm_config, kv_cache_config)
        self.num_blocks = kv_cache_config.num_blocks
        host_blocks = self.config.host_blocks(self.geometry.block_nbytes)
        ev_config = vllm_config.kv_events_config
        kv_events = bool(ev_config is not None and ev_config.enable_kv_cache_events)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.remote: RemoteTier | None = None
        if role == KVConnectorRole.SCHEDULER:
            spec = self.config.spec
            weights, ref = fingerprint_of(vllm_config)
            mac = secret_id(spec.remote_secret.encode()) if spec.remote_secret else ""
            keyer = make_keyer(weights, ref, self.geometry, spec.namespace, mac)
            if spec.remote is not None:
                self.remote = RemoteTier(spec.remote, "", self.geometry.block_nbytes,
                                         timeout=spec.remote_timeout)
            events = None
            if kv_events:
                events = TierEvents(lambda req, j: describe_block(req, j, keyer.block_size))
            pins = [k for p in self.config.pins
                    for k in prefix_keys(keyer, pin_tokens(p, vllm_config), p.cache_salt)]
            self.scheduler = SchedulerSide(keyer, host_blocks, spec.disk_dir,
                                           self.remote.present if self.remote else None,
                                           pins=pins, events=events,
                                           load_async=self.config.load_async,
                                           host_quota=spec.tenant_quotas(None)["host"])
            if transfer.kv_load_failure_policy != "recompute":
                logger.warning("prefixkv: kv_load_failure_policy is %r: a block that cannot "
                               "be read fails its request; set \"kv_load_failure_policy\": "
                               "\"recompute\" to recompute it instead",
                               transfer.kv_load_failure_policy)
            logger.info("prefixkv connector: host %d blocks, disk %s, remote %s, keys %s, "
                        "%d pinned blocks, KV events %s", host_blocks, spec.disk_dir,
                        self.remote.url if self.remote else None,
                        "weights " + weights if weights else ref, len(pins), events is not None)
        else:
            self.worker = WorkerSide(self.config, host_blocks, kv_events)

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the per-layer KV tensors and open the tiers."""
        assert self.worker is not None
        self.worker.register(kv_caches, self.num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Run this step's loads: host and disk before the forward pass; Valkey's start
        streaming in, layer by layer (:mod:`.streamed_load`)."""
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, PrefixKVMetadata)
            self.worker.run_loads(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for the streaming Valkey loads of ``layer_name`` (host and disk loads ended
        in :meth:`start_load_kv`)."""
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves run once per step in :meth:`wait_for_save`, over all layers."""

    def wait_for_save(self) -> None:
        """End the step's streamed loads (their failures reported this step), then queue the
        blocks this step completed for the save thread (host arena, then the disk and Valkey
        writers); the step does not wait for the copies."""
        if self.worker is not None:
            self.worker.end_loads()
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, PrefixKVMetadata)
            if meta.plan.saves:
                self.worker.save(meta.plan.saves)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Blocks vLLM freed by preempting requests may be reused this step: finish the
        queued copies first."""
        if self.worker is not None and isinstance(kv_connector_metadata, PrefixKVMetadata):
            self.worker.preempted(kv_connector_metadata.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose saves are all copied: vLLM frees their blocks now,
        requests whose asynchronous loads are done: vLLM schedules them now)."""
        if self.worker is None:
            return None, None
        sending, recving = self.worker.finished(finished_req_ids)
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """What the disk and remote tiers gained and lost since the last step (for the KV
        events)."""
        if self.worker is None:
            return None
        changes = {DISK_MEDIUM: self.worker.take_disk_changes(),
                   REMOTE_MEDIUM: self.worker.take_remote_changes()}
        changes = {m: c for m, c in changes.items() if c[0] or c[1]}
        return PrefixKVWorkerMeta(changes) if changes else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of this step whose load failed (vLLM recomputes them)."""
        return self.worker.take_failed() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> PrefixKVStats | None:
        """This worker's counters since the last call (loads per tier, failures, saves)."""
        if self.worker is None:
            return None
        counts = self.worker.take_counts()
        return PrefixKVStats(data=counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PrefixKVStats:
        """vLLM rebuilds the workers' stats in the logger with this."""
        return stats_from(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PrefixKVPromMetrics:
        """vLLM's ``/metrics`` series of the connector's tiers (``vllm:prefixkv_*``)."""
        return PrefixKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Flush queued writes and stop the writer threads."""
        if self.worker is not None:
            self.worker.close()
        if self.remote is not None:
            self.remote.close()

    # ------------------------------------------------------------------ scheduler role
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   **kwargs: Any) -> tuple[int | None, bool]:
        """Leading tokens past vLLM's hit that some tier holds, and whether they load
        asynchronously (``kv_load_async``)."""
        assert self.scheduler is not None
        n = self.scheduler.matched_tokens(request, num_computed_tokens)
        return n, n > 0 and self.scheduler.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the loads of the counted tokens into the request's blocks."""
        assert self.scheduler is not None
        if num_external_tokens > 0:
            self.scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)
        else:
            self.scheduler.after_alloc(request, [], 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves for the workers."""
        assert self.scheduler is not None
        return PrefixKVMetadata(self.scheduler.build(scheduler_output))

    def on_new_request(self, request: Request) -> None:
        """Start tracking ``request`` (its keys are computed as its blocks fill)."""
        if self.scheduler is not None:
            self.scheduler.track(request)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (keep the blocks until ``get_finished`` names the request) when a save of it
        was planned; else vLLM may free them now."""
        if self.scheduler is None:
            return False, None
        return self.scheduler.finished(request.request_id), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Finished asynchronous loads (their host slots released) and the worker's disk and
        remote changes (for the KV events)."""
        if self.scheduler is None:
            return
        self.scheduler.recv_done(connector_output.finished_recving or ())
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PrefixKVWorkerMeta):
            for medium, (stored, dropped) in meta.changes.items():
                self.scheduler.tier_changed(medium, stored, dropped)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The host, disk and Valkey tiers' ``BlockStored`` / ``BlockRemoved`` since the last
        call (``medium`` ``CPU`` / ``DISK`` / ``SHARED_STORAGE``); vLLM publishes them with its
        own."""
        if self.scheduler is None or self.scheduler.events is None:
            return ()
        return [to_vllm_event(e) for e in self.scheduler.events.take()]

    def reset_cache(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``: drop the host tier (disk and remote
        are kept: they are shared and survive restarts by design)."""
        if self.scheduler is not None:
            self.scheduler.reset()
        return True
