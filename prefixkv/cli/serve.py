"""Owns: ``prefixkv serve``, ``prefixkv generate`` (and ``engine start`` through compat.py).
Imports: prefixkv.config, prefixkv.server (app, limits), this package's flags; engine and
models.catalog: lazily.

``prefixkv serve`` and ``prefixkv generate`` (``prefixkv cache ...``: :mod:`.cache`).

* ``serve [MODEL]``: the OpenAI-compatible server (no MODEL: the built-in demo model, whose
  text is meaningless; it exists to show prefix caching at work).
* ``generate PROMPT``: one offline generation through ``LLM`` (no server).

Heavy imports (torch, the engine, uvicorn) happen inside the handlers so ``--help`` is fast.
Failures raise ``ValueError`` / ``OSError`` / ``RuntimeError`` with one clear line, which
``prefixkv.cli.main`` prints before exiting with status 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket

from prefixkv.config import EngineConfig
from prefixkv.cli.compat import register_engine
from prefixkv.cli.flags import add_engine_flags, engine_kwargs
from prefixkv.cli.kv_compat import add_kv_compat_flags, apply_kv_compat
from prefixkv.server.limits import ServerLimits


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``serve`` and ``generate`` to the ``prefixkv`` parser."""
    _register_serve(sub)
    register_engine(sub, add_engine_flags, _add_server_flags, _serve)
    _register_generate(sub)



# ---------------------------------------------------------------- serve


def _register_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the OpenAI-compatible server",
                       description="Serve MODEL over an OpenAI-compatible HTTP API with prefix "
                                   "caching, cache admin routes and Prometheus metrics.")
    add_engine_flags(p)
    _add_server_flags(p)


KEEP_ALIVE_S = 20
"""How long an idle client connection stays open (uvicorn's ``timeout_keep_alive``; its default
and vLLM's is 5 s). A server must keep an idle connection longer than its clients do, or a
client can send on a connection in the very moment the server closes it and get a reset: httpx,
which the OpenAI SDK uses, drops idle connections after 5 s, so at 5 s here about one request in
3,300 of ``prefixkv bench load`` failed with ``ReadError`` on a connection idle 4.9 s; aiohttp
keeps them 15 s."""


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--api-key", default=os.environ.get("PREFIXKV_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $PREFIXKV_API_KEY, else open)")
    g.add_argument("--admin-api-key", default=os.environ.get("PREFIXKV_ADMIN_API_KEY"),
                   help="key for the cache admin routes /v1/cache/* (default: "
                        "$PREFIXKV_ADMIN_API_KEY; without one they answer loopback clients only)")
    lim = ServerLimits()
    g.add_argument("--max-request-body-bytes", type=int, default=lim.max_body_bytes,
                   help=f"largest request body; 413 above it (default {lim.max_body_bytes})")
    g.add_argument("--max-n", type=int, default=lim.max_n,
                   help=f"most samples (n) per request (default {lim.max_n})")
    g.add_argument("--max-prompts-per-request", type=int, default=lim.max_prompts,
                   help=f"most prompts in one completions batch (default {lim.max_prompts})")
    g.add_argument("--default-chat-max-tokens", type=int, default=lim.default_chat_max_tokens,
                   help="max_tokens of a chat request that sets none, capped by the room left "
                        f"in the context (default {lim.default_chat_max_tokens})")
    g.add_argument("--max-retention-priority", type=int, default=lim.max_retention_priority,
                   help="highest retention priority (0-100) a request's 'priority' field can "
                        "give what it caches; 0: the field retains nothing; admin retentions go "
                        f"to 100 (default {lim.max_retention_priority})")
    g.add_argument("--otlp-traces-endpoint", metavar="URL",
                   default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None,
                   help="vLLM's: export an OpenTelemetry span per request (cached tokens by "
                        "tier, tenant, adapter) to this OTLP/HTTP endpoint, e.g. "
                        "http://127.0.0.1:4318/v1/traces; needs prefixkv[tracing] "
                        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) in the API; the first is reported in responses, all are "
                        "listed and accepted (default: the directory name, or prefixkv-demo)")
    g.add_argument("--strict-fields", action="store_true",
                   help="refuse unknown request fields with a 400 (default: ignore them, with "
                        "one logged warning per field name, as vLLM does)")
    g.add_argument("--freeze-gc", action=argparse.BooleanOptionalAction, default=True,
                   help="after loading, gc.freeze() everything then alive (as vLLM's engine "
                        "does): a full garbage collection no longer walks the ~385k objects of "
                        "torch, the model and the libraries (206 ms -> under 1 ms on the demo "
                        "model), so it cannot stall requests (default: on)")
    g.add_argument("--timeout-keep-alive", type=_positive_seconds, default=KEEP_ALIVE_S,
                   metavar="SECONDS",
                   help="close a client's idle connection after this long; longer than clients "
                        f"keep theirs, so none sends on one being closed (default {KEEP_ALIVE_S})")
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    add_kv_compat_flags(p)
    p.set_defaults(func=_serve)


def _positive_seconds(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (bound here so a busy port is one clear error)."""
    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def freeze_heap() -> int:
    """Collect, then move every object alive into the collector's permanent generation
    (``gc.freeze``): the server's process lives as long as the engine, the model and the
    libraries it loaded, so a full collection need never walk them again (it took 206 ms on the
    demo model, a stall of every request). Objects made later are collected as before; returns
    how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from prefixkv.engine.async_engine import AsyncEngine
    from prefixkv.models.catalog import installed_tokenizer_dir
    from prefixkv.server.app import DEFAULT_MODEL_NAME, create_app

    limits = ServerLimits(max_body_bytes=args.max_request_body_bytes, max_n=args.max_n,
                          max_prompts=args.max_prompts_per_request,
                          default_chat_max_tokens=args.default_chat_max_tokens,
                          max_retention_priority=args.max_retention_priority,
                          otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None))
    if limits.otlp_traces_endpoint:  # before the model loads: a missing package is one line
        from prefixkv.server.tracing import check_installed
        check_installed()
    apply_kv_compat(args)  # vLLM's / LMCache's offloading settings onto the tier flags
    config = EngineConfig.from_kwargs(**engine_kwargs(args))  # resolves --model first
    sock = _listen(args.host, args.port)
    names = list(args.served_model_name or [])
    name = names[0] if names else (
        os.path.basename(os.path.normpath(args.model)) if args.model else DEFAULT_MODEL_NAME)
    aliases = (args.model,) if args.model else ()
    try:
        engine = AsyncEngine.from_args(config=config)
    except BaseException:
        sock.close()
        raise

    def stop_engine() -> None:
        engine.shutdown()
        engine.engine.close()  # queued disk/remote tier writes land before exit
        print("prefixkv: engine stopped", flush=True)

    try:
        app = create_app(engine, api_key=args.api_key, admin_api_key=args.admin_api_key,
                         limits=limits, model_name=name, model_aliases=aliases,
                         served_model_names=tuple(names[1:]),
                         strict_fields=getattr(args, "strict_fields", False),
                         on_shutdown=stop_engine)
        frozen = freeze_heap() if getattr(args, "freeze_gc", True) else 0
        print(f"prefixkv: serving {name!r} on http://{args.host}:{args.port} "
              f"(prefix caching {'on' if config.cache.enable_prefix_caching else 'off'}"
              f"{f'; {frozen:,} objects frozen for the garbage collector' if frozen else ''})",
              flush=True)
        hf_tokenizer = installed_tokenizer_dir(config.model.model)
        if hf_tokenizer is not None:  # for clients that count tokens themselves
            print(f"prefixkv: its tokenizer as a Hugging Face directory (guidellm / aiperf "
                  f"--tokenizer): {hf_tokenizer}", flush=True)
        # On SIGINT/SIGTERM uvicorn stops accepting, lets running requests finish (up to 10 s),
        # runs the app's shutdown (which stops the engine thread), then re-raises the signal.
        uv_config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=10,
                                   timeout_keep_alive=args.timeout_keep_alive)
        uvicorn.Server(uv_config).run(sockets=[sock])
    finally:
        engine.shutdown()  # idempotent; covers a failed start
        sock.close()
    return 0


# ---------------------------------------------------------------- generate (offline)


def _register_generate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("generate", help="generate offline (no server) with the LLM API",
                       description="Generate a completion for PROMPT in this process.")
    p.add_argument("prompt", metavar="PROMPT", help="prompt text")
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file or known name, e.g. smollm2-135m-instruct "
                        "(default: the demo model)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="treat PROMPT as a user chat message")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", action="store_true", help="print a JSON record with token counts")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from prefixkv.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    o = out.outputs[0]
    if args.json:
        print(json.dumps({"text": o.text, "token_ids": o.token_ids,
                          "finish_reason": o.finish_reason,
                          "prompt_tokens": len(out.prompt_token_ids),
                          "num_cached_tokens": out.num_cached_tokens}))
    else:
        print(o.text)
    return 0
