"""The router benchmark's meters: a policy's CPU per ``select``, a thread's CPU, quantiles."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixkv.router.policies import Decision

__all__ = ["CpuMeter", "quantile", "thread_cpu"]


class CpuMeter:
    """Wraps a policy's ``select``: its thread CPU time, and the thread it runs on."""

    def __init__(self, select: Callable[..., Decision]) -> None:
        self._select = select
        self.seconds = 0.0
        self.native_id: int | None = None

    def __call__(self, *args: Any) -> Decision:
        t = time.thread_time()
        try:
            return self._select(*args)
        finally:
            self.seconds += time.thread_time() - t
            self.native_id = threading.get_native_id()


def thread_cpu(native_id: int | None) -> float | None:
    """CPU seconds (user + system) of a thread of this process, from Linux ``/proc``."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
