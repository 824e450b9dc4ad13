"""Owns: the app's Prometheus registry: per-request series, vLLM's aliases, the exposition.
Imports: prefixkv.engine's outputs and engine_metrics.py; no route, no dialect.

Prometheus metrics for ``GET /metrics`` (vLLM's names, with a ``prefixkv:`` prefix).

The series that mean what vLLM's mean are also exported under vLLM's own names
(``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ... see ``VLLM_ALIASES``), so existing vLLM dashboards work.

Each app owns one :class:`ServerMetrics` with its own ``CollectorRegistry``, so several apps in
one process (tests) never share counters. Two kinds of series:

* Per-request series, updated by the server as requests finish: prompt / generation tokens,
  prefix-cache queries and hits *counted in tokens* (vLLM's definition: a request queries its
  prompt tokens and hits its cached tokens), request outcomes, TTFT and end-to-end latency, and
  vLLM's per-phase histograms from the engine's own clock (queue, prefill, decode, inference
  time, time per output token; prompt and generation lengths).
* Engine state, passed in as an :class:`EngineGauges` snapshot at scrape time: running /
  waiting requests, preemptions, and the cache's cached / pinned / locked / free blocks,
  evictions and hit rates (its series: ``engine_metrics.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixkv.engine.outputs import RequestMetrics, RequestOutput
from prefixkv.server.engine_metrics import EngineCollector, EngineGauges

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # vLLM's
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
_PHASES = (  # (name, help, buckets): vLLM's per-request phase histograms, engine clock
    ("request_queue_time_seconds", "Time a request waited before its first step.",
     _LATENCY_BUCKETS),
    ("request_prefill_time_seconds", "Time from a request's first step to its first token.",
     _LATENCY_BUCKETS),
    ("request_decode_time_seconds", "Time from a request's first token to its last.",
     _LATENCY_BUCKETS),
    ("request_inference_time_seconds", "Time from a request's first step to its last token.",
     _LATENCY_BUCKETS),
    ("request_time_per_output_token_seconds",
     "Mean time between a request's output tokens (its decode time / (tokens - 1)).",
     _TPOT_BUCKETS),
)


VLLM_ALIASES = (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prompt_tokens", "generation_tokens", "prompt_tokens_by_source",
    "prompt_tokens_cached", "external_prefix_cache_queries", "external_prefix_cache_hits",
    "request_prefill_kv_computed_tokens",
    "request_success", "time_to_first_token_seconds", "e2e_request_latency_seconds",
    "num_preemptions", "request_prompt_tokens", "request_generation_tokens", "cache_config_info",
    "kv_block_lifetime_seconds", "kv_block_idle_before_evict_seconds", "kv_block_reuse_gap_seconds",
    *(name for name, _, _ in _PHASES),
)
"""Our ``prefixkv:<name>`` series that are also exported as ``vllm:<name>``. Not
``prefix_cache_hits``: ours counts every reused token, vLLM's only the pool's (its lower tiers'
are ``external_prefix_cache_hits``), so ``vllm:prefix_cache_hits`` has its own counter."""

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""vLLM's ``source`` labels of ``prompt_tokens_by_source``: computed, the pool, a lower tier."""


class ServerMetrics:
    """The metrics of one server app. Thread safe (prometheus_client's own locking)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        r, lbl = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            "prefixkv:prompt_tokens", "Prompt tokens of finished requests.", lbl, registry=r)
        self.generation_tokens = Counter(
            "prefixkv:generation_tokens", "Generated tokens.", lbl, registry=r)
        self.prefix_cache_queries = Counter(
            "prefixkv:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (tokens, not requests).", lbl, registry=r)
        self.prefix_cache_hits = Counter(
            "prefixkv:prefix_cache_hits",
            "Prompt tokens served from the prefix cache (tokens, not requests).", lbl, registry=r)
        self.request_success = Counter(
            "prefixkv:request_success", "Finished requests by finish reason.",
            lbl + ["finished_reason"], registry=r)
        self.request_errors = Counter(
            "prefixkv:request_errors", "Requests answered with an error, by HTTP status.",
            lbl + ["status"], registry=r)
        self.lora_info = Gauge(  # vLLM's series (llm-d's and the Gateway API's schedulers read it)
            "vllm:lora_requests_info", "LoRA adapters of running and waiting requests; the value "
            "is when it was read.", ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=r)
        self.ttft = Histogram(
            "prefixkv:time_to_first_token_seconds", "Time to first token, from request arrival.",
            lbl, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(
            "prefixkv:e2e_request_latency_seconds", "Request latency, arrival to last token.",
            lbl, buckets=_LATENCY_BUCKETS, registry=r)
        self.phases = {name: Histogram(f"prefixkv:{name}", doc, lbl, buckets=buckets, registry=r)
                       for name, doc, buckets in _PHASES}
        self.request_prompt_tokens = Histogram(
            "prefixkv:request_prompt_tokens", "Prompt length of finished requests.", lbl,
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "prefixkv:request_generation_tokens", "Tokens generated per finished request "
            "(all its choices).", lbl, buckets=_TOKEN_BUCKETS, registry=r)
        self.by_source = Counter(
            "prefixkv:prompt_tokens_by_source", "Prompt tokens by where their KV came from: "
            "computed, the pool's prefix cache, a lower tier (host, disk, remote).",
            lbl + ["source"], registry=r)
        self.cached = Counter("prefixkv:prompt_tokens_cached", "Prompt tokens whose KV was "
                              "reused (the pool and the lower tiers).", lbl, registry=r)
        self.external_queries = Counter(
            "prefixkv:external_prefix_cache_queries", "Prompt tokens looked up in the lower "
            "tiers (the full blocks after the pool's match).", lbl, registry=r)
        self.external_hits = Counter(
            "prefixkv:external_prefix_cache_hits", "Prompt tokens loaded from the lower tiers.",
            lbl, registry=r)
        self.computed = Histogram(
            "prefixkv:request_prefill_kv_computed_tokens", "Prompt tokens a request computed "
            "(its prompt less the reused tokens).", lbl, buckets=_TOKEN_BUCKETS, registry=r)
        for source in SOURCES:
            self.by_source.labels(model_name, source)
        for series in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries,
                       self.prefix_cache_hits, self.ttft, self.e2e, self.request_prompt_tokens,
                       self.request_generation_tokens, *self.phases.values(), self.cached,
                       self.external_queries, self.external_hits, self.computed):
            series.labels(model_name)  # report 0 before the first request
        self._hits_total = 0
        self._queries_total = 0
        r.register(_HitRateCollector(self, model_name))
        self._engine = EngineCollector(model_name)
        r.register(self._engine)
        self._aliases = CollectorRegistry()
        self._aliases.register(_VllmAliases(self.registry))
        self.local_hits = Counter(  # vLLM's meaning: the pool's hits only
            "vllm:prefix_cache_hits", "Prompt tokens served from the pool's prefix cache.", lbl,
            registry=self._aliases)
        self.local_hits.labels(model_name)

    def observe_prompt(self, prompt_tokens: int, cached_tokens: int, external_tokens: int = 0,
                       external_queried: int = 0) -> None:
        """One sequence's prompt was looked up: ``cached_tokens`` of ``prompt_tokens`` hit,
        ``external_tokens`` of them loaded from a lower tier after ``external_queried`` were
        looked up there."""
        m = self._model
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.prefix_cache_queries.labels(m).inc(prompt_tokens)
        self.prefix_cache_hits.labels(m).inc(cached_tokens)
        self.local_hits.labels(m).inc(cached_tokens - external_tokens)
        self.cached.labels(m).inc(cached_tokens)
        self.external_queries.labels(m).inc(external_queried)
        self.external_hits.labels(m).inc(external_tokens)
        self.computed.labels(m).observe(prompt_tokens - cached_tokens)
        for source, n in zip(SOURCES, (prompt_tokens - cached_tokens, cached_tokens - external_tokens,
                                       external_tokens)):
            self.by_source.labels(m, source).inc(n)
        self._queries_total += prompt_tokens
        self._hits_total += cached_tokens

    def observe_finished(self, generated_tokens: int, finish_reasons: list[str],
                         ttft_s: float | None, e2e_s: float, *, prompt_tokens: int = 0,
                         longest: int = 0, timings: RequestMetrics | None = None) -> None:
        """A request finished (all its choices): ``generated_tokens`` in all, ``longest`` by
        its longest choice, TTFT and end-to-end seconds on the server's clock; ``timings``
        (the engine's) give the phases a request reached (an aborted one may lack some)."""
        m = self._model
        self.generation_tokens.labels(m).inc(generated_tokens)
        for reason in finish_reasons:
            self.request_success.labels(m, reason or "unknown").inc()
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        self.e2e.labels(m).observe(e2e_s)
        self.request_prompt_tokens.labels(m).observe(prompt_tokens)
        self.request_generation_tokens.labels(m).observe(generated_tokens)
        if timings is None:
            return
        t = timings
        for phase, seconds in t.phases().items():
            self.phases[f"request_{phase}_time_seconds"].labels(m).observe(seconds)
        if longest > 1 and t.first_token_time is not None and t.finished_time is not None:
            self.phases["request_time_per_output_token_seconds"].labels(m).observe(
                max(0.0, t.finished_time - t.first_token_time) / (longest - 1))

    def observe_output(self, out: RequestOutput, reasons: list[str], ttft_s: float | None,
                       e2e_s: float) -> None:
        """:meth:`observe_finished` for a request's last output (its tokens, prompt, phases)."""
        lengths = [len(o.token_ids) for o in out.outputs]
        self.observe_finished(sum(lengths), reasons, ttft_s, e2e_s, prompt_tokens=len(out.prompt_token_ids),
                              longest=max(lengths, default=0), timings=out.metrics)

    def observe_error(self, status: int) -> None:
        """A request was answered with an error status."""
        self.request_errors.labels(self._model, str(status)).inc()

    @property
    def hit_rate(self) -> float:
        """Hits over queries, in tokens, since the server started."""
        return self._hits_total / self._queries_total if self._queries_total else 0.0

    def set_lora(self, info: tuple[list[str], list[str], int] | None) -> None:
        """The adapters running and waiting now (``engine.lora.lora_requests_info``); ``None``
        (adapters off) exports no sample."""
        self.lora_info.clear()
        if info is not None:
            running, waiting, max_lora = info
            self.lora_info.labels(",".join(running), ",".join(waiting), str(max_lora)).set(
                time.time())

    def render(self, gauges: EngineGauges) -> bytes:
        """The exposition text for ``GET /metrics``, with ``gauges`` as the engine state."""
        self._engine.snapshot = gauges
        return generate_latest(self.registry) + generate_latest(self._aliases)


class _HitRateCollector(Collector):
    """``prefixkv:prefix_cache_hit_rate``: hits / queries in tokens since start."""

    def __init__(self, metrics: ServerMetrics, model_name: str) -> None:
        self._metrics = metrics
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "prefixkv:prefix_cache_hit_rate",
            "Prefix-cache hit rate in tokens since start (hits_total / queries_total).",
            labels=["model_name"])
        g.add_metric([self._model], self._metrics.hit_rate)
        yield g


class _VllmAliases(Collector):
    """The ``VLLM_ALIASES`` series of ``source`` again, renamed ``prefixkv:`` -> ``vllm:``."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source
        self._names = {f"prefixkv:{n}" for n in VLLM_ALIASES}

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            if family.name not in self._names:
                continue
            renamed = Metric(family.name.replace("prefixkv:", "vllm:", 1), family.documentation,
                             family.type, family.unit)
            renamed.samples = [s._replace(name=s.name.replace("prefixkv:", "vllm:", 1))
                               for s in family.samples]
            yield renamed
