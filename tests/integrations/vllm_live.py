"""Helpers of the opt-in ``vllm`` suite: vLLM's CPU environment variables and one fresh vLLM
process per call (tests/integrations/vllm_driver.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""What vLLM's CPU build needs here (/work/shared/peers/VLLM-CPU.md)."""
RUN_TIMEOUT_S = 600

Outputs = list[dict[str, Any]]
"""Per run: ``{"seconds": s, "outputs": [{"tokens": [...], "cached": n}, ...]}``."""


def run_vllm(python: str, spec: dict[str, Any], log: Path) -> Outputs:
    """Start one ``LLM`` in a fresh process (tests/integrations/vllm_driver.py), run ``spec``;
    its log goes to ``log``."""
    result_file = log.with_suffix(".json")
    with open(log, "w") as out:
        done = subprocess.run(
            [python, str(HERE / "vllm_driver.py"), json.dumps({**spec, "out": str(result_file)})],
            env={**os.environ, **ENV}, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
            check=False)
    assert done.returncode == 0 and result_file.is_file(), \
        f"vLLM run failed (rc {done.returncode}), see {log}"
    result: Outputs = json.loads(result_file.read_text())
    return result


def wait_healthy(base: str, server: subprocess.Popen[bytes], log: Path) -> None:
    """Wait until the vLLM server at ``base`` answers ``/health`` (it must not exit first);
    its log is ``log``."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        assert server.poll() is None, f"server exited, see {log}"
        assert time.monotonic() < deadline, f"server did not start, see {log}"
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
