from __future__ import annotations

import threading

from prefixkv.tiers.writer import BackgroundWriter


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
