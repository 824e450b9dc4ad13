"""prefixkv.bench: benchmarks of the cache core and the engine.

* :mod:`prefixkv.bench.trace`: replay Mooncake-format traces through the cache core
  (``prefixkv bench trace``), with :mod:`prefixkv.bench.belady` (the offline optimum as a
  policy) and :mod:`prefixkv.bench.plots` (hit rate vs capacity charts).
* :mod:`prefixkv.bench.ops`: microbenchmarks of the index operations (``prefixkv bench ops``).
* :mod:`prefixkv.bench.scenarios`: seed 003's use cases end to end (``prefixkv bench scenarios``).

Only the trace replay is re-exported here (it imports nothing heavier than the cache core).
"""

from __future__ import annotations

from prefixkv.bench.belady import BeladyPolicy
from prefixkv.bench.trace import (
    TraceRequest,
    TraceRow,
    format_table,
    load_trace,
    parse_trace,
    replay,
)

__all__ = [
    "BeladyPolicy",
    "TraceRequest",
    "TraceRow",
    "format_table",
    "load_trace",
    "parse_trace",
    "replay",
]
