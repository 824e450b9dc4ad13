"""Owns: seed 004's ``prefixkv engine start`` alias of ``serve``.
Imports: the stdlib only (serve.py hands it the flag builders).

Seed 004's ``prefixkv engine start`` spelling of ``prefixkv serve``.

vLLM's engine flags (``--max-model-len``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--seed``, ``--tokenizer``, ``--chat-template``, ``--kv-cache-memory``) are ``serve`` flags
generated from :class:`~prefixkv.config.EngineConfig` (``cli/flags.py``), so vLLM launch
lines run unchanged. ``register_engine`` adds ``engine start``, an alias of ``serve``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register_engine(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    add_engine_flags: Callable[[argparse.ArgumentParser], None],
    add_server_flags: Callable[[argparse.ArgumentParser], None],
    serve: Callable[[argparse.Namespace], int],
) -> None:
    """Seed 004's spelling: ``prefixkv engine start MODEL --prefix-cache-size N
    --prefix-cache-enable --eviction-policy lru`` is ``prefixkv serve`` (the cache size is the
    KV pool in blocks, ``--num-kv-blocks``)."""
    p = sub.add_parser("engine", help="seed 004's alias: 'engine start' = serve")
    start = p.add_subparsers(dest="engine_command", metavar="ACTION", required=True).add_parser(
        "start", help="start the server (same as 'prefixkv serve')",
        description="Alias of 'prefixkv serve' with seed 004's flag names.")
    add_engine_flags(start)
    add_server_flags(start)
    g = start.add_argument_group("seed 004 names")
    g.add_argument("--prefix-cache-size", type=int, default=None, metavar="N",
                   help="KV blocks the cache may hold (= --num-kv-blocks)")
    g.add_argument("--prefix-cache-enable", action="store_true",
                   help="prefix caching on (the default; --no-enable-prefix-caching turns it off)")
    g.add_argument("--engine-kind", choices=("llm",), default="llm", help="only 'llm'")

    def engine_start(args: argparse.Namespace) -> int:
        return serve(seed004_args(args))

    start.set_defaults(func=engine_start)


def seed004_args(args: argparse.Namespace) -> argparse.Namespace:
    """Seed 004's flags mapped onto ``serve``'s (``--prefix-cache-size`` is ``--num-kv-blocks``)."""
    if args.prefix_cache_size is not None:
        if args.num_kv_blocks is not None and args.num_kv_blocks != args.prefix_cache_size:
            raise ValueError("give --prefix-cache-size or --num-kv-blocks, not both")
        args.num_kv_blocks = args.prefix_cache_size
    if args.prefix_cache_enable:
        args.enable_prefix_caching = True
    return args
