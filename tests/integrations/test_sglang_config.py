"""The SGLang backend's settings and page keys (prefixkv.integrations.sglang.config): no SGLang,
no torch. The backend itself runs against SGLang in test_sglang_backend.py (opt-in)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from prefixkv.integrations.sglang import PageKeys, Shard, StorageSettings
from prefixkv.integrations.sglang import config as sglang_config
from prefixkv.integrations.sglang.config import page_layout

SGLANG_OWN = {"backend_name": "prefixkv", "module_path": "prefixkv.integrations.sglang",
              "class_name": "PrefixKVStorage", "interface_v1": 1}
KEY = "ab" * 32


def test_settings_read_prefixkv_flag_names_next_to_sglang_keys() -> None:
    s = StorageSettings.from_extra({
        **SGLANG_OWN, "kv_disk_dir": "/var/cache/kv", "kv_disk_size": "2GiB",
        "kv_remote": "redis://:pw@127.0.0.1:6379/0", "kv_remote_timeout": 1, "kv_remote_ttl": 600,
        "kv_namespace": "prod", "kv_clear_remote": True, "kv_remote_secret": "s"})
    assert (s.disk_dir, s.disk_size, s.remote_timeout, s.remote_ttl, s.namespace) == (
        "/var/cache/kv", "2GiB", 1.0, 600.0, "prod")
    assert s.clear_remote and s.secret == "s" and "pw" not in repr(s) and "'s'" not in repr(s)
    assert StorageSettings.from_extra({"kv_disk_dir": "/d"}).disk_size == "10GiB"


def test_the_secret_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXKV_KV_REMOTE_SECRET", "from-env")
    assert StorageSettings.from_extra({"kv_disk_dir": "/d"}).secret == "from-env"


@pytest.mark.parametrize(("extra", "named"), [
    ({}, "kv_disk_dir or kv_remote"),
    ({"kv_disk_dirr": "/d"}, "kv_disk_dirr"),
    ({"kv_disk_dir": ""}, "kv_disk_dir"),
    ({"kv_disk_dir": "/d", "kv_disk_size": "lots"}, "kv_disk_size"),
    ({"kv_disk_size": "1GiB", "kv_remote": "redis://h:1/0"}, "kv_disk_size needs kv_disk_dir"),
    ({"kv_remote": "http://:pw123@h"}, "kv_remote"),
    ({"kv_remote": "redis://h:1/0", "kv_remote_timeout": 0}, "kv_remote_timeout"),
    ({"kv_remote": "redis://h:1/0", "kv_remote_ttl": True}, "kv_remote_ttl"),
    ({"kv_disk_dir": "/d", "kv_namespace": 3}, "kv_namespace"),
    ({"kv_disk_dir": "/d", "kv_clear_remote": "yes"}, "kv_clear_remote"),
])
def test_bad_settings_are_errors_naming_the_key(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named) as err:
        StorageSettings.from_extra(extra)
    assert "pw123" not in str(err.value)  # a URL's password is never echoed


def test_an_unknown_non_prefixkv_key_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    sglang_config._warned.discard("enable_metadata_cache")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            StorageSettings.from_extra({"kv_disk_dir": "/d", "enable_metadata_cache": True,
                                        **SGLANG_OWN})
    assert [r.getMessage().count("enable_metadata_cache") for r in caplog.records] == [1]


def config(**over: Any) -> SimpleNamespace:
    base = {"model_name": "m", "tp_rank": 0, "tp_size": 2, "pp_rank": 0, "pp_size": 1,
            "attn_cp_rank": 0, "attn_cp_size": 1, "is_mla_model": False, "dcp_size": 1}
    return SimpleNamespace(**{**base, **over})


def keys_for(settings: dict[str, Any] | None = None, layout: str = "sglang:bfloat16:page_first:64",
             **shard: Any) -> PageKeys:
    s = StorageSettings.from_extra({"kv_disk_dir": "/d", **(settings or {})})
    return PageKeys(s, Shard.of(config(**shard)), layout)


def test_page_keys_are_stable_and_scoped() -> None:
    base = keys_for()(KEY)
    assert len(base) == 32 and keys_for()(KEY) == base  # any process computes the same key
    assert keys_for()("cd" * 32) != base
    others = [keys_for({"kv_namespace": "b"}), keys_for(model_name="other"),
              keys_for(tp_rank=1), keys_for(tp_size=4), keys_for(pp_rank=1, pp_size=2),
              keys_for(attn_cp_rank=1, attn_cp_size=2), keys_for({"kv_remote_secret": "x"}),
              keys_for(layout=page_layout("bfloat16", "layer_first", 64)),
              keys_for(layout=page_layout("float16", "page_first", 64))]
    assert len({k(KEY) for k in others} | {base}) == len(others) + 1
    # a KV replicated across TP ranks (MLA) is one page for every rank
    rank0, rank1 = keys_for(is_mla_model=True, tp_rank=0), keys_for(is_mla_model=True, tp_rank=1)
    assert rank0(KEY) == rank1(KEY)


def test_bad_page_keys_and_shards_are_value_errors() -> None:
    with pytest.raises(ValueError, match="page key"):
        keys_for()("")
    with pytest.raises(ValueError, match="dcp_size"):
        Shard.of(config(dcp_size=2))
    assert Shard.of(config(model_name=None)).model_name == ""


def test_the_package_imports_without_sglang_or_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['sglang'] = None\n"
            "import prefixkv.integrations.sglang as m; print(sorted(m.__all__))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "PrefixKVStorage" in done.stdout
