"""BackgroundWriter: a bounded queue drained by one daemon thread, off the request path.

``submit`` never blocks: when the queue is full the item is dropped and ``False`` returned
(a lower tier is a cache; losing a write costs a recompute later, never a wrong answer).
``write`` exceptions are logged and counted by the caller's ``on_error``; the thread goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)
_STOP = object()


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
        self._thread.start()

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
        """Wait until everything submitted so far is written; ``False`` on timeout."""
        q = self._queue
        end = time.monotonic() + timeout
        with q.all_tasks_done:
            while q.unfinished_tasks:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                q.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

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
