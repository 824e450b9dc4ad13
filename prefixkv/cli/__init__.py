"""Owns: the ``prefixkv`` command: the parser and the dispatch of every subcommand.
Imports: the stdlib; this package's command modules on first use (heavy imports wait).

One module per subcommand family (``serve.py``, ``cache.py``, ``route.py``, ``bench.py``),
each exposing ``register(subparsers)``; this file only wires
them together, so ``prefixkv --help`` stays fast (heavy imports happen inside the handlers).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that add subcommands; each defines register(subparsers) and sets `func` defaults.
_COMMAND_MODULES = (
    "prefixkv.cli.serve",
    "prefixkv.cli.cache",
    "prefixkv.cli.route",
    "prefixkv.cli.bench",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also used by the docs and tests)."""
    parser = argparse.ArgumentParser(
        prog="prefixkv",
        description="Prefix caching for LLM inference: serve, route, manage the cache, benchmark.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a layer not built yet
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, dispatch, and turn errors into one clear line and exit code 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"prefixkv {args.command}: error: {exc}", file=sys.stderr)
        return 1
