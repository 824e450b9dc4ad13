"""Local prefixkv workers started as subprocesses (``prefixkv route --launch``, tests, benchmarks).

Ownership: :class:`LocalWorkers` owns its processes and stops them in :meth:`LocalWorkers.stop`.
With ``die_with_parent=True`` (``prefixkv route --launch``) each worker also asks the kernel, on
Linux, for SIGTERM when the thread that started it ends (``PR_SET_PDEATHSIG``), so a router killed
with SIGKILL leaves no worker behind either; start such workers from the main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, Self

__all__ = ["LAUNCHED_KV_EVENTS", "LocalWorkers", "free_port", "stop_processes"]

LAUNCHED_KV_EVENTS = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
                      '"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}')
"""Launched workers' KV events (``--policy precise``): free loopback ports, found by discovery."""

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: stop() still terminates the workers


def stop_processes(procs: Sequence[subprocess.Popen[Any]], timeout: float) -> None:
    """Terminate every process still running, wait for each, kill one that outlives ``timeout``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalWorkers:
    """``n`` prefixkv servers started as subprocesses on free loopback ports.

    ``python -m prefixkv.cli serve [MODEL] --host 127.0.0.1 --port P *extra_args``; another
    ``command`` replaces what comes before ``--host`` (a test's own server script). The object
    owns the processes: :meth:`stop` (or leaving the ``with`` block) terminates them all.
    """

    def __init__(
        self,
        n: int,
        model: str | None = None,
        extra_args: Sequence[str] = (),
        *,
        host: str = "127.0.0.1",
        log_dir: str | None = None,
        die_with_parent: bool = False,
        command: Sequence[str] | None = None,
    ) -> None:
        if n <= 0:
            raise ValueError(f"n must be >= 1, got {n!r}")
        self.urls: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self._commands: list[list[str]] = []
        self._log_dir = log_dir
        self._preexec = _die_with_parent if die_with_parent else None
        for _ in range(n):
            port = free_port(host)
            cmd = (list(command) if command is not None
                   else [sys.executable, "-m", "prefixkv.cli", "serve", *([model] if model else [])])
            cmd += ["--host", host, "--port", str(port), *extra_args]
            self._commands.append(cmd)
            self.urls.append(f"http://{host}:{port}")
            self.procs.append(self._spawn(len(self._commands) - 1))

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        # preexec_fn is set only with die_with_parent, used by the CLI before any thread starts
        if self._log_dir is None:
            return subprocess.Popen(self._commands[i], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.STDOUT,
                                    preexec_fn=self._preexec)  # noqa: PLW1509
        with open(os.path.join(self._log_dir, f"worker{i}.log"), "ab") as log:
            return subprocess.Popen(self._commands[i], stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=self._preexec)  # noqa: PLW1509

    def restart(self, i: int) -> None:
        """Start worker ``i`` again (same command and port) after it died or was killed."""
        if self.procs[i].poll() is None:
            raise ValueError(f"worker {i} is still running")
        self.procs[i] = self._spawn(i)

    def stop(self) -> None:
        """Terminate every worker and wait for it (kill after 10 s)."""
        stop_processes(self.procs, timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
