"""vLLM's engine flags and seed 004's ``prefixkv engine start`` spelling, for ``prefixkv serve``.

``add_vllm_flags`` adds vLLM's names (``--max-model-len``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--seed``, ``--tokenizer``, ``--chat-template``,
``--kv-cache-memory``) so vLLM launch lines run unchanged; ``vllm_kwargs`` passes the given
ones to ``build_engine``. ``register_engine`` adds ``engine start``, an alias of ``serve``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flags, same names and meaning (so vLLM launch scripts run unchanged)."""
    g = p.add_argument_group("vLLM-compatible engine flags")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences running at once (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step, the prefill chunk size (default 4096)")
    g.add_argument("--seed", type=int, default=None, help="engine seed for unseeded sampling (default 0)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--chat-template", default=None,
                   help="chat template: a file or the template text (default: the tokenizer's)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size in bytes or like '2GiB' (instead of --num-kv-blocks)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV cache events over ZMQ, e.g. '{\"enable_kv_cache_events\": "
                        "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}' "
                        "(the 'precise' router policy subscribes; docs/router.md)")


def vllm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM-compatible flags that were given, as ``build_engine`` arguments."""
    names = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "seed", "tokenizer",
             "chat_template", "kv_cache_memory", "kv_events_config")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}



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
