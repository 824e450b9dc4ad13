"""EngineConfig: every engine setting in one validated object, built once and handed down.

    config = EngineConfig.from_kwargs(model="smollm2-135m-instruct", block_size=16,
                                      max_num_seqs=32, kv_offload_size="2GiB")
    config.cache.block_size, config.scheduler.max_num_seqs, config.tiers.offload_size

Sections (plain frozen dataclasses, each checked in ``__post_init__``, ``ValueError`` naming
the bad field): :class:`ModelSettings` (what to load), :class:`CacheSettings` (KV pool and
prefix index), :class:`SchedulerSettings` (batching and admission) and
:class:`~prefixkv.tiers.spec.TierSpec` (lower KV tiers). ``LLM(model, **kwargs)``, ``build_engine``
and ``prefixkv serve`` all go through :meth:`EngineConfig.from_kwargs`, whose flat names are
vLLM's (``max_num_seqs``, ``kv_cache_memory``, ...); an unknown name is a ``TypeError`` naming
it. :data:`OPTIONS` describes each flat name (section, field, help, default as shown): the
``prefixkv serve`` flags are generated from it, so a flag's default and help are the code's.

Torch-free: ``prefixkv serve --help`` and ``import prefixkv`` read it without loading torch.
Device and dtype names are resolved when the model is loaded (they need torch).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixkv.cache import HASH_ALGOS, INDEXES, POLICIES, EvictionPolicy, PrefixCache, make_cache
from prefixkv.wire.kv_events import KVEventsConfig
from prefixkv.tiers.spec import TierSpec

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")  # = engine.schedule_policy's (a test checks)
QUANTIZATIONS = ("gguf",)  # = models.gguf_loader.QUANTIZATIONS (a test checks)


def _meta(help: str, *, shown: str | None = None, kind: str | None = None,
          choices: tuple[str, ...] | None = None, group: str = "engine",
          metavar: str | None = None) -> dict[str, Any]:
    """A field's flag description (read by :data:`OPTIONS`): help, the default as shown when
    it is not a plain value, the flag's value kind and choices, its ``--help`` group."""
    return {"help": help, "shown": shown, "kind": kind, "choices": choices, "group": group,
            "metavar": metavar}


def _check_int(obj: object, name: str, low: int, *, optional: bool = False) -> None:
    value = getattr(obj, name)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}{' or None' if optional else ''}, "
                         f"got {value!r}")


def _check_choice(obj: object, name: str, choices: tuple[str, ...] | list[str]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_text(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if value is not None and not isinstance(value, (str, Path)):
        raise ValueError(f"{name} must be a string or a path, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """What to load and how: the weights, tokenizer, chat template, device, dtype, context."""

    model: str | Path | None = field(default=None, metadata=_meta(
        "HF-format model directory, .gguf file, or a known name such as smollm2-135m-instruct "
        "(fetched once, ~93 MB)", kind="model",
        shown="the built-in demo model, deterministic weights, meaningless text"))
    tokenizer: str | Path | None = field(default=None, metadata=_meta(
        "tokenizer directory", shown="the model's", group="vllm"))
    chat_template: str | Path | None = field(default=None, metadata=_meta(
        "chat template: a file or the template text", shown="the tokenizer's", group="vllm"))
    device: str | None = field(default=None, metadata=_meta(
        "torch device", shown="cuda if present, else cpu"))
    dtype: Any = field(default=None, metadata=_meta(
        "float32 | bfloat16 | float16 | auto", shown="by device", kind="str"))
    quantization: str | None = field(default=None, metadata=_meta(
        "gguf: keep a GGUF's Q4_0/Q4_1 matmul weights at 4 bits (torch's int4 CPU kernel, "
        "bfloat16 activations inside); other tensors are dequantized",
        shown="none: dequantize to --dtype", kind="str", choices=QUANTIZATIONS, group="vllm"))
    threads: int | None = field(default=None, metadata=_meta(
        "torch CPU threads", shown="physical cores, or fewer if OMP_NUM_THREADS says so",
        kind="int"))
    tune_malloc: bool = field(default=True, metadata=_meta(
        "CPU: keep freed activations in glibc's heap (mmap threshold 512 MiB, trim threshold "
        "1 GiB; process-wide, as vLLM preloads tcmalloc): about 11% faster prefill",
        kind="bool"))
    max_model_len: int | None = field(default=None, metadata=_meta(
        "context length", shown="the model's max_position_embeddings", kind="int",
        group="vllm"))
    seed: int = field(default=0, metadata=_meta("engine seed for unseeded sampling", group="vllm"))
    constrained_json_disable_any_whitespace: bool = field(default=False, metadata=_meta(
        "structured JSON outputs (response_format, tools, json schemas) without free whitespace "
        "between tokens, for every request (SGLang's flag; vLLM's disable_any_whitespace): for "
        "a model that pads JSON with whitespace", shown="off: whitespace allowed, as vLLM and "
        "SGLang", kind="bool", group="vllm"))
    enable_lora: bool = field(default=False, metadata=_meta(
        "serve LoRA adapters (PEFT format; requests pick one by model name, vLLM's "
        "lora_request or SGLang's lora_path; docs/engine.md, LoRA)", kind="bool", group="vllm"))
    lora_modules: tuple[str, ...] = field(default=(), metadata=_meta(
        "adapters loaded at start (with enable_lora), as NAME=PATH", shown="none", kind="list",
        group="vllm", metavar="NAME=PATH"))
    max_lora_rank: int = field(default=16, metadata=_meta(
        "the largest adapter rank accepted", kind="int", group="vllm"))
    max_loras: int = field(default=4, metadata=_meta(
        "adapters kept loaded; the least recently used leaves first (and is loaded again from "
        "its path when asked for)", kind="int", group="vllm"))

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer", "chat_template"):
            _check_text(self, name)
        if self.device is not None and not isinstance(self.device, str):
            raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {self.device!r}")
        if self.dtype == "auto":  # vLLM's spelling of "the device default"
            object.__setattr__(self, "dtype", None)
        if self.quantization is not None:
            _check_choice(self, "quantization", QUANTIZATIONS)
        _check_int(self, "threads", 1, optional=True)
        for name in ("tune_malloc", "constrained_json_disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int(self, "max_model_len", 1, optional=True)
        _check_int(self, "seed", 0)
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        modules = self.lora_modules
        if isinstance(modules, str) or not isinstance(modules, (list, tuple)) or not all(
                isinstance(m, str) and "=" in m for m in modules):
            raise ValueError(f"lora_modules must be a list of NAME=PATH, got {modules!r}")
        object.__setattr__(self, "lora_modules", tuple(modules))
        if modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        _check_int(self, "max_lora_rank", 1)
        _check_int(self, "max_loras", 1)


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The KV pool (size, block size) and the prefix index over it.

    ``kv_cache_memory`` is bytes (a size such as ``"2GiB"`` is parsed at construction);
    give it or ``num_kv_blocks``, not both (neither: sized from the model and memory).
    ``max_pinned_blocks=None`` is 20% of the pool. ``eviction_policy`` is a name or a policy
    object (which has state: give each engine its own).
    """

    block_size: int = field(default=16, metadata=_meta("tokens per KV block"))
    num_kv_blocks: int | None = field(default=None, metadata=_meta(
        "KV blocks in the pool", shown="sized from the model and memory", kind="int"))
    kv_cache_memory: int | None = field(default=None, metadata=_meta(
        "KV pool size in bytes or like '2GiB' (instead of --num-kv-blocks)",
        shown="sized from the model and memory", kind="str", group="vllm"))
    enable_prefix_caching: bool = field(default=True, metadata=_meta(
        "reuse cached KV for shared prompt prefixes"))
    index: str = field(default="radix", metadata=_meta("prefix index kind", choices=INDEXES))
    eviction_policy: str | EvictionPolicy = field(default="lru", metadata=_meta(
        "which unused cached blocks go first", choices=tuple(sorted(POLICIES))))
    hash_algo: str = field(default="sha256", metadata=_meta(
        "block hash for --index hash", choices=HASH_ALGOS))
    max_pinned_blocks: int | None = field(default=None, metadata=_meta(
        "most blocks that may be pinned", shown="20% of the pool", kind="int"))
    max_pinned_blocks_per_tenant: int | None = field(default=None, metadata=_meta(
        "most blocks one cache_salt may keep pinned", shown="only the global budget",
        kind="int"))
    max_cached_blocks_per_tenant: int | None = field(default=None, metadata=_meta(
        "a cache_salt's quota: its cached blocks beyond it are evicted first (one tenant cannot "
        "flush another's), in the pool and in each lower tier (--kv-blocks-per-tenant sets "
        "theirs), and it may retain at most this many", shown="the whole pool",
        kind="int"))
    kv_cache_metrics: bool = field(default=False, metadata=_meta(
        "sample KV block residency (lifetime, idle time before eviction, reuse gap) per tier",
        group="vllm"))
    kv_cache_metrics_sample: float = field(default=0.01, metadata=_meta(
        "fraction of blocks sampled by --kv-cache-metrics", group="vllm"))
    kv_events_config: KVEventsConfig | None = field(default=None, metadata=_meta(
        "vLLM's KV events JSON, e.g. '{\"enable_kv_cache_events\": true}': publish BlockStored / "
        "BlockRemoved / AllBlocksCleared over ZMQ (the router's precise policy subscribes); "
        "bound on tcp://127.0.0.1:5557 unless \"endpoint\" says otherwise (\"tcp://*:5557\" "
        "exposes it on every interface)", shown="off", kind="str",
        group="vllm", metavar="JSON"))

    def __post_init__(self) -> None:
        _check_int(self, "block_size", 1)
        _check_int(self, "num_kv_blocks", 1, optional=True)
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory",
                               parse_size(self.kv_cache_memory, "kv_cache_memory"))
            if self.num_kv_blocks is not None:
                raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        if not isinstance(self.enable_prefix_caching, bool):
            msg = f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            raise ValueError(msg)  # noqa: TRY004 - bad settings are ValueErrors here
        _check_choice(self, "index", INDEXES)
        if not isinstance(self.eviction_policy, EvictionPolicy):  # an instance is passed in as is
            _check_choice(self, "eviction_policy", sorted(POLICIES))
        _check_choice(self, "hash_algo", HASH_ALGOS)
        _check_int(self, "max_pinned_blocks", 0, optional=True)
        _check_int(self, "max_pinned_blocks_per_tenant", 0, optional=True)
        _check_int(self, "max_cached_blocks_per_tenant", 0, optional=True)
        if not isinstance(self.kv_cache_metrics, bool):
            raise ValueError(f"kv_cache_metrics must be a bool, got {self.kv_cache_metrics!r}")
        rate = self.kv_cache_metrics_sample
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {rate!r}")
        if self.kv_events_config is not None:  # JSON text or a dict, parsed (ValueError) once
            object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))

    def make_index(self, num_blocks: int, block_size: int) -> PrefixCache | None:
        """The prefix index these settings describe over a pool of ``num_blocks`` (``None``
        with prefix caching off). Blocks are always counted per tenant (the quota defaults to
        the whole pool: counted, never over)."""
        if not self.enable_prefix_caching:
            return None
        quota = self.max_cached_blocks_per_tenant
        return make_cache(index=self.index, max_blocks=num_blocks, block_size=block_size,
                          eviction_policy=self.eviction_policy, hash_algo=self.hash_algo,
                          max_pinned_blocks=self.max_pinned_blocks,
                          max_blocks_per_tenant=num_blocks if quota is None else quota)


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """How many sequences run at once, the token budget of a step, and admission order."""

    max_num_seqs: int = field(default=64, metadata=_meta(
        "most sequences running at once", group="vllm"))
    max_num_batched_tokens: int = field(default=4096, metadata=_meta(
        "token budget of one step, the prefill chunk size", group="vllm"))
    schedule_policy: str = field(default="fcfs", metadata=_meta(
        "admission order when requests wait: fcfs, lpm (cached prefix first), dfs-weight "
        "(shared prefixes grouped)", choices=SCHEDULE_POLICIES))

    def __post_init__(self) -> None:
        _check_int(self, "max_num_seqs", 1)
        _check_int(self, "max_num_batched_tokens", 1)
        _check_choice(self, "schedule_policy", SCHEDULE_POLICIES)


# TierSpec (prefixkv.tiers) keeps its own field names; its flat names and flags carry "kv_".
_TIER_OPTIONS: dict[str, dict[str, Any]] = {
    "offload_size": {"help": "host-memory tier below the pool: GiB (2, as vLLM), a size "
                             "('512MiB') or blocks ('512blocks'); blocks evicted from the pool "
                             "are kept there", "shown": "off",
                     "kind": "str", "metavar": "SIZE"},
    "disk_dir": {"help": "disk tier: one checksummed file per block, kept across restarts",
                 "shown": "no disk tier", "kind": "str", "metavar": "DIR"},
    "disk_size": {"help": "disk tier capacity: GiB (10), a size ('500MiB') or blocks "
                          "('4096blocks')", "shown": "10GiB",
                  "kind": "str", "metavar": "SIZE"},
    "remote": {"help": "shared tier on Valkey/Redis, redis://[user:pass@]host:port[/db] "
                       "(rediss:// for TLS): workers on it reuse each other's prefixes",
               "shown": "none", "kind": "str", "metavar": "URL"},
    "remote_secret": {"help": "key of an HMAC on every disk and remote record: records that "
                              "fail it are misses (env PREFIXKV_KV_REMOTE_SECRET)",
                      "shown": "none", "kind": "str", "metavar": "SECRET"},
    "remote_timeout": {"help": "a remote call slower than this counts as down",
                       "metavar": "SECONDS"},
    "remote_ttl": {"help": "expiry of unpinned blocks stored in the remote tier; with the "
                           "server on maxmemory-policy volatile-lru pinned blocks are then "
                           "never evicted there", "shown": "none", "kind": "float",
                   "metavar": "SECONDS"},
    "prefetch_blocks": {"help": "most blocks read ahead from disk / remote into host memory "
                                "while their requests wait in the queue (0: off)",
                        "metavar": "BLOCKS"},
    "namespace": {"help": "extra key part of every block in the lower tiers (e.g. a "
                          "deployment name): engines on other namespaces never see them",
                  "shown": "none", "metavar": "NAME"},
    "blocks_per_tenant": {"help": "a tenant's quota in each lower tier, in blocks (its blocks "
                                  "beyond it are evicted first there): one count, or per tier "
                                  "'host=512,disk=4096,remote=8192'",
                          "shown": "--max-cached-blocks-per-tenant", "kind": "str",
                          "metavar": "BLOCKS"},
}


@dataclass(frozen=True, slots=True)
class Option:
    """One flat setting: ``LLM(name=...)``, flag ``--name-with-dashes``, ``section.field``."""

    name: str
    section: str
    field: str
    default: Any
    help: str
    shown: str
    kind: str
    choices: tuple[str, ...] | None
    group: str
    metavar: str | None

    @property
    def flag(self) -> str:
        """The command-line flag (``--kv-offload-size``)."""
        return "--" + self.name.replace("_", "-")

    @property
    def help_text(self) -> str:
        """The flag's ``--help`` line: the help and the default as the code has it."""
        return f"{self.help} (default: {self.shown})"


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _options() -> dict[str, Option]:
    out: dict[str, Option] = {}
    sections: list[tuple[str, type]] = [("model", ModelSettings), ("cache", CacheSettings),
                                        ("scheduler", SchedulerSettings), ("tiers", TierSpec)]
    for section, cls in sections:
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata) if section != "tiers" else {"group": "tiers", **_TIER_OPTIONS[f.name]}
            name = f.name if section != "tiers" else "kv_" + f.name
            kind = meta.get("kind") or ("str" if f.default is None else type(f.default).__name__)
            out[name] = Option(name, section, f.name, f.default, meta["help"],
                               meta.get("shown") or _shown(f.default), kind,
                               meta.get("choices"), meta.get("group", "engine"), meta.get("metavar"))
    return out


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """All engine settings, validated once; the engine and its parts read their section.

    Build it with :meth:`from_kwargs` (flat vLLM-style names) or from the sections; derive a
    variant with :meth:`replace`. Checks across sections happen here: lower tiers need prefix
    caching.
    """

    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    tiers: TierSpec = field(default_factory=TierSpec)

    def __post_init__(self) -> None:
        for name, cls in (("model", ModelSettings), ("cache", CacheSettings),
                          ("scheduler", SchedulerSettings), ("tiers", TierSpec)):
            if not isinstance(getattr(self, name), cls):
                msg = f"EngineConfig.{name} must be a {cls.__name__}, got {getattr(self, name)!r}"
                raise ValueError(msg)  # noqa: TRY004 - bad settings are ValueErrors here
        if self.tiers.enabled and not self.cache.enable_prefix_caching:
            raise ValueError("kv_offload_size / kv_disk_dir / kv_remote need prefix caching")

    @classmethod
    def from_kwargs(cls, model: str | Path | None = None, **kwargs: Any) -> EngineConfig:
        """A config from flat names (:data:`OPTIONS`; ``kv_cache_memory_bytes`` is an alias of
        ``kv_cache_memory``). ``TypeError`` for an unknown name, ``ValueError`` for a bad value."""
        return cls().replace(model=model, **kwargs)

    def replace(self, **kwargs: Any) -> EngineConfig:
        """A copy with the given flat names changed (same rules as :meth:`from_kwargs`)."""
        if "kv_cache_memory_bytes" in kwargs:
            value = kwargs.pop("kv_cache_memory_bytes")
            if kwargs.get("kv_cache_memory") is not None and value is not None:
                raise ValueError("give kv_cache_memory or kv_cache_memory_bytes, not both")
            if value is not None:
                kwargs["kv_cache_memory"] = value
        changes: dict[str, dict[str, Any]] = {}
        for name, value in kwargs.items():
            opt = OPTIONS.get(name)
            if opt is None:
                close = difflib.get_close_matches(name, OPTIONS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"unknown engine argument {name!r}{hint}")
            changes.setdefault(opt.section, {})[opt.field] = value
        sections = {s: dataclasses.replace(getattr(self, s), **c) for s, c in changes.items()}
        return dataclasses.replace(self, **sections)

    def to_kwargs(self) -> dict[str, Any]:
        """The flat names and their values (``from_kwargs(**c.to_kwargs()) == c``)."""
        return {o.name: getattr(getattr(self, o.section), o.field) for o in OPTIONS.values()}


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(value: int | str, name: str) -> int:
    """Bytes from an int or a size such as ``"512MiB"``, ``"2GiB"``, ``"1.5G"`` (``ValueError`` naming ``name``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        try:
            size = int(float(num) * _UNITS[unit])
        except (ValueError, KeyError):
            raise ValueError(f"{name} must be bytes or a size like '2GiB', got {value!r}") from None
    else:
        raise ValueError(f"{name} must be bytes or a size like '2GiB', got {value!r}")  # noqa: TRY004
    if size < 1:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return size


OPTIONS: dict[str, Option] = _options()
"""Every flat setting by name, in section order (the ``prefixkv serve`` flags are made from it)."""
