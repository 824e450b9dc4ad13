from __future__ import annotations

import threading
import time

from prefixkv.tiers.writer import BackgroundWriter, drain_at_exit


def test_writes_in_order_drops_when_full_and_survives_errors() -> None:
    gate = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def write(i: int) -> None:
        gate.wait()
        if i == 2:
            raise OSError("disk full")
        seen.append(i)

    w: BackgroundWriter[int] = BackgroundWriter("t", write, errors.append, maxsize=3)
    results = [w.submit(i) for i in range(6)]  # the thread holds one; the queue three
    assert results.count(False) >= 2
    assert not w.flush(timeout=0.05)
    gate.set()
    assert w.flush()
    assert seen == sorted(seen) and 2 not in seen and len(errors) == 1
    w.close()
    w.close()
    assert w.submit(9) is False


def test_close_without_waiting_returns_at_once_and_the_queue_still_lands() -> None:
    """A dropped engine's finalizer closes with ``wait=False``: it must not block, and what was
    queued is still written before the thread ends."""
    gate = threading.Event()
    seen: list[int] = []

    def write(i: int) -> None:
        gate.wait()
        seen.append(i)

    w: BackgroundWriter[int] = BackgroundWriter("t", write, lambda exc: None, maxsize=8)
    assert all(w.submit(i) for i in range(5))
    w.close(wait=False)  # the thread is blocked in a write: a waiting close would hang here
    assert w.running and w.submit(99) is False
    gate.set()
    w.close(timeout=5)  # a later close still waits
    assert not w.running and seen == [0, 1, 2, 3, 4]


def test_close_with_a_full_queue_drains_it_then_ends() -> None:
    gate = threading.Event()
    seen: list[int] = []
    w: BackgroundWriter[int] = BackgroundWriter(
        "t", lambda i: (gate.wait(), seen.append(i)), lambda exc: None, maxsize=2)
    accepted = [i for i in range(6) if w.submit(i)]  # the thread may hold one, the queue two
    assert 2 <= len(accepted) <= 3 and not w.submit(6)
    w.close(wait=False)  # no room for the stop marker
    gate.set()
    w.close(timeout=5)
    assert not w.running and seen == accepted


def test_exit_drain_waits_for_every_live_writer() -> None:
    """What ``atexit`` runs: each live writer's queue is written before the interpreter goes."""
    done: list[int] = []
    writers = [BackgroundWriter[int](f"t{k}", lambda i: (time.sleep(0.01), done.append(i)),
                                     lambda exc: None) for k in range(2)]
    for k, w in enumerate(writers):
        for i in range(10):
            assert w.submit(10 * k + i)
    drain_at_exit(timeout=10, writers=writers)  # (all live ones at exit: not in a test process)
    assert sorted(done) == list(range(20)) and not any(w.running for w in writers)


def test_flush_after_the_thread_ended_does_not_wait_out_its_timeout() -> None:
    """A close racing the thread's last item can leave the stop marker queued after the thread
    ended; a flush then (a cache reset after ``close()``) answers at once, not in 30 s."""
    w: BackgroundWriter[int] = BackgroundWriter("t", lambda i: None, lambda exc: None)
    w.close(timeout=5)
    assert not w.running and w.flush()
    w._queue.put_nowait(object())  # what that race leaves behind
    start = time.monotonic()
    assert w.flush(timeout=30) is False and time.monotonic() - start < 2
