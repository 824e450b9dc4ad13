"""The other client of ``prefixkv bench hostile``: an 8-token request looping in its own process.

:class:`Victim` posts :data:`VICTIM` over and over on its own connection, in a process of its
own, so that the benchmark's own work (sending a 10 MB body, sampling RSS) cannot slow it: only
the server, and the machine's cores, can. :meth:`Victim.window` summarises its requests that
overlapped one hostile request (:class:`Latencies`).

:class:`Pinning` places the processes on CPUs (``--pin``): the sender (the benchmark's own
process) on one core, the server and the victim on the others, as when the hostile client runs
on another machine. On two cores the sender's CPU time (25-35 ms to send 10 MB over loopback)
otherwise competes with the server's and the victim's; the figures with and without it are
both reported (docs/benchmarks.md).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["VICTIM", "Latencies", "Pinning", "Victim", "pin_process", "process_cpu_s"]

VICTIM = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
"""The other client's request: short, greedy, 8 tokens."""


@dataclass(frozen=True, slots=True)
class Latencies:
    """The victim's latencies over one window, in seconds; ``errors`` counts non-200 answers."""

    n: int
    p50_s: float
    max_s: float
    errors: int = 0

    @classmethod
    def of(cls, seconds: Sequence[float], errors: int = 0) -> Latencies:
        """Summarise ``seconds`` (zeros when empty)."""
        if not seconds:
            return cls(0, 0.0, 0.0, errors)
        return cls(len(seconds), statistics.median(seconds), max(seconds), errors)


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds every live thread of process ``pid`` has run (``/proc/PID/task/*/schedstat``,
    nanosecond clock; ``None`` without a pid or where it cannot be read)."""
    if pid is None:
        return None
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            pass
    return total / 1e9


def pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Restrict every thread of process ``pid`` to ``cpus`` (Linux affinity is per thread; the
    threads it starts later inherit it); ``ValueError`` naming ``cpus`` when empty."""
    if not cpus:
        raise ValueError("cpus must name at least one CPU")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


@dataclass(frozen=True, slots=True)
class Pinning:
    """Which CPUs the sender (this process) and the server + victim run on."""

    sender: frozenset[int]
    server: frozenset[int]

    @classmethod
    def split(cls) -> Pinning:
        """The sender on the lowest CPU this process may use, the server and victim on the
        rest; ``ValueError`` on a one-CPU machine (nothing to split)."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise ValueError(f"--pin needs two CPUs, this process may use {cpus}")
        return cls(frozenset(cpus[:1]), frozenset(cpus[1:]))

    def describe(self) -> str:
        """One line: where each runs."""
        return (f"pinned: the sender (this process) on CPU {sorted(self.sender)}, the server and "
                f"the victim on CPU {sorted(self.server)}")

    @contextmanager
    def applied(self, server_pid: int, victim_pid: int) -> Iterator[None]:
        """Pin the three for the ``with`` body; the sender and the server get their old CPUs
        back after (the victim's process ends with the run)."""
        own, server = os.sched_getaffinity(0), os.sched_getaffinity(server_pid)
        pin_process(server_pid, self.server)
        pin_process(victim_pid, self.server)
        pin_process(os.getpid(), self.sender)
        try:
            yield
        finally:
            pin_process(os.getpid(), frozenset(own))
            try:
                pin_process(server_pid, frozenset(server))
            except (FileNotFoundError, ProcessLookupError):  # the server is gone
                pass


def _victim_once(client: httpx.Client) -> tuple[float, bool]:
    start = time.perf_counter()
    ok = client.post("/v1/completions", json=VICTIM).status_code == 200
    return time.perf_counter() - start, ok


def _victim_loop(url: str, headers: dict[str, str] | None, out: Any, stop: Any) -> None:
    """The victim's process: post :data:`VICTIM` over and over until ``stop`` is set, putting
    ``(monotonic start, seconds, ok)`` on ``out`` for each."""
    with httpx.Client(base_url=url, timeout=600, headers=headers) as client:
        for _ in range(5):  # warm-up: a connection, the engine's first steps
            _victim_once(client)
        out.put(None)  # ready
        while not stop.is_set():
            began = time.monotonic()
            took, ok = _victim_once(client)
            out.put((began, took, ok))


class Victim:
    """The other client, in a process of its own (``pid``). Its requests are stamped with
    ``time.monotonic`` (one clock for every process of the machine)."""

    def __init__(self, url: str, headers: dict[str, str] | None) -> None:
        ctx = mp.get_context("spawn")
        self._out: Any = ctx.Queue()
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_victim_loop, args=(url, headers, self._out, self._stop),
                                 daemon=True)
        self._seen: list[tuple[float, float, bool]] = []
        self._proc.start()
        if self._out.get(timeout=120) is not None:
            raise RuntimeError("the victim process did not start")

    @property
    def pid(self) -> int:
        """The victim's process id."""
        assert self._proc.pid is not None  # started in __init__
        return self._proc.pid

    def _drain(self) -> None:
        while True:
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                return
            self._seen.append(item)

    def window(self, start: float, end: float) -> Latencies:
        """The victim's requests that overlapped ``[start, end]`` (monotonic)."""
        self._drain()
        hit = [(t, ok) for began, t, ok in self._seen if began < end and began + t > start]
        return Latencies.of([t for t, _ in hit], sum(not ok for _, ok in hit))

    def count(self, n: int, timeout_s: float = 120.0) -> Latencies:
        """Its next ``n`` requests from now."""
        self._drain()
        first = len(self._seen)
        deadline = time.monotonic() + timeout_s
        while len(self._seen) < first + n and time.monotonic() < deadline:
            try:
                self._seen.append(self._out.get(timeout=1))
            except queue.Empty:
                pass
        got = self._seen[first:first + n]
        return Latencies.of([t for _, t, _ in got], sum(not ok for _, _, ok in got))

    def close(self) -> None:
        """Stop the process (its request in flight finishes first)."""
        self._stop.set()
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
        self._out.cancel_join_thread()
