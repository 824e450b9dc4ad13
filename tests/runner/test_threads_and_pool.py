"""Runner defaults: CPU threads (physical cores, never more than asked) and the KV pool size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixkv.runner import model_runner
from prefixkv.runner.model_runner import ModelRunner, configure_threads, physical_cores


@pytest.fixture(scope="module")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prefixkv.models.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_physical_cores_is_within_the_affinity_mask() -> None:
    import os

    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_explicit_threads_are_applied_and_validated(restore_threads) -> None:
    assert configure_threads(1) == 1 and torch.get_num_threads() == 1
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            configure_threads(bad)  # type: ignore[arg-type]


def test_default_threads_never_raise_what_torch_uses(restore_threads, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)  # e.g. the user asked for one thread
    assert configure_threads(None) == 1
    torch.set_num_threads(64)  # more than the cores: brought down to the physical cores
    assert configure_threads(None) == min(64, physical_cores())


def test_runner_threads_argument(restore_threads, demo_model_dir: Path) -> None:
    runner = ModelRunner(demo_model_dir, num_kv_blocks=8, threads=1)
    assert runner.threads == 1 and torch.get_num_threads() == 1


def test_default_pool_holds_one_full_context_even_over_the_byte_budget(
    demo_model_dir: Path, monkeypatch
) -> None:
    monkeypatch.setitem(model_runner.DEFAULT_KV_CACHE_BYTES, "cpu", 1 << 20)  # ~16 blocks
    runner = ModelRunner(demo_model_dir, device="cpu")
    assert runner.num_kv_blocks * runner.block_size == runner.max_model_len == 8192
    monkeypatch.setitem(model_runner.DEFAULT_KV_CACHE_BYTES, "cpu", 1 << 40)  # plenty
    runner = ModelRunner(demo_model_dir, device="cpu", block_size=64)
    assert runner.num_kv_blocks == model_runner.DEFAULT_MAX_SEQS_IN_POOL * 8192 // 64
