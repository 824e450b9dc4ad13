"""The router benchmark's meters: a policy's CPU per ``select``, a thread's CPU, quantiles."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixkv.router.policies import Decision

__all__ = ["CpuMeter", "process_threads_cpu", "quantile", "thread_cpu"]


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
    """CPU seconds of a thread of this process, from Linux ``/proc`` (ns-precise)."""
    if native_id is None:
        return None
    return _task_cpu(f"/proc/self/task/{native_id}")


def process_threads_cpu(pid: int) -> float | None:
    """CPU seconds of every live thread of ``pid`` (ns-precise: a clock tick, 10 ms, is more
    than a fast router spends on a short run); ``None`` when ``pid`` is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    return sum(_task_cpu(f"/proc/{pid}/task/{t}") or 0.0 for t in tids)


def _task_cpu(task: str) -> float | None:
    """One task's run time from its ``schedstat`` (else user + system ticks from ``stat``)."""
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{task}/stat") as f:
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


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def process_cpu(pid: int) -> float | None:
    """CPU seconds (all live threads, ns-precise) of ``pid`` and its child processes; ``None``
    when ``pid`` is gone or ``/proc`` is missing."""
    total, found = 0.0, False
    for p in _descendants(pid) if os.path.isdir("/proc") else []:
        cpu = process_threads_cpu(p)
        if cpu is not None:
            found = True
            total += cpu
    return total if found else None


def process_rss_mb(pid: int, field: str = "VmHWM") -> float | None:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of ``pid`` and its child processes, in MB."""
    total, found = 0.0, False
    for p in _descendants(pid) if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        total += int(line.split()[1]) / 1024
                        found = True
        except OSError:
            continue
    return total if found else None
