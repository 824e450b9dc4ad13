"""A progress bar (size, rate) for a download another process writes into a directory.

The catalogue lets ``pip download`` fetch its wheels (pip's index, proxy, certificate and
credential settings stay in force) and shows how far it got by watching the bytes pip writes:
the largest file under the download's directory (pip's temporary file, then the copy it saves),
polled a few times a second. The bar is ``tqdm``'s, drawn only when the stream is a terminal
and cleared when the download ends, so logs and pipes get the caller's start and end lines and
nothing else.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

POLL_S = 0.2
"""How often the directory is looked at."""


@dataclass(slots=True)
class DownloadWatch:
    """What a watched download came to: the most bytes seen in one file, and for how long."""

    bytes: int = 0
    seconds: float = 0.0


def largest_file(directory: Path) -> int:
    """Size of the largest regular file under ``directory`` (0 if none); files that vanish
    while being looked at are skipped."""
    largest = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                largest = max(largest, os.stat(os.path.join(root, name)).st_size)
            except OSError:
                continue
    return largest


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


@contextmanager
def watch_download(
    directory: Path, *, total: int, label: str, stream: TextIO
) -> Iterator[DownloadWatch]:
    """Show a bar for the bytes appearing under ``directory`` while the ``with`` body runs.

    ``total`` is the expected size in bytes (the bar's end; a larger file just fills it). The
    yielded :class:`DownloadWatch` holds the bytes seen and the seconds taken once the body ends.
    """
    watch = DownloadWatch()
    # the terminal's size, or 80x24 where it reports none (a pty without a size: tqdm would
    # take it as zero rows and draw nothing at all)
    size = shutil.get_terminal_size((80, 24))
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=label,
               file=stream, leave=False, ncols=size.columns or 80, nrows=size.lines or 24,
               mininterval=POLL_S, disable=not _is_terminal(stream))
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            seen = largest_file(directory)
            if seen > watch.bytes:
                bar.update(seen - watch.bytes)
                watch.bytes = seen

    start = time.monotonic()
    thread = threading.Thread(target=poll, name="prefixkv-fetch-progress", daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        stop.set()
        thread.join()
        watch.seconds = time.monotonic() - start
        seen = largest_file(directory)
        if seen > watch.bytes:
            bar.update(seen - watch.bytes)
            watch.bytes = seen
        bar.close()
