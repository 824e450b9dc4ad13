"""Owns: vLLM's KV-offloading flags and LMCache's settings mapped onto the tier flags.
Imports: the stdlib only.

vLLM's and LMCache's KV-offloading settings, read onto prefixkv's tiers (``prefixkv serve``).

A vLLM launch line that offloads KV to CPU memory, or hands it to LMCache, runs unchanged:

* ``--kv-offloading-size GIB`` (vLLM's, a float in GiB) is the host tier (``--kv-offload-size``),
  with ``--kv-offloading-backend native`` (the default) or ``lmcache`` (then LMCache's settings
  below may add a disk or a remote tier, and give the size when this flag does not);
* ``--kv-transfer-config '{"kv_connector": "LMCacheConnectorV1", ...}'`` reads LMCache's
  configuration: the file ``$LMCACHE_CONFIG_FILE`` (YAML) or the ``LMCACHE_*`` environment
  variables (the file wins, as in LMCache): ``local_cpu`` + ``max_local_cpu_size`` (GB) -> the
  host tier, ``local_disk`` (``file:///path`` or a path) + ``max_local_disk_size`` (GB) -> the
  disk tier, ``remote_url`` (``redis://`` / ``valkey://``) -> the shared tier. LMCache's own
  server (``lm://``), its ``chunk_size`` and serializers have no counterpart: prefixkv's tiers
  store whole KV blocks under their chained hashes. ``"OffloadingConnector"`` (vLLM's native
  CPU offload) takes ``kv_connector_extra_config.cpu_bytes_to_use`` or ``num_cpu_blocks``.

Another connector (P/D disaggregation: Nixl, NCCL, Mooncake) is a ``ValueError`` naming it. A
tier given both ways with different values is a ``ValueError`` naming both flags.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

LMCACHE = ("LMCacheConnectorV1", "LMCacheConnector")
OFFLOADING = "OffloadingConnector"
_LMCACHE_KEYS = ("local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "remote_url")


def add_kv_compat_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's offloading flags (its names)."""
    g = p.add_argument_group("vLLM / LMCache KV offloading (mapped onto the tiers above)")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="vLLM's: CPU memory for offloaded KV, in GiB (= --kv-offload-size GIBGiB)")
    g.add_argument("--kv-offloading-backend", choices=("native", "lmcache"), default=None,
                   help="vLLM's: both are prefixkv's host tier; 'lmcache' also reads LMCache's "
                        "settings ($LMCACHE_CONFIG_FILE or LMCACHE_* variables)")
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="vLLM's connector config: LMCacheConnectorV1 (reads LMCache's settings) "
                        "or OffloadingConnector")


def apply_kv_compat(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Set ``args.kv_offload_size`` / ``kv_disk_dir`` / ``kv_disk_size`` / ``kv_remote`` from
    the flags above (and LMCache's settings in ``environ``, default ``os.environ``)."""
    env = os.environ if environ is None else environ
    size = getattr(args, "kv_offloading_size", None)
    backend = getattr(args, "kv_offloading_backend", None)
    config = _transfer_config(getattr(args, "kv_transfer_config", None))
    tiers: dict[str, Any] = {}
    if size is not None:
        if size <= 0:
            raise ValueError(f"--kv-offloading-size must be > 0 GiB, got {size}")
        tiers["kv_offload_size"] = f"{size}GiB"
    connector = config.get("kv_connector")
    if backend == "lmcache" or connector in LMCACHE:
        for name, value in lmcache_tiers(lmcache_settings(env)).items():
            tiers.setdefault(name, value)  # vLLM's size flag wins over LMCache's default
    elif connector == OFFLOADING:
        extra = config.get("kv_connector_extra_config") or {}
        if "cpu_bytes_to_use" in extra:
            tiers.setdefault("kv_offload_size", f"{int(extra['cpu_bytes_to_use'])}B")
        elif "num_cpu_blocks" in extra:
            tiers.setdefault("kv_offload_size", int(extra["num_cpu_blocks"]))
        elif size is None:
            raise ValueError("--kv-transfer-config: OffloadingConnector needs "
                             "kv_connector_extra_config.cpu_bytes_to_use or --kv-offloading-size")
    for name, value in tiers.items():
        mine = getattr(args, name, None)
        if mine is not None and str(mine) != str(value):
            raise ValueError(f"--{name.replace('_', '-')} {mine} and the vLLM/LMCache offloading "
                             f"settings ({value}) disagree: give one")
        setattr(args, name, value)


def _transfer_config(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-transfer-config is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    connector = config.get("kv_connector")
    if connector not in (*LMCACHE, OFFLOADING):
        raise ValueError(f"--kv-transfer-config: kv_connector {connector!r} is not supported "
                         f"(prefixkv maps {', '.join((*LMCACHE, OFFLOADING))} onto its KV tiers)")
    return config


def lmcache_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """LMCache's settings that map onto tiers: ``$LMCACHE_CONFIG_FILE`` (YAML) if set, else the
    ``LMCACHE_<KEY>`` variables (strings)."""
    path = env.get("LMCACHE_CONFIG_FILE")
    if path:
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise ValueError("LMCACHE_CONFIG_FILE needs PyYAML (pip install pyyaml)") from None
        try:
            with open(path, encoding="utf-8") as f:
                loaded = yaml.safe_load(f) or {}
        except OSError as exc:
            raise ValueError(f"LMCACHE_CONFIG_FILE {path!r}: {exc.strerror or exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"LMCACHE_CONFIG_FILE {path!r} does not hold a mapping")
        return {k: loaded[k] for k in _LMCACHE_KEYS if loaded.get(k) is not None}
    return {k: env[f"LMCACHE_{k.upper()}"] for k in _LMCACHE_KEYS if env.get(f"LMCACHE_{k.upper()}")}


def lmcache_tiers(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The tier settings LMCache's ``settings`` mean (LMCache's defaults: CPU on, 5 GB)."""
    tiers: dict[str, Any] = {}
    if _flag(settings.get("local_cpu", True), "local_cpu"):
        tiers["kv_offload_size"] = f"{_gb(settings.get('max_local_cpu_size', 5.0), 'max_local_cpu_size')}GB"
    disk = settings.get("local_disk")
    if disk:
        tiers["kv_disk_dir"] = str(disk).removeprefix("file://")
        if settings.get("max_local_disk_size") is not None:
            tiers["kv_disk_size"] = f"{_gb(settings['max_local_disk_size'], 'max_local_disk_size')}GB"
    remote = settings.get("remote_url")
    if remote:
        if not str(remote).startswith(("redis://", "valkey://")):
            raise ValueError(f"LMCache remote_url {remote!r}: only redis:// and valkey:// stores "
                             "are supported (LMCache's own lm:// server is not)")
        tiers["kv_remote"] = str(remote)
    return tiers


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"LMCache {name} must be true or false, got {value!r}")


def _gb(value: Any, name: str) -> float:
    try:
        gb = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"LMCache {name} must be a number of GB, got {value!r}") from None
    if gb <= 0:
        raise ValueError(f"LMCache {name} must be > 0, got {value!r}")
    return gb
