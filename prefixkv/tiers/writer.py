"""BackgroundWriter: a bounded queue drained by one daemon thread, off the request path.

``submit`` never blocks: when the queue is full the item is dropped and ``False`` returned
(a lower tier is a cache; losing a write costs a recompute later, never a wrong answer).
``write`` exceptions are logged and counted by the caller's ``on_error``; the thread goes on.

Ownership of the thread's end: :meth:`close` stops intake and lets the thread write what is
queued, then end; ``wait=False`` returns at once (what a finalizer of a dropped engine calls:
it must never block). At interpreter exit, :func:`drain_at_exit` (registered with ``atexit``)
waits, up to :data:`EXIT_DRAIN_S` seconds in all, for every live writer to finish its queue: a
script that exits right after its last request still leaves its disk / remote tier complete.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)
_STOP = object()
EXIT_DRAIN_S = 30.0
"""The most seconds interpreter exit waits for all live writers' queued items, together."""
_LIVE: weakref.WeakSet[BackgroundWriter[Any]] = weakref.WeakSet()


class BackgroundWriter(Generic[T]):
    """Runs ``write(item)`` for each submitted item on its own thread, in order."""

    def __init__(
        self, name: str, write: Callable[[T], None], on_error: Callable[[BaseException], None],
        maxsize: int = 1024,
    ) -> None:
        self._write = write
        self._on_error = on_error
        self._queue: queue.Queue[object] = queue.Queue(maxsize)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._stop_when_empty = False  # closed with a full queue: no room for the sentinel
        self._thread.start()
        _LIVE.add(self)

    def submit(self, item: T) -> bool:
        """Queue ``item``; ``False`` if the queue is full or the writer is closed."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return False
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is written; ``False`` on timeout, or at once
        when the thread has ended (after :meth:`close`) with something still queued."""
        q = self._queue
        end = time.monotonic() + timeout
        with q.all_tasks_done:
            while q.unfinished_tasks:
                left = end - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                q.all_tasks_done.wait(min(left, 0.5))
        return True

    @property
    def running(self) -> bool:
        """Whether the thread is still alive (writing, or waiting for items)."""
        return self._thread.is_alive()

    def close(self, timeout: float = 30.0, *, wait: bool = True) -> None:
        """Take no more items; the thread writes what is queued, then ends. ``wait``: return
        when it has, or after ``timeout`` seconds; otherwise at once. Idempotent (a later call
        with ``wait`` still waits)."""
        if not self._closed:
            self._closed = True
            if not self._put_stop():
                self._stop_when_empty = True
                self._put_stop()  # the thread may have emptied the queue meanwhile
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _put_stop(self) -> bool:
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._write(item)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - a failed write is a lost cache entry
                self._on_error(exc)
            finally:
                self._queue.task_done()
            if self._stop_when_empty and self._queue.empty():
                return


def drain_at_exit(
    timeout: float = EXIT_DRAIN_S, writers: Iterable[BackgroundWriter[Any]] | None = None
) -> None:
    """Close ``writers`` (default: every live one) and wait, ``timeout`` seconds in all, for
    their queued items (registered with ``atexit``: writers are daemon threads, which exit
    would cut short)."""
    end = time.monotonic() + timeout
    for writer in list(_LIVE if writers is None else writers):
        writer.close(max(0.0, end - time.monotonic()))


atexit.register(drain_at_exit)
