"""Types of the optional C helper built from ``_evict.c`` (see that file's header)."""

from typing import Any

class Runner:
    def __init__(self, heap: Any, held: Any, forest: Any, node_type: type, detached: Any,
                 block_size: int, /) -> None: ...
    def run(self, want: int, got: int, runs: list[Any], loose: list[Any], /) -> tuple[int, int, Any]: ...
