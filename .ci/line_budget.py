"""CI gate (tinygrad's habit): no module of the package grows past the line budget.

One concept per module, ~300 lines; past MAX_LINES a module is asking to be split, and CI
says so. Prints the largest modules either way.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LINES = 450  # the hard stop; ~300 is the aim (docs/architecture.md lists the modules past it)

root = Path(__file__).resolve().parents[1] / "prefixkv"
sizes = sorted(((len(p.read_text(encoding="utf-8").splitlines()), p.relative_to(root.parent))
                for p in root.rglob("*.py")), reverse=True)
over = [(n, p) for n, p in sizes if n > MAX_LINES]
print("largest modules:", ", ".join(f"{p} {n}" for n, p in sizes[:5]))
for n, p in over:
    print(f"{p}: {n} lines > {MAX_LINES}: split it where a seam exists", file=sys.stderr)
sys.exit(1 if over else 0)
