"""SaveQueue: each step's saves copied out of vLLM's KV on a thread, off the step's path.

vLLM's contract for asynchronous saves (``KVConnectorBase_V1``): a block being saved must stay
in place until the save is reported done. Who guarantees it, per case:

* a **running** request's full blocks are never written again and not freed;
* a **finished** request's blocks: the scheduler half answers ``request_finished`` with "free
  later" for every request that had a save planned; vLLM then keeps its blocks until the worker
  names the request in ``get_finished``'s ``finished_sending``, which :meth:`finished` does only
  once every copy of that request is done;
* a **preempted** request's blocks are freed at once: ``handle_preemptions`` (before the step
  that may reuse them) waits for every queued copy (:meth:`wait`).

Copies run in order on one thread; the copy function (the worker's) moves bytes only: to the host
arena and into the disk and Valkey writers' queues, which write on their own threads.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from prefixkv.integrations.vllm.plan import SaveBlock

logger = logging.getLogger("vllm.prefixkv")


class SaveQueue:
    """Runs ``copy(saves)`` for each submitted step on one daemon thread, in order."""

    def __init__(self, copy: Callable[[Sequence[SaveBlock]], None]) -> None:
        self._copy = copy
        self._cv = threading.Condition()
        self._jobs: deque[list[SaveBlock]] = deque()
        self._busy = False
        self._inflight: Counter[str] = Counter()  # request -> its saves not yet copied
        self._seen: set[str] = set()  # requests with a save planned, not yet reported
        self._owed: set[str] = set()  # of those, finished by vLLM: report when copied
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prefixkv-save-copier",
                                        daemon=True)
        self._thread.start()

    def submit(self, planned: Iterable[SaveBlock], saves: list[SaveBlock]) -> None:
        """Queue ``saves`` (the blocks of ``planned`` still to store): every request named in
        ``planned`` is then owed a report by :meth:`finished`, even if nothing of it is left."""
        with self._cv:
            self._seen.update(s.req_id for s in planned)
            if not saves:
                return
            if self._closed:  # shutting down: copy here, in order after what is queued
                self._wait_locked(None)
                self._copy(saves)
                return
            self._inflight.update(s.req_id for s in saves)
            self._jobs.append(saves)
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued copy is done; ``False`` on timeout."""
        with self._cv:
            return self._wait_locked(timeout)

    def _wait_locked(self, timeout: float | None) -> bool:
        return self._cv.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """vLLM's ``get_finished``: note the requests that finished this step; return those
        owed a report whose copies are all done (each is returned once)."""
        with self._cv:
            self._owed.update(r for r in finished_req_ids if r in self._seen)
            ready = {r for r in self._owed if not self._inflight[r]}
            self._owed -= ready
            self._seen -= ready
            for r in ready:
                self._inflight.pop(r, None)
            return ready

    @property
    def pending(self) -> int:
        """Steps queued or being copied."""
        with self._cv:
            return len(self._jobs) + self._busy

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued copies, then stop the thread (idempotent)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                saves = self._jobs.popleft()
                self._busy = True
            try:
                self._copy(saves)
            except Exception:  # noqa: BLE001 - a lost save costs a recompute, never KV
                logger.exception("prefixkv: a save failed; those blocks are recomputed later")
            finally:
                with self._cv:
                    self._busy = False
                    self._inflight.subtract(s.req_id for s in saves)
                    self._cv.notify_all()
