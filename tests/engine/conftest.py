"""Shared fixtures: the built-in demo model (its text is meaningless; only token ids matter)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from prefixkv.engine import LLM


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from prefixkv.models.demo import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture
def make_llm(demo_model: Path) -> Any:
    def make(**kwargs: Any) -> LLM:
        kwargs.setdefault("num_kv_blocks", 256)
        return LLM(demo_model, **kwargs)

    return make


class Helpers:
    """Small helpers shared by the engine tests (a fixture, so no test imports conftest)."""

    @staticmethod
    def tokens(seed: int, n: int) -> list[int]:
        """Printable-byte token ids (the demo tokenizer is byte level)."""
        rng = random.Random(seed)
        return [rng.randrange(32, 127) for _ in range(n)]

    @classmethod
    def shared_prefix_workload(cls, n: int) -> list[list[int]]:
        """``n`` prompts on one 40-token system prompt, one unrelated prompt, and a strict
        prefix of the shared part (the equivalence tests' workload)."""
        system = cls.tokens(0, 40)
        prompts = [system + cls.tokens(100 + i, 3 + (i * 5) % 17) for i in range(n)]
        prompts.append(cls.tokens(7, 50))  # unrelated
        prompts.append(system[:23])  # a strict prefix of the shared part
        return prompts

    @staticmethod
    def new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
        """Threads alive now that were not in ``before`` (``set(threading.enumerate())``)."""
        return {t for t in threading.enumerate() if t not in before}

    @staticmethod
    def all_end(threads: set[threading.Thread], within: float = 10.0) -> bool:
        """Whether every thread of ``threads`` has ended within ``within`` seconds."""
        end = time.monotonic() + within
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    @staticmethod
    def assert_no_leak(llm: LLM) -> None:
        """Every KV block is free or cached once nothing runs, and nothing stays locked."""
        kv = llm.engine.kv
        assert not llm.engine.has_unfinished_requests()
        cached = kv.cache.num_cached_blocks if kv.cache is not None else 0
        assert kv.pool.num_free + cached == kv.num_blocks
        if kv.cache is not None:
            assert kv.cache.get_stats().locked_blocks == 0


@pytest.fixture(scope="session")
def helpers() -> type[Helpers]:
    return Helpers
