"""vLLM's and LMCache's KV-offloading settings on ``prefixkv serve``: the mapping onto the tiers,
its errors, and a real server started with LMCache's connector config getting those tiers."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_live import wait_for_health

from prefixkv.cli import build_parser
from prefixkv.cli.kv_compat import apply_kv_compat

ROOT = Path(__file__).resolve().parents[2]
LMCACHE = '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def tiers(args: argparse.Namespace) -> tuple[object, ...]:
    return args.kv_offload_size, args.kv_disk_dir, args.kv_disk_size, args.kv_remote


def test_vllm_offloading_size_is_the_host_tier() -> None:
    args = serve_args("--kv-offloading-size", "0.5")
    apply_kv_compat(args, {})
    assert tiers(args) == ("0.5GiB", None, None, None)
    args = serve_args("--kv-offloading-size", "2", "--kv-offloading-backend", "native")
    apply_kv_compat(args, {"LMCACHE_LOCAL_DISK": "/ignored"})  # native: LMCache's settings unread
    assert tiers(args) == ("2.0GiB", None, None, None)
    args = serve_args("--kv-transfer-config", '{"kv_connector": "OffloadingConnector", '
                      '"kv_connector_extra_config": {"cpu_bytes_to_use": 1073741824}}')
    apply_kv_compat(args, {})
    assert args.kv_offload_size == "1073741824B"


def test_lmcache_settings_from_the_environment_and_its_config_file(tmp_path: Path) -> None:
    env = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "2.5",
           "LMCACHE_LOCAL_DISK": f"file://{tmp_path}", "LMCACHE_MAX_LOCAL_DISK_SIZE": "20",
           "LMCACHE_REMOTE_URL": "redis://127.0.0.1:6379"}
    args = serve_args("--kv-transfer-config", LMCACHE)
    apply_kv_compat(args, env)
    assert tiers(args) == ("2.5GB", str(tmp_path), "20.0GB", "redis://127.0.0.1:6379")
    # vLLM's size flag wins over LMCache's CPU size; LMCache's defaults: CPU on, 5 GB
    args = serve_args("--kv-offloading-backend", "lmcache", "--kv-offloading-size", "1")
    apply_kv_compat(args, {})
    assert tiers(args) == ("1.0GiB", None, None, None)
    args = serve_args("--kv-transfer-config", LMCACHE)
    apply_kv_compat(args, {})
    assert tiers(args) == ("5.0GB", None, None, None)
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nlocal_cpu: false\nlocal_disk: /data/kv\n"
                      "max_local_disk_size: 100\n")
    args = serve_args("--kv-transfer-config", LMCACHE)
    apply_kv_compat(args, {"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_LOCAL_CPU": "True"})
    assert tiers(args) == (None, "/data/kv", "100.0GB", None)  # the file wins; no CPU tier


@pytest.mark.parametrize(("flags", "env", "message"), [
    (("--kv-transfer-config", '{"kv_connector": "NixlConnector"}'), {}, "NixlConnector"),
    (("--kv-transfer-config", "{not json"), {}, "not valid JSON"),
    (("--kv-transfer-config", LMCACHE), {"LMCACHE_REMOTE_URL": "lm://host:65432"}, "lm://"),
    (("--kv-transfer-config", LMCACHE), {"LMCACHE_LOCAL_CPU": "maybe"}, "local_cpu"),
    (("--kv-transfer-config", LMCACHE), {"LMCACHE_MAX_LOCAL_CPU_SIZE": "-1"}, "max_local_cpu_size"),
    (("--kv-transfer-config", LMCACHE, "--kv-offload-size", "64"), {}, "--kv-offload-size"),
    (("--kv-offloading-size", "0"), {}, "--kv-offloading-size"),
    (("--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}'), {}, "cpu_bytes_to_use"),
    (("--kv-transfer-config", LMCACHE), {"LMCACHE_CONFIG_FILE": "/nonexistent.yaml"}, "LMCACHE_CONFIG_FILE"),
])
def test_settings_without_a_counterpart_are_errors(flags: tuple[str, ...], env: dict[str, str],
                                                   message: str) -> None:
    args = serve_args(*flags)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        apply_kv_compat(args, env)


def test_a_server_started_with_lmcaches_config_gets_those_tiers(tmp_path: Path) -> None:
    from test_server_cli import _free_port

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.01",
           "LMCACHE_LOCAL_DISK": f"file://{tmp_path}", "LMCACHE_MAX_LOCAL_DISK_SIZE": "0.05"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "serve", "--port", str(port), "--num-kv-blocks", "256",
         "--log-level", "warning", "--kv-transfer-config", LMCACHE],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(url, proc)
        found = {t["tier"]: t for t in httpx.get(url + "/v1/cache/stats").json()["tiers"]}
        block = 65536  # the demo model's KV block: 16 tokens x 4 layers x 2 x 2 heads x 64 x 4 B
        assert found["host"]["capacity_blocks"] == 10**7 // block
        assert found["disk"]["capacity_blocks"] == 5 * 10**7 // block
        # blocks leave the 256-block pool for the lower tiers and come back from them
        prompt = {"prompt": "an offloaded document " * 30, "max_tokens": 1, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=prompt, timeout=60).status_code == 200
        for i in range(6):
            other = {**prompt, "prompt": f"filler {i} " * 150}
            assert httpx.post(url + "/v1/completions", json=other, timeout=60).status_code == 200
        again = httpx.post(url + "/v1/completions", json=prompt, timeout=60).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 640
        found = {t["tier"]: t for t in httpx.get(url + "/v1/cache/stats").json()["tiers"]}
        assert found["host"]["hits"] + found["disk"]["hits"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
