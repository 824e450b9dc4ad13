"""prefixkv.integrations.sglang.PrefixKVStorage against SGLang 0.5.23 itself (opt-in, marker
``sglang``): the class is built by SGLang's own ``StorageBackendFactory`` ("dynamic" backend)
over SGLang's real CPU host pool (``MHATokenToKVPoolHost`` on CPU tensors), with a real disk
directory and a real valkey-server. SGLang cannot serve on this CPU (its device KV pools need a
CUDA build of sgl_kernel), so this checks the storage contract, not a served request.

Run it in a venv with SGLang installed ``--no-deps`` (docs/sglang.md)::

    /tmp/sglang/bin/python -m pytest -o addopts="" -q -m sglang tests/integrations/test_sglang_backend.py

Skipped wherever ``import sglang.srt.mem_cache.hicache_storage`` fails (CI, the main venv).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
pytestmark = pytest.mark.sglang
LAYERS, HEADS, HEAD_DIM, PAGE, TOKENS = 2, 2, 8, 4, 64


class _Anything:
    def __getattr__(self, name: str) -> _Anything:
        return _Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return _Anything()


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """SGLang's host pool module imports torchvision (PyPI has only CUDA builds, which fail
    against a CPU torch) through its multimodal configs, never using it for KV pages
    (/work/shared/peers/README.md): answer the import with a stand-in."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.partition(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.28.0"  # type: ignore[attr-defined]
        module.__getattr__ = lambda name: _Anything()  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _TorchvisionStandIn())

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from prefixkv.integrations.sglang import PrefixKVStorage  # noqa: E402

DYNAMIC = {"backend_name": "prefixkv", "module_path": "prefixkv.integrations.sglang",
           "class_name": "PrefixKVStorage", "interface_v1": 1}


def host_pool(layout: str = "page_first", dtype: torch.dtype = torch.float32) -> Any:
    """SGLang's MHA host pool on CPU (the device buffers are CPU tensors: nothing moves to a
    device in these tests; the storage path only touches the host pool)."""
    k = tuple(torch.zeros(TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))

    def ptrs(bufs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, dtype=dtype,
        device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)


def mla_pool(layout: str = "page_first") -> Any:
    """SGLang's MLA host pool on CPU (one latent row per token and layer)."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    rank, rope = 16, 4
    bufs = tuple(torch.zeros(TOKENS, 1, rank + rope) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
        kv_lora_rank=rank, qk_rope_head_dim=rope, kv_cache_dim=rank + rope, dtype=torch.float32,
        device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)


def make_backend(pool: Any, extra: dict[str, Any], *, model: str = "smollm2", tp_rank: int = 0,
                 tp_size: int = 1, mla: bool = False, metrics: bool = False) -> Any:
    """The backend as SGLang's controller makes it: factory, then the host pool registration."""
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=True,
        model_name=model, extra_config={**DYNAMIC, **extra})
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def fill(pool: Any, count: int, seed: int) -> torch.Tensor:
    """Allocate ``count`` host pages holding seeded values; their slot indices."""
    idx = pool.alloc(count * PAGE)
    gen = torch.Generator().manual_seed(seed)
    for slot in idx[::PAGE].tolist():
        page = pool.get_dummy_flat_data_page()
        pool.set_from_flat_data_page(slot, torch.randn(page.shape, generator=gen).to(page.dtype))
    assert all(bool(p.abs().sum() > 0) for p in pages(pool, idx))  # comparisons are not vacuous
    return idx


def pages(pool: Any, idx: torch.Tensor) -> list[torch.Tensor]:
    return [pool.get_data_page(s, flat=True).clone() for s in idx[::PAGE].tolist()]


def keys(n: int, tag: str = "p") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


@pytest.fixture
def valkey_url(valkey_server: Any) -> str:
    return str(valkey_server.url)


@pytest.fixture(params=["disk", "remote", "both"])
def tiers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    extra: dict[str, Any] = {}
    if request.param in ("disk", "both"):
        extra["kv_disk_dir"] = str(tmp_path / "kv")
    if request.param in ("remote", "both"):
        extra["kv_remote"] = request.getfixturevalue("valkey_url")
    yield extra


def test_sglang_factory_builds_it_and_nothing_is_abstract(tmp_path: Path) -> None:
    backend = make_backend(host_pool(), {"kv_disk_dir": str(tmp_path)})
    assert isinstance(backend, PrefixKVStorage) and isinstance(backend, HiCacheStorage)
    assert not getattr(PrefixKVStorage, "__abstractmethods__", set())
    with pytest.raises(ValueError, match="kv_disk_dirr"):
        make_backend(host_pool(), {"kv_disk_dirr": str(tmp_path)})


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_zero_copy_round_trip_into_a_fresh_pool(tiers: dict[str, Any], layout: str) -> None:
    src = host_pool(layout)
    idx = fill(src, 5, seed=1)
    want = pages(src, idx)
    writer = make_backend(src, tiers)
    assert writer.batch_set_v1(keys(5), idx) == [True] * 5
    writer.close()
    dst = host_pool(layout)  # another process's pool: nothing shared but the tiers
    reader = make_backend(dst, tiers)
    assert reader.batch_exists(keys(5)) == 5
    slots = dst.alloc(5 * PAGE)
    assert reader.batch_get_v1(keys(5), slots) == [True] * 5
    for got, expected in zip(pages(dst, slots), want):
        assert torch.equal(got, expected)
    reader.close()


def test_value_forms_round_trip(tiers: dict[str, Any]) -> None:
    pool = host_pool(dtype=torch.bfloat16)
    idx = fill(pool, 3, seed=2)
    want = pages(pool, idx)
    backend = make_backend(pool, tiers)
    assert backend.set(keys(3)[0], want[0])
    assert backend.batch_set(keys(3)[1:], want[1:])
    assert backend.exists(keys(3)[2]) and not backend.exists(keys(4)[3])
    target = pool.get_dummy_flat_data_page()
    assert backend.get(keys(3)[0], target) is target and torch.equal(target, want[0])
    got = backend.batch_get(keys(4), [pool.get_dummy_flat_data_page() for _ in range(4)])
    assert [torch.equal(g, w) for g, w in zip(got[:3], want)] == [True] * 3 and got[3] is None
    assert torch.equal(backend.get(keys(3)[1]), want[1])  # no target: a fresh tensor
    assert not backend.set(keys(1, "short")[0], want[0][:-1])  # not a page: refused
    backend.close()


def test_batch_exists_is_the_leading_run(tmp_path: Path, valkey_url: str) -> None:
    pool = host_pool()
    idx = fill(pool, 6, seed=3)
    ks = keys(6)
    disk_only = make_backend(pool, {"kv_disk_dir": str(tmp_path / "kv")})
    remote_only = make_backend(pool, {"kv_remote": valkey_url})
    both = make_backend(pool, {"kv_disk_dir": str(tmp_path / "kv"), "kv_remote": valkey_url})
    page = idx[: 2 * PAGE]
    assert disk_only.batch_set_v1(ks[0:2], page) == [True, True]       # pages 0, 1: disk
    assert remote_only.batch_set_v1(ks[2:4], page) == [True, True]     # pages 2, 3: Valkey
    assert disk_only.batch_set_v1(ks[5:6], idx[:PAGE]) == [True]        # page 5: after a hole
    assert both.batch_exists(ks) == 4
    assert disk_only.batch_exists(ks) == 2 and remote_only.batch_exists(ks) == 0
    assert remote_only.batch_exists(ks[2:]) == 2 and both.batch_exists([]) == 0
    for b in (disk_only, remote_only, both):
        b.close()


def test_mla_ranks_share_one_copy_written_while_both_run(tmp_path: Path) -> None:
    """With MLA only TP rank 0 writes (SGLang's ``is_storage_writer``) and every rank must see
    the page (the ranks' hit counts are reduced to their minimum): rank 1, started before the
    write, finds rank 0's files on the shared directory."""
    extra = {"kv_disk_dir": str(tmp_path / "kv")}
    pool0, pool1 = mla_pool(), mla_pool()
    rank0 = make_backend(pool0, extra, mla=True, tp_rank=0, tp_size=2)
    rank1 = make_backend(pool1, extra, mla=True, tp_rank=1, tp_size=2)
    idx = fill(pool0, 3, seed=13)
    assert rank1.batch_exists(keys(3)) == 0
    assert rank0.batch_set_v1(keys(3), idx) == [True] * 3
    assert rank1.batch_exists(keys(3)) == 3
    slots = pool1.alloc(3 * PAGE)
    assert rank1.batch_get_v1(keys(3), slots) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(pages(pool1, slots), pages(pool0, idx)))


def _corrupt_disk(directory: Path, how: str) -> None:
    for f in directory.glob("*.kvb"):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if how == "truncate"
                      else data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_disk_record_is_a_miss(tmp_path: Path, how: str) -> None:
    pool = host_pool()
    idx = fill(pool, 1, seed=4)
    extra = {"kv_disk_dir": str(tmp_path / "kv")}
    make_backend(pool, extra).batch_set_v1(keys(1), idx)
    _corrupt_disk(tmp_path / "kv", how)
    dst = host_pool()
    slots = dst.alloc(PAGE)
    before = pages(dst, slots)
    reader = make_backend(dst, extra)
    assert reader.batch_get_v1(keys(1), slots) == [False]
    assert torch.equal(pages(dst, slots)[0], before[0])  # the host page was not written
    assert reader.tier_stats()[0].corrupt == 1
    assert reader.batch_exists(keys(1)) == 0 and not list((tmp_path / "kv").glob("*.kvb"))


def test_a_damaged_valkey_record_is_a_miss(valkey_url: str) -> None:
    import redis

    pool = host_pool()
    idx = fill(pool, 2, seed=5)
    backend = make_backend(pool, {"kv_remote": valkey_url})
    assert backend.batch_set_v1(keys(2), idx) == [True, True]
    client = redis.Redis.from_url(valkey_url)
    names = sorted(client.keys(b"pkv:*"))
    assert len(names) == 2
    value = client.get(names[0])
    client.set(names[0], value[:-1] + bytes([value[-1] ^ 1]))
    reader = make_backend(host_pool(), {"kv_remote": valkey_url})
    got = reader.batch_get_v1(keys(2), reader.mem_pool_host.alloc(2 * PAGE))
    assert sorted(got) == [False, True]
    assert reader.tier_stats()[0].corrupt == 1 and client.exists(names[0]) == 0


def test_other_shards_models_and_layouts_never_share_pages(tmp_path: Path) -> None:
    pool = host_pool()
    extra = {"kv_disk_dir": str(tmp_path / "kv")}
    make_backend(pool, extra, tp_rank=0, tp_size=2).batch_set_v1(keys(2), fill(pool, 2, seed=6))
    assert make_backend(pool, extra, tp_rank=0, tp_size=2).batch_exists(keys(2)) == 2
    assert make_backend(pool, extra, tp_rank=1, tp_size=2).batch_exists(keys(2)) == 0
    assert make_backend(pool, extra, tp_rank=0, tp_size=2, model="other").batch_exists(keys(2)) == 0
    assert make_backend(host_pool("layer_first"), extra, tp_size=2).batch_exists(keys(2)) == 0
    assert make_backend(pool, {**extra, "kv_namespace": "b"}, tp_size=2).batch_exists(keys(2)) == 0
    mla_rank0 = make_backend(pool, extra, mla=True, tp_rank=0, tp_size=2)
    mla_rank0.batch_set_v1(keys(1), fill(pool, 1, 7))
    assert make_backend(pool, extra, mla=True, tp_rank=1, tp_size=2).batch_exists(keys(1)) == 1


def test_clear_and_stats(tmp_path: Path, valkey_url: str) -> None:
    pool = host_pool()
    idx = fill(pool, 3, seed=8)
    extra = {"kv_disk_dir": str(tmp_path / "kv"), "kv_remote": valkey_url}
    backend = make_backend(pool, extra, metrics=True)
    assert backend.batch_set_v1(keys(3), idx) == [True] * 3
    assert backend.batch_get_v1(keys(3), pool.alloc(3 * PAGE)) == [True] * 3
    metrics = backend.get_stats()
    assert type(metrics).__name__ == "StorageMetrics"
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [3]
    assert metrics.backup_bandwidth[0] > 0 and metrics.prefetch_bandwidth[0] > 0
    assert backend.get_stats().prefetch_pgs == []  # drained, as SGLang's histograms expect
    disk, remote = backend.tier_stats()
    assert (disk.tier, disk.stored_blocks, disk.hits, disk.occupancy_blocks) == ("disk", 3, 3, 3)
    page_bytes = pool.get_dummy_flat_data_page().nbytes
    assert disk.hit_tokens == 3 * PAGE and disk.loaded_bytes == 3 * page_bytes
    assert (remote.tier, remote.stored_blocks, remote.hits) == ("remote", 3, 0)
    backend.clear()  # the disk only: the shared server is other instances' too
    assert not list((tmp_path / "kv").glob("*.kvb"))
    assert backend.batch_exists(keys(3)) == 3  # still on Valkey
    assert backend.batch_get_v1(keys(3), pool.alloc(3 * PAGE)) == [True] * 3
    assert backend.tier_stats()[1].hits == 3
    backend.disk.flush()  # the Valkey hits were copied back to the disk
    assert len(list((tmp_path / "kv").glob("*.kvb"))) == 3
    wiper = make_backend(pool, {**extra, "kv_clear_remote": True})
    wiper.clear()  # its disk (the same directory) and every prefixkv block on the server
    assert not list((tmp_path / "kv").glob("*.kvb"))
    assert backend.batch_get_v1(keys(3), pool.alloc(3 * PAGE)) == [False] * 3
    assert backend.batch_exists(keys(3)) == 0
    assert make_backend(pool, extra).get_stats() is None  # SGLang's metrics off


def test_a_pool_without_flat_pages_is_refused_at_attach(tmp_path: Path) -> None:
    pool = host_pool()
    pool.layout = "page_first_kv_split"  # SGLang's MHA host pool has no flat page in it
    with pytest.raises(ValueError, match="page_first_kv_split"):
        make_backend(pool, {"kv_disk_dir": str(tmp_path)})


def test_hybrid_models_are_refused_at_attach(tmp_path: Path) -> None:
    pool = host_pool()
    backend = make_backend(pool, {"kv_disk_dir": str(tmp_path)})
    backend.register_mem_host_pool_v2(pool, "kv")
    backend.on_host_pools_registered()  # the KV pool alone is fine
    backend.register_mem_host_pool_v2(pool, "mamba")
    with pytest.raises(ValueError, match="mamba"):
        backend.on_host_pools_registered()


def test_prefetch_and_backup_threads_at_once(tmp_path: Path, valkey_url: str) -> None:
    """SGLang's backup thread writes while its prefetch thread queries and reads: every page
    read is a page written, never a mix."""
    import threading

    pool = host_pool()  # one backend, one host pool: reads fill other slots of it
    backend = make_backend(pool, {"kv_disk_dir": str(tmp_path / "kv"), "kv_remote": valkey_url})
    batches = [(keys(3, f"t{i}-"), fill(pool, 3, seed=100 + i)) for i in range(6)]
    want = {k: p for ks, idx in batches for k, p in zip(ks, pages(pool, idx))}
    errors: list[BaseException] = []

    def backup() -> None:
        try:
            for ks, idx in batches:
                assert backend.batch_set_v1(ks, idx) == [True] * 3
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    writer = threading.Thread(target=backup)
    writer.start()
    seen = 0
    while writer.is_alive() or seen < len(batches):
        for ks, _ in batches:
            n = backend.batch_exists(ks)
            slots = pool.alloc(n * PAGE) if n else None
            if slots is not None:
                loaded = backend.batch_get_v1(ks[:n], slots)
                for k, ok, got in zip(ks, loaded, pages(pool, slots)):
                    assert ok and torch.equal(got, want[k])
                pool.free(slots)
        seen = sum(backend.batch_exists(ks) == 3 for ks, _ in batches)
    writer.join()
    assert not errors


class _Prefetch:
    """What SGLang's page-get functions read of a prefetch operation."""

    request_id = "r1"

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize("zero_copy", [True, False])
def test_sglang_controller_io_functions_move_pages_through_it(tmp_path: Path,
                                                            zero_copy: bool) -> None:
    """SGLang's own HiCacheController page functions (zero copy with ``interface_v1``, the
    value forms without) run against the backend, as its prefetch and backup threads call them."""
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController as C

    src, dst = host_pool(), host_pool()
    idx = fill(src, 4, seed=11)
    extra = {"kv_disk_dir": str(tmp_path / "kv")}
    get, put = ((C._page_get_zero_copy, C._page_set_zero_copy) if zero_copy
                else (C._generic_page_get, C._generic_page_set))
    writer = SimpleNamespace(storage_backend=make_backend(src, extra), storage_host_pool=src,
                             page_size=PAGE)
    assert put(writer, keys(4), idx) is True
    reader = SimpleNamespace(storage_backend=make_backend(dst, extra), storage_host_pool=dst,
                             page_size=PAGE)
    slots = dst.alloc(5 * PAGE)
    assert get(reader, _Prefetch(), keys(5), slots) == 4  # the leading run of loaded pages
    assert all(torch.equal(a, b) for a, b in zip(pages(dst, slots[: 4 * PAGE]), pages(src, idx)))


def test_valkey_down_is_a_miss_and_the_disk_still_serves(tmp_path: Path,
                                                        valkey_server: Any) -> None:
    pool = host_pool()
    idx = fill(pool, 2, seed=12)
    remote_only = make_backend(pool, {"kv_remote": valkey_server.url, "kv_remote_timeout": 0.2})
    both = make_backend(pool, {"kv_remote": valkey_server.url, "kv_remote_timeout": 0.2,
                               "kv_disk_dir": str(tmp_path / "kv")})
    assert both.batch_set_v1(keys(2), idx) == [True, True]
    valkey_server.kill()
    assert remote_only.batch_exists(keys(2)) == 0
    assert remote_only.batch_get_v1(keys(2), pool.alloc(2 * PAGE)) == [False, False]
    assert remote_only.batch_set_v1(keys(2, "new"), idx) == [False, False]
    assert remote_only.tier_stats()[0].errors >= 1
    assert both.batch_exists(keys(2)) == 2
    assert both.batch_get_v1(keys(2), pool.alloc(2 * PAGE)) == [True, True]
    assert both.batch_set_v1(keys(2, "new"), idx) == [True, True]  # the disk took them


CHILD = """
import json, sys, importlib.util
spec = importlib.util.spec_from_file_location("sglang_backend_test", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
print(json.dumps(mod.child(json.loads(sys.argv[2]))))
"""


def child(args: dict[str, Any]) -> Any:
    """In a second process: write pages ``seed`` (``write``) or read them back (``read``:
    the loaded pages' float sums)."""
    pool = host_pool()
    backend = make_backend(pool, {"kv_remote": args["url"]})
    if args["op"] == "write":
        out: Any = backend.batch_set_v1(keys(4, "shared"), fill(pool, 4, seed=args["seed"]))
    else:
        slots = pool.alloc(4 * PAGE)
        out = [backend.batch_exists(keys(4, "shared")),
               backend.batch_get_v1(keys(4, "shared"), slots),
               [float(p.double().sum()) for p in pages(pool, slots)]]
    backend.close()
    return out


def run_child(args: dict[str, Any]) -> Any:
    done = subprocess.run([sys.executable, "-c", CHILD, __file__, json.dumps(args)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_processes_share_pages_through_valkey(valkey_url: str) -> None:
    assert run_child({"url": valkey_url, "op": "write", "seed": 9}) == [True] * 4
    pool = host_pool()
    want = [float(p.double().sum()) for p in pages(pool, fill(pool, 4, seed=9))]
    backend = make_backend(host_pool(), {"kv_remote": valkey_url})
    slots = backend.mem_pool_host.alloc(4 * PAGE)
    assert backend.batch_exists(keys(4, "shared")) == 4
    assert backend.batch_get_v1(keys(4, "shared"), slots) == [True] * 4
    assert [float(p.double().sum()) for p in pages(backend.mem_pool_host, slots)] == want
    backend.close()
    exists, loaded, sums = run_child({"url": valkey_url, "op": "read"})
    assert (exists, loaded, sums) == (4, [True] * 4, want)


def test_a_secret_keeps_other_writers_out(tmp_path: Path) -> None:
    pool = host_pool()
    extra = {"kv_disk_dir": str(tmp_path / "kv"), "kv_remote_secret": "s3cret"}
    make_backend(pool, extra).batch_set_v1(keys(1), fill(pool, 1, seed=10))
    assert make_backend(pool, extra).batch_exists(keys(1)) == 1
    no_secret = make_backend(pool, {"kv_disk_dir": str(tmp_path / "kv")})
    assert no_secret.batch_exists(keys(1)) == 0  # another key space, and its files untouched
    assert len(list((tmp_path / "kv").glob("*.kvb"))) == 1

